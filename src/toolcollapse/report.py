"""`toolcollapse report`: a study's runs as the paper's tables, figures and a findings checklist.

The report reads only what the runs wrote -- each run's metrics.jsonl, its evaluations and the
sweep's evaluation of the starting checkpoint -- and writes `report/report.md` and a self-contained
`report/report.html` (figures embedded) next to the runs, with the PNG figures in `report/figures/`.

Every verdict of the findings checklist is computed here from those files, with the numbers
behind it; nothing in it is written by hand. A setting's *method* is its name without the
`_lr...` suffix, its *schedule* is read from its resolved config (`schedule`), its learning
rate is `grpo.lr`. Differences between methods are read against their noise: the spread over
seeds, or, with one seed, the binomial standard error of a success rate on the evaluated tasks.
"""

from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from toolcollapse.config import MonitorConfig, RunConfig
from toolcollapse.sweep import mean_sd

# The paper's BFCL multi-turn scores for Qwen2.5-1.5B-Instruct (their Table; ../shared/DESIGN.md), keyed by
# the name of our closest method: theirs, shown beside ours, never mixed into a verdict.
PAPER_QWEN25_1P5B = {"plain": ("plain RL", 3.50), "ets": ("SFT interleaved with RL", 17.25), "prs": ("PRS", 25.75)}
CONTENT_SPLITS = ("ood_content", "ood_entities", "ood_facts", "ood_compositions", "ood_chains")
FORMAT_SPLITS = ("ood_format",)
HEALTHY_TARGET = 0.85  # the 5-step mean healthy-turn rate a stable run keeps (issue 13's target)
LOG_TEN = math.log(10.0)
SPIKE_FLOOR = 0.01  # a control-token spike: x10 in odds, and the probability at 1 % or more (not 1e-5 -> 1e-4)


def schedule(cfg: RunConfig) -> str:
    """plain | synchronous | interleaved | adaptive | sft_only, from a run's resolved config."""
    s = cfg.supervision
    if s.sft_only_enabled:
        return "sft_only"
    if s.adaptive.enabled:
        return "adaptive"
    if s.ets.enabled:
        return "interleaved"
    if s.ops.enabled or s.hbg.enabled or s.sft_coef > 0 or s.unlikelihood_coef > 0:
        return "synchronous"
    return "plain"


def method_name(setting: str) -> str:
    return re.sub(r"_lr[0-9.eE+-]+$", "", setting)


@dataclass
class Group:
    """The runs of one setting (a method at one learning rate), over seeds."""

    setting: str
    method: str
    schedule: str
    lr: float
    runs: list[dict[str, Any]] = field(default_factory=list)  # sweep.summarize_runs rows
    metrics: list[list[dict[str, Any]]] = field(default_factory=list)  # each run's metrics.jsonl rows
    matched: list[str] = field(default_factory=list)  # an sft_only control: the run dirs whose tokens it matched

    def success(self, split: str, first_split: str) -> list[float]:
        key = "eval_success" if split == first_split else f"{split}/eval_success"
        return [r[key] for r in self.runs if key in r]

    @property
    def rl_runs(self) -> list[dict[str, Any]]:
        """The RL runs that took all their steps (an unfinished run has not shown whether it collapses)."""
        return [r for r in self.runs if r.get("steps_done") and r["steps_done"] >= r["steps"]]

    @property
    def finished(self) -> list[dict[str, Any]]:
        return self.rl_runs + [r for r in self.runs if r.get("sft_only")]

    @property
    def collapsed(self) -> list[dict[str, Any]]:
        return [r for r in self.rl_runs if r["collapsed"]]


