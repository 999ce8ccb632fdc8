"""What the TRL adapters share: the output files and the collectives across ranks."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather, pad_across_processes
from trl.models.utils import unwrap_model_for_generation

ALARMS = "alarms.jsonl"  # in the trainer's output_dir: one line per alarm, with the action taken
MONITOR = "monitor.jsonl"  # ... one line per probe and per log: the series with their step, 0-based as in rl's
                           # metrics.jsonl (a probe before that step's update, the rollouts sampled in it)
MONITOR_CONFIG = "monitor.yaml"  # ... the MonitorConfig the rules came from (what `diagnose` replays)


def _append(out_dir: str, name: str, row: Mapping[str, Any]) -> None:
    """One JSON line in <out_dir>/<name>, written by the main process only."""
    if PartialState().is_main_process:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / name, "a") as f:
            f.write(json.dumps(row) + "\n")



def _loss_mask(batch: Mapping[str, Any]) -> torch.Tensor:
    """The completion tokens TRL's loss counts: the completion mask, less a multi-turn completion's tool
    responses (`tool_mask`), as `GRPOTrainer._compute_loss` takes it."""
    return batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]


def _sampled_runs(mask: Sequence[Any]) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled tokens (mask 1) of a completion: in TRL's tool loop and in our
    rollouts, one assistant turn each (the tool replies and template tokens between them are 0)."""
    runs, at = [], 0
    for keep, group in itertools.groupby(bool(k) for k in mask):
        n = sum(1 for _ in group)
        if keep:
            runs.append((at, at + n))
        at += n
    return runs


def _gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's [n_i, k] rows, concatenated in rank order on every rank (n_i may differ, and be 0)."""
    if PartialState().num_processes == 1:
        return rows
    device = PartialState().device
    counts = gather(torch.tensor([rows.shape[0]], device=device)).tolist()
    padded = gather(pad_across_processes(rows.to(device), dim=0))  # [world * max_n, k]
    width = max(counts)
    return torch.cat([padded[i * width:i * width + n] for i, n in enumerate(counts)]).cpu()


def _from_rank_zero(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if PartialState().num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


@contextlib.contextmanager
def _generation_model(trainer: Any) -> Iterator[Any]:
    """The trainer's plain model, whole, as TRL's own generation takes it (grpo_trainer.py, transformers
    path): `unwrap_model_for_generation` (ZeRO-3 gathers the shards) and FSDP's full parameters. Every
    rank must enter (the gathers are collectives)."""
    t, args = trainer, trainer.args
    dist = getattr(t, "_dist", None)
    with (unwrap_model_for_generation(t.model_wrapped, t.accelerator,
                                      gather_deepspeed3_params=args.ds3_gather_for_generation,
                                      gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs) as unwrapped,
          dist.summon_full_params(t.model_wrapped, recurse=False) if dist else contextlib.nullcontext()):
        yield unwrapped
