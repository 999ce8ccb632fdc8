"""What the control-token monitor adds to an RL step, measured side by side in one process.

Two configurations of the same run (same checkpoint, seed, tasks):
  off: no probe, no gradient share, no control-token list (so no per-token statistics
       and no alarm rules on them);
  on:  the defaults -- probe set of 32 oracle conversations every 2 steps, control-token
       statistics of the update's forward every step, gradient share every 10 steps,
       alarm rules on the probe series.
The monitor only observes: it draws no random numbers, so both runs sample the same
rollouts and make the same updates (checked: their reward and healthy-rate series must be
equal). Runs alternate off/on, on/off, ... over `--rounds`; each run's wall time over its
steps is summed from its metrics (`seconds`: probe + rollout + update, which is where the monitor
works) and divided by its steps; the wall time of the whole call (loading, building the probe set,
alarms, logging, the final checkpoint) is reported too. Prints the means and the ratios.

    python bench/monitor_overhead.py --checkpoint runs/tiny/sft --steps 10 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from toolcollapse.config import load_config
from toolcollapse.rl import run_rl
from toolcollapse.runtime import read_jsonl

OFF = ["monitor.probe_every=0", "monitor.grad_share_every=0", "monitor.control_tokens=[]"]


def one_run(checkpoint: str, steps: int, threads: int, extra: list[str]) -> tuple[float, float, list[tuple]]:
    """(seconds per step inside the loop, wall seconds of the whole run_rl call, (reward, healthy) per step)"""
    overrides = [f"init={checkpoint}", f"threads={threads}", f"grpo.steps={steps}", "grpo.prompts_per_step=4",
                 "grpo.checkpoint_every=1000", "grpo.lr=1.0e-5", *extra]
    cfg = load_config(Path(checkpoint) / "toolcollapse.yaml", overrides)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        run_rl(cfg, Path(tmp) / "rl")
        wall = time.time() - t0
        rows = read_jsonl(Path(tmp) / "rl" / "metrics.jsonl")
    return sum(r["seconds"] for r in rows) / steps, wall, [(r["reward_mean"], r["healthy_rate"]) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"off": [], "on": []}
    walls: dict[str, list[float]] = {"off": [], "on": []}
    trajectories = {}
    t0 = time.time()
    for k in range(args.rounds):
        for name in (("off", "on") if k % 2 == 0 else ("on", "off")):
            per_step, wall, traj = one_run(args.checkpoint, args.steps, args.threads, OFF if name == "off" else [])
            times[name].append(per_step)
            walls[name].append(wall)
            trajectories.setdefault(name, traj)
            print(f"round {k} {name}: {per_step:.2f} s/step, whole run {wall:.1f} s", flush=True)
    assert trajectories["off"] == trajectories["on"], "the monitor changed the rollouts: it must only observe"
    off, on = statistics.mean(times["off"]), statistics.mean(times["on"])
    w_off, w_on = statistics.mean(walls["off"]), statistics.mean(walls["on"])
    print(f"monitor off: {off:.2f} s/step, on: {on:.2f} s/step, overhead {100 * (on / off - 1):+.1f} %; "
          f"whole runs {w_off:.1f} s vs {w_on:.1f} s, {100 * (w_on / w_off - 1):+.1f} % "
          f"({args.rounds} rounds x {args.steps} steps each, {args.threads} threads, {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