@dataclass
class Study:
    name: str
    splits: list[str]  # evaluated splits, the in-distribution one first
    eval_n: int
    start: dict[str, float]  # the starting checkpoint's success per split
    groups: list[Group]
    monitor: MonitorConfig  # the runs' (the study's overrides make it one)
    runs_total: int

    @property
    def lrs(self) -> list[float]:
        """Learning rates with finished RL runs, highest first."""
        return sorted({g.lr for g in self.groups if g.schedule != "sft_only" and g.rl_runs}, reverse=True)

    @property
    def alarm_lrs(self) -> list[float]:
        """Learning rates with finished plain GRPO runs, highest first: the collapsing rate and the stable one."""
        return sorted({g.lr for g in self.groups if g.method == "plain" and g.schedule == "plain" and g.rl_runs},
                      reverse=True)

    def group(self, method: str, lr: float) -> Group | None:
        return next((g for g in self.groups if g.method == method and g.lr == lr), None)

    def at(self, lr: float, *schedules: str) -> list[Group]:
        return [g for g in self.groups if g.lr == lr and (not schedules or g.schedule in schedules)]


def load_study(sweep: Any, specs: Sequence[Any]) -> Study:
    from toolcollapse.runtime import read_jsonl
    from toolcollapse.sweep import eval_splits, start_success, summarize_runs

    rows = summarize_runs(sweep, specs)
    groups: dict[str, Group] = {}
    for spec, row in zip(specs, rows):
        g = groups.setdefault(spec.setting, Group(spec.setting, method_name(spec.setting), schedule(spec.cfg),
                                                  spec.cfg.grpo.lr))
        g.runs.append(row)
        match = spec.cfg.supervision.sft_only.match
        if match:
            g.matched.append(str(Path(match.replace("{seed}", str(spec.seed)))))
        path = Path(spec.run_dir) / "metrics.jsonl"
        g.metrics.append(read_jsonl(path) if path.is_file() else [])
    name = Path(sweep.out_dir).name
    eval_n = sweep.eval_n or max((r.get("eval_n", 0) for r in rows), default=0)
    return Study(name, eval_splits(sweep), eval_n, start_success(sweep), list(groups.values()),
                 specs[0].cfg.monitor, len(specs))


