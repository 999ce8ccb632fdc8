"""SFT step of the tiny recipe (configs/tiny.yaml), measured side by side: today's path against
the candidates for a faster one, on the same batches, in alternating rounds.

    python bench/sft_step.py --checkpoint runs/tiny/sft

Sides (each on both phases of the recipe: the copy warm-up, 16 conversations without the
system prompt, and the main phase, 8 full conversations whose system prompt is run once):
  float32        today's step (`sft.train_phase`)
  bfloat16       the same under bfloat16 autocast (`model.dtype: bfloat16`, issue 14)
  sorted/4       float32, the batch sorted by length and run as micro-batches of 4, each cut to
                 its own longest row (the same gradient, less padding; not in `sft`)
  bf16 sorted/4  both candidates together

The step before the flash kernels (the rows attending to a per-row copy of the system prompt's keys and
values under a mask) was a module switch until issue 19; its side runs at b6b1319 (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from toolcollapse.chat import PieceEncoder
from toolcollapse.config import load_config
from toolcollapse.envs import make_env
from toolcollapse.model import load_model, load_tokenizer, place
from toolcollapse.optim import make_optimizer
from toolcollapse.encoding import batch_logits, encode_tasks, encode_without_system_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="runs/tiny/sft", help="a tiny checkpoint (its tokenizer and weights)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("configs/tiny.yaml")
    env = make_env(cfg)
    tokenizer = load_tokenizer(args.checkpoint)
    encoder = PieceEncoder(tokenizer)
    tasks = env.tasks("train")[:2000]
    phases = {"warm-up (16 x no system prompt)": (encode_without_system_prompt(encoder, tasks), 16),
              "main (8 x full task)": (encode_tasks(encoder, tasks), 8)}
    sides = {"float32": ("float32", 0), "bfloat16": ("bfloat16", 0),
             "sorted/4": ("float32", 4), "bf16 sorted/4": ("bfloat16", 4)}
    pad = tokenizer.pad_token_id
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for phase, (examples, size) in phases.items():
            for side, (dtype, micro) in sides.items():
                model = place(load_model(args.checkpoint, trainable=True), torch.device("cpu"), dtype).train()
                optimizer = make_optimizer(model, 1e-4, 0.0, (0.9, 0.95))
                rng = random.Random(r)  # the same batches for every side of a round
                batches = [rng.sample(examples, size) for _ in range(args.steps + 2)]
                for k, batch in enumerate(batches):
                    if k == 2:
                        t0 = time.perf_counter()
                    step(model, optimizer, batch, pad, micro)
                times.setdefault((phase, side), []).append((time.perf_counter() - t0) / args.steps)
    print(f"seconds per SFT step, mean of {args.rounds} rounds x {args.steps} steps, {args.threads} threads")
    print("ratios: float32 (today's step) over each side")
    print(f"{'phase':34s}" + "".join(f"{s:>14s}" for s in sides) + "".join(f"{'x ' + s:>16s}" for s in list(sides)[1:]))
    for phase in phases:
        mean = {s: sum(times[phase, s]) / len(times[phase, s]) for s in sides}
        print(f"{phase:34s}" + "".join(f"{mean[s]:14.3f}" for s in sides)
              + "".join(f"{mean['float32'] / mean[s]:16.2f}" for s in list(sides)[1:]))


def step(model, optimizer, batch, pad: int, micro: int) -> None:
    """One optimizer step on `batch`: whole (micro=0, sft.train_phase's forward), or sorted into micro-batches."""
    if not micro:
        logits, targets = batch_logits(model, batch, pad)
        F.cross_entropy(logits, targets).backward()
    else:
        batch = sorted(batch, key=lambda e: len(e[0]))
        n = sum(sum(m[1:]) for _, m in batch)
        for s in range(0, len(batch), micro):
            logits, targets = batch_logits(model, batch[s:s + micro], pad)
            (F.cross_entropy(logits, targets, reduction="sum") / n).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
