"""RL steps of the study configuration: the code of a git revision vs the working tree, side by side.

`bench/rl_step.py` once compared the two paths as flags of one code (removed in issue 19); but what changed
since issue 14 was filed without a flag (each sequence's own random stream drawn by inverting the CDF instead
of `torch.multinomial`, the probe's reductions, micro-batches of 4 in `configs/tiny_rl.yaml`) speeds up its
old side too. This runs the code of `--rev` itself (default 25cd5cc, the last commit before issue 14's first
change) from a git worktree against the working tree, each run in its own process, alternating, from the same
checkpoint with each side's `configs/tiny_rl.yaml` and the same study overrides and seed. Their samplers
differ, so their sampled rollouts do, from the first step: each side's sampled tokens per episode are printed,
and the step's time per sampled token beside its time. Greedy rollouts (4 tasks x 8) are compared token for token.
The revision reads the checkpoint's saved config, so a copy drops the keys it does not know (weights linked).

    python bench/rl_step_vs_commit.py --checkpoint runs/tiny/sft --steps 5 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

KEYS = ("seconds", "seconds_probe", "seconds_rollout", "seconds_update", "response_tokens")
EPISODES = 4 * 8  # a step's episodes in rl_step.STUDY: prompts_per_step x group_size


# ----------------------------------------------------------------------------- run inside each side's process
# (under the revision's code: only what both codes have; the study overrides come from the parent, `rl_step.STUDY`)


def child_steps(root: str, checkpoint: str, steps: int, *study: str) -> list[dict]:
    import torch

    from toolcollapse.config import load_config
    from toolcollapse.rl import run_rl
    from toolcollapse.runtime import read_jsonl
    torch.set_num_threads(1)
    cfg = load_config(f"{root}/configs/tiny_rl.yaml", [f"init={checkpoint}", f"grpo.steps={steps}", *study])
    with tempfile.TemporaryDirectory() as tmp:
        run_rl(cfg, Path(tmp) / "rl")
        return [{k: row[k] for k in ("step", *KEYS)} for row in read_jsonl(Path(tmp) / "rl" / "metrics.jsonl")]


def child_greedy(root: str, checkpoint: str, *study: str) -> list[list[int]]:
    import torch

    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.evaluate import sampling_params
    from toolcollapse.model import load_model, load_tokenizer
    from toolcollapse.rollout import RolloutEngine
    torch.set_num_threads(1)
    cfg = load_config(f"{root}/configs/tiny_rl.yaml", [f"init={checkpoint}", *study])
    model, tokenizer, env = load_model(checkpoint).eval(), load_tokenizer(checkpoint), make_env(cfg)
    episodes = RolloutEngine(model, tokenizer, env).generate(env.tasks("train")[:4], sampling_params(cfg, greedy=True),
                                                             group_size=8)
    return [list(ep.tokens) for ep in episodes]


def child_config(src: str, dst: str) -> list[str]:
    """Copy the checkpoint config `src` to `dst` without the keys this code's RunConfig does not have."""
    import yaml

    from toolcollapse.config import RunConfig
    dropped: list[str] = []

    def known(cls: type, raw: dict, where: str) -> dict:
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        dropped.extend(f"{where}{k}" for k in raw if k not in names)
        return {k: known(hints[k], v, f"{where}{k}.") if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict)
                else v for k, v in raw.items() if k in names}

    Path(dst).write_text(yaml.safe_dump(known(RunConfig, yaml.safe_load(Path(src).read_text()), ""), sort_keys=False))
    return dropped


# ----------------------------------------------------------------------------- the comparison


