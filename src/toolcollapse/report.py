"""`toolcollapse report`: a study's runs as tables, figures and a findings checklist, standing on their own.

The report reads only what the runs wrote -- each run's metrics.jsonl, its evaluations, the sweep's evaluation of
the starting checkpoint, the tries' choices (results.py) -- and writes `report/report.md` and a self-contained
`report/report.html` (figures embedded), with the PNG figures in `report/figures/`.

Every comparison of two arms is paired on the same tasks, with a 95 % bootstrap interval over tasks and seeds and
an exact sign test on the tasks (McNemar's test for one greedy run a side; stats.py); every verdict word comes from those intervals (findings.py). The top of the report says
what ran (model, start, steps, rollouts, rates, limits), at which commit and date, and the command that writes it
again; the paper's own figures sit in a table of their own, never beside ours in one column.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
import subprocess
from pathlib import Path
from typing import Any, Sequence

from toolcollapse.alarms import content_rules, control_rules, control_series, run_rules
from toolcollapse.config import load_config, sft_tasks_read
from toolcollapse.diagnose import BASELINE_WARMUP, baseline_rules, diagnose_rows, lead_table
from toolcollapse.figures import plot_control_tokens, plot_states_grid
from toolcollapse.findings import EARLY_STEP, PAPER_ORDER, PAPER_QWEN25_1P5B, Finding, Rates, findings, rates
from toolcollapse.results import Arm, Study, healthy_through, load_study, mean_of
from toolcollapse.stats import PairedDiff, verdict

PROVENANCE = "provenance.json"  # <out_dir>/provenance.json: commit, date and command of the study's runs

METHODS = {  # what each method name of our study files means
    "plain": "GRPO alone",
    "ops": "OPS, the released code's variant: one ground-truth row in each group of G, the clipped surrogate on it",
    "ops_luffy": "OPS as the paper's text has it: one ground-truth row a group, LUFFY's shaping p/(p + 0.1) on it",
    "ops_none": "OPS, the released code's variant (the clipped surrogate on the ground-truth row)",
    "hbg": "HBG: 2 of G rows sample with a hint (the tools to call) in the system prompt, trained without it",
    "ets": "ETS: rounds of GRPO, each followed by an SFT phase on the ground truth of the round's failed tasks",
    "prs": "PRS: ETS plus a judge's reflection on each failed rollout in the SFT phase",
    "unlikelihood": "GRPO + unlikelihood on the first control token the grammar rejects in each failed turn",
    "sft_term": "GRPO + a synchronous SFT term on the step's tasks' ground truth (fixed coefficient)",
    "hybrid": "OPS (released variant) + the synchronous SFT term",
    "adaptive": "GRPO; on a monitor alarm: roll back, cut the LR, SFT on the tasks failed so far",
}


# ----------------------------------------------------------------------------- cells


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def diff_cell(d: PairedDiff | None) -> str:
    """`+2.0 [+0.4, +3.6] yes` in points; `-` without both sides."""
    if d is None:
        return "-"
    return f"{100 * d.diff:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}], p={d.p_value:.2g} {verdict(d.low, d.high)}"


def seeds_cell(arm: Arm) -> str:
    done = len(arm.finished)
    return str(done) if done == len(arm.runs) else f"{done}/{len(arm.runs)}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> tuple[str, list[str], list[list[str]]]:
    return ("table", list(header), [list(r) for r in rows])


# ----------------------------------------------------------------------------- the top


def git_commit() -> str:
    """The commit of the code that runs (this package's checkout, not the working directory's)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=here)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=here)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def write_provenance(out_dir: Path, command: str) -> None:
    """Record where and when a study's runs were started (the report cites it): once, and again only when a
    later call runs another commit's code."""
    path = Path(out_dir) / PROVENANCE
    past = json.loads(path.read_text()) if path.is_file() else []
    commit = git_commit()
    if not past or past[-1]["commit"] != commit:
        past.append({"commit": commit, "date": _now(), "command": command})
        path.write_text(json.dumps(past, indent=1) + "\n")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def checkpoint_params(path: Path) -> int | None:
    """Parameters in a checkpoint's safetensors files, from their headers (nothing loaded)."""
    total, found = 0, False
    for weights in Path(path).glob("*.safetensors"):
        with open(weights, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for dim in info["shape"]:
                    n *= dim
                total += n
                found = True
    return total if found else None


def setup_text(study: Study, r: Rates, command: str) -> list[str]:
    """The paragraphs that say what ran: model, start, RL, evaluation, provenance."""
    sweep = study.sweep
    init = Path(sweep.init)
    rl = next((a.cfg for a in study.arms if a.schedule != "sft_only"), study.arms[0].cfg if study.arms else None)
    lines = []
    params = checkpoint_params(init)
    trained = init / "toolcollapse.yaml"
    recipe = ""
    if trained.is_file():
        s = load_config(trained)
        warm = " + ".join(f"{w.steps} x {w.batch_size} ({w.content})" for w in s.sft.copy_warmup if w.steps)
        recipe = (f", SFT {warm + ' + ' if warm else ''}{s.sft.steps} x {s.sft.batch_size} conversations of the first "
                  f"{sft_tasks_read(s)} train tasks")
    if rl is not None:
        model = rl.model.preset + " Llama from scratch" if rl.model.source == "scratch" else rl.model.source
        lines.append(f"**Model and start.** {model} ({params / 1e6:.2f} M parameters)" if params else
                     f"**Model and start.** {model}")
        lines[-1] += f"; every run starts from `{init}`{recipe}; environment `{rl.env}`."
        g, ro = rl.grpo, rl.rollout
        lines.append(
            f"**RL.** {g.steps} steps x {g.prompts_per_step} prompts x G = {g.group_size} "
            f"({g.steps * g.prompts_per_step * g.group_size:,} rollouts a run) from the `{g.split}` tasks; each batch in "
            f"{g.mini_batches} mini-batch(es) of whole groups, {g.updates_per_batch} pass(es): "
            f"{g.mini_batches * g.updates_per_batch} optimizer step(s) a step; clip {g.clip_low:g}/{g.clip_high:g}, "
            f"dual clip {g.dual_clip}, KL {g.kl_coef:g} (k3), {g.loss_agg}, temperature {ro.temperature:g}, up to "
            f"{ro.max_turns} turns of {ro.max_new_tokens} tokens. Plain GRPO at lr "
            f"{', '.join(f'{x:g}' for x in study.plain_lrs) or '-'}; the signals at lr "
            f"{'-' if r.signals is None else f'{r.signals:g}'}; each arm's SFT phases (ETS, PRS, adaptive, "
            "sft_only) in its row of the arms tables.")
    counts = ", ".join(f"{s} {len(study.tasks[s])}" for s in study.splits if s in study.tasks)
    sampled = ""
    if study.sampled and study.sampled in study.tasks:
        k = study.start_limits.get(study.sampled, {}) or {}
        sampled = (f"; sampled pass@1 on {study.first}: {k.get('samples', 1)} episodes a task at temperature "
                   f"{k.get('temperature', '?')}, their mean success")
    lines.append(f"**Evaluation.** Every final checkpoint and the start, greedy, on the same tasks under one set of "
                 f"limits: {counts}{sampled}. Comparisons are paired on those tasks: the difference in points with "
                 "its 95 % bootstrap interval over tasks and seeds, the sign test's p over tasks (McNemar's for one seed a "
                 "side), and a verdict (yes / no only when the "
                 "interval excludes zero, else undecided).")
    seeds: dict[int, list[str]] = {}
    for arm in study.arms:
        seeds.setdefault(len(arm.runs), []).append(arm.setting)
    if len(seeds) > 1:  # the study's file gave some arms fewer seeds (issue 18's budget rule)
        lines.append("**Seeds.** " + "; ".join(f"{n} seed{'s' if n != 1 else ''}: {', '.join(names)}"
                                               for n, names in sorted(seeds.items(), reverse=True))
                     + ". A comparison uses the seeds each side has (`tasks x seeds a/b` in its numbers).")
    prov = Path(study.out_dir) / PROVENANCE
    ran = json.loads(prov.read_text()) if prov.is_file() else []
    started = ("runs started at " + "; continued at ".join(f"commit {x['commit']} on {x['date']}" for x in ran)
               if ran else "the runs' commit was not recorded")
    lines.append(f"**Provenance.** {started}; this report written at commit {git_commit()} on {_now()} by `{command}`.")
    return lines


def definitions() -> list[list[str]]:
    rows = [[name, what] for name, what in METHODS.items()]
    rows += [["sft_only_<arm>", "the control of <arm>: no RL; SFT from the start on training-task ground truth for "
                                "as many SFT tokens as <arm>'s run of the same seed trained on"],
             ["start", "the checkpoint every run starts from"],
             ["healthy min", "the lowest 5-step mean of the healthy-turn rate (healthy call or response) over the run"],
             [f"healthy @{EARLY_STEP}", f"the lowest 5-step mean of the healthy-turn rate over steps 0-{EARLY_STEP} "
                                         "(sampled rollouts at the training temperature)"],
             ["collapsed", "the healthy-turn rate below half its step-0 value (or 20 %) for monitor.collapse_hold "
                           "steps, anywhere in the run"],
             ["Δ start / plain / sft_only", "the arm minus the start / plain GRPO at the same LR / its sft_only "
                                             "control, in points: [95 % CI], the sign test's p over tasks, verdict"],
             ["n/a", "HBG and unlikelihood train on no SFT tokens: no sft_only control"]]
    return rows


# ----------------------------------------------------------------------------- tables


def start_table(study: Study) -> tuple[str, list[str], list[list[str]]]:
    names = study.splits + ([study.sampled] if study.sampled else [])
    return _table(["", *names], [["start: success %", *[pct(study.start[n].mean()) if n in study.start else "-"
                                                          for n in names]]])


def scan_table(study: Study, r: Rates) -> tuple[str, list[str], list[list[str]]]:
    header = ["lr", "seeds", f"Δ start {r.scan_split}", f"Δ start {study.first}",
              *([f"Δ start {study.sampled}"] if study.sampled else []), f"healthy @{EARLY_STEP}", "healthy min",
              f"healthy turns, greedy {study.first}: start -> end", "collapsed", "pick"]
    rows = []
    for lr in study.plain_lrs:
        arm = study.plain(lr)
        early = [healthy_through(m, EARLY_STEP) for _, m in arm.finished_metrics()]
        early = [h for h in early if h is not None]
        pick = " ".join(name for name, x in (("lr_up", r.up), ("lr_down", r.down)) if x == lr)
        rows.append([f"{lr:g}", seeds_cell(arm), diff_cell(study.compare(arm, "start", r.scan_split)),
                     *([diff_cell(study.compare(arm, "start", study.first))] if r.scan_split != study.first else ["="]),
                     *([diff_cell(study.compare(arm, "start", study.sampled))] if study.sampled else []),
                     pct(min(early)) if early else "-",
                     pct(min((x["healthy_min_smooth"] for x in arm.rl_runs), default=None)),
                     f"{pct(study.start_healthy.get(study.first))} -> {pct(_mean(arm.healthy.get(study.first)))}",
                     f"{len(arm.collapsed)}/{len(arm.rl_runs)}", pick or ""])
    return _table(header, rows)


def _mean(xs: Sequence[float | None] | None) -> float | None:
    xs = [x for x in xs or () if x is not None]
    return sum(xs) / len(xs) if xs else None


def format_or_skill(study: Study, lr: float | None) -> str:
    """What degrades at `lr`: the format (the greedy healthy-turn rate falls by 2 points or more), or only the
    skill (success falls, the format holds)."""
    arm = study.plain(lr)
    if arm is None or study.first not in arm.healthy or study.start_healthy.get(study.first) is None:
        return ""
    before, after = study.start_healthy[study.first], _mean(arm.healthy[study.first])
    d = study.compare(arm, "start", study.first)
    what = "the format degrades" if after is not None and after <= before - 0.02 else "the format holds"
    return (f" At lr {lr:g} {what}: greedy healthy turns on {study.first} {pct(before)} -> {pct(after)} %, "
            f"success {d.describe() if d else '-'}.")


def arms_table(study: Study, lr: float) -> tuple[str, list[str], list[list[str]]]:
    ood = study.splits[1:]
    header = ["arm", "schedule", "seeds", f"{study.first} %", "Δ start", "Δ plain", "Δ sft_only",
              *([f"Δ start {study.sampled}"] if study.sampled else []), *[f"Δ start {s}" for s in ood],
              "healthy min", "collapsed", "SFT phases", "SFT tokens"]
    plain = study.plain(lr)
    rows = []
    order = {"plain": 0, "sft_only": 2}
    for arm in sorted(study.at(lr), key=lambda a: (order.get(a.schedule, 1), a.setting)):
        control = study.control_of(arm) if arm.schedule != "sft_only" else None
        no_tokens = arm.schedule not in ("sft_only", "plain") and not any(x["sft_tokens"] for x in arm.finished)
        rows.append([
            arm.setting, arm.schedule + authors_cell(arm), seeds_cell(arm), pct(arm.success(study.first)),
            diff_cell(study.compare(arm, "start", study.first)),
            "-" if arm is plain or plain is None else diff_cell(study.compare(arm, plain, study.first)),
            "n/a" if no_tokens and control is None else diff_cell(study.compare(arm, control, study.first))
            if control is not None else "-",
            *([diff_cell(study.compare(arm, "start", study.sampled))] if study.sampled else []),
            *[diff_cell(study.compare(arm, "start", s)) for s in ood],
            pct(min((x["healthy_min_smooth"] for x in arm.rl_runs), default=None)),
            f"{len(arm.collapsed)}/{len(arm.rl_runs)}" if arm.rl_runs else "no RL", phases_cell(arm),
            f"{sum(x['sft_tokens'] for x in arm.finished) / max(1, len(arm.finished)):,.0f}"])
    return _table(header, rows)


def authors_cell(arm: Arm) -> str:
    """`; judge openai <model>: 31/40 accepted, 40 calls, 52,000 tokens` for an arm whose PRS reflections (or HBG
    hints) a chat model wrote, summed over its runs; an arm whose replies all fell back reads "deterministic"
    (or "template"): that is what it trained on."""
    s, parts = arm.cfg.supervision, []
    for prefix, spec, on, fallback in (("judge", s.prs.judge, s.prs.enabled, "deterministic"),
                                       ("hint", s.hbg.hint_writer, s.hbg.enabled, "template")):
        if not on or spec.kind not in ("hf", "openai"):
            continue
        last = [next((r for r in reversed(rows) if f"{prefix}/calls" in r), {}) for rows in arm.metrics]
        total = {k: sum(r.get(f"{prefix}/{k}", 0) for r in last) for k in ("accepted", "rejected", "failed", "calls",
                                                                          "tokens_in", "tokens_out")}
        asked = total["accepted"] + total["rejected"] + total["failed"]
        who = f"{prefix} {spec.kind} {spec.model or spec.source}"
        parts.append(f"{who}: {fallback} (all {asked} replies fell back)" if asked and not total["accepted"] else
                     f"{who}: {total['accepted']}/{asked} accepted, {total['calls']} calls, "
                     f"{total['tokens_in'] + total['tokens_out']:,} tokens")
    return "".join(f"; {p}" for p in parts)


def phases_cell(arm: Arm) -> str:
    """`epochs x lr` of the arm's SFT phases, where it has any."""
    s = arm.cfg.supervision
    if not (s.ets.enabled or s.adaptive.enabled and s.adaptive.sft or s.sft_only_enabled):
        return "-"
    return f"{s.phase.epochs} x lr {s.phase.lr:g}"


def regime_table(study: Study) -> tuple[str, list[str], list[list[str]]]:
    """The update's own statistics per arm, means over its runs' steps (ratio extremes over all of them)."""
    header = ["arm", "lr", "optimizer steps a step", "clip low %", "clip high %", "dual clip %", "ratio min", "ratio max",
              "entropy: first 5 -> last 5 steps", "informative groups %", "reward (sampled) %"]
    rows = []
    for arm in [a for a in study.arms if a.schedule != "sft_only"]:
        ms = [m for _, m in arm.finished_metrics()]
        rows_all = [x for m in ms for x in m if "ratio_max" in x]
        if not rows_all:
            continue
        head = [x for m in ms for x in m[:5]]
        tail = [x for m in ms for x in m[-5:]]
        f = lambda v, k=1.0, d=2: "-" if v is None else f"{k * v:.{d}f}"  # noqa: E731
        rows.append([arm.setting, f"{arm.lr:g}", f(mean_of(rows_all, "optimizer_steps"), d=0),
                     f(mean_of(rows_all, "clip_frac_low"), 100), f(mean_of(rows_all, "clip_frac_high"), 100),
                     f(mean_of(rows_all, "dual_clip_frac"), 100),
                     f(min((x["ratio_min"] for x in rows_all if "ratio_min" in x), default=None), d=3),
                     f(max(x["ratio_max"] for x in rows_all), d=3),
                     f"{f(mean_of(head, 'entropy'), d=3)} -> {f(mean_of(tail, 'entropy'), d=3)}",
                     f(mean_of(rows_all, "frac_groups_informative"), 100, 1), f(mean_of(rows_all, "reward_mean"), 100, 1)])
    return _table(header, rows)


def tries_table(study: Study) -> tuple[str, list[str], list[list[str]]]:
    rows = []
    for base, rec in study.selection.items():
        for i, t in enumerate(rec["tries"]):
            rows.append([base, ", ".join(f"{k}={v}" for k, v in t["overrides"].items()) or "as written",
                         pct(t["success"]), "chosen" if i == rec["chosen"] else ""])
    first = next(iter(study.selection.values()), {"split": "val", "seed": 0})
    return _table(["arm", "try", f"{first['split']} success % (seed {first['seed']}, greedy)", ""], rows)


def paper_table(study: Study, r: Rates) -> tuple[str, list[str], list[list[str]]]:
    rows = []
    for method in PAPER_ORDER:
        name, score = PAPER_QWEN25_1P5B[method]
        arm = next((a for a in study.arms if a.method == method and a.lr == r.signals), None) or study.plain(r.signals)
        arm = arm if arm is not None and arm.method == method else None
        ours = "-" if arm is None else f"{pct(arm.success(study.first))} ({diff_cell(study.compare(arm, 'start', study.first))})"
        rows.append([name, f"{score:.2f}", method, ours])
    return _table(["the paper's method", "paper: Qwen2.5-1.5B-Instruct, BFCL multi-turn, lr 1e-6, accuracy %",
                   "our arm", f"ours: {study.first} % (Δ start)"], rows)


def monitor_table(study: Study) -> tuple[str, list[str], list[list[str]]]:
    m = study.monitor
    panel = {"control tokens (the run's detector)": control_rules(m),
             "control tokens, absolute scale": control_rules(m, scale="absolute"),
             "content log-probs": content_rules(m)}
    for rule in baseline_rules(m.alarm_detector, BASELINE_WARMUP):
        panel[f"baseline: {rule.series}"] = [rule]
    series = control_series(m.control_tokens)
    runs = [(f"{a.setting}/{run['seed']}", rows) for a in study.arms if a.schedule != "adaptive"
            for run, rows in a.finished_metrics() if any(k in rows[0] for k in series)]
    out = []
    for row in lead_table(runs, panel, m.collapse_hold) if runs else []:
        leads = row["leads"]
        spread = "-" if not leads else f"{sorted(leads)[len(leads) // 2]} [{min(leads)}-{max(leads)}]"
        out.append([row["detector"], f"{row['fired_before']}/{row['n_collapsed']}", spread,
                    f"{len(row['false_alarms'])}/{row['n_stable']}"])
    return _table(["detector", "fired before the collapse", "lead (steps), median [min-max]",
                   "false alarms (runs without collapse)"], out)


# ----------------------------------------------------------------------------- figures


def figures(study: Study, r: Rates, out: Path) -> list[tuple[str, Path, str]]:
    out.mkdir(parents=True, exist_ok=True)
    made = []
    lr = r.down if r.down is not None else (study.plain_lrs or [None])[0]
    plain = study.plain(lr)
    if plain is not None and plain.finished_metrics():
        runs = plain.finished_metrics()
        run, rows = next(((x, m) for x, m in runs if x["collapsed"]), runs[0])
        d = diagnose_rows(rows, run_rules(study.monitor), [], study.monitor.collapse_hold, run=run["run"])
        path = plot_control_tokens(rows, control_series(study.monitor.control_tokens), d, out / "control_tokens.png")
        collapse = "none" if d.collapse_step is None else f"step {d.collapse_step}"
        made.append(("figure", path, f"Control tokens on the probe set, plain GRPO at lr {lr:g}, seed {run['seed']}: "
                                     f"alarms dashed, the collapse in red ({collapse})."))
    for x in study.lrs:
        panels = {a.setting: a.finished_metrics()[0][1] for a in study.at(x) if a.finished_metrics()}
        if panels:
            path = plot_states_grid(panels, out / f"states_lr{x:g}.png", f"lr {x:g}")
            made.append(("figure", path, f"The four turn states per arm at lr {x:g} (first seed)."))
    return made


# ----------------------------------------------------------------------------- rendering


def blocks(study: Study, figs: list[tuple[str, Path, str]], command: str = "toolcollapse report") -> list[tuple]:
    r = rates(study)
    out: list[tuple] = [("h1", f"Study report: {study.name}"),
                        ("p", f"{study.runs_done}/{study.runs_total} runs done (the tries not chosen included).")]
    out += [("p", line) for line in setup_text(study, r, command)]
    out += [("h2", "Arms and columns"), _table(["name", "meaning"], definitions()),
            ("h2", "The start"), start_table(study)]
    if len(study.plain_lrs) > 1:
        out += [("h2", "Learning-rate scan: plain GRPO against the start"),
                ("p", f"lr_up = {r.up if r.up is not None else 'none'}: {r.why_up}. lr_down = "
                      f"{r.down if r.down is not None else 'none'}: {r.why_down}."
                      + "".join(format_or_skill(study, lr) for lr in study.plain_lrs)), scan_table(study, r)]
    for lr in study.lrs:
        out += [("h2", f"Arms at lr {lr:g}"), arms_table(study, lr)]
    out += [("h2", "The update: clipping, ratios, entropy, signal"), regime_table(study)]
    if study.selection:
        out += [("h2", "Tries: each arm's coefficient chosen on validation"),
                ("p", "Every try ran at the first seed and was scored greedily on the validation split; the highest "
                      "is the arm (ties: the earlier try). Test results never enter the choice."), tries_table(study)]
    out += [("h2", "Findings"), _table(["claim", "source", "verdict", "the numbers"],
                                       [[f.claim, f.source, f.verdict, f.evidence] for f in findings(study)])]
    out += [("h2", "The paper's figures (their model, environment, metric and LR)"),
            ("p", "The paper's scores are accuracy of Qwen2.5-1.5B-Instruct on BFCL multi-turn at lr 1e-6; ours are "
                  "a tiny model on the synthetic tool world. Only the order of the methods can be compared "
                  "(finding 8)."), paper_table(study, r)]
    out += [("h2", "Early warning: lead time and false alarms"),
            ("p", "Over every finished RL run but the adaptive ones: a detector's first alarm before the run's "
                  "collapse, and alarms in runs that never collapsed."), monitor_table(study), ("h2", "Figures")]
    return out + figs


def to_markdown(items: list[tuple], base: Path) -> str:
    lines = []
    for item in items:
        if item[0] in ("h1", "h2"):
            lines += ["#" * int(item[0][1]) + " " + item[1], ""]
        elif item[0] == "p":
            lines += [item[1], ""]
        elif item[0] == "table":
            _, header, rows = item
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows] + [""]
        elif item[0] == "figure":
            _, path, caption = item
            lines += [f"![{caption}]({Path(path).relative_to(base).as_posix()})", "", f"*{caption}*", ""]
    return "\n".join(lines)


