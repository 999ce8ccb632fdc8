"""What the control-token monitor adds to an RL step, measured side by side in one process.

Three configurations of the same run (same checkpoint, seed, tasks):
  off:     no probe, no gradient share, no control-token list (so no per-token statistics
           and no alarm rules on them), no validation;
  monitor: the monitor's defaults -- probe set of 32 oracle conversations every 3 steps (control
           tokens and content slots from one forward), control-token statistics of the update's
           forward every step, alarm rules (the gradient share is off by default) -- without validation;
  on:      the defaults: the monitor and validation (32 test tasks, greedy, every grpo.eval_every steps).
The monitor and validation only observe: they draw no random numbers, so every run samples the
same rollouts and makes the same updates (checked: their reward and healthy-rate series must be
equal). Runs rotate their order over `--rounds`; each run's wall time over its
steps is summed from its metrics (`seconds`: probe + rollout + update, which is where the monitor
works) and divided by its steps; the wall time of the whole call (loading, building the probe set,
alarms, logging, the final checkpoint) is reported too. Prints the means and the ratios.

    python bench/monitor_overhead.py --checkpoint runs/tiny/sft --steps 20 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from toolcollapse.config import GRPOConfig, MonitorConfig, load_config
from toolcollapse.rl import run_rl
from toolcollapse.runtime import read_jsonl

# The library's defaults, not those a checkpoint's saved config pins (runs/tiny/sft's says probe_every: 2,
# the default when it was trained)
DEFAULTS = [f"monitor.probe_every={MonitorConfig().probe_every}", f"monitor.probe_size={MonitorConfig().probe_size}",
            f"grpo.eval_every={GRPOConfig().eval_every}", f"grpo.eval_n={GRPOConfig().eval_n}"]
OFF = ["monitor.probe_every=0", "monitor.grad_share_every=0", "monitor.control_tokens=[]", "grpo.eval_every=0"]
SIDES = {"off": OFF, "monitor": ["grpo.eval_every=0"], "on": []}


def one_run(checkpoint: str, steps: int, threads: int,
            extra: list[str]) -> tuple[float, float, list[tuple], list[dict]]:
    """(seconds per step inside the loop, wall seconds of the whole run_rl call, (reward, healthy) per step, rows)"""
    overrides = [f"init={checkpoint}", f"threads={threads}", f"grpo.steps={steps}", "grpo.prompts_per_step=4",
                 "grpo.checkpoint_every=1000", "grpo.lr=1.0e-5", *DEFAULTS, *extra]
    cfg = load_config(Path(checkpoint) / "toolcollapse.yaml", overrides)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        run_rl(cfg, Path(tmp) / "rl")
        wall = time.time() - t0
        rows = read_jsonl(Path(tmp) / "rl" / "metrics.jsonl")
    return sum(r["seconds"] for r in rows) / steps, wall, [(r["reward_mean"], r["healthy_rate"]) for r in rows], rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    names = list(SIDES)
    times: dict[str, list[float]] = {n: [] for n in names}
    walls: dict[str, list[float]] = {n: [] for n in names}
    trajectories = {}
    parts: dict[str, list[float]] = {"seconds_probe": [], "seconds_val": [], "seconds": []}
    t0 = time.time()
    for k in range(args.rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            per_step, wall, traj, rows = one_run(args.checkpoint, args.steps, args.threads, SIDES[name])
            if name == "on":  # where the time of the monitor's probe and of validation goes, inside one run
                for key in parts:
                    parts[key].append(sum(r.get(key, 0.0) for r in rows))
            times[name].append(per_step)
            walls[name].append(wall)
            trajectories.setdefault(name, traj)
            print(f"round {k} {name}: {per_step:.2f} s/step, whole run {wall:.1f} s", flush=True)
    assert all(t == trajectories["off"] for t in trajectories.values()), \
        "the monitor or validation changed the rollouts: they must only observe"
    off, w_off = statistics.mean(times["off"]), statistics.mean(walls["off"])
    for name in names[1:]:
        on, w_on = statistics.mean(times[name]), statistics.mean(walls[name])
        print(f"{name} vs off: {off:.2f} -> {on:.2f} s/step, overhead {100 * (on / off - 1):+.1f} %; "
              f"whole runs {w_off:.1f} s vs {w_on:.1f} s, {100 * (w_on / w_off - 1):+.1f} %")
    total = sum(parts["seconds"])
    probe = 100 * sum(parts["seconds_probe"]) / total
    print(f"inside the `on` runs: the probe (control tokens and content) {probe:.1f} %"
          f" and validation {100 * sum(parts['seconds_val']) / total:.1f} % of the step time")
    print(f"({args.rounds} rounds x {args.steps} steps each, {args.threads} threads, {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
