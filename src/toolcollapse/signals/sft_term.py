"""The synchronous SFT term: every optimizer step also minimises coef * NLL of the ground truth of its
mini-batch's own tasks (token-mean over their assistant tokens), the joint loss of CHORD (arXiv 2508.11408)
with a fixed weight. Logged per RL step: `sup/sft_nll` (the token mean over its optimizer steps' ground truth)
and `sup/sft_tokens` (their tokens), so that a gain can be told apart from "more SFT".

One term, two forms: ours runs a forward of its own over the mini-batch's tasks (`backward`); TRL's trainer
carries each prompt's reference in its policy batch, and each micro-batch adds its reference rows' loss to
TRL's own (`rows_loss`), so a distributed backward stays one collective.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from toolcollapse.encoding import encode_tasks
from toolcollapse.signals.base import LossTerm, OptimizerStep, Signal, Step
from toolcollapse.supervision import SFTTerm


def reference_nll(model: Any, ids: torch.Tensor, kind: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """One forward over right-padded rows [B, L] of context and reference (`kind`: 0 padding, 1 context, 2 a
    trained reference token; the position before a trained token predicts it): the trained tokens' summed NLL,
    their count, and the logits' sum times zero, which, added to a loss, keeps every parameter of the forward
    in the backward (a row of padding only trains nothing and still takes part in a distributed backward)."""
    train = kind == 2
    select = torch.zeros_like(train)
    select[:, :-1] = train[:, 1:]
    attention = (kind > 0).long()
    attention[:, 0] = 1  # a padding-only row still attends somewhere (a fully masked row gives NaN)
    logits = model(input_ids=ids, attention_mask=attention).logits
    nll = F.cross_entropy(logits[select].float(), ids[train], reduction="sum")
    return nll, int(train.sum()), 0.0 * logits.sum()


class SFTTermLoss(LossTerm):
    SUMS = ("nll", "tokens", "calls")  # the summed NLL of the reference tokens, their count, the forwards

    def __init__(self, sft: SFTTerm, examples: Sequence[Any] = ()):
        super().__init__()
        self.sft, self.examples = sft, list(examples)  # supervision.SFTTerm; the step's tasks' ground truth
        self.part: Sequence[Any] = ()

    def begin(self, step: OptimizerStep) -> None:
        g = step.group_size
        one_a_group = len(self.examples) == step.batch_rows // g
        self.part = self.examples[step.start // g:step.end // g] if one_a_group else self.examples

    def backward(self, model: Any) -> bool:
        nll, tokens = self.sft.backward(model, self.part)
        self.add(nll=nll, tokens=tokens, calls=1)
        return math.isfinite(nll)

    def rows_loss(self, model: Any, ids: torch.Tensor, kind: torch.Tensor, per: torch.Tensor) -> torch.Tensor:
        """TRL's form, for one micro-batch: its reference rows [B, L] (`kind` as `reference_nll`'s), coef * their
        summed NLL over `per` -- the optimizer step's reference tokens, per micro-batch and rank, so that the
        step's micro-batches add up to its token mean -- plus `reference_nll`'s zero-weighted logits."""
        nll, tokens, keep = reference_nll(model, ids, kind)
        self.add(nll=nll.item(), tokens=tokens, calls=1)
        return self.sft.coef * nll / per + keep

    @staticmethod
    def metrics_of(sums: dict[str, float]) -> dict[str, float]:
        if not sums["calls"]:
            return {}
        out = {"sup/sft_tokens": sums["tokens"]}
        if sums["tokens"]:
            out["sup/sft_nll"] = sums["nll"] / sums["tokens"]
        return out


class SFTTermSignal(Signal):
    name = "sft_term"

    @staticmethod
    def enabled(cfg) -> bool:
        return cfg.supervision.sft_coef > 0

    def start(self, run: Any) -> None:
        self.encoder = run.engine.encoder
        self.nll = SFTTerm(self.cfg.supervision.sft_coef, self.cfg.grpo.micro_batch_size, run.tokenizer.pad_token_id)

    def terms(self, step: Step) -> list[LossTerm]:
        return [SFTTermLoss(self.nll, encode_tasks(self.encoder, step.tasks))]
