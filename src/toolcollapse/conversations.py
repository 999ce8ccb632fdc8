"""One's own data: JSON-lines conversations in the chat format TRL and the OpenAI API use, turned into
what the monitor and the SFT term need -- the probe set, and each prompt's ground-truth first turn.

A line is `{"messages": [...]}` (or the list of messages itself): `system` / `user` messages with a text
`content`; `assistant` messages with a `content`, or one call in `tool_calls` (`{"type": "function",
"function": {"name", "arguments"}}`, `arguments` an object or its JSON string); `tool` messages with the
tool's reply as `content`. Our chat format has one call a turn: an assistant message with several calls is
refused, naming the line. `toolcollapse probe FILE --tokenizer DIR` reads a file and says what the probe
would watch; `examples/trl_grpo.py --data FILE` trains GRPO on the prompts with `first_turn_reward`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from toolcollapse.chat import CONTROL_TAGS, PieceEncoder, render_text
from toolcollapse.config import ConfigError, MonitorConfig
from toolcollapse.monitor import (CONTENT_NAMES, NO_CONTENT, SLOT_NAMES, ProbeSet, build_probe, content_labels,
                                  resolve_token_ids)
from toolcollapse.parser import parse_turn
from toolcollapse.records import Message, ToolCall, TurnState
from toolcollapse.runtime import jsonl_lines

ROLES = ("system", "user", "assistant", "tool")


def read_conversations(path: str | Path) -> list[list[Message]]:
    """The conversations of a JSON-lines file as our Messages; a ConfigError naming file and line for one
    that is not a conversation with at least one assistant turn."""
    if not Path(path).is_file():
        raise ConfigError(f"conversations file not found: {path}")
    out = []
    for number, line, record in jsonl_lines(path):
        where = f"{path}:{number}"
        messages = record.get("messages") if isinstance(record, dict) else None
        if messages is None and line.lstrip().startswith("["):
            try:
                messages = json.loads(line)
            except (ValueError, RecursionError):
                raise ConfigError(f"{where}: not JSON (a line cut short?)") from None
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{where}: expected {{\"messages\": [...]}}, a non-empty list of chat messages")
        conversation = [_message(m, f"{where}, message {i}") for i, m in enumerate(messages)]
        if not any(m.role == "assistant" for m in conversation):
            raise ConfigError(f"{where}: no assistant message: nothing to watch or train on")
        out.append(conversation)
    if not out:
        raise ConfigError(f"{path}: no conversations")
    return out


def _message(m: Any, where: str) -> Message:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ConfigError(f"{where}: a message needs a role among {', '.join(ROLES)}")
    content = m.get("content") or ""
    if not isinstance(content, str):
        raise ConfigError(f"{where}: content should be text, got {type(content).__name__}")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ConfigError(f"{where}: tool_calls should be a list, got {type(calls).__name__}")
    if m["role"] != "assistant" or not calls:
        return Message(m["role"], content)
    if len(calls) > 1:
        raise ConfigError(f"{where}: {len(calls)} tool_calls in one message; toolcollapse's chat format has one "
                          "call a turn (split it into turns, each followed by its tool message)")
    fn = calls[0].get("function", calls[0]) if isinstance(calls[0], dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ConfigError(f"{where}: a tool call should be {{\"function\": {{\"name\", \"arguments\"}}}}")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ConfigError(f"{where}: the arguments of {fn['name']} are not JSON: {args[:80]!r}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"{where}: the arguments of {fn['name']} should be an object")
    return Message("assistant", content, ToolCall(fn["name"], args))


def conversation_probe(conversations: Sequence[Sequence[Message]], tokenizer: Any,
                       monitor: MonitorConfig | None = None, call_end: str = "template") -> ProbeSet:
    """The probe set of the first `monitor.probe_size` conversations, with content labels (tool names,
    argument values copied or computed, answers), as `rl` builds it from the tool world's oracle."""
    size = (monitor or MonitorConfig()).probe_size
    encoder = PieceEncoder(tokenizer, call_end)
    chosen = [list(c) for c in conversations[:size]]
    examples = [encoder.encode_conversation(c) for c in chosen]
    content = [content_labels(encoder, c) for c in chosen]
    return build_probe(examples, tokenizer.pad_token_id, resolve_token_ids(tokenizer, CONTROL_TAGS), content)


def reference_rows(conversations: Sequence[Sequence[Message]]) -> list[dict[str, Any]]:
    """TRL rows for the SFT term and OPS: `prompt` (the messages before the first assistant turn, as dicts) and
    `reference` (that turn as the policy writes it after the generation prompt, in our chat format)."""
    rows = []
    for conversation in conversations:
        first = next(i for i, m in enumerate(conversation) if m.role == "assistant")
        prompt = list(conversation[:first])
        before = render_text(prompt, add_generation_prompt=True)
        turn = render_text([*prompt, conversation[first]]).removeprefix(before).removesuffix("\n")
        rows.append({"prompt": [m.to_hf() for m in prompt], "reference": turn})
    return rows


def first_turn_reward(tokenizer: Any, call_end: str = "template") -> Any:
    """A TRL reward function for one's own data (`reference_rows`): 1.0 when a completion is a healthy turn that
    makes the reference turn's call (the same tool and arguments) or gives its answer (the same text), else 0.0.
    It reads TRL's `completion_ids` (the completion text TRL passes has lost the control tags) and parses them
    with the four-state parser."""

    def first_turn(completion_ids: Sequence[Sequence[int]], reference: Sequence[str], **_: Any) -> list[float]:
        out = []
        for ids, ref in zip(completion_ids, reference):
            got = parse_turn(tokenizer.decode(list(ids), skip_special_tokens=False), None, call_end)
            want = parse_turn(ref, None, call_end)
            same = got.call == want.call if want.call is not None else (
                got.call is None and got.text.strip() == want.text.strip())
            out.append(float(same and got.state in (TurnState.HEALTHY_CALL, TurnState.HEALTHY_RESPONSE)))
        return out

    return first_turn


def describe_probe(probe: ProbeSet) -> list[str]:
    """What the probe watches: its rows, the positions of each slot, the content tokens of each kind."""
    slots = probe.slot_of.tolist()
    content = probe.content_of.tolist()
    lines = [f"{probe.input_ids.shape[0]} conversations, {len(slots)} trained positions"]
    lines += [f"  slot {name}: {slots.count(s)} positions" for s, name in SLOT_NAMES.items() if slots.count(s)]
    lines += [f"  content {name}: {content.count(int(c))} tokens" for c, name in CONTENT_NAMES.items()
              if content.count(int(c))]
    if all(c == NO_CONTENT for c in content):
        lines.append("  no content tokens: the content alarms have nothing to watch")
    return lines
