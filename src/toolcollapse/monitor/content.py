"""Content statistics: the skill, not the format. Every trained token of an oracle turn carries a `Content`
label (the tool's name, an argument value copied from the question or a tool result, any other argument
value, the answer text); per label the probe reports the ground truth's mean log-prob and how often it is
the greedy choice (monitor/probe.py's docstring; docs/LOG.md, "the silent collapse")."""

from __future__ import annotations

import enum
import json
from typing import Any, Sequence

import torch

from toolcollapse.chat import assistant_body


class Content(enum.IntEnum):
    """What a trained target token of an oracle turn carries besides the format."""

    TOOL_NAME = 0  # the called tool's name
    ARG_COPIED = 1  # an argument value written verbatim earlier in the conversation (an entity, a number)
    ARG_COMPUTED = 2  # any other argument value (a chosen attribute, unit, function; a derived number)
    ANSWER = 3  # the final answer's text


NO_CONTENT = -1  # structure: tags, JSON punctuation and keys, the <|im_end|>
CONTENT_NAMES = {c: c.name.lower() for c in Content}


def content_labels(encoder: Any, messages: Sequence[Any]) -> list[int]:
    """The Content of every trained target of one oracle conversation (NO_CONTENT where none), in the
    order of `slots`. A value counts as copied when its text occurs in what the model was given before
    the turn: the user's questions and the tool results (not the system prompt, not its own calls)."""
    out: list[int] = []
    context = ""
    for message in messages:
        if message.role != "assistant":
            context += "" if message.role == "system" else message.content + "\n"
            continue
        call_text = "\n" + message.tool_call.to_json() + "\n" if message.tool_call is not None else None
        for piece in assistant_body(message, encoder.call_end):
            ids, mask = encoder.encode([piece])
            if not any(mask):
                continue
            spans: list[tuple[int, int, int]] = []
            if piece.special:
                pass
            elif piece.text == call_text:
                spans = _call_spans(message.tool_call, piece.text, context)
            elif message.tool_call is None:
                spans = [(0, len(piece.text), Content.ANSWER)]
            out += _label_tokens(encoder.tokenizer, ids, piece.text, spans)
    return out


def _call_spans(call: Any, text: str, context: str) -> list[tuple[int, int, int]]:
    """(start, end, Content) character spans of a call's name and leaf argument values in its JSON text."""
    at = text.index('"name": ') + len('"name": ')
    name = json.dumps(call.name, ensure_ascii=False)
    spans = [(at + 1, at + len(name) - 1, int(Content.TOOL_NAME))]
    _value_spans(call.arguments, text, text.index('"arguments": ', at) + len('"arguments": '), context, spans)
    return spans


def _value_spans(value: Any, text: str, at: int, context: str, out: list[tuple[int, int, int]]) -> int:
    """Append the spans of `value`'s leaves, serialized in `text` from `at`; returns where it ends."""
    if isinstance(value, dict):
        for key, v in value.items():
            k = json.dumps(key, ensure_ascii=False) + ": "
            at = _value_spans(v, text, text.index(k, at) + len(k), context, out)
        return at
    if isinstance(value, list):
        for v in value:
            at = _value_spans(v, text, at, context, out)
        return at
    serial = json.dumps(value, ensure_ascii=False)
    start = text.index(serial, at)
    lo, hi = (start + 1, start + len(serial) - 1) if isinstance(value, str) else (start, start + len(serial))
    copied = hi > lo and text[lo:hi] in context
    out.append((lo, hi, int(Content.ARG_COPIED if copied else Content.ARG_COMPUTED)))
    return start + len(serial)


def _label_tokens(tokenizer: Any, ids: Sequence[int], text: str, spans: Sequence[tuple[int, int, int]]) -> list[int]:
    """The label of each token of `text` (encoded as `ids`): the first span it overlaps, else NO_CONTENT.
    A tokenization whose pieces do not decode back to `text` character by character gets no labels."""
    if not spans:
        return [NO_CONTENT] * len(ids)
    ends = [len(tokenizer.decode(ids[:k + 1], clean_up_tokenization_spaces=False)) for k in range(len(ids))]
    if not ends or ends[-1] != len(text):
        return [NO_CONTENT] * len(ids)
    labels = []
    for start, end in zip([0, *ends[:-1]], ends):
        labels.append(next((c for lo, hi, c in spans if start < hi and end > lo), NO_CONTENT))
    return labels


def content_stats(truth: torch.Tensor, greedy: torch.Tensor, content_of: torch.Tensor,
                  prefix: str = "probe/content") -> dict[str, float]:
    """Per Content slot: the mean log-prob of the ground-truth token and how often it is the greedy
    choice. truth: [M] its log-prob; greedy: [M] bool, it is the argmax; content_of: [M] Content
    values. A slot with no positions is absent."""
    out = {}
    for c in Content:
        here = content_of == c
        if here.any():
            out[f"{prefix}/{CONTENT_NAMES[c]}/logp"] = truth[here].mean().item()
            out[f"{prefix}/{CONTENT_NAMES[c]}/acc"] = greedy[here].float().mean().item()
    return out
