"""Sweeps: one base experiment, named settings x seeds, run in a local process pool.

A sweep file names the base config, the settings (each a set of `--set` style
overrides) and the seeds; every (setting, seed) becomes the run directory
`<out_dir>/<setting>/seed<seed>` -- deterministic, so re-running the command skips
finished runs and resumes interrupted ones from their last checkpoint. After
training, each run's final checkpoint is evaluated greedily on `eval_split`
(`eval_n` tasks), and so is the starting checkpoint, once, for comparison.

    toolcollapse sweep configs/study/collapse.yaml
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolcollapse.config import ConfigError, RunConfig, Split, load_config


@dataclass(frozen=True)
class SweepConfig:
    base: str  # experiment YAML every run starts from
    init: str  # starting checkpoint of every run (an SFT directory)
    out_dir: str
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {dotted key: value}
    overrides: dict[str, Any] = field(default_factory=dict)  # {dotted key: value} for every run
    seeds: tuple[int, ...] = (0, 1, 2)
    workers: int = 2  # runs at once
    threads_per_worker: int = 1
    eval_split: Split = "test"
    eval_n: int = 0  # tasks evaluated after training (0: no evaluation)
    eval_settings: tuple[str, ...] | None = None  # settings whose final checkpoints are evaluated (None: all)


@dataclass(frozen=True)
class RunSpec:
    setting: str
    seed: int
    run_dir: Path
    cfg: RunConfig


def load_sweep(path: str | Path, overrides: list[str] = ()) -> tuple[SweepConfig, list[RunSpec]]:
    """Read the sweep file and build (and so validate) every run's config before any work."""
    sweep = load_config(path, overrides, cls=SweepConfig)
    if not sweep.settings:
        raise ConfigError(f"{path}: settings is empty; name at least one set of overrides")
    unknown = sorted(set(sweep.eval_settings or ()) - set(sweep.settings))
    if unknown:
        raise ConfigError(f"eval_settings: {unknown[0]!r} is not one of the settings ({', '.join(sweep.settings)})")
    if not (Path(sweep.init) / "config.json").is_file():
        raise ConfigError(f"init checkpoint not found: {sweep.init} (no config.json there); train it first with "
                          f"`toolcollapse sft` (the studies in configs/study/ start from configs/tiny_long.yaml's)")
    specs = []
    for name, sets in sweep.settings.items():
        if not isinstance(sets, dict):
            raise ConfigError(f"settings.{name}: expected a mapping of dotted keys to values")
        for seed in sweep.seeds:
            run_dir = Path(sweep.out_dir) / name / f"seed{seed}"
            items = [f"{k}={v}" for k, v in {**sweep.overrides, **sets}.items()] + [
                f"seed={seed}", f"init={sweep.init}", f"threads={sweep.threads_per_worker}",
                f"name={name}-seed{seed}", f"out_dir={run_dir}"]
            try:
                cfg = load_config(sweep.base, items)
            except ConfigError as err:
                raise ConfigError(f"settings.{name}: {err}") from None
            specs.append(RunSpec(name, seed, run_dir, cfg))
    return sweep, specs


def run_sweep(sweep: SweepConfig, specs: list[RunSpec]) -> list[Path]:
    jobs = [(spec, sweep) for spec in specs]
    if sweep.eval_n:
        jobs.append((None, sweep))
    t0 = time.time()
    ctx = mp.get_context("spawn")  # fresh interpreters: torch threads and RNG state do not leak across runs
    with ctx.Pool(sweep.workers, maxtasksperchild=1) as pool:
        for done in pool.imap_unordered(_run_one, jobs):
            print(f"sweep: {done} done ({time.time() - t0:.0f}s)", flush=True)
    return [s.run_dir for s in specs]


def _run_one(job: tuple[RunSpec | None, SweepConfig]) -> str:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec, sweep = job
    if spec is None:  # the starting checkpoint, evaluated once for comparison
        cfg = load_config(Path(sweep.init) / "toolcollapse.yaml", [f"threads={sweep.threads_per_worker}"])
        _evaluate(Path(sweep.init), cfg, sweep)
        return f"eval of {sweep.init}"
    from toolcollapse.checkpoint import complete_checkpoints
    from toolcollapse.rl import run_rl

    done = complete_checkpoints(spec.run_dir)
    finished = bool(done) and done[-1].name == f"step_{spec.cfg.grpo.steps:06d}"
    if not finished:
        run_rl(spec.cfg, spec.run_dir, resume=bool(done))
    if sweep.eval_n and (sweep.eval_settings is None or spec.setting in sweep.eval_settings):
        _evaluate(complete_checkpoints(spec.run_dir)[-1], spec.cfg, sweep)
    return str(spec.run_dir)


