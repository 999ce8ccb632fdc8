"""Training checkpoints that resume exactly: weights, optimizer, RNG states, step.

A checkpoint is a directory `checkpoints/step_000040/` holding a standard
`save_pretrained` model (so `toolcollapse eval` reads it directly), the tokenizer,
the run's config, `trainer.pt` (optimizer and RNG states) and a `COMPLETE` marker.
It is written into `.step_000040.partial`, synced to disk and renamed into place, so
no reader ever sees half a checkpoint and a good one is never removed before its
replacement is whole; a run killed or out of space while saving leaves only the
partial directory, which the next start removes (`clean_partial`).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolcollapse.model import CheckpointError

MARKER = "COMPLETE"


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, step: int, model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer,
                    write_config: Any, keep: int) -> Path:
    """Save after `step` optimizer steps (atomically: module docstring); keep only the newest `keep`."""
    root = Path(run_dir) / "checkpoints"
    path, partial = root / f"step_{step:06d}", root / f".step_{step:06d}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        write_config(partial)
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": _rng_state()}, partial / "trainer.pt")
        (partial / MARKER).write_text(str(step))
        _sync(partial)
    except BaseException as err:
        full = isinstance(err, Exception) and shutil.disk_usage(root).free < (1 << 20)  # before the partial goes
        shutil.rmtree(partial, ignore_errors=True)
        if full and not isinstance(err, OSError):  # torch reports a full disk as a RuntimeError of its own
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial)) from err
        raise
    if path.exists():  # the same step saved again (after a rollback): swap, then drop the old one
        replaced = root / f".step_{step:06d}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        path.rename(replaced)
        partial.rename(path)
        shutil.rmtree(replaced)
    else:
        partial.rename(path)
    _sync_dir(root)
    for old in complete_checkpoints(run_dir)[:-keep]:
        (old / MARKER).unlink()  # first: a crash mid-delete leaves no complete-looking half
        shutil.rmtree(old)
    return path


def clean_partial(run_dir: Path) -> None:
    """After a crash while saving: a swap cut short is finished (the new checkpoint if whole, else the old one
    back), and every partial directory is removed."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return
    for replaced in root.glob(".step_*.replaced"):
        name = replaced.name.removeprefix(".").removesuffix(".replaced")
        partial, path = root / f".{name}.partial", root / name
        if not path.exists():
            (partial if (partial / MARKER).is_file() else replaced).rename(path)
        shutil.rmtree(replaced, ignore_errors=True)
    for partial in root.glob(".step_*.partial"):
        shutil.rmtree(partial, ignore_errors=True)


def _sync(directory: Path) -> None:
    for file in directory.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _sync_dir(directory)


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file()) if root.is_dir() else []


def load_trainer_state(path: Path, optimizer: torch.optim.Optimizer) -> int:
    """Restore optimizer and RNG states; returns the number of steps already taken."""
    file = Path(path) / "trainer.pt"
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)  # AdamW moves its state to the weights
        optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        return int(state["step"])
    except Exception as err:  # truncated, not a torch file, another optimizer's state, ...
        raise CheckpointError(f"{file}: the optimizer and RNG state do not load ({type(err).__name__}: {err}); "
                              f"delete {path} to resume from the checkpoint before it") from None
