"""TRL's batches in the monitor's and the signals' terms: turn states, rejected controls, supervision counts
and the loss terms' sums, reduced over ranks (the training forward's `ctrl/*`: `monitor.SampledTokens`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from toolcollapse.autopsy import control_tag_ids, split_turns
from toolcollapse.chat import IM_END, valid_text
from toolcollapse.integrations.trl._common import _gather_rows, _sampled_runs
from toolcollapse.monitor import TurnCounts
from toolcollapse.parser import parse_turn, parse_turn_ids
from toolcollapse.supervision import rejected_positions


class TurnStates:
    """The turn rates `turn_stats.rollout_stats` logs (`state/*`, `error/*`, `healthy_rate`,
    `turns_per_episode`), from TRL's completions: this adapter splits them into turns and parses them; the
    counts and rates are the monitor's (`monitor.TurnCounts`), summed over ranks at `reduce`."""

    def __init__(self, tokenizer: Any, tools: Mapping[str, Any] | None = None, call_end: str = "template"):
        self.tokenizer, self.tools, self.call_end = tokenizer, tools, call_end
        self.id_to_tag, self.text_tags = control_tag_ids(tokenizer)
        self.counts = TurnCounts(_gather_rows)

    def add(self, completion_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """[B, T] completions of one generation batch (`mask`: their tokens; a multi-turn completion's tool
        responses are split off by the chat format's turn boundaries)."""
        self.counts.add(self.parse(ids, m) for ids, m in zip(completion_ids.tolist(), mask.tolist()))

    def parse(self, ids: list[int], mask: list[Any]) -> list[Any]:
        """One completion's assistant turns, parsed."""
        def decode(part: list[int]) -> str:
            return self.tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        turns = [valid_text(t) for a, b in _sampled_runs(mask) for t in split_turns(decode(ids[a:b]))]
        # every control tag one token: the live parse, on ids; otherwise the tags can only match as text
        return [parse_turn(turn, self.tools, self.call_end) if self.text_tags else
                parse_turn_ids(self.tokenizer(turn, add_special_tokens=False)["input_ids"], self.id_to_tag, decode,
                               self.tools, self.call_end) for turn in turns]

    def reduce(self) -> dict[str, float]:
        """The rates over every rank's turns since the last call (a collective: call it on every rank)."""
        return self.counts.reduce()


def rejected_controls(completion_ids: torch.Tensor, mask: torch.Tensor, id_to_tag: Mapping[int, str]) -> torch.Tensor:
    """[B, T] bool: in each sampled turn of each completion, its first control token the grammar rejects
    (`supervision.rejected_positions`, as our trainer's unlikelihood marks them)."""
    out = torch.zeros_like(completion_ids, dtype=torch.bool)
    for b, (ids, m) in enumerate(zip(completion_ids.tolist(), mask.tolist())):
        for position in rejected_positions(ids, _turn_spans(ids, m, id_to_tag), dict(id_to_tag)):
            out[b, position] = True
    return out


def _turn_spans(ids: Sequence[int], mask: Sequence[Any], id_to_tag: Mapping[int, str]) -> list[tuple[int, int]]:
    """[start, end) of a completion's turns: its runs of sampled tokens (`mask`: a multi-turn completion's tool
    responses are 0 there), each cut after its `<|im_end|>`."""
    spans = []
    for start, end in _sampled_runs(mask):
        for t in range(start, end):
            if id_to_tag.get(ids[t]) == IM_END:
                spans.append((start, t + 1))
                start = t + 1
        if start < end:
            spans.append((start, end))
    return spans


class Supervision:
    """OPS's and HBG's counts for `MonitoredGRPOTrainer` since the last log (summed over ranks at `reduce`),
    and the SFT term's running total of tokens (a window's own are its term's, `SFTTermLoss`)."""

    KEYS = ("expert_rows", "expert_loss_sum", "expert_tokens", "hinted_rows")

    def __init__(self, sft_coef: float, reference_column: str):
        if sft_coef < 0:
            raise ValueError(f"sft_coef {sft_coef} must be >= 0")
        self.sft_coef, self.column = sft_coef, reference_column
        self.counts = torch.zeros(len(self.KEYS), dtype=torch.float64)
        self.tokens_total = 0.0

    def count(self, key: str, value: float) -> None:
        self.counts[self.KEYS.index(key)] += value

    def reduce(self, sft_tokens: float = 0.0) -> dict[str, float]:
        """The window's metrics (a collective: call it on every rank); `sft_tokens`: the SFT term's tokens
        in it, every rank's."""
        counts = dict(zip(self.KEYS, _gather_rows(self.counts[None]).sum(dim=0).tolist()))
        self.counts = torch.zeros_like(self.counts)
        out = {}
        if self.sft_coef > 0:  # in every row, as ours (0 in a window without an SFT forward: TRL's last log)
            self.tokens_total += sft_tokens
            out["sup/sft_tokens"], out["sup/sft_tokens_total"] = sft_tokens, self.tokens_total
        if counts["hinted_rows"]:
            out["sup/hinted_rows"] = counts["hinted_rows"]
        if counts["expert_rows"]:
            out["sup/expert_rows"] = counts["expert_rows"]
            if counts["expert_tokens"]:
                out["sup/expert_luffy_loss"] = counts["expert_loss_sum"] / counts["expert_tokens"]
        return out


class TermSums:
    """The signals' loss terms (`signals.LossTerm`) since the last log: their sums, added up by class over
    the terms and then over the ranks, turned into metrics by the class (`metrics_of`) -- the reduction our
    trainer does over an RL step's optimizer steps, here over TRL's logging window."""

    def __init__(self) -> None:
        self.live: list[Any] = []  # the terms whose sums are not logged yet

    def reduce(self, still_used: Sequence[Any] = ()) -> dict[str, float]:
        """The metrics (a collective: every rank holds terms of the same classes); `still_used`: the terms of
        the generation batch in use, kept (their sums zeroed) for the micro-batches after this log."""
        by_class: dict[str, tuple[Any, dict[str, float]]] = {}
        for term in self.live:
            cls = type(term)
            _, sums = by_class.setdefault(cls.__qualname__, (cls, dict.fromkeys(cls.SUMS, 0.0)))
            for key, value in term.sums.items():
                sums[key] += value
            term.sums = dict.fromkeys(cls.SUMS, 0.0)
        self.live = list(still_used)
        out: dict[str, float] = {}
        for name in sorted(by_class):
            cls, sums = by_class[name]
            if not sums:
                continue
            total = _gather_rows(torch.tensor([list(sums.values())], dtype=torch.float64)).sum(dim=0).tolist()
            out.update(cls.metrics_of(dict(zip(sums, total))))
        return out
