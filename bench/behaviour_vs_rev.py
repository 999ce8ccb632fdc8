"""Behaviour kept: every trainer path run 3 steps under the code of a git revision and under the working tree.

A refactor that claims to keep behaviour is checked here, not by flags of today's code that switch the old
path back on. Each scenario runs in its own process under each side's code (a git worktree of `--rev`,
and this checkout), from the same checkpoint, with the same config and seed, and the two sides' outputs
are compared:

  rollouts     every episode the rollout engine generated (GRPO groups, hinted and expert rows,
               validation), token for token
  metrics      metrics.jsonl (ours) / monitor.jsonl and the log history (TRL): the same rows and keys,
               values equal (timings left out)
  logs         phases.jsonl, alarms.jsonl, failures.jsonl: the same rows
  weights      every checkpoint's (and TRL's final save's) tensors, and the AdamW state

A value counts as kept when it is equal, or within `--rtol` where float sums were reordered; rollouts must
be identical. The scenarios: plain GRPO, each supervision signal (OPS both variants, HBG, ETS, PRS,
unlikelihood, the SFT term, hybrid), adaptive with an alarm that acts (a rollback, a cut LR and an SFT
phase), sft_only, and the TRL trainer (our engine as its rollout function) with the SFT term and with OPS.

    python bench/behaviour_vs_rev.py --checkpoint runs/tiny_headroom/sft     # against b6b1319, the default
    python bench/behaviour_vs_rev.py --rev b6b1319 --checkpoint runs/tiny_headroom/sft --only plain,ets

Exit status 0 when every scenario is kept, 1 when one is not (the differences are printed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A small, fast version of the study's step: 2 prompts x 4, the probe every step, checkpoints every step. The
# shaped reward (partial credit, well-formed turns) and temperature 1.5 make groups informative from any start,
# so every update moves the weights through the policy gradient, not only through weight decay.
BASE = ["grpo.steps=3", "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=4",
        "grpo.checkpoint_every=1", "grpo.keep_checkpoints=10", "grpo.samples_per_step=8", "grpo.lr=1e-3",
        "grpo.format_reward=0.5", "grpo.partial_credit=0.5", "rollout.temperature=1.5",
        "monitor.probe_size=4", "monitor.probe_every=1", "rollout.max_new_tokens=48", "rollout.max_turns=4",
        "threads=1"]
PHASE = ["supervision.phase.epochs=1", "supervision.phase.batch_size=4"]
ETS = ["supervision.ets.enabled=true", "supervision.ets.every=2", "supervision.ets.window=2", *PHASE]
OPS = ["supervision.ops.enabled=true"]
# an alarm from the config alone, the same on both sides: the step counter as a monitored series (it moves
# from its warm-up value 0 at step 1, far past any noise floor) -> a rollback, the LR halved, an SFT phase
ALARM = ["monitor.alarm_series=[step]", "monitor.alarm_scale=absolute", "monitor.content_alarms=false"]
SCENARIOS: dict[str, list[str]] = {
    "plain": [],
    "plain_minibatches": ["grpo.prompts_per_step=4", "grpo.mini_batches=2"],
    "ops": [*OPS, "supervision.ops.shaping=none"],
    "ops_luffy": OPS,
    "hbg": ["supervision.hbg.enabled=true"],
    "ets": ETS,
    "prs": [*ETS, "supervision.prs.enabled=true"],
    "unlikelihood": ["supervision.unlikelihood_coef=0.5"],
    "sft_term": ["supervision.sft_coef=0.5"],
    # each mini-batch its own tasks' ground truth; unlikelihood logged over the last of two passes
    "sft_term_minibatches": ["supervision.sft_coef=0.5", "grpo.prompts_per_step=4", "grpo.mini_batches=2"],
    "unlikelihood_two_passes": ["supervision.unlikelihood_coef=0.5", "grpo.prompts_per_step=4", "grpo.mini_batches=2",
                                "grpo.updates_per_batch=2"],
    "hybrid": [*OPS, "supervision.ops.shaping=none", "supervision.sft_coef=0.5"],
    "adaptive": ["supervision.adaptive.enabled=true", *ALARM, *PHASE],
    "sft_only": ["supervision.sft_only.tokens=3000", *PHASE],
    "trl_sft_term": ["supervision.sft_coef=0.5"],
    "trl_ops": [],
}
# differences a change meant, by scenario: the metric whose values may differ, and why (docs/LOG.md); its
# differences are printed, and the scenario counts as kept when nothing else differs
INTENDED: dict[str, dict[str, str]] = {
    "sft_term_minibatches": {"sup/sft_nll": "the token mean over all the step's optimizer steps, not the mean of "
                                            "their token means: one definition in both trainers (LOG 2026-12-07 (14))"},
}
TRL_ARGS = {"trl_sft_term": ["--rollouts", "engine"], "trl_ops": ["--rollouts", "engine", "--ops", "1"]}
PRE_REFACTOR = "b6b1319"  # main before issue 19 (the architecture redesign) began
LOGS = ("metrics.jsonl", "phases.jsonl", "alarms.jsonl", "failures.jsonl", "monitor.jsonl", "log_history.json")


# ----------------------------------------------------------------------------- one side (a child process)


def child(kind: str, out: str, config: str, checkpoint: str, *overrides: str) -> None:
    """Run one scenario under the code on PYTHONPATH, recording every generated episode's tokens."""
    import torch

    from toolcollapse import rollout
    torch.set_num_threads(1)
    calls: list[list[list[int]]] = []
    generate = rollout.RolloutEngine.generate

    def recording(self, *args, **kwargs):
        episodes = generate(self, *args, **kwargs)
        calls.append([list(ep.tokens) for ep in episodes])
        return episodes

    rollout.RolloutEngine.generate = recording
    run = Path(out) / "run"
    sets = [a for o in overrides for a in ("--set", o)]
    try:
        if kind == "rl":
            from toolcollapse.cli import main
            code = main(["rl", "--config", config, "--init", checkpoint, "--out", str(run), *sets])
            if code:
                sys.exit(code)
        else:  # the TRL example script, as a user runs it
            extra = TRL_ARGS[kind]
            sys.argv = ["trl_grpo.py", "--checkpoint", checkpoint, "--config", config, "--out", str(run),
                        "--steps", "3", *extra, *sets]
            runpy.run_path(str(Path("examples") / "trl_grpo.py"), run_name="__main__")
    finally:
        (Path(out) / "rollouts.json").write_text(json.dumps(calls))


