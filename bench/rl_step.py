"""RL steps of the study configuration: the path before issue 14 vs today's, side by side in one run.

The study configuration (configs/study/*.yaml): 4 prompts x G 8, up to 8 turns of 64
tokens, the probe every step, 1 thread. Each round runs `--steps` steps of `run_rl` twice
from the same checkpoint and seed, in alternating order:
  old:  rollout.shared_prefix_attention=false (a copy of the system prompt's KV per row),
        rollout.compact_finished_rows=false (rows whose turn ended decode pads),
        grpo.sort_micro_batches=false, grpo.micro_batch_size=16 (micro-batches of 16 in
        rollout order, padded to the batch's longest row), grpo.prefix_once=false (the system
        prompt run in each micro-batch of the update and of the reference pass), and
        attention.PREFIX_FLASH=False (teacher-forced rows attend to a per-row copy of the
        prefix under a mask, one fused kernel, instead of the two flash kernels)
  new:  the defaults.
Exactness check: 4 tasks x 8 through both engines give identical episodes, greedy and sampled
(every sequence draws from its own random stream, so the old engine's batches -- rows that ended
their turn decoding pads -- sample the same tokens); so both sides train on the same rollouts, as
the first step's reward, healthy rate and tokens per episode printed for both show. Prints per-step
seconds (probe, rollout, update) and the ratios. Step 0 also runs validation (every grpo.eval_every = 20
steps): it is reported with the others and apart, and the step of a run is a later step plus validation's
time over 20 steps, and over 4 (the study configs'). These short runs validate at step 0 only (--steps <= 20).

    python bench/rl_step.py --checkpoint runs/tiny/sft --steps 4 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from toolcollapse import attention
from toolcollapse.config import load_config
from toolcollapse.envs import make_env
from toolcollapse.evaluate import sampling_params
from toolcollapse.model import load_model, load_tokenizer
from toolcollapse.rl import run_rl
from toolcollapse.rollout import RolloutEngine
from toolcollapse.runtime import read_jsonl

OLD = ["rollout.shared_prefix_attention=false", "rollout.compact_finished_rows=false", "grpo.sort_micro_batches=false",
       "grpo.micro_batch_size=16", "grpo.prefix_once=false"]
STUDY = ["grpo.prompts_per_step=4", "grpo.group_size=8", "rollout.max_turns=8", "rollout.max_new_tokens=64",
         "monitor.probe_every=1", "grpo.lr=1.0e-5", "grpo.checkpoint_every=1000", "threads=1"]
PARTS = ("seconds", "seconds_probe", "seconds_rollout", "seconds_update")


def run(checkpoint: str, steps: int, extra: list[str]) -> list[dict]:
    cfg = load_config("configs/tiny_rl.yaml", [f"init={checkpoint}", f"grpo.steps={steps}", *STUDY, *extra])
    with tempfile.TemporaryDirectory() as tmp:
        run_rl(cfg, Path(tmp) / "rl")
        return read_jsonl(Path(tmp) / "rl" / "metrics.jsonl")


def identical(checkpoint: str, greedy: bool) -> bool:
    """The old and the new engine give the same episodes on the step's 4 tasks x 8."""
    cfg = load_config("configs/tiny_rl.yaml", [f"init={checkpoint}", *STUDY])
    model, tokenizer, env = load_model(checkpoint).eval(), load_tokenizer(checkpoint), make_env(cfg)
    tasks = env.tasks("train")[:4]
    episodes = [RolloutEngine(model, tokenizer, env, cascade=new, compact=new).generate(
                tasks, sampling_params(cfg, greedy=greedy), group_size=8) for new in (False, True)]
    return [e.tokens for e in episodes[0]] == [e.tokens for e in episodes[1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    print(f"episodes identical, old vs new engine (4 tasks x 8): greedy {identical(args.checkpoint, True)}, "
          f"sampled {identical(args.checkpoint, False)}")
    rows: dict[str, list[dict]] = {"old": [], "new": []}
    for k in range(args.rounds):
        for name in (("old", "new") if k % 2 == 0 else ("new", "old")):
            attention.PREFIX_FLASH = name == "new"
            metrics = run(args.checkpoint, args.steps, OLD if name == "old" else [])
            rows[name].append(metrics)
    first = {name: [(r[0]["reward_mean"], round(r[0]["healthy_rate"], 4), r[0]["response_tokens"]) for r in runs]
             for name, runs in rows.items()}
    print(f"step 0 (reward, healthy rate, sampled tokens an episode) per run: old {first['old']}, new {first['new']}")
    for label, pick in (("all steps", lambda r: r), ("without step 0 (validation)", lambda r: r[1:])):
        print(f"{label}, mean seconds per step over {args.rounds} runs of {args.steps} steps:")
        for part in PARTS:
            old = statistics.mean(x[part] for run in rows["old"] for x in pick(run))
            new = statistics.mean(x[part] for run in rows["new"] for x in pick(run))
            print(f"  {part:16s} old {old:6.2f}  new {new:6.2f}  ratio {old / new:5.2f}x")
    # a run validates once in eval_every steps, these runs at step 0 (their one warm-up step) only: a run's step
    # is a later step without its validation, plus validation's time spread over eval_every steps
    later = {name: statistics.mean(x["seconds"] - x.get("seconds_val", 0.0) for r in runs for x in r[1:])
             for name, runs in rows.items()}
    val = {name: statistics.mean(x.get("seconds_val", 0.0) for r in runs for x in r[:1]) for name, runs in rows.items()}
    for every in (load_config("configs/tiny_rl.yaml").grpo.eval_every, 4):  # the default; the study configs' 4
        step = {name: later[name] + val[name] / every for name in rows}
        print(f"per step of a run that validates every {every} steps: old {step['old']:.2f}  new {step['new']:.2f}  "
              f"ratio {step['old'] / step['new']:.2f}x")
    print(f"({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
