"""`toolcollapse diagnose`: what happened in a run, and how early the monitor saw it.

- A run directory: replays the run's alarm rules over its metrics.jsonl (the alarms it
  raised live), finds the collapse step, and writes `diagnose/summary.json` and PNG
  figures: control-token probabilities with alarms and collapse marked, the four-state
  stacked area, error types over steps.
- A sweep file: the **lead-time table** -- for each detector, on the runs that collapsed,
  how many steps its first alarm came before the collapse; on the runs that did not, how
  often it fired at all (false alarms). Control-token detectors on the probe series are
  compared with the same detectors on baseline series any trainer logs.
- A dump of another framework's rollouts: see autopsy.py.

Every step index here is the step whose rollouts (and probe, taken before that step's
update) came from the policy after `step` updates, so alarm and collapse share one clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Mapping, Sequence

from toolcollapse.alarms import (
    COLLAPSE_FLOOR,
    CONTENT_SERIES,
    SKILL_DROP,
    Alarm,
    Rule,
    content_rules,
    control_rules,
    control_series,
    find_collapse,
    replay,
    run_rules,
    skill_collapse_step,
)
from toolcollapse.autopsy import format_autopsy, run_autopsy
from toolcollapse.config import ConfigError, MonitorConfig, RunConfig, load_config
from toolcollapse.figures import plot_content, plot_control_tokens, plot_errors, plot_states
from toolcollapse.rundir import resume_config
from toolcollapse.runtime import read_jsonl

# Series any trainer logs, watched for a change in either direction (the healthy rate: for a fall).
BASELINES = {"entropy": 0, "approx_kl_old": 0, "grad_norm": 0, "reward_std_within_group": 0,
             "response_tokens": 0, "healthy_rate": -1}
BASELINE_WARMUP = 5  # observations: the baselines are noisy, their warm-up has to show their spread


def baseline_rules(detector: str, warmup: int) -> list[Rule]:
    # min_scale ~0: these series are noisy, their warm-up spread is their scale
    return [Rule(s, detector, d, warmup, min_scale=1e-9) for s, d in BASELINES.items()]


# ----------------------------------------------------------------------------- one run


@dataclass
class RunDiagnosis:
    run: str
    steps_done: int
    healthy_start: float
    healthy_min: float
    collapse_step: int | None  # healthy rate below half its step-0 value for `hold` steps
    below_floor_step: int | None  # ... below 20 % for `hold` steps
    alarms: list[Alarm] = field(default_factory=list)  # the run's own rules (what it raised live)
    baseline_alarms: list[Alarm] = field(default_factory=list)

    @property
    def first_alarm(self) -> int | None:
        return min((a.step for a in self.alarms), default=None)

    def to_json(self) -> dict[str, Any]:
        alarm = lambda a: {"step": a.step, "series": a.rule.series, "detector": a.rule.detector,  # noqa: E731
                           "value": a.value}
        lead = (self.collapse_step - self.first_alarm
                if self.collapse_step is not None and self.first_alarm is not None else None)
        return {"run": self.run, "steps_done": self.steps_done, "healthy_start": self.healthy_start,
                "healthy_min": self.healthy_min, "collapse_step": self.collapse_step,
                "below_20_step": self.below_floor_step, "first_alarm": self.first_alarm,
                "lead_steps": lead, "alarms": [alarm(a) for a in self.alarms],
                "baseline_alarms": [alarm(a) for a in self.baseline_alarms]}


def diagnose_rows(rows: Sequence[Mapping[str, Any]], rules: Sequence[Rule], baselines: Sequence[Rule],
                  hold: int, run: str = "") -> RunDiagnosis:
    healthy = [r["healthy_rate"] for r in rows]
    collapse = find_collapse(rows, hold)
    return RunDiagnosis(
        run=run, steps_done=len(rows), healthy_start=healthy[0], healthy_min=min(healthy),
        collapse_step=collapse.step, below_floor_step=collapse.floor_step,
        alarms=replay(rules, rows), baseline_alarms=replay(baselines, rows))


def read_run(run_dir: Path) -> tuple[RunConfig, list[dict[str, Any]]]:
    """A run's config and metric rows: one of ours, or the output directory of a TRL run monitored by
    toolcollapse.integrations.trl (its monitor.jsonl rows merged by step, its monitor.yaml)."""
    if not (Path(run_dir) / "metrics.jsonl").is_file() and (Path(run_dir) / "monitor.jsonl").is_file():
        return read_trl_run(Path(run_dir))
    cfg = resume_config(run_dir)
    path = Path(run_dir) / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    if not rows:
        raise ConfigError(f"{path}: no metrics yet (has the run taken a step?)")
    return cfg, rows


def read_trl_run(out_dir: Path) -> tuple[RunConfig, list[dict[str, Any]]]:
    config = out_dir / "monitor.yaml"
    if not config.is_file():
        raise ConfigError(f"{out_dir}: monitor.jsonl without monitor.yaml; was it written by "
                          "toolcollapse.integrations.trl?")
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(out_dir / "monitor.jsonl"):
        by_step.setdefault(int(row["step"]), {}).update(row)
    # every step has its probe (before the update, if it ran then) and its rollouts' series (logged after)
    rows = [by_step[k] for k in sorted(by_step) if "healthy_rate" in by_step[k]]
    if not rows:
        raise ConfigError(f"{out_dir}/monitor.jsonl: no healthy_rate yet (MonitoredGRPOTrainer logs it; has it "
                          "logged a step?)")
    return RunConfig(monitor=load_config(config, cls=MonitorConfig, inherit=False)), rows


def diagnose_run(run_dir: Path, out_dir: Path | None = None, figures: bool = True) -> RunDiagnosis:
    cfg, rows = read_run(run_dir)
    m = cfg.monitor
    d = diagnose_rows(rows, run_rules(m), baseline_rules(m.alarm_detector, BASELINE_WARMUP),
                      m.collapse_hold, run=str(run_dir))
    out_dir = Path(out_dir) if out_dir else Path(run_dir) / "diagnose"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(d.to_json(), indent=2))
    if figures:
        plot_control_tokens(rows, control_series(m.control_tokens), d, out_dir / "control_tokens.png")
        if any(CONTENT_SERIES[0] in r for r in rows):
            plot_content(rows, d, out_dir / "content.png")
        plot_states(rows, d, out_dir / "states.png")
        plot_errors(rows, d, out_dir / "errors.png")
    return d


def format_run(d: RunDiagnosis) -> str:
    step = lambda v: "never" if v is None else f"step {v}"  # noqa: E731
    lines = [f"{d.run}: {d.steps_done} steps, healthy-turn rate {d.healthy_start:.0%} at step 0, "
             f"min {d.healthy_min:.0%}",
             f"collapse (below half of step 0 for the hold): {step(d.collapse_step)}; "
             f"below {COLLAPSE_FLOOR:.0%}: {step(d.below_floor_step)}"]
    lines += [f"  {a.describe()}" for a in sorted(d.alarms, key=lambda a: a.step)] or ["  no control-token alarm"]
    if d.collapse_step is not None and d.first_alarm is not None:
        lines.append(f"lead: first alarm {d.collapse_step - d.first_alarm} steps before the collapse")
    lines += [f"  baseline {a.describe()}" for a in sorted(d.baseline_alarms, key=lambda a: a.step)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the lead-time table


def detector_panel(m: MonitorConfig, baseline_warmup: int) -> dict[str, list[Rule]]:
    """Label -> rules; a row's alarm is the first alarm of any of its rules. The probe series use
    the run config's warm-up; the noisy baseline series need a longer one to learn their spread."""
    panel: dict[str, list[Rule]] = {}
    for det in ("robust_z", "cusum"):
        for scale in ("absolute", "logodds"):
            rules = control_rules(m, det, scale)
            panel[f"{det} control tokens, {scale} (any of {len(rules)})"] = rules
        for r in control_rules(m, det):
            panel[f"{det} {r.series}"] = [r]
        rules = content_rules(m, det)
        panel[f"{det} content (any of {len(rules)})"] = rules
        for r in rules:
            panel[f"{det} {r.series} (down)"] = [r]
        for r in baseline_rules(det, baseline_warmup):
            panel[f"{det} {r.series} ({'down' if r.direction < 0 else 'both'}) [baseline]"] = [r]
    return panel


