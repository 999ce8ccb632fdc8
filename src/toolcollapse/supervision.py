"""Supervision signals mixed into GRPO (arXiv 2606.26027; docs: DESIGN.md, "Supervision signals").

So far two terms added to the GRPO loss. The synchronous SFT term: every GRPO step also minimises

    sft_coef * NLL(ground-truth conversations of the step's tasks)

token-mean over their assistant tokens (the tokens `sft` trains), in the same optimizer step
as the policy loss -- the joint loss of CHORD (arXiv 2508.11408) with a fixed weight. It
keeps supervision on the format and on copying while RL moves the policy, at the price of
SFT tokens, which every step logs (`sup/sft_tokens`, and their running total) so that a
gain can be told apart from "more SFT" (docs/LOG.md).

Unlikelihood (not in the paper; arXiv 1908.04319): in each of the policy's own failed turns,
the first control token the grammar rejects (`parser.first_rejected_control`: `<|im_end|>`
inside a call, a stray `</tool_call>`, `<tool_response>` ...) adds
`unlikelihood_coef * -log(1 - p)` (mean over such tokens of the batch), computed from the
update's own forward: the collapse's spike pushed down where it happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch.nn.functional as F

from toolcollapse.sft import Example, batch_logits


@dataclass(frozen=True)
class SFTTerm:
    """`coef` * token-mean NLL of `examples`, accumulated into the parameters' .grad in micro-batches."""

    coef: float
    micro_batch_size: int
    pad_id: int

    def backward(self, model: Any, examples: Sequence[Example]) -> dict[str, float]:
        """Add the term's gradient to .grad; its statistics (the NLL is at temperature 1, as `sft` trains)."""
        n_tokens = sum(sum(m[1:]) for _, m in examples)
        total = 0.0
        for start in range(0, len(examples), self.micro_batch_size):
            logits, targets = batch_logits(model, examples[start:start + self.micro_batch_size], self.pad_id)
            nll = F.cross_entropy(logits, targets, reduction="sum")
            (self.coef * nll / max(1, n_tokens)).backward()
            total += nll.item()
        return {"sup/sft_nll": total / max(1, n_tokens), "sup/sft_tokens": float(n_tokens)}


@dataclass(frozen=True)
class StepSupervision:
    """What the supervision signals add to one GRPO step (all empty: plain GRPO)."""

    sft: SFTTerm | None = None
    sft_examples: Sequence[Example] = ()  # the ground truth of the step's tasks
    unlikelihood_coef: float = 0.0
    unlikely: Sequence[Sequence[int]] | None = None  # per rollout: positions of rejected control tokens


def sft_tokens_so_far(rows: Sequence[dict[str, Any]]) -> float:
    """The running total of SFT tokens in a run's metric rows (0 before any)."""
    return next((r["sup/sft_tokens_total"] for r in reversed(rows) if "sup/sft_tokens_total" in r), 0.0)

