"""What a sparser probe costs the alarms: runs probed every step, read as if probed every k steps.

The probe's cost per step is fixed (it teacher-forces the same probe set whatever the step does),
so its share of the step grows as the step gets faster; `monitor.probe_every` trades that share
against the alarms' resolution. This reads a sweep whose runs probed every step
(`configs/study/probe_interval.yaml`), drops the probe's series from the steps a probe every k
would have skipped, and replays the run's alarm rules (control tokens and content, the defaults)
on what is left: for each k, on the runs with a format collapse the alarms that fired before it and
their lead; on the runs that lost skill (validation success down 30 %) those that fired before it
and their lead to its halving; and the false alarms on the runs without the event. Leads in steps.

    python bench/probe_interval.py configs/study/probe_interval.yaml

The schedule that probed densely while a detector neared its threshold (`--adaptive`, docs/LOG.md
2026-12-05 (6): it lost the skill warnings) was removed with the detectors' `level` in issue 19; it runs at
revision b6b1319.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from toolcollapse import alarms
from toolcollapse.alarms import Cusum, content_rules, control_rules
from toolcollapse.diagnose import format_lead_table, lead_table
from toolcollapse.runtime import read_jsonl
from toolcollapse.sweep import load_sweep


def probed_every(rows: list[dict], k: int) -> list[dict]:
    """The rows as a run probing every k steps would have logged them (the probe's series only)."""
    return [r if r["step"] % k == 0 else unprobed(r) for r in rows]


def unprobed(row: dict) -> dict:
    return {key: v for key, v in row.items() if not key.startswith("probe/")}


class CusumPerObservation(Cusum):
    """CUSUM as it was before 2026-12-05 (6): every observation counts once, however many steps since the last."""

    def update(self, x: float, steps: int = 1) -> bool:
        return super().update(x, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--every", type=int, nargs="*", default=[1, 2, 3, 4])
    ap.add_argument("--cusum-per-observation", action="store_true",
                    help="the content rules' CUSUM as before: an observation counts once, not once per step")
    args = ap.parse_args()
    if args.cusum_per_observation:
        alarms.DETECTORS["cusum"] = CusumPerObservation
    _, specs = load_sweep(args.sweep)
    runs = []
    for spec in specs:
        rows = read_jsonl(Path(spec.run_dir) / "metrics.jsonl")
        if len(rows) < spec.cfg.grpo.steps:
            raise SystemExit(f"{spec.run_dir}: {len(rows)}/{spec.cfg.grpo.steps} steps; run the sweep first")
        if spec.cfg.monitor.probe_every != 1:
            raise SystemExit(f"{spec.run_dir}: probed every {spec.cfg.monitor.probe_every} steps, not every step")
        runs.append((str(spec.run_dir), rows))
    m = specs[0].cfg.monitor
    schedules = {f"every {k} step(s)": (lambda rows, k=k: probed_every(rows, k)) for k in args.every}
    panel = {"control tokens + content (the defaults)": control_rules(m) + content_rules(m),
             "control tokens": control_rules(m), "content": content_rules(m)}
    for label, schedule in schedules.items():
        sub = [(name, schedule(rows)) for name, rows in runs]
        print(f"\n## probe {label}\n")
        share = {}
        for name, rows in sub:  # probes a step, by setting (the run directory's parent)
            share.setdefault(Path(name).parent.name, []).append(sum(any(k.startswith("probe/") for k in r)
                                                                    for r in rows) / len(rows))
        print("probes a step: " + ", ".join(f"{s} {sum(v) / len(v):.2f}" for s, v in share.items()) + "\n")
        print(format_lead_table(lead_table(sub, panel, m.collapse_hold)))
        print()
        print(format_lead_table(lead_table(sub, panel, m.collapse_hold, event="skill"), "30 % skill loss",
                                "skill halved"))


if __name__ == "__main__":
    main()
