"""GRPO steps with HBG's hinted rows or OPS's expert rows: the path before vs today's, side by side in one run.

The study configuration of `bench/rl_step.py` (4 prompts x G 8, 1 thread) with a supervision signal on
(the supervision study's HBG: 2 hinted rows of 8; OPS: 1 expert row of 8). What differs:
  old:  the hinted and expert rows' old log-probs recomputed in micro-batches in row order, each padded to
        the batch's longest row, their prefix run per micro-batch (kept below)
  new:  the recompute planned as the update's (`update.plan_rows`)
(Until issue 19 the old side also prefilled every row of HBG's batch apart, through a module switch that is
gone: `git show b6b1319:bench/supervised_step.py`; its figures are in docs/BENCHMARKS.md.)
Each round runs `--steps` steps of `run_rl` both ways from the same checkpoint and seed, in alternating
order. The first step trains on the same rollouts on both sides (its reward, healthy rate and tokens an
episode are printed for both); the recomputed log-probs then differ in rounding, so later steps drift.

    python bench/supervised_step.py --checkpoint runs/tiny/sft --steps 4 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from toolcollapse import update

sys.path.insert(0, str(Path(__file__).parent))
import rl_step  # noqa: E402

SETTINGS = {"hbg": ["supervision.hbg.enabled=true"],
            "ops": ["supervision.ops.enabled=true", "supervision.ops.shaping=none"]}


@torch.no_grad()
def old_recompute(model, batch, rows, g, temperature=1.0) -> None:
    """`update.recompute_old_logprobs` before: micro-batches in row order, uncut, the prefix run in each."""
    index = torch.tensor(list(rows), device=batch.input_ids.device)
    old = batch.old_logp[index]
    for start in range(0, len(index), g.micro_batch_size):
        part = batch.rows(index[start:start + g.micro_batch_size])
        old[start:start + len(part)][part.target_mask] = update.policy_logprobs(model, part, temperature)[0]
    batch.old_logp[index] = old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    new_recompute = update.recompute_old_logprobs
    spent: list[float] = []

    def timed(run):
        def recompute(*a, **k):
            t = time.perf_counter()
            run(*a, **k)
            spent.append(time.perf_counter() - t)
        return recompute

    for setting, extra in SETTINGS.items():
        rows: dict[str, list[list[dict]]] = {"old": [], "new": []}
        recompute: dict[str, list[float]] = {"old": [], "new": []}
        for k in range(args.rounds):
            for name in (("old", "new") if k % 2 == 0 else ("new", "old")):
                update.recompute_old_logprobs = timed(old_recompute if name == "old" else new_recompute)
                spent.clear()
                rows[name].append(rl_step.run(args.checkpoint, args.steps, extra))
                recompute[name] += spent[1:]
        update.recompute_old_logprobs = new_recompute
        first = {name: [(r[0]["reward_mean"], round(r[0]["healthy_rate"], 4), r[0]["response_tokens"]) for r in runs]
                 for name, runs in rows.items()}
        print(f"{setting}: step 0 (reward, healthy rate, sampled tokens an episode): old {first['old']}, "
              f"new {first['new']}")
        print(f"{setting}: mean seconds per step without step 0, {args.rounds} runs of {args.steps} steps each way:")
        for part in ("seconds", "seconds_rollout", "seconds_update"):
            old, new = (statistics.mean(x[part] for run in rows[n] for x in run[1:]) for n in ("old", "new"))
            print(f"  {part:16s} old {old:6.2f}  new {new:6.2f}  ratio {old / new:5.2f}x")
        old, new = (statistics.mean(recompute[n]) for n in ("old", "new"))
        print(f"  {'recompute':16s} old {old:6.2f}  new {new:6.2f}  ratio {old / new:5.2f}x  (inside the update)")
    print(f"({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