def call(src: Path, *args: str) -> typing.Any:
    """This script's `--child` mode under the code in `src` (a checkout's root); its JSON answer."""
    env = {**os.environ, "PYTHONPATH": str(src / "src")}
    done = subprocess.run([sys.executable, __file__, "--child", *args], cwd=src, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"`{args[0]}` under the code of {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft")
    ap.add_argument("--rev", default="25cd5cc", help="the revision to compare against (a commit, tag or branch)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, *rest = args.child
        fn = {"steps": lambda root, ck, n, *study: child_steps(root, ck, int(n), *study), "greedy": child_greedy,
              "config": child_config}[mode]
        print(json.dumps(fn(*rest)))
        return
    here = Path(__file__).resolve().parents[1]
    checkpoint = Path(args.checkpoint).resolve()
    if not (checkpoint / "toolcollapse.yaml").is_file():
        ap.error(f"--checkpoint {args.checkpoint}: not a toolcollapse checkpoint (no toolcollapse.yaml); "
                 "build one with `toolcollapse sft --config configs/tiny.yaml`")
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "rev"
        added = subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(old), args.rev],
                               capture_output=True, text=True)
        if added.returncode:
            ap.error(f"--rev {args.rev}: git could not check it out ({added.stderr.strip()})")
        try:
            compare(here, old, checkpoint, Path(tmp) / "checkpoint", args)
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(old)], check=True)


def compare(here: Path, old: Path, checkpoint: Path, old_checkpoint: Path, args: argparse.Namespace) -> None:
    old_checkpoint.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "toolcollapse.yaml":
            (old_checkpoint / f.name).symlink_to(f)
    dropped = call(old, "config", str(checkpoint / "toolcollapse.yaml"), str(old_checkpoint / "toolcollapse.yaml"))
    print(f"{args.rev}: the checkpoint's config without {len(dropped)} keys it does not know ({', '.join(dropped)})")
    sides = {"rev": (old, old_checkpoint), "now": (here, checkpoint)}
    sys.path.insert(0, str(Path(__file__).parent))
    from rl_step import STUDY  # the study configuration, as bench/rl_step.py runs it
    greedy = {name: call(root, "greedy", str(root), str(ck), *STUDY) for name, (root, ck) in sides.items()}
    print(f"greedy episodes identical, {args.rev} vs now (4 tasks x 8): {greedy['rev'] == greedy['now']}")
    rows: dict[str, list[dict]] = {"rev": [], "now": []}
    for k in range(args.rounds):
        for name in (("rev", "now") if k % 2 == 0 else ("now", "rev")):
            root, ck = sides[name]
            rows[name] += call(root, "steps", str(root), str(ck), str(args.steps), *STUDY)
            print(f"round {k} {name}: {statistics.mean(r['seconds'] for r in rows[name][-args.steps:]):.2f} s a step")
    first = {name: rows[name][0] for name in rows}
    print("first step (the same weights, each side's sampler): " + "; ".join(
        f"{name} {r['response_tokens']:.1f} sampled tokens an episode" for name, r in first.items()))
    later = {name: [r for r in rs if r["step"] > 0] for name, rs in rows.items()}
    print(f"\nseconds per step, mean of {len(later['now'])} (step 0 apart: it also loads and, now, validates)")
    print(f"| | {args.rev} | now | ratio |\n|---|---|---|---|")
    for key in KEYS[:-1]:
        a, b = (statistics.mean(r[key] for r in later[s]) for s in ("rev", "now"))
        print(f"| {key} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    a, b = (statistics.mean(r["seconds"] for r in rows[s]) for s in ("rev", "now"))
    print(f"| seconds, step 0 included | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    tok = {s: statistics.mean(r["response_tokens"] for r in later[s]) for s in later}
    per = {s: 1e3 * sum(r["seconds"] for r in later[s]) / sum(EPISODES * r["response_tokens"] for r in later[s])
           for s in later}
    print(f"| sampled tokens an episode | {tok['rev']:.1f} | {tok['now']:.1f} | |")
    print(f"| ms of the step per sampled token | {per['rev']:.2f} | {per['now']:.2f} | {per['rev'] / per['now']:.2f}x |")


if __name__ == "__main__":
    main()
