"""OPS, off-policy supervision: `ops.rows` of each group are the task's ground truth fed turn by turn through
the environment (`RolloutEngine.replay`), rewarded like the others. Their tokens' loss is LUFFY's shaping
-A * p/(p + gamma) (arXiv 2504.14945; `ops.shaping: luffy`, the paper's text) or the clipped surrogate with
old log-probs from a forward pass (`none`, the released scripts). Their tokens count as SFT tokens
(`sup/expert_tokens`), so that an sft_only control can match them."""

from __future__ import annotations

import torch

from toolcollapse.losses import luffy_loss
from toolcollapse.signals.base import LossTerm, Rows, Signal, Step


class LuffyShaping(LossTerm):
    """The tokens of the batch's `expert` rows take -A * p / (p + gamma) instead of the clipped surrogate."""

    def __init__(self, gamma: float):
        super().__init__()
        self.gamma = gamma

    def expert_loss(self, logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return luffy_loss(logp, adv, self.gamma)


class OPS(Signal):
    name = "ops"

    @staticmethod
    def enabled(cfg) -> bool:
        return cfg.supervision.ops.enabled

    def rows(self) -> Rows:
        return Rows("expert", self.cfg.supervision.ops.rows)

    def terms(self, step: Step) -> list[LossTerm]:
        ops = self.cfg.supervision.ops
        return [LuffyShaping(ops.gamma)] if ops.shaping == "luffy" else []

    def after_update(self, step: Step) -> dict[str, float]:
        """The expert rows' trained tokens (none in a step the update skipped)."""
        if step.metrics.get("skipped_uninformative"):
            return {}
        tokens = self.cfg.grpo.updates_per_batch * sum(
            sum(ep.loss_mask) for ep, kind in zip(step.episodes, step.kinds) if kind == "expert")
        return {"sup/expert_tokens": float(tokens)} if tokens else {}