def to_html(items: list[tuple]) -> str:
    e = html.escape
    body = []
    for item in items:
        if item[0] in ("h1", "h2"):
            body.append(f"<{item[0]}>{e(item[1])}</{item[0]}>")
        elif item[0] == "p":
            body.append("<p>" + e(item[1]).replace("**", "") + "</p>")
        elif item[0] == "table":
            _, header, rows = item
            body.append("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr></thead><tbody>"
                        + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
                        + "</tbody></table>")
        elif item[0] == "figure":
            _, path, caption = item
            data = base64.b64encode(Path(path).read_bytes()).decode()
            body.append(f'<figure><img alt="{e(caption)}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{e(caption)}</figcaption></figure>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;"
             "vertical-align:top}th{background:#f3f3f3}img{max-width:100%}figcaption{font-size:13px;color:#555}")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>toolcollapse report</title>"
            f"<style>{style}</style></head><body>" + "\n".join(body) + "</body></html>")


def write_report(sweep: Any, specs: Sequence[Any], out_dir: Path | None = None,
                 command: str | None = None) -> Path:
    """report.md, report.html and figures/ in `out_dir` (default <sweep out_dir>/report); the report's path."""
    out = Path(out_dir) if out_dir else Path(sweep.out_dir) / "report"
    study = load_study(sweep, specs)
    items = blocks(study, figures(study, rates(study), out / "figures"),
                   command or f"toolcollapse report {sweep.out_dir}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(to_markdown(items, out))
    (out / "report.html").write_text(to_html(items))
    return out / "report.md"


__all__ = ["Finding", "blocks", "findings", "load_study", "write_report"]
