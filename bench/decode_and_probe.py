"""Where the study step's decoding and probe time goes, and the two changes made there (issues 14, 17),
each side by side in one process:

  1. decoding through `rollout.lean_decode` vs `model(...)`: the study rollout (4 tasks x 8, sampled)
     over two steps' tasks, rounds alternating; identical episodes checked;
  2. one decoding step's cost by the number of rows in it (the engine's `_forward`, timed per call):
     the fixed part is what a step costs at 1 row;
  3. how much of the rows' own keys decoding reads are real (the rest: holes left by shorter
     observations and by rows that ended their turn early);
  4. the probe: a full log_softmax of all its logits (the old reduction) vs `run_probe`'s per-chunk one;
  5. with --bf16: RL steps of the study configuration in float32 vs bfloat16 autocast (new path both).

    python bench/decode_and_probe.py --checkpoint runs/tiny/sft [--bf16]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

from toolcollapse import attention, monitor
from toolcollapse.config import load_config
from toolcollapse.envs import make_env
from toolcollapse.evaluate import sampling_params
from toolcollapse.model import device_of, load_model, load_tokenizer, logits_after, run_prefix
from toolcollapse.monitor import probe_for
from toolcollapse.rollout import RolloutEngine

STUDY_ROLLOUT = ["rollout.max_turns=8", "rollout.max_new_tokens=64"]


def lean_side_by_side(engine: RolloutEngine, env, cfg, rounds: int = 6) -> None:
    times: dict[bool, list[float]] = {True: [], False: []}
    episodes = {}
    for r in range(rounds):
        for lean in ((True, False) if r % 2 else (False, True)):
            engine.lean_decoding = lean
            for k in range(2):  # two study steps' tasks
                tasks = env.tasks("train")[4 * k:4 * k + 4]
                t = time.perf_counter()
                eps = engine.generate(tasks, sampling_params(cfg, greedy=False), group_size=8, seed=k)
                times[lean].append(time.perf_counter() - t)
                episodes.setdefault((lean, k), [(e.tokens, e.logprobs) for e in eps])
    engine.lean_decoding = True
    same = all(episodes[(True, k)] == episodes[(False, k)] for k in range(2))
    a, b = statistics.mean(times[False]), statistics.mean(times[True])
    print(f"1. study rollout, mean of {len(times[True])}: model(...) {a:.3f} s, lean_decode {b:.3f} s, {a / b:.2f}x; "
          f"tokens and log-probs identical: {same}")


def decode_costs(engine: RolloutEngine, env, cfg) -> None:
    calls: dict[int, list[float]] = collections.defaultdict(list)
    real = [0, 0]
    forward, split = engine._forward, attention.split_attention

    def timed(ids, attn, pos, cache):
        t = time.perf_counter()
        out = forward(ids, attn, pos, cache)
        if ids.shape[1] == 1:
            calls[ids.shape[0]].append(time.perf_counter() - t)
        return out

    def counted(query, key, value, mask, scale):
        if mask is not None:
            m = mask.expand(query.shape[0], 1, query.shape[2], key.rest.shape[2])
            real[0], real[1] = real[0] + int(m.sum()), real[1] + m.numel()
        return split(query, key, value, mask, scale)

    engine._forward, attention.split_attention = timed, counted
    try:
        engine.generate(env.tasks("train")[:4], sampling_params(cfg, greedy=False), group_size=8)
    finally:
        engine._forward, attention.split_attention = forward, split
    n = sum(len(v) for v in calls.values())
    print(f"2. decoding steps of one study rollout: {n} in {sum(map(sum, calls.values())):.2f} s; median ms by rows: "
          + ", ".join(f"{k}: {1e3 * statistics.median(v):.2f}" for k, v in sorted(calls.items())))
    print(f"3. real keys among the rows' own keys that decoding reads: {100 * real[0] / max(1, real[1]):.0f} %")


@torch.no_grad()
def probe_full_log_softmax(model, probe, token_ids) -> dict[str, float]:
    """The probe's reduction before issue 17's change: every chunk's logits concatenated, one log_softmax."""
    device, p = device_of(model), probe.prefix_len
    prefix = run_prefix(model, probe.input_ids[:1, :p].to(device))
    parts = []
    for start in range(0, len(probe.input_ids), monitor.PROBE_CHUNK):
        select = probe.select[start:start + monitor.PROBE_CHUNK]
        width = int(select.any(dim=0).nonzero().max()) + 1
        ids = probe.input_ids[start:start + monitor.PROBE_CHUNK, p:width].to(device)
        parts.append(logits_after(model, prefix, ids, select[:, p:width].to(device)).cpu())
    logp = torch.log_softmax(torch.cat(parts), dim=-1)
    truth = logp.gather(1, probe.targets[:, None]).squeeze(1)
    return {**monitor.control_token_stats(logp, probe.slot_of, token_ids),
            **monitor.content_stats(truth, logp.argmax(dim=-1) == probe.targets, probe.content_of)}


def probe_side_by_side(model, cfg, tokenizer, rounds: int = 8) -> None:
    probe, token_ids = probe_for(cfg, make_env(cfg), tokenizer)
    a, b = probe_full_log_softmax(model, probe, token_ids), monitor.run_probe(model, probe, token_ids)
    times: dict[str, list[float]] = {"old": [], "new": []}
    sides = (("old", probe_full_log_softmax), ("new", monitor.run_probe))
    for r in range(rounds):
        for name, run in (sides if r % 2 else sides[::-1]):
            t = time.perf_counter()
            run(model, probe, token_ids)
            times[name].append(time.perf_counter() - t)
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"4. probe ({len(probe.input_ids)} conversations, {torch.get_num_threads()} threads), median of {rounds}: "
          f"full log_softmax {o:.3f} s, per chunk {n:.3f} s, {o / n:.2f}x; "
          f"largest statistic difference {max(abs(a[k] - b[k]) for k in a):.1e}")


def bf16_side_by_side(checkpoint: str, steps: int = 5) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import rl_step

    rows = {"float32": [], "bfloat16": []}
    for k in range(2):
        for dtype in (("float32", "bfloat16") if k % 2 == 0 else ("bfloat16", "float32")):
            rows[dtype].append(rl_step.run(checkpoint, steps, [f"model.dtype={dtype}"]))
    for part in rl_step.PARTS:
        a, b = (statistics.mean(x[part] for r in rows[d] for x in r[1:]) for d in ("float32", "bfloat16"))
        print(f"5. RL step without step 0, {part:16s} float32 {a:.2f} s, bfloat16 {b:.2f} s, {a / b:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--bf16", action="store_true", help="also RL steps in float32 vs bfloat16 (~3 minutes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("configs/tiny_rl.yaml", STUDY_ROLLOUT)
    model, tokenizer, env = load_model(args.checkpoint).eval(), load_tokenizer(args.checkpoint), make_env(cfg)
    engine = RolloutEngine(model, tokenizer, env)
    lean_side_by_side(engine, env, cfg)
    decode_costs(engine, env, cfg)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        probe_side_by_side(model, cfg, tokenizer)
    torch.set_num_threads(1)
    if args.bf16:
        bf16_side_by_side(args.checkpoint)


if __name__ == "__main__":
    main()
