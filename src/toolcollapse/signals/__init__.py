"""Supervision signals' loss terms: what each adds to an optimizer step of the GRPO update.

The update (update.py) sums the terms it is handed and never learns a signal's name. A term is one object
per RL step, told at each of the step's optimizer steps which mini-batch it is (`begin`), and asked, in
this order:

  token_loss    the per-token policy loss, reshaped (OPS's LUFFY shaping on the expert rows' tokens)
  forward_loss  a loss from the update's own forward pass, added to the mini-batch's (unlikelihood)
  backward      a loss with a forward pass of its own, its gradient added to the same optimizer step
                (the SFT term); False when it was not finite, which skips the optimizer step
  metrics       what it logs for the RL step, once its optimizer steps are done

A new loss term is a subclass of `base.LossTerm` in its own module of this package, built where the loop
builds the others (`step_terms`). The signals' rows (OPS, HBG: supervision.py) and phases (ETS, PRS, adaptive:
interleave.py) are not terms.
"""

from __future__ import annotations

from typing import Any, Sequence

from toolcollapse.signals.base import LossTerm, OptimizerStep
from toolcollapse.signals.ops import LuffyShaping
from toolcollapse.signals.sft_term import SFTTermLoss
from toolcollapse.signals.unlikelihood import Unlikelihood


def step_terms(supervision: Any, sft: Any = None, sft_examples: Sequence[Any] = ()) -> list[LossTerm]:
    """The loss terms `supervision` (a SupervisionConfig) turns on for one RL step; `sft`: the SFT term's
    settings (supervision.SFTTerm) and `sft_examples` the ground truth of the step's tasks, one a group."""
    terms: list[LossTerm] = []
    if supervision.ops.enabled and supervision.ops.shaping == "luffy":
        terms.append(LuffyShaping(supervision.ops.gamma))
    if supervision.unlikelihood_coef > 0:
        terms.append(Unlikelihood(supervision.unlikelihood_coef))
    if sft is not None:
        terms.append(SFTTermLoss(sft, sft_examples))
    return terms


__all__ = ["LossTerm", "LuffyShaping", "OptimizerStep", "SFTTermLoss", "Unlikelihood", "step_terms"]
