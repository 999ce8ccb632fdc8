"""Losses as pure functions of tensors.

Later stages add the GRPO/PPO policy loss, KL estimators, LUFFY shaping and
unlikelihood here; each takes tensors and returns a scalar plus a small stats record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SFTStats:
    loss: float  # mean NLL per target token
    accuracy: float  # share of target tokens that are the argmax
    n_tokens: int


def sft_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, SFTStats]:
    """Token-mean negative log-likelihood. logits: [M, V] at the M trained positions; targets: [M]."""
    loss = F.cross_entropy(logits.float(), targets)
    with torch.no_grad():
        acc = (logits.argmax(dim=-1) == targets).float().mean().item() if targets.numel() else 0.0
    return loss, SFTStats(loss=loss.item(), accuracy=acc, n_tokens=targets.numel())
