"""A sweep's tables: each run's collapse figures from its metrics.jsonl (`summarize_run`), the per-run table
and the per-method table with evaluation success against the start (`toolcollapse sweep` prints them)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from toolcollapse.alarms import find_collapse, rolling_mean
from toolcollapse.checkpoint import complete_checkpoints
from toolcollapse.runtime import read_jsonl
from toolcollapse.supervision import sft_tokens_so_far
from toolcollapse.sweep import RunSpec, SweepConfig, eval_splits, start_eval_dir

WINDOW = 5  # steps in the trailing mean of the healthy-turn rate and the reward shown in the table
MOVED = 0.10  # a probe series has "moved" once it is this far (absolute probability) from its step-0 value


def summarize_run(run_dir: Path, steps: int, hold: int) -> dict[str, Any]:
    """Collapse figures of one RL run from its metrics.jsonl.

    `collapsed`, `collapse_step` and `floor_step` are `alarms.find_collapse` (the definition
    `diagnose` uses: the raw healthy-turn rate below half its step-0 value, or below 20 %,
    for `hold` steps); the 5-step trailing means are for display only.
    """
    path = Path(run_dir) / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    if not rows:
        return {"run": str(run_dir), "steps_done": 0, **run_cost(run_dir, rows)}
    smooth = rolling_mean([r["healthy_rate"] for r in rows], WINDOW)
    collapse = find_collapse(rows, hold)
    informative = [r["frac_groups_informative"] for r in rows]
    out: dict[str, Any] = {
        "run": str(run_dir), "steps_done": len(rows), "steps": steps,
        "healthy_start": rows[0]["healthy_rate"], "healthy_min_smooth": min(smooth), "healthy_end_smooth": smooth[-1],
        "collapse_step": collapse.step, "floor_step": collapse.floor_step, "collapsed": collapse.collapsed,
        "reward_start": sum(r["reward_mean"] for r in rows[:WINDOW]) / min(WINDOW, len(rows)),
        "reward_end": sum(r["reward_mean"] for r in rows[-WINDOW:]) / min(WINDOW, len(rows)),
        "informative_min": min(informative),
        "step_uninformative": next((r["step"] for r in rows if r["frac_groups_informative"] == 0), None),
        "skipped_nonfinite": sum(r.get("skipped_nonfinite", 0) for r in rows),
    }
    out.update(first_probe_moves(rows))
    out.update(run_cost(run_dir, rows))
    return out


def run_cost(run_dir: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """SFT tokens the run trained on (the synchronous term and its phases; an sft_only run's phase) and
    its wall time: the steps' seconds plus the phases'."""
    path = Path(run_dir) / "phases.jsonl"
    phases = read_jsonl(path) if path.is_file() else []
    tokens = sft_tokens_so_far(rows) if rows else sum(p.get("phase/tokens", 0.0) for p in phases)
    seconds = sum(r.get("seconds", 0.0) for r in rows) + sum(p.get("phase/seconds", 0.0) for p in phases)
    return {"sft_tokens": tokens, "wall_s": seconds, "sft_only": not rows and bool(phases)}


def first_probe_moves(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The probe series that moved first (|value - step-0 value| >= MOVED), with its step and values."""
    probed = [r for r in rows if any(k.startswith("probe/") for k in r)]
    if not probed:
        return {}
    first = probed[0]
    moves = []
    summary_keys = [k for k in first if k.startswith("probe/") and ("/p@" not in k or k.endswith("/p@answer_start"))]
    for key in summary_keys:
        for r in probed[1:]:
            if key in r and abs(r[key] - first[key]) >= MOVED:
                moves.append((r["step"], -abs(r[key] - first[key]), key, first[key], r[key]))
                break
    if not moves:
        return {"first_probe_move": None}
    step, _, key, before, after = min(moves)
    return {"first_probe_move": f"{key.removeprefix('probe/')} {before:.3f}->{after:.3f} @{step}"}


def summarize_runs(sweep: SweepConfig, specs: list[RunSpec]) -> list[dict[str, Any]]:
    rows = []
    for spec in specs:
        row = {"setting": spec.setting, "seed": spec.seed,
               **summarize_run(spec.run_dir, spec.cfg.grpo.steps, spec.cfg.monitor.collapse_hold)}
        row.update(_eval_figures(spec.run_dir, sweep.eval_split, start_eval_dir(sweep)))
        for split in eval_splits(sweep)[1:]:
            figures = _eval_figures(spec.run_dir, split, start_eval_dir(sweep))
            row.update({f"{split}/{k}": v for k, v in figures.items()})
        rows.append(row)
    return rows


def _eval_figures(run_dir: Path, split: str, start_dir: Path) -> dict[str, Any]:
    """Success of the run's final checkpoint, paired task by task with the starting checkpoint's
    when both were evaluated on the same tasks under the same rollout limits."""
    done = complete_checkpoints(run_dir)
    final = done[-1] / "eval" / f"{split}.jsonl" if done else None
    start = start_dir / f"{split}.jsonl"
    if final is None or not final.is_file():
        return {}
    ours = {r["task_id"]: r["success"] for r in read_jsonl(final)}
    out: dict[str, Any] = {"eval_success": sum(ours.values()) / len(ours), "eval_n": len(ours)}
    if start.is_file():
        limits = [json.loads(p.with_suffix(".summary.json").read_text()).get("limits") for p in (final, start)]
        base = {r["task_id"]: r["success"] for r in read_jsonl(start) if r["task_id"] in ours}
        if len(base) == len(ours) and limits[0] == limits[1] and limits[0] is not None:
            out.update(paired_comparison([base[k] for k in ours], list(ours.values())))
        else:
            out["eval_unpaired"] = "the start was evaluated on other tasks or under other limits"
    return out


def paired_comparison(before: list[bool], after: list[bool]) -> dict[str, Any]:
    """Success change on the same tasks, with an exact two-sided sign test on the discordant pairs (McNemar)."""
    gained = sum(a and not b for b, a in zip(before, after))
    lost = sum(b and not a for b, a in zip(before, after))
    n = gained + lost
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2 ** n if n else 1.0
    return {"eval_start_success": sum(before) / len(before), "eval_gained": gained, "eval_lost": lost,
            "eval_p_value": min(1.0, 2 * tail)}


def format_table(rows: list[dict[str, Any]]) -> str:
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    step = lambda v: "-" if v is None else str(v)  # noqa: E731
    head = ("| setting | seed | steps | healthy: step 0 -> min -> end (5-step mean) | collapse @ | < 20 % @ "
            "| collapsed | reward start -> end | informative min (=0 @) | first probe move | test success: start -> final (paired) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        if not r.get("steps_done"):
            lines.append(f"| {r['setting']} | {r['seed']} | " + ("no RL (sft_only) |" if r.get("sft_only") else "not run |"))
            continue
        ev = "-"
        if "eval_success" in r:
            ev = f"{pct(r['eval_success'])} (n={r['eval_n']})"
        if "eval_unpaired" in r:
            ev += f" (unpaired: {r['eval_unpaired']})"
        if "eval_start_success" in r:
            ev = (f"{pct(r['eval_start_success'])} -> {ev}: +{r['eval_gained']} / -{r['eval_lost']} tasks, "
                  f"p = {r['eval_p_value']:.2g}")
        lines.append(
            f"| {r['setting']} | {r['seed']} | {r['steps_done']}/{r['steps']} "
            f"| {pct(r['healthy_start'])} -> {pct(r['healthy_min_smooth'])} -> {pct(r['healthy_end_smooth'])} "
            f"| {step(r['collapse_step'])} | {step(r['floor_step'])} | {'yes' if r['collapsed'] else 'no'} "
            f"| {r['reward_start']:.2f} -> {r['reward_end']:.2f} "
            f"| {r['informative_min']:.2f} ({step(r['step_uninformative'])}) "
            f"| {r.get('first_probe_move') or '-'} | {ev} |")
    return "\n".join(lines)


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return f"{100 * mean:.1f} ± {100 * sd:.1f}" if len(values) > 1 else f"{100 * mean:.1f}"


def format_method_table(rows: list[dict[str, Any]], splits: list[str], start: dict[str, float]) -> str:
    """One line per setting, over its seeds: the healthy-turn rate's 5-step mean (min, final; mean over
    seeds), collapses, greedy success per eval split (mean ± sd, %; n= where fewer seeds were evaluated
    than run), SFT tokens and wall time (means over the runs done; "k/n" seeds where some are not)."""
    head = ("| setting | seeds | healthy min | healthy final | collapsed (@ steps) | "
            + " | ".join(f"{s} %" for s in splits) + " | SFT tokens | wall (min) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|",
             "| start | - | - | - | - | " + " | ".join(mean_sd([start[s]]) if s in start else "-" for s in splits)
             + " | 0 | 0 |"]
    for setting in dict.fromkeys(r["setting"] for r in rows):
        runs = [r for r in rows if r["setting"] == setting]
        rl = [r for r in runs if r.get("steps_done")]
        done = [r for r in runs if r.get("steps_done") or r.get("sft_only")]
        collapsed = [r["collapse_step"] for r in rl if r["collapsed"]]
        success = []
        for key in ["eval_success"] + [f"{s}/eval_success" for s in splits[1:]]:
            values = [r[key] for r in runs if key in r]
            success.append(mean_sd(values) + (f" (n={len(values)})" if values and len(values) < len(done) else ""))
        cells = [setting, str(len(done)) if len(done) == len(runs) else f"{len(done)}/{len(runs)}",
                 mean_sd([r["healthy_min_smooth"] for r in rl]), mean_sd([r["healthy_end_smooth"] for r in rl]),
                 f"{len(collapsed)}/{len(rl)}" + (f" (@ {', '.join(map(str, collapsed))})" if collapsed else "")
                 if rl else ("no RL" if any(r.get("sft_only") for r in runs) else "not run"), *success,
                 f"{sum(r['sft_tokens'] for r in done) / max(1, len(done)):.0f}",
                 f"{sum(r['wall_s'] for r in done) / max(1, len(done)) / 60:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def start_success(sweep: SweepConfig) -> dict[str, float]:
    """The starting checkpoint's success per evaluated split."""
    out = {}
    for split in eval_splits(sweep):
        path = start_eval_dir(sweep) / f"{split}.jsonl"
        results = read_jsonl(path) if path.is_file() else []
        if results:
            out[split] = sum(r["success"] for r in results) / len(results)
    return out
