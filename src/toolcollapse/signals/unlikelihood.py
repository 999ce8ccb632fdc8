"""Unlikelihood (arXiv 1908.04319; not in the paper): coef * mean -log(1 - p) over the mini-batch's rejected
control tokens -- in each of the policy's own failed turns, the first control token the grammar rejects
(`supervision.unlikely_positions`, the batch's `unlikely` mask) -- from the update's own forward pass: the
collapse's spike pushed down where it happened. Logged over the last pass: `sup/unlikelihood` (the mean),
`sup/unlikely_tokens` (their count)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from toolcollapse.losses import unlikelihood
from toolcollapse.records import PolicyBatch
from toolcollapse.signals.base import LossTerm, OptimizerStep, Signal, Step
from toolcollapse.supervision import unlikely_positions


class Unlikelihood(LossTerm):
    """coef * -log(1 - p) at the marked tokens, a mean over the optimizer step's (ours: `begin`'s batch, the
    mini-batch; TRL's: its `marked_tokens`, so that the micro-batches of a step add up to the same mean, with
    one optimizer step a generation batch, TRL's default)."""

    SUMS = ("unlikelihood", "tokens")  # over the last pass: the terms' sum and their tokens

    def __init__(self, coef: float, marked: Sequence[Sequence[int]]):
        super().__init__()
        self.coef, self.marked = coef, marked  # per row, the positions `build_batch` marks as `unlikely`
        self.n: float = 0  # what the optimizer step's rejected tokens' sum divides by
        self.last_pass = False

    def begin(self, step: OptimizerStep) -> None:
        here = int(step.batch.unlikely.sum()) if step.batch.unlikely is not None else 0
        self.n = here if step.marked_tokens is None else step.marked_tokens
        self.last_pass = step.last_pass
        if self.last_pass:
            self.add(tokens=here)

    def forward_loss(self, logp: torch.Tensor, mb: PolicyBatch) -> torch.Tensor | None:
        if not self.n:
            return None
        ul = unlikelihood(logp[mb.unlikely[mb.target_mask]])  # [K] the micro-batch's rejected tokens
        if self.last_pass:
            self.add(unlikelihood=ul.sum().item())
        return self.coef * ul.sum() / self.n

    @staticmethod
    def metrics_of(sums: dict[str, float]) -> dict[str, float]:
        if not sums["tokens"]:
            return {}
        return {"sup/unlikelihood": sums["unlikelihood"] / sums["tokens"], "sup/unlikely_tokens": sums["tokens"]}


class UnlikelihoodSignal(Signal):
    name = "unlikelihood"

    def __init__(self, cfg, **given):
        super().__init__(cfg)
        self.id_to_tag: dict[int, str] = {}

    @staticmethod
    def enabled(cfg) -> bool:
        return cfg.supervision.unlikelihood_coef > 0

    def start(self, run: Any) -> None:
        self.id_to_tag = run.engine.id_to_tag

    def terms(self, step: Step) -> list[LossTerm]:
        marked = unlikely_positions(step.episodes, self.id_to_tag, self.cfg.rollout.call_end)
        return [Unlikelihood(self.cfg.supervision.unlikelihood_coef, marked)]