def lead_table(runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], panel: Mapping[str, Sequence[Rule]],
               hold: int, event: str = "format") -> list[dict[str, Any]]:
    """For each panel row: alarms before the event and their lead on the runs that had it; false alarms
    on the rest. event `format`: the collapse (healthy-turn rate); `skill`: validation success at
    SKILL_DROP of its start or below, with the lead to half of it in the `< 20 %` column's place."""
    judged = []
    for name, rows in runs:
        if event == "skill":
            judged.append((name, rows, skill_collapse_step(rows, SKILL_DROP), skill_collapse_step(rows, 0.5)))
            continue
        collapse = find_collapse(rows, hold)
        judged.append((name, rows, collapse.step, collapse.floor_step))
    out = []
    for label, rules in panel.items():
        leads, floor_leads, missed, false = [], [], [], []
        for name, rows, collapse, floor in judged:
            first = min((a.step for a in replay(rules, rows)), default=None)
            if collapse is None:
                if first is not None:
                    false.append(name)
            elif first is not None and first < collapse:
                leads.append(collapse - first)
                if floor is not None:
                    floor_leads.append(floor - first)
            else:
                missed.append(name)
        n_collapsed = sum(c is not None for *_, c, _ in judged)
        out.append({"detector": label, "n_collapsed": n_collapsed, "fired_before": len(leads),
                    "leads": leads, "lead_ge_3": sum(x >= 3 for x in leads), "floor_leads": floor_leads,
                    "missed": missed, "n_stable": len(judged) - n_collapsed, "false_alarms": false})
    return out


