"""The loss-term protocol: what a supervision signal adds to an optimizer step of the GRPO update
(this package's docstring says when each hook is called)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolcollapse.records import PolicyBatch


@dataclass(frozen=True)
class OptimizerStep:
    """Which optimizer step of an RL step a term is in."""

    batch: PolicyBatch  # the mini-batch: whole groups, rows [start, end) of the step's batch
    start: int
    end: int
    batch_rows: int  # the step's batch
    group_size: int
    last_pass: bool  # the last of `grpo.updates_per_batch` passes over the batch


class LossTerm:
    """A term of the loss beside the clipped surrogate (the defaults add nothing)."""

    def begin(self, step: OptimizerStep) -> None:
        """An optimizer step starts."""

    def token_loss(self, pg: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mb: PolicyBatch,
                   seq_ids: torch.Tensor) -> torch.Tensor:
        """The per-token policy loss [M] of micro-batch `mb` (`seq_ids` [M]: each token's row)."""
        return pg

    def forward_loss(self, logp: torch.Tensor, mb: PolicyBatch) -> torch.Tensor | None:
        """A scalar added to the micro-batch's loss, from its log-probs [M] at the sampled tokens."""
        return None

    def backward(self, model: Any) -> bool:
        """After the micro-batches: a loss of its own forward, backpropagated; whether it was finite."""
        return True

    def metrics(self) -> dict[str, float]:
        return {}