def _evaluate(checkpoint: Path, cfg: RunConfig, sweep: SweepConfig) -> None:
    from toolcollapse.evaluate import run_eval

    summary_path = checkpoint / "eval" / f"{sweep.eval_split}.summary.json"
    if summary_path.is_file() and json.loads(summary_path.read_text())["n_episodes"] == sweep.eval_n:
        return  # already evaluated on the same tasks (the first eval_n of the split)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, split=sweep.eval_split, n_tasks=sweep.eval_n,
                                                            greedy=True))
    run_eval(checkpoint, cfg)


# ----------------------------------------------------------------------------- the collapse table

WINDOW = 5  # steps in the rolling mean of the healthy-turn rate
MOVED = 0.10  # a probe series has "moved" once it is this far (absolute probability) from its step-0 value


def summarize_run(run_dir: Path, steps: int) -> dict[str, Any]:
    """Collapse figures of one RL run from its metrics.jsonl.

    The healthy-turn rate is smoothed by a trailing 5-step mean; `healthy_start` is the
    rate at step 0 (the starting policy); a run `collapsed` when it starts at >= 90 %
    and its smoothed rate reaches <= 20 %.
    """
    from toolcollapse.alarms import first_step_below, rolling_mean
    from toolcollapse.runtime import read_jsonl

    path = Path(run_dir) / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    if not rows:
        return {"run": str(run_dir), "steps_done": 0}
    healthy = rolling_mean([r["healthy_rate"] for r in rows], WINDOW)
    start = healthy[0]  # step 0: the starting policy, before any update
    informative = [r["frac_groups_informative"] for r in rows]
    out: dict[str, Any] = {
        "run": str(run_dir), "steps_done": len(rows), "steps": steps,
        "healthy_start": start, "healthy_min": min(healthy), "healthy_end": healthy[-1],
        "step_below_half": first_step_below(healthy, start / 2),
        "step_below_20": first_step_below(healthy, 0.2),
        "collapsed": start >= 0.9 and min(healthy) <= 0.2,
        "reward_start": sum(r["reward_mean"] for r in rows[:WINDOW]) / min(WINDOW, len(rows)),
        "reward_end": sum(r["reward_mean"] for r in rows[-WINDOW:]) / min(WINDOW, len(rows)),
        "informative_min": min(informative),
        "step_uninformative": next((r["step"] for r in rows if r["frac_groups_informative"] == 0), None),
        "skipped_nonfinite": sum(r.get("skipped_nonfinite", 0) for r in rows),
    }
    out.update(first_probe_moves(rows))
    return out


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
        row = {"setting": spec.setting, "seed": spec.seed, **summarize_run(spec.run_dir, spec.cfg.grpo.steps)}
        row.update(_eval_figures(spec.run_dir, sweep.eval_split, sweep.init))
        rows.append(row)
    return rows


def _eval_figures(run_dir: Path, split: str, init: str) -> dict[str, Any]:
    """Success of the run's final checkpoint, paired task by task with the starting checkpoint's."""
    from toolcollapse.checkpoint import complete_checkpoints
    from toolcollapse.runtime import read_jsonl

    done = complete_checkpoints(run_dir)
    final = done[-1] / "eval" / f"{split}.jsonl" if done else None
    start = Path(init) / "eval" / f"{split}.jsonl"
    if final is None or not final.is_file():
        return {}
    ours = {r["task_id"]: r["success"] for r in read_jsonl(final)}
    out: dict[str, Any] = {"eval_success": sum(ours.values()) / len(ours), "eval_n": len(ours)}
    if start.is_file():
        base = {r["task_id"]: r["success"] for r in read_jsonl(start) if r["task_id"] in ours}
        if len(base) == len(ours):
            out.update(paired_comparison([base[k] for k in ours], list(ours.values())))
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
    head = ("| setting | seed | steps | healthy start -> min -> end (5-step mean) | below half @ | <=20% @ "
            "| collapsed | reward start -> end | informative min (=0 @) | first probe move | test success: start -> final (paired) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        if not r.get("steps_done"):
            lines.append(f"| {r['setting']} | {r['seed']} | not run |")
            continue
        ev = "-"
        if "eval_success" in r:
            ev = f"{pct(r['eval_success'])} (n={r['eval_n']})"
        if "eval_start_success" in r:
            ev = (f"{pct(r['eval_start_success'])} -> {ev}: +{r['eval_gained']} / -{r['eval_lost']} tasks, "
                  f"p = {r['eval_p_value']:.2g}")
        lines.append(
            f"| {r['setting']} | {r['seed']} | {r['steps_done']}/{r['steps']} "
            f"| {pct(r['healthy_start'])} -> {pct(r['healthy_min'])} -> {pct(r['healthy_end'])} "
            f"| {step(r['step_below_half'])} | {step(r['step_below_20'])} | {'yes' if r['collapsed'] else 'no'} "
            f"| {r['reward_start']:.2f} -> {r['reward_end']:.2f} "
            f"| {r['informative_min']:.2f} ({step(r['step_uninformative'])}) "
            f"| {r.get('first_probe_move') or '-'} | {ev} |")
    return "\n".join(lines)
