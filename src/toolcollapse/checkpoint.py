"""Training checkpoints that resume exactly: weights, optimizer, RNG states, step.

A checkpoint is a directory `checkpoints/step_000040/` holding a standard
`save_pretrained` model (so `toolcollapse eval` reads it directly), the tokenizer,
the run's config, `trainer.pt` (optimizer and RNG states) and, written last, a
`COMPLETE` marker: a run killed while saving leaves no marker, and resume takes
the newest directory that has one.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

MARKER = "COMPLETE"


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, step: int, model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer,
                    write_config: Any, keep: int) -> Path:
    """Save after `step` optimizer steps; keep only the newest `keep` checkpoints."""
    path = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    write_config(path)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": _rng_state()}, path / "trainer.pt")
    (path / MARKER).write_text(str(step))
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return path


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file()) if root.is_dir() else []


def load_trainer_state(path: Path, optimizer: torch.optim.Optimizer) -> int:
    """Restore optimizer and RNG states; returns the number of steps already taken."""
    from toolcollapse.model import CheckpointError

    file = Path(path) / "trainer.pt"
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)  # AdamW moves its state to the weights
        optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        return int(state["step"])
    except Exception as err:  # truncated, not a torch file, another optimizer's state, ...
        raise CheckpointError(f"{file}: the optimizer and RNG state do not load ({type(err).__name__}: {err}); "
                              f"delete {path} to resume from the checkpoint before it") from None
