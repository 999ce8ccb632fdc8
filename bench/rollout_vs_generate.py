"""Multi-turn rollout speed: toolcollapse's KV-cached engine vs a `generate`-per-turn loop.

The baseline is what most multi-turn RL code does: every turn, call
`model.generate` on the whole history (left-padded batch), so the history is
prefilled again each turn. Both sides run the same model on the same tasks, greedy,
with the same stop tokens, turn cap and token budget, and append the same template
and tool-response tokens; the script checks that they sampled the same number of
tokens and prints the ratio of sampled tokens per second, measured side by side. (The engine
before issue 14, shared-prefix attention and row compaction off, ran as a second side until issue 19
removed those switches: `git show b6b1319:bench/rollout_vs_generate.py`; docs/BENCHMARKS.md has its figures.)

    python bench/rollout_vs_generate.py --checkpoint runs/tiny/sft --tasks 64
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer

from toolcollapse.chat import ENDOFTEXT, STOP_TAGS, PieceEncoder, conversation_pieces, generation_prompt, \
    message_pieces, turn_suffix
from toolcollapse.config import load_config
from toolcollapse.envs import make_env
from toolcollapse.model import load_model
from toolcollapse.parser import parse_turn_ids
from toolcollapse.rollout import RolloutEngine, SamplingParams


@torch.no_grad()
def generate_per_turn(model, tokenizer, env, tasks, params: SamplingParams) -> int:
    """The baseline loop; returns the number of sampled tokens."""
    enc = PieceEncoder(tokenizer)
    stop_ids = [enc.special_ids[t] for t in STOP_TAGS]
    pad = enc.special_ids[ENDOFTEXT]
    id_to_tag = {i: t for t, i in enc.special_ids.items()}
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    live = [(enc.encode(conversation_pieces(t.prompt, add_generation_prompt=True))[0], env.reset(t)) for t in tasks]
    sampled = 0
    for turn in range(params.max_turns):
        if not live:
            break
        width = max(len(h) for h, _ in live)
        ids = torch.full((len(live), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, (h, _) in enumerate(live):
            ids[i, width - len(h):] = torch.tensor(h)
            attn[i, width - len(h):] = 1
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=params.max_new_tokens,
                             do_sample=False, eos_token_id=stop_ids, pad_token_id=pad)
        nxt = []
        for (h, state), row in zip(live, out[:, width:].tolist()):
            stop = next((k for k, t in enumerate(row) if t in stop_ids), None)
            new = row[:stop + 1] if stop is not None else row
            sampled += len(new)
            parsed = parse_turn_ids(new, id_to_tag, decode, state.tools)
            if parsed.end == "none" or (turn == params.max_turns - 1 and parsed.end == "call"):
                continue
            obs = env.step(state, parsed)
            if not obs:
                continue
            pieces = turn_suffix(parsed.end == "call") + [p for m in obs for p in message_pieces(m)]
            nxt.append((h + new + enc.encode(pieces + generation_prompt())[0], state))
        live = nxt
    return sampled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--split", default="test")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(f"{args.checkpoint}/toolcollapse.yaml")
    model = load_model(args.checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    env = make_env(cfg)
    tasks = env.tasks(args.split)[:args.tasks]
    params = SamplingParams(max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                            max_seq_len=cfg.model.max_seq_len, greedy=True, batch_size=len(tasks))
    engine = RolloutEngine(model, tokenizer, env)
    engine.generate(tasks[:4], params)  # warm-up (allocator, kernels)
    sides = {}
    t0 = time.perf_counter()
    episodes = engine.generate(tasks, params)
    sides["toolcollapse engine"] = (sum(sum(ep.loss_mask) for ep in episodes), time.perf_counter() - t0, None)
    t0 = time.perf_counter()
    base_tokens = generate_per_turn(model, tokenizer, env, tasks, params)
    sides["generate() per turn"] = (base_tokens, time.perf_counter() - t0, None)

    print(f"model {args.checkpoint} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params), "
          f"{len(tasks)} {args.split} tasks, greedy, max_turns {params.max_turns}, "
          f"max_new_tokens {params.max_new_tokens}, {args.threads} threads")
    for name, (tokens, seconds, _) in sides.items():
        print(f"{name:24s}: {tokens} sampled tokens in {seconds:.1f} s = {tokens / seconds:.0f} tok/s")
    rate = {name: tokens / seconds for name, (tokens, seconds, _) in sides.items()}
    print(f"speed-up over generate() per turn: {rate['toolcollapse engine'] / rate['generate() per turn']:.2f}x")
    if len({tokens for tokens, _, _ in sides.values()}) > 1:
        print("token counts differ from generate(): float noise in greedy ties")


if __name__ == "__main__":
    main()
