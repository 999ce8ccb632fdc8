"""OPS's loss term: LUFFY's policy shaping (arXiv 2504.14945) on the expert rows' tokens, the paper's text
(`supervision.ops.shaping: luffy`); the released code's variant keeps the clipped surrogate there and needs
no term. The expert rows themselves: supervision.group_rollouts."""

from __future__ import annotations

import torch

from toolcollapse.losses import luffy_loss
from toolcollapse.records import PolicyBatch
from toolcollapse.signals.base import LossTerm


class LuffyShaping(LossTerm):
    """The tokens of the batch's `expert` rows take -A * p / (p + gamma) instead of the clipped surrogate."""

    def __init__(self, gamma: float):
        self.gamma = gamma

    def token_loss(self, pg: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mb: PolicyBatch,
                   seq_ids: torch.Tensor) -> torch.Tensor:
        if mb.expert is None:
            return pg
        return torch.where(mb.expert[seq_ids], luffy_loss(logp, adv, self.gamma), pg)