# ----------------------------------------------------------------------------- the comparison


def run_side(root: Path, scenario: str, checkpoint: Path, out: Path) -> float:
    kind = "rl" if not scenario.startswith("trl_") else scenario
    shutil.rmtree(out, ignore_errors=True)  # --keep: an earlier comparison's
    out.mkdir(parents=True)
    overrides = [*BASE, *SCENARIOS[scenario]]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", kind, str(out),
                           str(root / "configs" / "tiny_rl.yaml"), str(checkpoint), *overrides],
                          cwd=root, env=env, capture_output=True, text=True)
    (out / "stderr.txt").write_text(done.stderr)
    if done.returncode:
        raise RuntimeError(f"{scenario} under the code of {root} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.time() - t0


def _rows(path: Path) -> list:
    if not path.is_file():
        return []
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line]


def _timing(key: str) -> bool:
    return "seconds" in key or key.endswith("_runtime") or "per_second" in key or key in ("time", "date")


def compare_values(where: str, a, b, rtol: float, diffs: list[str]) -> float:
    """Record where `a` and `b` differ (beyond `rtol` for floats); the largest relative difference seen."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys_a, keys_b = {k for k in a if not _timing(k)}, {k for k in b if not _timing(k)}
        if keys_a != keys_b:
            diffs.append(f"{where}: keys only in rev {sorted(keys_a - keys_b)}, only now {sorted(keys_b - keys_a)}")
        return max([compare_values(f"{where}.{k}", a[k], b[k], rtol, diffs) for k in keys_a & keys_b], default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{where}: {len(a)} items in rev, {len(b)} now")
        return max([compare_values(f"{where}[{i}]", x, y, rtol, diffs) for i, (x, y) in enumerate(zip(a, b))],
                   default=0.0)
    if isinstance(a, float) or isinstance(b, float):
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
            diffs.append(f"{where}: {a!r} vs {b!r}")
            return math.inf
        if a == b or (math.isnan(a) and math.isnan(b)):
            return 0.0
        if not (math.isfinite(a) and math.isfinite(b)):  # a NaN or an infinity on one side only
            diffs.append(f"{where}: {a!r} vs {b!r}")
            return math.inf
        rel = abs(a - b) / max(abs(a), abs(b))
        if rel > rtol:
            diffs.append(f"{where}: {a!r} vs {b!r} (relative {rel:.2g})")
        return rel
    if a != b:
        diffs.append(f"{where}: {a!r} vs {b!r}")
        return math.inf
    return 0.0


def weight_files(run: Path) -> dict[str, Path]:
    """Every checkpoint's weights and trainer state, and a final save (TRL's --out), by relative path."""
    return {str(p.relative_to(run)): p for p in sorted(run.rglob("*")) if p.name in ("model.safetensors", "trainer.pt")}


def compare_tensors(where: str, a, b, rtol: float, diffs: list[str]) -> float:
    import numpy as np
    import torch
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):  # the RNG states in trainer.pt
        a, b = torch.from_numpy(a), torch.from_numpy(b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            diffs.append(f"{where}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
            return math.inf
        if torch.equal(a, b):
            return 0.0
        rel = ((a.double() - b.double()).abs().max() / a.double().abs().max().clamp_min(1e-30)).item()
        if rel > rtol:
            diffs.append(f"{where}: max difference {rel:.2g} of the largest entry")
        return rel
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            diffs.append(f"{where}: keys only in rev {sorted(map(str, set(a) - set(b)))[:5]}, only now "
                         f"{sorted(map(str, set(b) - set(a)))[:5]}")
        return max([compare_tensors(f"{where}.{k}", a[k], b[k], rtol, diffs) for k in set(a) & set(b)], default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return max([compare_tensors(f"{where}[{i}]", x, y, rtol, diffs) for i, (x, y) in enumerate(zip(a, b))],
                   default=0.0)
    return compare_values(where, a, b, rtol, diffs)


def compare_sides(old: Path, new: Path, rtol: float) -> tuple[list[str], dict[str, object]]:
    import torch
    from safetensors.torch import load_file
    diffs: list[str] = []
    rollouts = [_rows(side / "rollouts.json") for side in (old, new)]
    episodes = sum(len(c) for c in rollouts[1])
    tokens_equal = rollouts[0] == rollouts[1]
    if not tokens_equal:
        first = next((i for i, (x, y) in enumerate(zip(*rollouts)) if x != y), min(map(len, rollouts)))
        diffs.append(f"rollouts: differ from generate call {first} ({len(rollouts[0])} calls in rev, "
                     f"{len(rollouts[1])} now)")
    worst = 0.0
    for name in LOGS:
        a, b = _rows(old / "run" / name), _rows(new / "run" / name)
        worst = max(worst, compare_values(name, a, b, rtol, diffs))
    files = [weight_files(side / "run") for side in (old, new)]
    if set(files[0]) != set(files[1]):
        diffs.append(f"weights: files only in rev {sorted(set(files[0]) - set(files[1]))}, "
                     f"only now {sorted(set(files[1]) - set(files[0]))}")
    for rel in sorted(set(files[0]) & set(files[1])):
        a, b = (load_file(f[rel]) if rel.endswith(".safetensors") else
                torch.load(f[rel], map_location="cpu", weights_only=False) for f in files)
        worst = max(worst, compare_tensors(rel, a, b, rtol, diffs))
    digest = hashlib.sha256(json.dumps(rollouts[1]).encode()).hexdigest()[:12]
    steps = [r for r in _rows(new / "run" / "metrics.jsonl") if "frac_groups_informative" in r]
    informative = sum(r["frac_groups_informative"] for r in steps) / len(steps) if steps else math.nan
    return diffs, {"generate calls": len(rollouts[1]), "episodes": episodes, "rollouts sha": digest,
                   "informative groups": informative,
                   "weight files": len(files[1]), "largest relative difference": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default=PRE_REFACTOR, help="the revision to compare against (a commit, tag or branch; "
                    f"default {PRE_REFACTOR}, the last commit before issue 19's redesign)")
    ap.add_argument("--checkpoint", default="runs/tiny/sft", help="a toolcollapse checkpoint both sides start from")
    ap.add_argument("--only", help=f"comma-separated scenarios (default all: {', '.join(SCENARIOS)})")
    ap.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance for floats (rollouts: exact)")
    ap.add_argument("--keep", help="keep both sides' run directories here")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    names = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"--only: unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    here = Path(__file__).resolve().parents[1]
    checkpoint = Path(args.checkpoint).resolve()
    if not (checkpoint / "config.json").is_file():
        ap.error(f"--checkpoint {args.checkpoint}: not a model checkpoint (no config.json); "
                 "build one with `toolcollapse sft --config configs/tiny.yaml`")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        old = Path(tmp) / "rev"
        added = subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(old), args.rev],
                               capture_output=True, text=True)
        if added.returncode:
            ap.error(f"--rev {args.rev}: git could not check it out ({added.stderr.strip()})")
        try:
            failed = run_all(names, here, old, checkpoint, work, args)
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(old)], check=True)
    sys.exit(1 if failed else 0)


def run_all(names: list[str], here: Path, old: Path, checkpoint: Path, work: Path, args: argparse.Namespace) -> list[str]:
    print(f"| scenario | kept | generate calls | episodes | rollouts sha | informative groups | weight files | "
          f"largest relative difference | seconds {args.rev} / now |\n|---|---|---|---|---|---|---|---|---|")
    failed = []
    for name in names:
        sides = {side: work / name / side for side in ("rev", "now")}
        t_old = run_side(old, name, checkpoint, sides["rev"])
        t_new = run_side(here, name, checkpoint, sides["now"])
        diffs, facts = compare_sides(sides["rev"], sides["now"], args.rtol)
        meant = [d for d in diffs if _intended(name, d)]
        diffs = [d for d in diffs if d not in meant]
        kept = "NO" if diffs else "yes, but what is intended" if meant else "yes"
        print(f"| {name} | {kept} | " + " | ".join(
            f"{v:.2g}" if isinstance(v, float) else str(v) for v in facts.values()) + f" | {t_old:.0f} / {t_new:.0f} |",
            flush=True)
        for key in sorted({_key(d) for d in meant}):
            print(f"    intended, {key}: {INTENDED[name][key]} ({sum(_key(d) == key for d in meant)} values)")
        if diffs:
            failed.append(name)
            for d in diffs[:20]:
                print(f"    {d}")
            if len(diffs) > 20:
                print(f"    ... and {len(diffs) - 20} more")
    return failed


def _key(diff: str) -> str:
    """The metric key of a value difference (`metrics.jsonl[0].sup/sft_nll: 0.1 vs 0.2 ...`)."""
    return diff.split(": ", 1)[0].rsplit(".", 1)[-1]


def _intended(name: str, diff: str) -> bool:
    """Whether `diff` is two finite numbers of the scenario's listed metric (never a key gone, a type changed,
    a NaN)."""
    return diff.endswith(")") and " (relative " in diff and _key(diff) in INTENDED.get(name, {})


if __name__ == "__main__":
    main()
