"""What running tools in the sandbox's child process costs a rollout, measured side by side.

The same checkpoint, tasks and seed sample the same rollouts twice per round: once with every
tool call sent to the tool process (`tools.isolated: true`, the default: each call bounded by
`tools.timeout_s`) and once with the calls run in this process (`isolated: false`). The
episodes must be identical (checked); the ratio of the rollout times is the overhead. Rounds
alternate the order. The study configuration: 4 prompts x 8, up to 8 turns of 64 tokens.
Then the cost of one call alone: the rollouts' own calls replayed 20 times each way.

    python bench/sandbox_overhead.py --checkpoint runs/tiny/sft --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from toolcollapse.config import ToolsConfig, load_config
from toolcollapse.envs.toolworld import ToolWorld
from toolcollapse.evaluate import sampling_params
from toolcollapse.model import load_model, load_tokenizer
from toolcollapse.rollout import RolloutEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(Path(args.checkpoint) / "toolcollapse.yaml", ["rollout.max_turns=8", "rollout.max_new_tokens=64"])
    model, tokenizer = load_model(args.checkpoint).eval(), load_tokenizer(args.checkpoint)
    worlds = {isolated: ToolWorld(cfg.world, ToolsConfig(isolated=isolated)) for isolated in (True, False)}
    tasks = worlds[True].tasks("train")[:4]
    params = sampling_params(cfg, greedy=False)
    times: dict[bool, list[float]] = {True: [], False: []}
    calls = 0
    for k in range(args.rounds):
        episodes = {}
        for isolated in ((True, False) if k % 2 == 0 else (False, True)):
            engine = RolloutEngine(model, tokenizer, worlds[isolated])
            t0 = time.perf_counter()
            episodes[isolated] = engine.generate(tasks, params, group_size=8, seed=k)
            times[isolated].append(time.perf_counter() - t0)
        assert [e.tokens for e in episodes[True]] == [e.tokens for e in episodes[False]], "episodes differ"
        calls += sum(t.parsed.end == "call" for e in episodes[True] for t in e.turns)
    on, off = statistics.mean(times[True]), statistics.mean(times[False])
    print(f"{args.rounds} rounds of 32 rollouts ({calls / args.rounds:.0f} tool calls each), identical episodes")
    print(f"rollout seconds: in-process {off:.2f}, sandboxed {on:.2f}; ratio {on / off:.3f}")
    made = [t.parsed.call for e in episodes[True] for t in e.turns if t.parsed.end == "call" and t.parsed.call]
    per_call = {}
    for isolated in (False, True):
        t0 = time.perf_counter()
        for _ in range(20):
            for call in made:
                worlds[isolated].run_call(call)
        per_call[isolated] = (time.perf_counter() - t0) / (20 * len(made))
    print(f"one call: in-process {1e3 * per_call[False]:.3f} ms, sandboxed {1e3 * per_call[True]:.3f} ms "
          f"({len(made)} calls x 20)")


if __name__ == "__main__":
    main()
