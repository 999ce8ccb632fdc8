"""The synchronous SFT term: every optimizer step also minimises coef * NLL of the ground truth of its
mini-batch's own tasks (token-mean over their assistant tokens), the joint loss of CHORD (arXiv 2508.11408)
with a fixed weight. Logged per RL step: `sup/sft_nll` (the mean over its optimizer steps) and
`sup/sft_tokens` (the tokens trained on, summed), so that a gain can be told apart from "more SFT"."""

from __future__ import annotations

import math
from typing import Any, Sequence

from toolcollapse.encoding import encode_tasks
from toolcollapse.signals.base import LossTerm, OptimizerStep, Signal, Step
from toolcollapse.supervision import SFTTerm


class SFTTermLoss(LossTerm):
    def __init__(self, sft: Any, examples: Sequence[Any]):
        self.sft, self.examples = sft, list(examples)  # supervision.SFTTerm; the step's tasks' ground truth
        self.part: Sequence[Any] = ()
        self.nll, self.tokens, self.calls = 0.0, 0.0, 0

    def begin(self, step: OptimizerStep) -> None:
        g = step.group_size
        one_a_group = len(self.examples) == step.batch_rows // g
        self.part = self.examples[step.start // g:step.end // g] if one_a_group else self.examples

    def backward(self, model: Any) -> bool:
        stats = self.sft.backward(model, self.part)
        self.nll += stats["sup/sft_nll"]
        self.tokens += stats["sup/sft_tokens"]
        self.calls += 1
        return math.isfinite(stats["sup/sft_nll"])

    def metrics(self) -> dict[str, float]:
        if not self.calls:
            return {}
        return {"sup/sft_nll": self.nll / self.calls, "sup/sft_tokens": self.tokens}


class SFTTermSignal(Signal):
    name = "sft_term"

    @staticmethod
    def enabled(cfg) -> bool:
        return cfg.supervision.sft_coef > 0

    def start(self, run: Any) -> None:
        self.encoder = run.engine.encoder
        self.nll = SFTTerm(self.cfg.supervision.sft_coef, self.cfg.grpo.micro_batch_size, run.tokenizer.pad_token_id)

    def terms(self, step: Step) -> list[LossTerm]:
        return [SFTTermLoss(self.nll, encode_tasks(self.encoder, step.tasks, self.cfg.rollout.call_end))]