def format_lead_table(rows: Sequence[Mapping[str, Any]], event: str = "collapse", second: str = "< 20 %") -> str:
    def spread(xs: Sequence[int]) -> str:
        return "-" if not xs else f"{median(xs):g} [{min(xs)}-{max(xs)}]"

    head = (f"| detector | fired before {event} | lead >= 3 | lead to {event}, median [min-max] "
            f"| lead to {second} | false alarms (runs without {event}) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        lines.append(f"| {r['detector']} | {r['fired_before']}/{r['n_collapsed']} | {r['lead_ge_3']}/{r['n_collapsed']} "
                     f"| {spread(r['leads'])} | {spread(r['floor_leads'])} "
                     f"| {len(r['false_alarms'])}/{r['n_stable']} |")
    return "\n".join(lines)


def format_sweep(specs: Sequence[Any], baseline_warmup: int) -> str:
    """Per-run collapse and first alarm, then the lead-time table, for every run of a sweep with metrics."""
    runs, lines = [], []
    for spec in specs:
        path = Path(spec.run_dir) / "metrics.jsonl"
        rows = read_jsonl(path) if path.is_file() else []
        if len(rows) < spec.cfg.grpo.steps:
            lines.append(f"{spec.run_dir}: " + (f"{len(rows)}/{spec.cfg.grpo.steps} steps, left out until it "
                                                 f"finishes" if rows else "not run"))
            continue
        m = spec.cfg.monitor
        d = diagnose_rows(rows, run_rules(m), [], m.collapse_hold, run=str(spec.run_dir))
        first = lambda series: min((a.step for a in d.alarms if a.rule.series in series), default=None)  # noqa: E731
        skill = (f"; validation success {rows[0]['val/success']:.2f} at step 0, down 30 % at "
                 f"{skill_collapse_step(rows, SKILL_DROP)}, halved at {skill_collapse_step(rows)}; first content "
                 f"alarm at {first(CONTENT_SERIES)}" if "val/success" in rows[0] else "")
        lines.append(f"{spec.run_dir}: {len(rows)} steps, collapse at {d.collapse_step}, below 20 % at "
                     f"{d.below_floor_step}, first control-token alarm at {first(control_series(m.control_tokens))}"
                     + skill)
        runs.append((str(spec.run_dir), rows))
    if not runs:
        return "\n".join(lines + ["no run has metrics yet"])
    m = specs[0].cfg.monitor
    panel = detector_panel(m, baseline_warmup)
    table = lead_table(runs, panel, m.collapse_hold)
    lines += ["", f"collapse: healthy-turn rate below half its step-0 value for {m.collapse_hold} steps; "
                  f"control-token detectors warm up on {m.alarm_warmup} probe observation(s), "
                  f"baselines on {baseline_warmup}", format_lead_table(table)]
    if any("val/success" in r for _, rows in runs for r in rows):
        lines += ["", f"skill: the event is validation success (val/success) at {SKILL_DROP:.0%} of its first value or "
                      "below",
                  format_lead_table(lead_table(runs, panel, m.collapse_hold, event="skill"), "30 % skill loss",
                                    "skill halved")]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- another framework's dump


def autopsy_dump(path: Path, tokenizer: str, fmt: str = "auto", tools: str | None = None,
                 batch_size: int | None = None, out_dir: Path | None = None, figures: bool = True) -> str:
    """Four-state and error-type rates per step of a dump (autopsy.py); summary.json and figures in out_dir."""
    rows, notes = run_autopsy(path, tokenizer, fmt, tools, batch_size)
    out_dir = Path(out_dir) if out_dir else Path(path).with_name(Path(path).stem + "_diagnose")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"dump": str(path), "steps": len(rows), "notes": notes, "rows": rows,
               "collapse_step": find_collapse(rows, MonitorConfig.collapse_hold).step if rows else None}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if figures and rows:
        plot_states(rows, None, out_dir / "states.png")
        plot_errors(rows, None, out_dir / "errors.png")
    return format_autopsy(rows, notes) + f"\nwrote {out_dir}/summary.json" + (
        " and states.png, errors.png" if figures and rows else "")
