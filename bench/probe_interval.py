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
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from toolcollapse.alarms import content_rules, control_rules
from toolcollapse.diagnose import format_lead_table, lead_table
from toolcollapse.runtime import read_jsonl
from toolcollapse.sweep import load_sweep


def probed_every(rows: list[dict], k: int) -> list[dict]:
    """The rows as a run probing every k steps would have logged them (the probe's series only)."""
    return [r if r["step"] % k == 0 else {key: v for key, v in r.items() if not key.startswith("probe/")}
            for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--every", type=int, nargs="+", default=[1, 2, 3, 4])
    args = ap.parse_args()
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
    for k in args.every:
        mk = dataclasses.replace(m, probe_every=k)
        panel = {"control tokens + content (the defaults)": control_rules(mk) + content_rules(mk),
                 "control tokens": control_rules(mk), "content": content_rules(mk)}
        sub = [(name, probed_every(rows, k)) for name, rows in runs]
        print(f"\n## probe every {k} step(s)\n")
        print(format_lead_table(lead_table(sub, panel, m.collapse_hold)))
        print()
        print(format_lead_table(lead_table(sub, panel, m.collapse_hold, event="skill"), "30 % skill loss",
                                "skill halved"))


if __name__ == "__main__":
    main()