# ----------------------------------------------------------------------------- numbers


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def sd(xs: Sequence[float]) -> float:
    return math.sqrt(sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def pct(xs: Sequence[float]) -> str:
    return mean_sd(list(xs))


def compare(a: Sequence[float], b: Sequence[float], n_tasks: int) -> tuple[float, float, str]:
    """(mean(a) - mean(b), its noise, "higher" | "lower" | "same"): the noise is the standard error of
    the difference, from the spread over seeds, floored by the binomial error of a rate on n_tasks (every
    seed is scored on the same tasks, so more seeds do not shrink that floor)."""
    n_tasks = max(1, n_tasks)

    def se(xs: Sequence[float]) -> float:
        binomial = math.sqrt(max(mean(xs) * (1 - mean(xs)), 0.25 / n_tasks) / n_tasks)
        return max(sd(xs) / math.sqrt(len(xs)), binomial)
    diff = mean(a) - mean(b)
    noise = math.hypot(se(a), se(b))
    return diff, noise, "higher" if diff > 2 * noise else "lower" if diff < -2 * noise else "same"


def logodds(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def row_at(rows: Sequence[dict[str, Any]], step: int, key: str) -> dict[str, Any] | None:
    """The last row at or before `step` that has `key` (the probe runs every few steps)."""
    return next((r for r in reversed(rows) if r["step"] <= step and key in r), None)


# ----------------------------------------------------------------------------- the findings


@dataclass
class Finding:
    claim: str
    source: str  # "paper" (DESIGN.md's seven findings) or "ours"
    verdict: str  # yes | no | inconclusive
    evidence: str
    key: str = ""  # the check's name (f1_collapse_keeps_skill, ..., own_alarm_leads, ...)


def findings(study: Study) -> list[Finding]:
    lrs = study.alarm_lrs or study.lrs
    hi, lo = (lrs[0], lrs[-1]) if lrs else (None, None)
    checks = (_f1_collapse_keeps_skill, _f2_control_tokens_spike, _f3_four_states, _f4_signals_recover,
              _f5_sync_vs_interleaved, _f6_high_lr_worse, _f7_interleaved_costs_ood, _own_alarm_leads,
              _own_adaptive_recovers, _own_adaptive_vs_fixed, _own_signal_vs_sft_only)
    out = []
    for check in checks:
        finding = check(study, hi, lo)
        finding.key = check.__name__.lstrip("_")
        out.append(finding)
    return out


def _plain(study: Study, lr: float | None) -> Group | None:
    return next((g for g in study.at(lr, "plain") if g.method == "plain"), None) if lr is not None else None


def _runs_with_metrics(g: Group) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The finished RL runs with their metric rows."""
    return [(r, m) for r, m in zip(g.runs, g.metrics) if m and r in g.rl_runs]


def _watched_runs(study: Study) -> list[tuple[str, list[dict[str, Any]]]]:
    """The finished RL runs the alarm only watches: an adaptive run's alarm acts (its recovery is meant to
    stop the collapse), so it is neither a lead nor a false alarm. Runs without a probe are left out."""
    from toolcollapse.alarms import control_series

    series = control_series(study.monitor.control_tokens)
    return [(f"{g.setting}/{r['seed']}", m) for g in study.groups if g.schedule != "adaptive"
            for r, m in _runs_with_metrics(g) if any(k in m[0] for k in series)]


def _f1_collapse_keeps_skill(study: Study, hi: float | None, lo: float | None) -> Finding:
    from toolcollapse.alarms import CONTENT_SERIES

    claim = "1. GRPO collapses although the model keeps the skill (the format goes, the content stays)"
    plain = _plain(study, hi)
    if plain is None or not plain.rl_runs:
        return Finding(claim, "paper", "inconclusive", "no plain GRPO run")
    collapsed = [(r, m) for r, m in _runs_with_metrics(plain) if r["collapsed"]]
    head = f"plain GRPO at lr {hi:g}: {len(collapsed)}/{len(plain.rl_runs)} seeds collapsed"
    if not collapsed:
        return Finding(claim, "paper", "no", head)
    drops = []
    for r, m in collapsed:
        start = m[0]
        at = row_at(m, r["collapse_step"], CONTENT_SERIES[0])
        slots = [k for k in CONTENT_SERIES if k in start and at is not None and k in at]
        if slots:
            drops.append(mean([at[k] - start[k] for k in slots]))
    if not drops:
        return Finding(claim, "paper", "inconclusive", head + "; no content probe in these runs")
    kept = sorted(drops)[len(drops) // 2] > -math.log(2)
    return Finding(claim, "paper", "yes" if kept else "no",
                   head + f"; the ground truth's content log-prob at the collapse step moved by "
                   f"{', '.join(f'{d:+.2f}' for d in drops)} nats from step 0 (kept: a median above "
                   f"-{math.log(2):.2f}, i.e. the ground truth still at least half as likely)")


def _f2_control_tokens_spike(study: Study, hi: float | None, lo: float | None) -> Finding:
    from toolcollapse.alarms import control_series

    claim = ("2. The collapse comes with a spike on control tokens (probe: x10 odds or more, to 1 % or more, by the "
             "collapse step)")
    series = control_series(study.monitor.control_tokens)
    moves = []
    for g in study.groups:
        for r, m in _runs_with_metrics(g):
            if not r["collapsed"]:
                continue
            best = (0.0, "")
            for key in series:
                at = row_at(m, r["collapse_step"], key)
                if key in m[0] and at is not None and at[key] >= SPIKE_FLOOR:
                    change = logodds(at[key]) - logodds(m[0][key])
                    if change > best[0]:
                        best = (change, f"{key.removeprefix('probe/')} {m[0][key]:.4f} -> {at[key]:.4f}")
            if any(key in m[0] for key in series):  # a run without a probe says nothing here
                moves.append((g.setting, r["seed"], *best))
    if not moves:
        return Finding(claim, "paper", "inconclusive", "no probed run collapsed")
    spiked = [m for m in moves if m[2] >= LOG_TEN]
    examples = "; ".join(f"{s} seed {seed}: {what}" for s, seed, _, what in moves[:3] if what)
    return Finding(claim, "paper", "yes" if 2 * len(spiked) > len(moves) else "no",
                   f"{len(spiked)}/{len(moves)} collapsed runs had a control-token series up x10 in odds or more, "
                   f"to 1 % or more, by their collapse step (e.g. {examples})")


def _f3_four_states(study: Study, hi: float | None, lo: float | None) -> Finding:
    from toolcollapse.records import TurnState

    claim = "3. Every turn falls in one of four states, and all four occur (>= 5 % of turns at some step)"
    peak = {s.value: 0.0 for s in TurnState}
    for g in study.groups:
        for m in g.metrics:
            for row in m:
                for s in peak:
                    peak[s] = max(peak[s], row.get(f"state/{s}", 0.0))
    if not any(peak.values()):
        return Finding(claim, "paper", "inconclusive", "no RL run")
    verdict = "yes" if min(peak.values()) >= 0.05 else "no"
    return Finding(claim, "paper", verdict, "peak share of a step's turns: "
                   + ", ".join(f"{s} {100 * v:.0f} %" for s, v in peak.items()))


def _f4_signals_recover(study: Study, hi: float | None, lo: float | None) -> Finding:
    claim = "4. Supervision signals recover training where plain GRPO collapses"
    plain = _plain(study, hi)
    if plain is None or not plain.rl_runs:
        return Finding(claim, "paper", "inconclusive", "no plain GRPO run")
    signals = [g for g in study.at(hi, "synchronous", "interleaved", "adaptive") if g.rl_runs]
    first = study.splits[0]
    head = f"lr {hi:g}: plain GRPO collapsed in {len(plain.collapsed)}/{len(plain.rl_runs)} seeds"
    if 2 * len(plain.collapsed) < len(plain.rl_runs) or not signals:
        return Finding(claim, "paper", "inconclusive", head + ("" if signals else "; no signal ran")
                       + " (a recovery needs a collapse to recover from)")
    if not plain.success(first, first) or not any(g.success(first, first) for g in signals):
        return Finding(claim, "paper", "inconclusive", head + f"; {first} not evaluated yet")
    kept = [g for g in signals if not g.collapsed]
    better = [g for g in kept if g.success(first, first)
              and compare(g.success(first, first), plain.success(first, first), study.eval_n)[2] == "higher"]
    listing = ", ".join(f"{g.method} {len(g.collapsed)}/{len(g.rl_runs)}" for g in signals)
    if better:
        best = max(better, key=lambda g: mean(g.success(first, first)))
        return Finding(claim, "paper", "yes", head + f"; collapses of the signals: {listing}; {best.method} never "
                       f"collapsed and solves {pct(best.success(first, first))} % of {first} against plain's "
                       f"{pct(plain.success(first, first))} %")
    return Finding(claim, "paper", "no", head + f"; collapses of the signals: {listing}; none both kept the format "
                   f"on every seed and solved more {first} tasks than plain beyond noise")


def _f5_sync_vs_interleaved(study: Study, hi: float | None, lo: float | None) -> Finding:
    claim = "5. Interleaved schedules (ETS, PRS) do better than synchronous ones (the paper's best, PRS, is interleaved)"
    first = study.splits[0]
    best = {}
    for kind in ("synchronous", "interleaved"):
        groups = [g for g in study.at(hi, kind) if g.success(first, first)]
        if groups:
            best[kind] = max(groups, key=lambda g: mean(g.success(first, first)))
    if len(best) < 2:
        return Finding(claim, "paper", "inconclusive", f"lr {hi}: need both schedules evaluated")
    i, s = best["interleaved"], best["synchronous"]
    diff, noise, word = compare(i.success(first, first), s.success(first, first), study.eval_n)
    verdict = {"higher": "yes", "lower": "no", "same": "inconclusive"}[word]
    return Finding(claim, "paper", verdict, f"lr {hi:g}, {first}: best interleaved {i.method} "
                   f"{pct(i.success(first, first))} % vs best synchronous {s.method} {pct(s.success(first, first))} % "
                   f"(difference {100 * diff:+.1f} ± {100 * noise:.1f} points)")


def _f6_high_lr_worse(study: Study, hi: float | None, lo: float | None) -> Finding:
    claim = "6. A high RL learning rate worsens collapse"
    p_hi, p_lo = _plain(study, hi), _plain(study, lo)
    if p_hi is None or p_lo is None or hi == lo or not (p_hi.rl_runs and p_lo.rl_runs):
        return Finding(claim, "paper", "inconclusive", "needs plain GRPO at two learning rates")
    a, b = len(p_hi.collapsed) / len(p_hi.rl_runs), len(p_lo.collapsed) / len(p_lo.rl_runs)
    verdict = "yes" if a > b else "no" if a < b else "inconclusive"  # as often at both: no difference shows
    healthy = [pct([r["healthy_min_smooth"] for r in g.rl_runs]) for g in (p_hi, p_lo)]
    return Finding(claim, "paper", verdict,
                   f"plain GRPO collapsed in {len(p_hi.collapsed)}/{len(p_hi.rl_runs)} seeds at lr {hi:g} and "
                   f"{len(p_lo.collapsed)}/{len(p_lo.rl_runs)} at lr {lo:g}; lowest 5-step healthy-turn rate "
                   f"{healthy[0]} % vs {healthy[1]} %")


def _f7_interleaved_costs_ood(study: Study, hi: float | None, lo: float | None) -> Finding:
    claim = ("7. Interleaved SFT stabilises training but costs out-of-distribution success "
             "(format-OOD and content-OOD)")
    first = study.splits[0]
    ood = [s for s in study.splits[1:] if s in CONTENT_SPLITS + FORMAT_SPLITS]
    plain_hi, plain_lo = _plain(study, hi), _plain(study, lo)
    inter_hi = [g for g in study.at(hi, "interleaved") if g.rl_runs]
    inter_lo = [g for g in study.at(lo, "interleaved") if g.success(first, first)]
    if not (plain_hi and plain_hi.rl_runs and inter_hi and plain_lo and inter_lo and ood):
        return Finding(claim, "paper", "inconclusive", "needs plain GRPO and an interleaved method at both "
                       "learning rates, evaluated on OOD splits")
    if not plain_hi.collapsed:
        return Finding(claim, "paper", "inconclusive", f"plain GRPO did not collapse at lr {hi:g}: nothing to stabilise")
    if plain_lo.collapsed or hi == lo:
        return Finding(claim, "paper", "inconclusive", f"no stable plain GRPO to measure an OOD cost against "
                       f"(plain at lr {lo:g} collapsed in {len(plain_lo.collapsed)}/{len(plain_lo.rl_runs)})")
    rate = lambda g: len(g.collapsed) / len(g.rl_runs)  # noqa: E731
    stabilises = all(rate(g) < rate(plain_hi) for g in inter_hi)
    words, cells = [], []
    for g in inter_lo:
        for split in ood:
            a, b = g.success(split, first), plain_lo.success(split, first)
            if a and b:
                diff, noise, word = compare(a, b, study.eval_n)
                words.append(word)
                cells.append(f"{g.method} {split} {100 * diff:+.1f} ± {100 * noise:.1f}")
    head = (f"stabilises at lr {hi:g}: {'yes' if stabilises else 'no'} (collapsed: plain "
            f"{len(plain_hi.collapsed)}/{len(plain_hi.rl_runs)}, " + ", ".join(
                f"{g.method} {len(g.collapsed)}/{len(g.rl_runs)}" for g in inter_hi) + f"); OOD success against plain "
            f"at lr {lo:g}, points: " + "; ".join(cells))
    lower = words.count("lower")
    if not words:
        return Finding(claim, "paper", "inconclusive", head + "(no OOD split evaluated on both sides yet)")
    if stabilises and 2 * lower > len(words):
        return Finding(claim, "paper", "yes", head)
    if not stabilises or not lower:  # no OOD split lower than plain's beyond noise: no cost shows
        return Finding(claim, "paper", "no", head)
    return Finding(claim, "paper", "inconclusive", head + f" (lower beyond noise on {lower} of {len(words)})")


def _own_alarm_leads(study: Study, hi: float | None, lo: float | None) -> Finding:
    from toolcollapse.alarms import control_rules
    from toolcollapse.diagnose import lead_table

    claim = ("Ours: the control-token alarm fires before the collapse (in >= 2/3 of collapsed runs) and seldom "
             "elsewhere (<= 1/3 of stable runs)")
    runs = _watched_runs(study)
    if not runs:
        return Finding(claim, "ours", "inconclusive", "no finished RL run with a probe")
    row = lead_table(runs, {"control": control_rules(study.monitor)}, study.monitor.collapse_hold)[0]
    n, k, stable, false = row["n_collapsed"], row["fired_before"], row["n_stable"], len(row["false_alarms"])
    leads = sorted(row["leads"])
    evidence = (f"fired before the collapse in {k}/{n} collapsed runs (leads {leads} steps); false alarms in "
                f"{false}/{stable} runs that did not collapse (adaptive runs left out: their alarm acts)")
    if not n:
        return Finding(claim, "ours", "inconclusive", evidence)
    ok = 3 * k >= 2 * n and 3 * false <= stable
    return Finding(claim, "ours", "yes" if ok else "no", evidence)


def _own_adaptive_recovers(study: Study, hi: float | None, lo: float | None) -> Finding:
    claim = (f"Ours: the adaptive schedule (alarm -> rollback, LR cut, SFT phase) keeps the 5-step healthy-turn rate "
             f">= {HEALTHY_TARGET:.0%} on every seed where plain GRPO collapses, and solves at least as many tasks")
    first = study.splits[0]
    plain, adaptive = _plain(study, hi), next(iter(study.at(hi, "adaptive")), None)
    if plain is None or adaptive is None or not (plain.rl_runs and adaptive.rl_runs):
        return Finding(claim, "ours", "inconclusive", f"needs plain GRPO and the adaptive schedule at lr {hi}")
    mins = [r["healthy_min_smooth"] for r in adaptive.rl_runs]
    kept = all(v >= HEALTHY_TARGET for v in mins)
    head = (f"lr {hi:g}: plain collapsed {len(plain.collapsed)}/{len(plain.rl_runs)}; adaptive's lowest 5-step "
            f"healthy rate per seed {', '.join(f'{100 * v:.1f} %' for v in mins)}")
    if not plain.collapsed:
        return Finding(claim, "ours", "inconclusive", head + " (plain did not collapse)")
    a, p = adaptive.success(first, first), plain.success(first, first)
    if not (a and p):
        return Finding(claim, "ours", "inconclusive", head + f"; {first} not evaluated yet")
    word = compare(a, p, study.eval_n)[2]
    head += f"; {first} {pct(a)} % vs plain {pct(p)} %"
    return Finding(claim, "ours", "yes" if kept and word != "lower" else "no", head)


def _own_adaptive_vs_fixed(study: Study, hi: float | None, lo: float | None) -> Finding:
    claim = ("Ours: the adaptive schedule matches or beats the best fixed schedule on test success with fewer "
             "SFT tokens")
    first = study.splits[0]
    adaptive = next((g for g in study.at(hi, "adaptive") if g.success(first, first)), None)
    fixed = [g for g in study.at(hi, "synchronous", "interleaved") if g.success(first, first)]
    if adaptive is None or not fixed:
        return Finding(claim, "ours", "inconclusive", f"needs the adaptive schedule and a fixed one at lr {hi}")
    best = max(fixed, key=lambda g: mean(g.success(first, first)))
    diff, noise, word = compare(adaptive.success(first, first), best.success(first, first), study.eval_n)
    tokens = [mean([r["sft_tokens"] for r in g.runs if "eval_success" in r]) for g in (adaptive, best)]
    verdict = "yes" if word != "lower" and tokens[0] < tokens[1] else "no"
    return Finding(claim, "ours", verdict, f"lr {hi:g}, {first}: adaptive {pct(adaptive.success(first, first))} % "
                   f"with {tokens[0]:.0f} SFT tokens vs the best fixed, {best.method}, "
                   f"{pct(best.success(first, first))} % with {tokens[1]:.0f} ({100 * diff:+.1f} ± {100 * noise:.1f})")


def _own_signal_vs_sft_only(study: Study, hi: float | None, lo: float | None) -> Finding:
    claim = "Ours: a signal's gain is more than its SFT tokens' (it beats sft_only matched to its tokens)"
    first = study.splits[0]
    cells, words = [], []
    for control in (g for g in study.groups if g.schedule == "sft_only" and g.success(first, first)):
        signal = next((g for g in study.groups if {r["run"] for r in g.runs} & set(control.matched)), None)
        if signal is None or not signal.success(first, first):
            continue
        diff, noise, word = compare(signal.success(first, first), control.success(first, first), study.eval_n)
        words.append(word)
        cells.append(f"{signal.setting} {pct(signal.success(first, first))} % vs sft_only "
                     f"{pct(control.success(first, first))} % ({100 * diff:+.1f} ± {100 * noise:.1f})")
    if not words:
        return Finding(claim, "ours", "inconclusive", "no sft_only control with its matched run evaluated")
    higher = words.count("higher")
    verdict = "yes" if 2 * higher > len(words) else "no" if "lower" in words or not higher else "inconclusive"
    return Finding(claim, "ours", verdict, f"{first}: " + "; ".join(cells))


# ----------------------------------------------------------------------------- tables


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> tuple[str, list[str], list[list[str]]]:
    return ("table", list(header), [list(r) for r in rows])


def method_table(study: Study, lr: float) -> tuple[str, list[str], list[list[str]]]:
    first = study.splits[0]
    header = ["method", "schedule", "seeds", "collapsed", *[f"{s} %" for s in study.splits], "SFT tokens",
              "paper: Qwen2.5-1.5B on BFCL (theirs)"]
    rows = [["start checkpoint", "-", "-", "-", *[pct([study.start[s]]) if s in study.start else "-"
                                                  for s in study.splits], "0", ""]]
    for g in study.at(lr):
        done = g.finished
        paper = PAPER_QWEN25_1P5B.get(g.method)
        rows.append([g.method, g.schedule, f"{len(done)}/{len(g.runs)}",
                     f"{len(g.collapsed)}/{len(g.rl_runs)}" if g.rl_runs else "no RL",
                     *[pct(g.success(s, first)) for s in study.splits],
                     f"{mean([r['sft_tokens'] for r in done]):.0f}" if done else "-",
                     f"{paper[1]:.2f} ({paper[0]})" if paper else ""])
    return _table(header, rows)


def lr_table(study: Study) -> tuple[str, list[str], list[list[str]]]:
    first = study.splits[0]
    header = ["method"] + [f"lr {lr:g}: {what}" for lr in study.lrs for what in ("collapsed", "healthy min",
                                                                                 f"{first} %")]
    rows = []
    for method in dict.fromkeys(g.method for g in study.groups if g.schedule != "sft_only"):
        cells = [method]
        for lr in study.lrs:
            g = study.group(method, lr)
            if g is None or not g.rl_runs:
                cells += ["-", "-", "-"]
                continue
            cells += [f"{len(g.collapsed)}/{len(g.rl_runs)}", pct([r["healthy_min_smooth"] for r in g.rl_runs]),
                      pct(g.success(first, first))]
        rows.append(cells)
    return _table(header, rows)


def monitor_table(study: Study) -> tuple[str, list[str], list[list[str]]]:
    from toolcollapse.alarms import content_rules, control_rules
    from toolcollapse.diagnose import BASELINE_WARMUP, baseline_rules, lead_table

    m = study.monitor
    panel = {"control tokens (the run's detector)": control_rules(m),
             "control tokens, absolute scale": control_rules(m, scale="absolute"),
             "control tokens, log-odds scale": control_rules(m, scale="logodds"),
             "content log-probs": content_rules(m)}
    for r in baseline_rules(m.alarm_detector, BASELINE_WARMUP):
        panel[f"baseline: {r.series}"] = [r]
    runs = _watched_runs(study)
    header = ["detector", "fired before the collapse", "lead (steps), median [min-max]",
              "false alarms (runs without collapse)"]
    out = []
    for row in lead_table(runs, panel, m.collapse_hold):
        leads = row["leads"]
        spread = "-" if not leads else f"{sorted(leads)[len(leads) // 2]} [{min(leads)}-{max(leads)}]"
        out.append([row["detector"], f"{row['fired_before']}/{row['n_collapsed']}", spread,
                    f"{len(row['false_alarms'])}/{row['n_stable']}"])
    return _table(header, out)


# ----------------------------------------------------------------------------- figures


def figures(study: Study, out: Path) -> list[tuple[str, Path, str]]:
    from toolcollapse.alarms import control_series, run_rules
    from toolcollapse.diagnose import diagnose_rows
    from toolcollapse.figures import plot_control_tokens, plot_states_grid

    out.mkdir(parents=True, exist_ok=True)
    made = []
    hi = (study.alarm_lrs or study.lrs or [None])[0]
    plain = _plain(study, hi)
    if plain is not None:
        runs = _runs_with_metrics(plain)
        chosen = next(((r, m) for r, m in runs if r["collapsed"]), runs[0] if runs else None)
        if chosen is not None:
            r, m = chosen
            d = diagnose_rows(m, run_rules(study.monitor), [], study.monitor.collapse_hold, run=r["run"])
            path = plot_control_tokens(m, control_series(study.monitor.control_tokens), d,
                                       out / "control_tokens.png")
            collapse = "none" if d.collapse_step is None else f"step {d.collapse_step}"
            made.append(("figure", path, (f"Control tokens on the probe set, plain GRPO at lr {hi:g}, seed {r['seed']}: "
                                          f"alarms dashed, the collapse in red ({collapse}).")))
    for lr in study.lrs:
        panels = {}
        for g in study.at(lr):
            runs = _runs_with_metrics(g)
            if runs:
                panels[g.method] = runs[0][1]
        if panels:
            path = plot_states_grid(panels, out / f"states_lr{lr:g}.png", f"lr {lr:g}")
            made.append(("figure", path, f"The four turn states per method at lr {lr:g} (first seed)."))
    return made


# ----------------------------------------------------------------------------- rendering


def blocks(study: Study, figs: list[tuple[str, Path, str]]) -> list[tuple]:
    done = sum(len(g.finished) for g in study.groups)
    out: list[tuple] = [
        ("h1", f"Study report: {study.name}"),
        ("p", (f"{done}/{study.runs_total} runs done; greedy success on {study.eval_n} tasks per split, the same "
               "tasks and rollout limits for every run and for the starting checkpoint. Mean ± sd over seeds, in %.")),
        ("h2", "Findings"),
        _table(["claim", "source", "reproduced", "the numbers"],
               [[f.claim, f.source, f.verdict, f.evidence] for f in findings(study)]),
    ]
    for lr in study.lrs:
        out += [("h2", f"Methods at lr {lr:g}"), method_table(study, lr)]
    if len(study.lrs) > 1:
        out += [("h2", "Learning-rate ablation"), lr_table(study)]
    out += [("h2", "Early warning: lead time and false alarms"),
            ("p", ("Over every RL run of the study: a detector's first alarm before the run's collapse (the "
                   "healthy-turn rate below half its step-0 value for the hold), and alarms in runs that never "
                   "collapsed.")),
            monitor_table(study), ("h2", "Figures")]
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
        if item[0] in ("h1", "h2", "p"):
            body.append(f"<{item[0]}>{e(item[1])}</{item[0]}>")
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
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;"
             "vertical-align:top}th{background:#f3f3f3}img{max-width:100%}figcaption{font-size:13px;color:#555}")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>toolcollapse report</title>"
            f"<style>{style}</style></head><body>" + "\n".join(body) + "</body></html>")


def write_report(sweep: Any, specs: Sequence[Any], out_dir: Path | None = None) -> Path:
    """report.md, report.html and figures/ in `out_dir` (default <sweep out_dir>/report); the report's path."""
    out = Path(out_dir) if out_dir else Path(sweep.out_dir) / "report"
    study = load_study(sweep, specs)
    items = blocks(study, figures(study, out / "figures"))
    (out / "report.md").write_text(to_markdown(items, out))
    (out / "report.html").write_text(to_html(items))
    return out / "report.md"
