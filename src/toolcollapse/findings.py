"""The findings checklist of a study report: each claim's verdict computed from the runs' files.

A verdict that compares two arms reads their paired 95 % bootstrap interval (stats.py) on the same tasks: "yes"
or "no" only when the interval excludes zero, otherwise "undecided", with the interval in the evidence. The
descriptive claims (a collapse, a spike, the four states) count runs. "n/a" marks a claim the study cannot test
(no run of the kind it needs).

The learning rates the claims read (`rates`): `lr_up`, the plain GRPO rate whose paired interval against the
start lies above zero on the scan split (val when evaluated, else the first split), the largest gain if several;
`lr_down`, the lowest plain rate that keeps >= 90 % healthy turns through step 10 on every seed and whose interval
lies below zero (a slow loss, not a one-step collapse); the signals' rate, the one most of the supervised arms
ran at.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from toolcollapse.alarms import CONTENT_SERIES, control_rules, control_series
from toolcollapse.diagnose import lead_table
from toolcollapse.records import TurnState
from toolcollapse.results import Arm, Study, healthy_through
from toolcollapse.stats import PairedDiff, verdict

# The paper's BFCL multi-turn scores for Qwen2.5-1.5B-Instruct (arXiv 2606.26027), keyed by our closest method
PAPER_QWEN25_1P5B = {"plain": ("plain RL (GRPO)", 3.50), "ets": ("SFT interleaved with RL", 17.25),
                     "prs": ("PRS", 25.75)}
PAPER_ORDER = ("plain", "ets", "prs")  # lowest to highest, as the paper ranks them
CONTENT_SPLITS = ("ood_content", "ood_entities", "ood_facts", "ood_compositions", "ood_chains")
FORMAT_SPLITS = ("ood_format",)
HEALTHY_EARLY = 0.90  # lr_down: the healthy-turn rate kept through EARLY_STEP
EARLY_STEP = 10
LOG_TEN = math.log(10.0)
SPIKE_FLOOR = 0.01  # a control-token spike: x10 in odds, and the probability at 1 % or more


@dataclass
class Finding:
    claim: str
    source: str  # "paper" (the paper's seven findings) or "ours"
    verdict: str  # yes | no | undecided | n/a
    evidence: str
    key: str = ""


@dataclass(frozen=True)
class Rates:
    scan_split: str
    up: float | None
    down: float | None
    signals: float | None  # the rate most supervised arms ran at
    why_up: str
    why_down: str


def rates(study: Study) -> Rates:
    split = "val" if "val" in study.splits else study.first
    lrs = study.plain_lrs
    gains = {lr: study.compare(study.plain(lr), "start", split) for lr in lrs}
    up = [lr for lr, d in gains.items() if d is not None and d.low > 0]
    lr_up = max(up, key=lambda lr: gains[lr].diff) if up else None
    down = []
    for lr in sorted(lrs):
        d, arm = gains[lr], study.plain(lr)
        early = [healthy_through(m, EARLY_STEP) for _, m in arm.finished_metrics()]
        if d is not None and d.high < 0 and early and all(h is not None and h >= HEALTHY_EARLY for h in early):
            down.append(lr)
    signals = Counter(a.lr for a in study.arms if a.schedule not in ("plain", "sft_only"))
    described = "; ".join(f"lr {lr:g}: {d.describe()}" for lr, d in gains.items() if d is not None) or "no plain run"
    return Rates(split, lr_up, down[0] if down else None, signals.most_common(1)[0][0] if signals else None,
                 f"plain GRPO against the start on {split}: {described}",
                 f"the lowest plain rate keeping >= {HEALTHY_EARLY:.0%} healthy turns through step {EARLY_STEP} on "
                 f"every seed and ending below the start on {split}")


def findings(study: Study) -> list[Finding]:
    r = rates(study)
    checks = (_f1_collapse_keeps_skill, _f2_control_tokens_spike, _f3_four_states, _f4_signals_recover,
              _f5_sync_vs_interleaved, _f6_high_lr_worse, _f7_interleaved_costs_ood, _f8_paper_order,
              _own_plain_improves, _own_signal_improves, _own_signal_vs_sft_only, _own_adaptive_vs_fixed,
              _own_alarm_leads)
    out = []
    for check in checks:
        finding = check(study, r)
        finding.key = check.__name__.lstrip("_")
        out.append(finding)
    return out


def _word(d: PairedDiff | None) -> str:
    return "n/a" if d is None else verdict(d.low, d.high)


def _signals(study: Study, lr: float | None) -> list[Arm]:
    return [a for a in study.arms if lr is not None and a.lr == lr and a.schedule not in ("plain", "sft_only")
            and a.outcomes.get(study.first) is not None]


def _f1_collapse_keeps_skill(study: Study, r: Rates) -> Finding:
    claim = ("1. GRPO collapses although the model keeps the skill (the format goes, the probe's content "
             "log-prob stays)")
    lr = study.plain_lrs[0] if study.plain_lrs else None
    plain = study.plain(lr)
    if plain is None or not plain.rl_runs:
        return Finding(claim, "paper", "n/a", "no plain GRPO run")
    collapsed = [(run, m) for run, m in plain.finished_metrics() if run["collapsed"]]
    head = (f"plain GRPO at lr {lr:g} (the highest): {len(collapsed)}/{len(plain.rl_runs)} seeds collapsed "
            "over the whole run")
    if not collapsed:
        return Finding(claim, "paper", "no", head)
    drops = []
    for run, m in collapsed:
        at = next((x for x in reversed(m) if x["step"] <= run["collapse_step"] and CONTENT_SERIES[0] in x), None)
        slots = [k for k in CONTENT_SERIES if k in m[0] and at is not None and k in at]
        if slots:
            drops.append(sum(at[k] - m[0][k] for k in slots) / len(slots))
    if not drops:
        return Finding(claim, "paper", "n/a", head + "; no content probe in these runs")
    kept = sorted(drops)[len(drops) // 2] > -math.log(2)
    return Finding(claim, "paper", "yes" if kept else "no",
                   head + f"; the ground truth's content log-prob at the collapse step moved by "
                   f"{', '.join(f'{d:+.2f}' for d in drops)} nats from step 0 (kept: a median above "
                   f"-{math.log(2):.2f}, the ground truth still at least half as likely)")


def _f2_control_tokens_spike(study: Study, r: Rates) -> Finding:
    claim = ("2. The collapse comes with a spike on control tokens (probe: x10 odds or more, to 1 % or more, by the "
             "collapse step)")
    series = control_series(study.monitor.control_tokens)
    moves = []
    for arm in study.arms:
        for run, m in arm.finished_metrics():
            if not run["collapsed"] or not any(k in m[0] for k in series):
                continue
            best = (0.0, "")
            for key in series:
                at = next((x for x in reversed(m) if x["step"] <= run["collapse_step"] and key in x), None)
                if key in m[0] and at is not None and at[key] >= SPIKE_FLOOR:
                    change = _logodds(at[key]) - _logodds(m[0][key])
                    if change > best[0]:
                        best = (change, f"{key.removeprefix('probe/')} {m[0][key]:.4f} -> {at[key]:.4f}")
            moves.append((arm.setting, run["seed"], *best))
    if not moves:
        return Finding(claim, "paper", "n/a", "no probed run collapsed")
    spiked = [m for m in moves if m[2] >= LOG_TEN]
    examples = "; ".join(f"{s} seed {seed}: {what}" for s, seed, _, what in moves[:3] if what)
    return Finding(claim, "paper", "yes" if 2 * len(spiked) > len(moves) else "no",
                   f"{len(spiked)}/{len(moves)} collapsed runs had a control-token series up x10 in odds or more, "
                   f"to 1 % or more, by their collapse step" + (f" (e.g. {examples})" if examples else ""))


def _logodds(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def _f3_four_states(study: Study, r: Rates) -> Finding:
    claim = "3. Every turn falls in one of four states, and all four occur (>= 5 % of turns at some step)"
    peak = {s.value: 0.0 for s in TurnState}
    for arm in study.arms:
        for m in arm.metrics:
            for row in m:
                for s in peak:
                    peak[s] = max(peak[s], row.get(f"state/{s}", 0.0))
    if not any(peak.values()):
        return Finding(claim, "paper", "n/a", "no RL run")
    return Finding(claim, "paper", "yes" if min(peak.values()) >= 0.05 else "no",
                   "peak share of a step's turns: " + ", ".join(f"{s} {100 * v:.0f} %" for s, v in peak.items()))


def _f4_signals_recover(study: Study, r: Rates) -> Finding:
    claim = ("4. A supervision signal turns degrading RL into improving RL: above plain GRPO at the same LR and "
             "above the start")
    lr = r.signals
    plain, signals = study.plain(lr), _signals(study, lr)
    if plain is None or not signals:
        return Finding(claim, "paper", "n/a", f"needs plain GRPO and a signal at one LR (signals at {lr})")
    cells, both, against = [], [], []
    for arm in signals:
        vs_plain, vs_start = study.compare(arm, plain, study.first), study.compare(arm, "start", study.first)
        cells.append(f"{arm.method}: vs plain {vs_plain.describe() if vs_plain else '-'}, vs start "
                     f"{vs_start.describe() if vs_start else '-'}")
        if _word(vs_plain) == "yes" and _word(vs_start) == "yes":
            both.append(arm.method)
        if "no" in (_word(vs_plain), _word(vs_start)):
            against.append(arm.method)
    word = "yes" if both else "no" if len(against) == len(signals) else "undecided"
    head = f"lr {lr:g}, {study.first}" + (f"; above both: {', '.join(both)}" if both else "")
    return Finding(claim, "paper", word, head + "; " + "; ".join(cells))


def _f5_sync_vs_interleaved(study: Study, r: Rates) -> Finding:
    claim = "5. Interleaved schedules (ETS, PRS) do better than synchronous ones (the paper's best, PRS, is interleaved)"
    arms = _signals(study, r.signals)
    best = {}
    for kind in ("synchronous", "interleaved"):
        of_kind = [a for a in arms if a.schedule == kind]
        if of_kind:
            best[kind] = max(of_kind, key=lambda a: a.success(study.first))
    if len(best) < 2:
        return Finding(claim, "paper", "n/a", "needs a synchronous and an interleaved signal evaluated at one LR")
    i, s = best["interleaved"], best["synchronous"]
    d = study.compare(i, s, study.first)
    return Finding(claim, "paper", _word(d), f"lr {r.signals:g}, {study.first}: the best interleaved, {i.method} "
                   f"({100 * i.success(study.first):.1f} %), against the best synchronous, {s.method} "
                   f"({100 * s.success(study.first):.1f} %): {d.describe()}")


def _f6_high_lr_worse(study: Study, r: Rates) -> Finding:
    claim = "6. A high RL learning rate worsens the outcome (plain GRPO at the highest rate against the lowest)"
    lrs = [lr for lr in study.plain_lrs if study.plain(lr).outcomes.get(study.first) is not None]
    if len(lrs) < 2:
        return Finding(claim, "paper", "n/a", "needs plain GRPO evaluated at two learning rates")
    hi, lo = study.plain(lrs[0]), study.plain(lrs[-1])
    d = study.compare(lo, hi, study.first)  # "the low rate is above the high one"
    return Finding(claim, "paper", _word(d), f"{study.first}: lr {lo.lr:g} against lr {hi.lr:g}: {d.describe()}; "
                   f"collapsed {len(hi.collapsed)}/{len(hi.rl_runs)} at lr {hi.lr:g}, "
                   f"{len(lo.collapsed)}/{len(lo.rl_runs)} at lr {lo.lr:g}")


def _f7_interleaved_costs_ood(study: Study, r: Rates) -> Finding:
    claim = ("7. Interleaved SFT costs out-of-distribution success beyond what its SFT tokens cost (ETS, PRS "
             "below their sft_only controls on format- and content-OOD)")
    ood = [s for s in study.splits[1:] if s in CONTENT_SPLITS + FORMAT_SPLITS]
    cells, words = [], []
    for arm in [a for a in study.arms if a.schedule == "interleaved"]:
        control = study.control_of(arm)
        for split in ood if control is not None else ():
            d = study.compare(control, arm, split)  # "the control is above the interleaved arm": the cost
            if d is not None:
                cells.append(f"{arm.method} {split}: control minus arm {d.describe()}")
                words.append(_word(d))
    if not words:
        return Finding(claim, "paper", "n/a", "needs an interleaved arm and its sft_only control evaluated on OOD splits")
    word = "yes" if "yes" in words and "no" not in words else "no" if "no" in words and "yes" not in words \
        else "undecided"
    return Finding(claim, "paper", word, "; ".join(cells))


def _f8_paper_order(study: Study, r: Rates) -> Finding:
    claim = "8. The paper's order of methods holds here: plain GRPO < ETS (SFT interleaved) < PRS"
    lr = r.signals
    arms = {m: next((a for a in _signals(study, lr) + [study.plain(lr)] if a is not None and a.method == m), None)
            for m in PAPER_ORDER}
    if any(a is None or a.outcomes.get(study.first) is None for a in arms.values()):
        return Finding(claim, "paper", "n/a", f"needs plain, ETS and PRS evaluated at lr {lr}")
    pairs = [(arms[hi], arms[lo]) for lo, hi in zip(PAPER_ORDER, PAPER_ORDER[1:])]
    diffs = [study.compare(hi, lo, study.first) for hi, lo in pairs]
    words = [_word(d) for d in diffs]
    word = "yes" if all(w == "yes" for w in words) else "no" if "no" in words else "undecided"
    return Finding(claim, "paper", word, f"lr {lr:g}, {study.first}: " + "; ".join(
        f"{hi.method} - {lo.method} {d.describe()}" for (hi, lo), d in zip(pairs, diffs)))


def _own_plain_improves(study: Study, r: Rates) -> Finding:
    claim = "Ours: plain GRPO improves the start at lr_up"
    lr = r.up
    if lr is None:  # no rate chosen: the one that gained most on the scan split, read on the first
        scored = [(study.compare(study.plain(x), "start", r.scan_split), x) for x in study.plain_lrs]
        scored = [(d.diff, x) for d, x in scored if d is not None]
        if not scored:
            return Finding(claim, "ours", "n/a", "no plain GRPO run evaluated")
        lr = max(scored)[1]
    d = study.compare(study.plain(lr), "start", study.first)
    head = (f"lr_up = {lr:g} (chosen on {r.scan_split})" if r.up is not None else
            f"no plain rate's interval lay above zero on {r.scan_split}; the best there, lr {lr:g}")
    return Finding(claim, "ours", _word(d), f"{head}; {study.first}: " + (d.describe() if d else "not evaluated"))


def _own_signal_improves(study: Study, r: Rates) -> Finding:
    claim = ("Ours: a signal at lr_down ends above the start, above plain GRPO at lr_down, and above its sft_only "
             "control")
    lr = r.signals
    plain, arms = study.plain(lr), _signals(study, lr)
    if plain is None or not arms:
        return Finding(claim, "ours", "n/a", f"needs plain GRPO and the signals at one LR (signals at {lr})")
    head = f"signals at lr {lr:g}" + ("" if lr == r.down else f" (the scan's lr_down is {r.down})")
    cells, winners, losers = [], [], []
    for arm in arms:
        control = study.control_of(arm)
        ds = [study.compare(arm, "start", study.first), study.compare(arm, plain, study.first),
              study.compare(arm, control, study.first) if control is not None else None]
        trains_sft = any(x["sft_tokens"] for x in arm.finished)
        third = ("n/a" if not trains_sft else "no control") if control is None else \
            "not evaluated" if ds[2] is None else _word(ds[2])
        words = [_word(d) for d in ds[:2]] + [third]
        cells.append(f"{arm.method}: start {words[0]}, plain {words[1]}, sft_only {words[2]}")
        if all(w == "yes" for w in words[:2]) and words[2] in ("yes", "n/a"):
            winners.append(arm.method)
        if "no" in words:
            losers.append(arm.method)
    word = "yes" if winners else "no" if len(losers) == len(arms) else "undecided"
    note = " (sft_only n/a: the arm trains on no ground-truth tokens to match)" if any("sft_only n/a" in c for c in
                                                                                       cells) else ""
    return Finding(claim, "ours", word, head + (f"; all three: {', '.join(winners)}" if winners else "") + "; "
                   + "; ".join(cells) + note)


def _own_signal_vs_sft_only(study: Study, r: Rates) -> Finding:
    claim = "Ours: a signal's gain is more than its SFT tokens' (it beats sft_only matched to its tokens)"
    cells, words = [], []
    for arm in study.arms:
        control = study.control_of(arm) if arm.schedule != "sft_only" else None
        d = study.compare(arm, control, study.first) if control is not None else None
        if d is not None:
            cells.append(f"{arm.setting} against {control.setting}: {d.describe()}")
            words.append(_word(d))
    if not words:
        return Finding(claim, "ours", "n/a", "no sft_only control with its matched arm evaluated")
    word = "yes" if 2 * words.count("yes") > len(words) else "no" if 2 * words.count("no") > len(words) \
        else "undecided"
    return Finding(claim, "ours", word, f"{study.first}: " + "; ".join(cells))


def _own_adaptive_vs_fixed(study: Study, r: Rates) -> Finding:
    claim = "Ours: the adaptive schedule matches or beats the best fixed signal on test success with fewer SFT tokens"
    arms = _signals(study, r.signals)
    adaptive = next((a for a in arms if a.schedule == "adaptive"), None)
    fixed = [a for a in arms if a.schedule in ("synchronous", "interleaved")]
    if adaptive is None or not fixed:
        return Finding(claim, "ours", "n/a", f"needs the adaptive schedule and a fixed signal at lr {r.signals}")
    best = max(fixed, key=lambda a: a.success(study.first))
    d = study.compare(adaptive, best, study.first)
    tokens = [sum(x["sft_tokens"] for x in a.finished) / max(1, len(a.finished)) for a in (adaptive, best)]
    word = "no" if _word(d) == "no" or tokens[0] >= tokens[1] else _word(d) if _word(d) == "yes" else "undecided"
    return Finding(claim, "ours", word, f"{study.first}: adaptive against the best fixed, {best.method}: "
                   f"{d.describe()}; SFT tokens {tokens[0]:.0f} against {tokens[1]:.0f}")


def _own_alarm_leads(study: Study, r: Rates) -> Finding:
    claim = ("Ours: the control-token alarm fires before a collapse (>= 2/3 of collapsed runs) and seldom "
             "elsewhere (<= 1/3 of the runs that did not collapse)")
    series = control_series(study.monitor.control_tokens)
    runs = [(f"{a.setting}/{run['seed']}", m) for a in study.arms if a.schedule != "adaptive"
            for run, m in a.finished_metrics() if any(k in m[0] for k in series)]
    if not runs:
        return Finding(claim, "ours", "n/a", "no finished RL run with a probe")
    row = lead_table(runs, {"control": control_rules(study.monitor)}, study.monitor.collapse_hold)[0]
    n, k, stable, false = row["n_collapsed"], row["fired_before"], row["n_stable"], len(row["false_alarms"])
    evidence = (f"over {len(runs)} runs (adaptive ones left out: their alarm acts): fired before the collapse in "
                f"{k}/{n} collapsed runs (leads {sorted(row['leads'])} steps); alarms in {false}/{stable} runs that "
                "did not collapse")
    if not n:
        meaning = (f"no run collapsed, so no lead can be measured; {false} of {stable} stable runs alarmed: "
                   + ("an alarm on these runs was a false alarm -- act on it only with the healthy-turn rate or "
                      "validation success confirming" if false else "the alarm stayed quiet where nothing fell"))
        return Finding(claim, "ours", "undecided", f"{evidence}. What it means: {meaning}")
    ok = 3 * k >= 2 * n and 3 * false <= stable
    meaning = ("an alarm is worth acting on (roll back, cut the LR): it came early and seldom falsely"
               if ok else "an alarm alone is weak evidence here: "
               + ("it missed collapses" if 3 * k < 2 * n else "") + (" and " if 3 * k < 2 * n and 3 * false > stable
                                                                     else "")
               + ("it fired in many runs that never collapsed" if 3 * false > stable else ""))
    return Finding(claim, "ours", "yes" if ok else "no", f"{evidence}. What it means: {meaning}")


def describe_rates(r: Rates) -> dict[str, Any]:
    return {"lr_up": r.up, "lr_down": r.down, "signals": r.signals}
