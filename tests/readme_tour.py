"""The README tour: every shell command of the README, in the README's order, on small copies of the configs.

    python tests/readme_tour.py [--keep DIR]

Each command runs verbatim (its own `--set`s included) in a scratch directory that holds a copy of `configs/`
in which every run is shrunk: a few SFT and GRPO steps, one seed, four evaluated tasks (`shrink_run`,
`shrink_sweep`). What the tour checks is that every command works where the README puts it, on what the
commands before it left -- not what it measures (the figures are in docs/LOG.md). Not run: installs (the
README's test line has installed everything), the test line itself, commands on a path of the reader's own
machine (`/path/to/...`, e.g. a GPU run of their model); `python -m webbrowser FILE` checks that FILE is there.
`tests/test_readme_tour.py` runs it (marked slow: `.ci/run` runs it after the README's test line)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT_S = 600  # one command; the whole tour takes a few minutes on 2 cores (docs/LOG.md)

# a few steps of everything; a pretrained model (SmolLM2-135M: ~110 trained tokens/s on 2 cores) fewer
SMALL = {"sft": 4, "phase": 3, "batch": 4, "grpo": 2, "prompts": 2, "group": 8, "tasks": 4, "probe": 8,
         "turns": None, "new_tokens": None}
PRETRAINED = {"sft": 1, "phase": 1, "batch": 2, "grpo": 1, "prompts": 1, "group": 2, "tasks": 2, "probe": 2,
              "turns": 2, "new_tokens": 32}


@dataclass
class Step:
    line: str  # the README's line, comment dropped
    argv: list[str] | None  # None: not run
    why: str = ""  # why it is not run, or what was checked instead
    rc: int | None = None
    seconds: float = 0.0
    output: str = ""


def readme_lines(text: str) -> list[str]:
    """The commands of the README's ```bash blocks, one per line, comments dropped."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                lines.append(shlex.join(words))
    return lines


def plan(line: str, scratch: Path) -> list[Step]:
    """The steps of one README line: its `&&`-joined commands, each run or skipped with the reason."""
    words = shlex.split(line)
    commands, current = [], []
    for word in words:
        if word == "&&":
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    steps = []
    for argv in commands:
        text = shlex.join(argv)
        if argv[0] == "pip":
            steps.append(Step(text, None, "an install: the README's test line installed everything"))
        elif "pytest" in argv:
            steps.append(Step(text, None, "the README's test line: the tour runs after it"))
        elif any("/path/to" in a for a in argv):
            steps.append(Step(text, None, "a path on the reader's own machine"))
        elif argv[:3] == ["python", "-m", "webbrowser"]:
            steps.append(Step(text, None, f"opens a browser: checked that {argv[-1]} is there instead"))
        else:
            argv = [sys.executable if a == "python" else str(scratch) + a if a.startswith("/tmp/") else a
                    for a in argv]
            steps.append(Step(text, argv))
    return steps


def _shrink(section: dict | None, limits: dict[str, int]) -> None:
    for key, most in limits.items():
        if section is not None and isinstance(section.get(key), int):
            section[key] = min(section[key], most)


def shrink_run(cfg: dict) -> dict:
    """A run config with a few steps of everything; its keys, splits and signals as they were."""
    n = SMALL if (cfg.get("model") or {}).get("source", "scratch") == "scratch" else PRETRAINED
    if "base" not in cfg:  # the defaults shrunk too (a child inherits its base's shrunk values)
        for section, key, value in (("sft", "steps", n["sft"]), ("grpo", "steps", n["grpo"]),
                                    ("grpo", "eval_n", n["tasks"]), ("monitor", "probe_size", n["probe"])):
            cfg.setdefault(section, {}).setdefault(key, value)
        cfg.setdefault("eval", {})
    sft = cfg.get("sft")
    if sft is not None:
        sft["val_n"] = n["tasks"]
    _shrink(sft, {"steps": n["sft"], "batch_size": n["batch"], "warmup_steps": 1, "val_every": n["sft"]})
    for phase in (sft or {}).get("copy_warmup") or []:
        _shrink(phase, {"steps": n["phase"], "batch_size": n["batch"]})
    grpo = cfg.get("grpo")
    _shrink(grpo, {"steps": n["grpo"], "group_size": n["group"], "eval_n": n["tasks"], "checkpoint_every": 1,
                   "micro_batch_size": n["batch"]})
    if grpo is not None and "prompts_per_step" in grpo:
        grpo["prompts_per_step"] = n["prompts"]
        _shrink(grpo, {"mini_batches": n["prompts"]})
    if n["turns"]:
        _shrink(cfg.get("rollout"), {"max_turns": n["turns"], "max_new_tokens": n["new_tokens"]})
    if cfg.get("eval") is not None:  # n_tasks absent or null: the whole split
        cfg["eval"]["n_tasks"] = min(cfg["eval"].get("n_tasks") or n["tasks"], n["tasks"])
    _shrink(cfg.get("monitor"), {"probe_size": n["probe"]})
    return cfg


