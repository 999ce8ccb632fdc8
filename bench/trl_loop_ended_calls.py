"""Where TRL's tool loop and our engine part ways on sampled rollouts: the share of TRL's rollouts that end at a
call it did not run (a call it could not parse ends the rollout there; ours answers it with an error and goes
on), and the per-step rewards and per-turn error rates of both sides, on the configuration of
bench/grpo_multiturn_vs_trl.py (the measurement behind docs/LOG.md, "the reward gap between TRL's tool loop
and ours").

    python bench/trl_loop_ended_calls.py --checkpoint runs/tiny/sft --steps 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import grpo_multiturn_vs_trl as side  # noqa: E402

from toolcollapse.envs import make_env  # noqa: E402
from toolcollapse.integrations.trl import rollout_episode  # noqa: E402
from toolcollapse.rl import run_rl  # noqa: E402
from toolcollapse.runtime import read_jsonl  # noqa: E402

ERRORS = ("error/invalid_json", "error/unknown_tool", "error/bad_arguments")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)
    env = make_env(side.config(args.checkpoint, args.steps))
    batches = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = side.trl_trainer(args.checkpoint, args.steps, tmp, monitored=True)
        generate = trainer._generate_and_score_completions

        def keep(inputs):
            out = generate(inputs)
            batches.append((inputs, {k: out[k].cpu() for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                               "completion_mask", "tool_mask")}))
            return out

        trainer._generate_and_score_completions = keep
        trainer.train()
        trl_rows = [h for h in trainer.state.log_history if "reward" in h]
    task = {t.id: t for t in env.tasks("train")}
    n = ended = 0
    for inputs, out in batches:
        for i, x in enumerate(inputs):
            k = out["completion_mask"][i].bool()
            ep = rollout_episode(task[x["task_id"]], out["prompt_ids"][i][out["prompt_mask"][i].bool()],
                                 out["completion_ids"][i][k], out["tool_mask"][i][k], trainer.processing_class, env)
            n += 1
            ended += bool(ep.turns) and ep.turns[-1].parsed.end == "call"
    with tempfile.TemporaryDirectory() as tmp:
        run_rl(side.config(args.checkpoint, args.steps, ("monitor.probe_every=0",)), Path(tmp) / "rl")
        our_rows = read_jsonl(Path(tmp) / "rl" / "metrics.jsonl")
    print(f"TRL's tool loop: {ended} of {n} rollouts ({ended / n:.1%}) ended at a call it did not run")
    for name, rows, reward in (("TRL", trl_rows, "reward"), ("ours", our_rows, "reward_mean")):
        print(f"{name:4s} reward per step {[round(r[reward], 3) for r in rows]}; "
              + "; ".join(f"{e} {[round(r.get(e, 0.0), 4) for r in rows]}" for e in ERRORS))


if __name__ == "__main__":
    main()
