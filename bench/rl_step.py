"""RL steps of the study configuration, timed: per-step seconds (probe, rollout, update).

The study configuration (configs/study/*.yaml): 4 prompts x G 8, up to 8 turns of 64 tokens, the probe every
step, 1 thread; `--rounds` runs of `--steps` steps of `run_rl` from the same checkpoint and seed. Until issue
19 this script also ran the path before issue 14 (switches of the config and module globals: a copy of the
system prompt per row, no row compaction, micro-batches in rollout order, the prefix per micro-batch); those
switches are gone, and the path before is a revision's: `bench/rl_step_vs_commit.py --rev 25cd5cc` runs that
code itself beside the working tree (`git show b6b1319:bench/rl_step.py` is the old script; its figures are
in docs/BENCHMARKS.md). `STUDY`, `PARTS` and `run` serve the other benchmarks.

    python bench/rl_step.py --checkpoint runs/tiny/sft --steps 4 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from toolcollapse.config import load_config
from toolcollapse.rl import run_rl
from toolcollapse.runtime import read_jsonl

STUDY = ["grpo.prompts_per_step=4", "grpo.group_size=8", "rollout.max_turns=8", "rollout.max_new_tokens=64",
         "monitor.probe_every=1", "grpo.lr=1.0e-5", "grpo.checkpoint_every=1000", "threads=1"]
PARTS = ("seconds", "seconds_probe", "seconds_rollout", "seconds_update")


def run(checkpoint: str, steps: int, extra: list[str]) -> list[dict]:
    cfg = load_config("configs/tiny_rl.yaml", [f"init={checkpoint}", f"grpo.steps={steps}", *STUDY, *extra])
    with tempfile.TemporaryDirectory() as tmp:
        run_rl(cfg, Path(tmp) / "rl")
        return read_jsonl(Path(tmp) / "rl" / "metrics.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    runs = [run(args.checkpoint, args.steps, []) for _ in range(args.rounds)]
    print(f"step 0 (reward, healthy rate, sampled tokens an episode) per run: "
          f"{[(r[0]['reward_mean'], round(r[0]['healthy_rate'], 4), r[0]['response_tokens']) for r in runs]}")
    for label, pick in (("all steps", lambda r: r), ("without step 0 (validation)", lambda r: r[1:])):
        print(f"{label}, mean seconds per step over {args.rounds} runs of {args.steps} steps:")
        for part in PARTS:
            print(f"  {part:16s} {statistics.mean(x[part] for r in runs for x in pick(r)):6.2f}")
    # a run validates once in eval_every steps, these runs at step 0 (their one warm-up step) only: a run's step
    # is a later step without its validation, plus validation's time spread over eval_every steps
    later = statistics.mean(x["seconds"] - x.get("seconds_val", 0.0) for r in runs for x in r[1:])
    val = statistics.mean(x.get("seconds_val", 0.0) for r in runs for x in r[:1])
    for every in (load_config("configs/tiny_rl.yaml").grpo.eval_every, 4):  # the default; the study configs' 4
        print(f"per step of a run that validates every {every} steps: {later + val / every:.2f}")
    print(f"({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
