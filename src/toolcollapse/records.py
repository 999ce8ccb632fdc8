"""Typed records passed between stages: messages, tasks, parsed turns, episodes.

Every stage imports its inputs and outputs from here, so a field means the same thing
in the world generator, the parser, the rollout engine and the evaluator.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_json(self) -> str:
        """The call's JSON exactly as the chat template's `tojson` renders it."""
        return json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False)


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    tool_call: ToolCall | None = None  # assistant turns only

    def to_hf(self) -> dict[str, Any]:
        """OpenAI/Hugging Face message dict, as `apply_chat_template` expects."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_call is not None:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": self.tool_call.name, "arguments": self.tool_call.arguments}}
            ]
        return out


@dataclass(frozen=True)
class Task:
    id: str
    split: str
    prompt: tuple[Message, ...]  # system + first user message
    reference: tuple[Message, ...]  # ground-truth continuation (assistant and tool messages)
    answer: str  # expected final answer; "" when success is judged on state (BFCL)
    meta: dict[str, Any] = field(default_factory=dict)  # template, n_calls, ... for reporting


class TurnState(str, enum.Enum):
    """The paper's four states of an assistant turn."""

    HEALTHY_CALL = "healthy_call"
    HEALTHY_RESPONSE = "healthy_response"
    TEXT_POLLUTION = "text_pollution"  # the turn ends properly but its content is malformed
    FULL_COLLAPSE = "full_collapse"  # the turn's structure itself is lost

    @property
    def healthy(self) -> bool:
        return self in (TurnState.HEALTHY_CALL, TurnState.HEALTHY_RESPONSE)


class ErrorType(str, enum.Enum):
    """Every malformation the parser names. See `parser.COLLAPSE_ERRORS` for the state each implies."""

    UNCLOSED_CALL = "unclosed_call"  # <tool_call> never closed before the turn ended
    INVALID_JSON = "invalid_json"  # call body is not JSON
    BAD_CALL_SCHEMA = "bad_call_schema"  # JSON, but not {"name": str, "arguments": {...}}
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"  # arguments do not match the tool's JSON schema
    TEXT_OUTSIDE_CALL = "text_outside_call"  # non-whitespace text around a call
    FORBIDDEN_CONTROL_TOKEN = "forbidden_control_token"  # a control token the grammar forbids here
    MULTIPLE_CALLS = "multiple_calls"  # the world expects one call per turn
    UNTAGGED_CALL = "untagged_call"  # a call written as plain text, without <tool_call> tags
    EMPTY_TURN = "empty_turn"  # nothing before the end of the turn
    MISSING_END_OF_TURN = "missing_end_of_turn"  # token budget, end of text or <|endoftext|>
    DEGENERATE_REPETITION = "degenerate_repetition"  # a short unit repeated over and over


# Who writes the <|im_end|> closing a call turn (rollout.call_end; chat.py): the pipeline, as a
# template token after a sampled </tool_call>, or the policy, which is then trained on it.
CallEnd = Literal["template", "sampled"]

# What ended the turn: "call" = a closed <tool_call> (the pipeline runs a tool next),
# "answer" = <|im_end|> after text (the answer), "none" = budget, end of text or <|endoftext|>.
TurnEnd = Literal["call", "answer", "none"]


@dataclass(frozen=True)
class ParsedTurn:
    state: TurnState
    errors: tuple[ErrorType, ...]  # in order of detection; empty iff healthy
    call: ToolCall | None  # the call envelope if one parsed (possibly unknown tool / bad args)
    text: str  # text outside any call: the answer of a response turn
    end: TurnEnd = "none"
    detail: str = ""  # human-readable note on the first error


FinishReason = Literal["answered", "max_turns", "context_limit", "malformed"]


@dataclass
class TurnRecord:
    start: int  # index in Episode.tokens of the turn's first sampled token
    end: int  # one past its last sampled token
    parsed: ParsedTurn
    observation: str | None = None  # the tool's reply appended after the turn, if any


@dataclass
class Episode:
    """One multi-turn rollout, token-in/token-out: `tokens` is exactly what the model saw."""

    task_id: str
    tokens: list[int]  # [T] prompt, sampled turns and appended observations
    loss_mask: list[int]  # [T] 1 where the policy sampled the token
    logprobs: list[float]  # [T] sampling log-prob where loss_mask is 1, else 0.0
    prompt_len: int
    turns: list[TurnRecord] = field(default_factory=list)
    finish: FinishReason = "answered"
    success: bool = False
    final_text: str | None = None  # the answer turn's text, if the episode reached one

    @property
    def states(self) -> list[TurnState]:
        return [t.parsed.state for t in self.turns]


@dataclass
class PolicyBatch:
    """Rollouts as tensors for the policy update: right-padded, one row per episode."""

    input_ids: "torch.Tensor"  # [N, T] long
    target_mask: "torch.Tensor"  # [N, T] bool: the policy sampled this token (loss_mask)
    old_logp: "torch.Tensor"  # [N, T] sampling log-prob where target_mask, else 0
    advantages: "torch.Tensor"  # [N] one per episode, broadcast over its tokens
    unlikely: "torch.Tensor | None" = None  # [N, T] bool: sampled control tokens the grammar rejected
    expert: "torch.Tensor | None" = None  # [N] bool: off-policy rows (OPS's ground truth), shaped apart

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: "slice | torch.Tensor") -> "PolicyBatch":
        return PolicyBatch(self.input_ids[index], self.target_mask[index], self.old_logp[index],
                           self.advantages[index], None if self.unlikely is None else self.unlikely[index],
                           None if self.expert is None else self.expert[index])

    def to(self, device: "torch.device | str") -> "PolicyBatch":
        return PolicyBatch(self.input_ids.to(device), self.target_mask.to(device), self.old_logp.to(device),
                           self.advantages.to(device), None if self.unlikely is None else self.unlikely.to(device),
                           None if self.expert is None else self.expert.to(device))

    def trimmed(self) -> "PolicyBatch":
        """Without the columns after the last sampled token of any row (they change no log-prob)."""
        width = int(self.target_mask.any(dim=0).nonzero().max()) + 1 if self.target_mask.any() else 1
        return PolicyBatch(self.input_ids[:, :width], self.target_mask[:, :width], self.old_logp[:, :width],
                           self.advantages, None if self.unlikely is None else self.unlikely[:, :width], self.expert)