def shrink_sweep(cfg: dict) -> dict:
    """A sweep or study file with one seed, every setting, few steps and tasks."""
    cfg["seeds"] = [cfg.get("seeds", [0])[0]]
    _shrink(cfg, {"eval_n": SMALL["tasks"], "eval_samples": 1})
    if cfg.get("eval_extra_splits"):
        cfg["eval_extra_splits"] = cfg["eval_extra_splits"][:1]
    most = {"grpo.steps": SMALL["grpo"], "grpo.eval_n": SMALL["tasks"], "grpo.checkpoint_every": 1,
            "grpo.mini_batches": SMALL["prompts"], "supervision.ets.every": 1, "supervision.ets.window": 1,
            "monitor.probe_every": 1}
    overrides = cfg.setdefault("overrides", {})
    overrides.update({key: min(overrides.get(key, n), n) for key, n in most.items()})
    overrides["grpo.prompts_per_step"] = SMALL["prompts"]
    for sets in cfg.get("settings", {}).values():
        _shrink(sets, most)
        sets.pop("grpo.prompts_per_step", None)
        if isinstance(sets.get("seeds"), list):
            sets["seeds"] = sets["seeds"][:1]
    return cfg


def shrunk_configs(scratch: Path) -> None:
    shutil.copytree(ROOT / "configs", scratch / "configs")
    for path in sorted((scratch / "configs").rglob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        if not isinstance(cfg, dict) or "compute_environment" in cfg:  # accelerate's files
            continue
        cfg = shrink_sweep(cfg) if "settings" in cfg else shrink_run(cfg)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def run(step: Step, scratch: Path) -> None:
    if step.argv is None:
        if step.line.startswith("python -m webbrowser"):
            step.rc = 0 if (scratch / shlex.split(step.line)[-1]).is_file() else 1
        return
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        done = subprocess.run(step.argv, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=COMMAND_TIMEOUT_S)
        step.rc, step.output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as err:
        step.rc, step.output = 124, f"timed out after {COMMAND_TIMEOUT_S} s\n{err.stdout or ''}"
    step.seconds = time.perf_counter() - start


def tour(scratch: Path, readme: Path = ROOT / "README.md", echo=print) -> list[Step]:
    """Run the tour in `scratch` (an empty directory); every step, run or not. Stops at the first failure."""
    shrunk_configs(scratch)
    steps = []
    for line in readme_lines(readme.read_text()):
        for step in plan(line, scratch):
            steps.append(step)
            run(step, scratch)
            mark = ("skip: " + step.why) if step.argv is None and step.rc is None else f"exit {step.rc}"
            echo(f"{step.seconds:6.1f}s  {step.line}  [{mark}]")
            if step.rc not in (None, 0):
                echo(step.output[-4000:])
                return steps
    echo(f"{sum(s.seconds for s in steps):6.1f}s  in all, {sum(s.rc is not None for s in steps)} commands")
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", metavar="DIR", help="run in DIR (new or empty) and keep what the commands wrote")
    args = parser.parse_args()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        steps = tour(Path(args.keep).resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="readme_tour_") as scratch:
            steps = tour(Path(scratch))
    return 0 if all(s.rc in (None, 0) for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
