"""BFCL entries as `Task`s: the prompt, the tools visible at each turn, and the reference trajectory.

Tools: every function documented for the entry's involved classes, in class order,
minus a miss_func entry's held-out functions, which BFCL adds at their turn
(`utils.py::populate_test_cases_with_predefined_functions`,
`base_handler.py::inference_multi_turn_*`). BFCL's `excluded_function` field is not
read by BFCL's code and is ignored here too.

Reference (`Task.reference`, what SFT trains on and `replay_references` replays): per
user turn, each ground-truth call as one assistant tool-call message (the chat format
allows one call per turn) followed by a tool message with its real, deterministic
result, then a short fixed assistant reply closing the turn; then the next user
message. Ground-truth calls are written as the parser will read them back: positional
arguments bound to their parameter names, values through a JSON round trip.
"""

from __future__ import annotations

import inspect
import json
from typing import Mapping, Sequence

from toolcollapse.envs.bfcl.backend import World, execute, load_world
from toolcollapse.envs.bfcl.calls import LiteralCall, parse_call_string
from toolcollapse.envs.bfcl.data import Entry
from toolcollapse.envs.bfcl.prompts import added_functions_text, closing_text, system_prompt
from toolcollapse.records import Message, Task, ToolCall
from toolcollapse.tools import ToolSpec

ClassDocs = Mapping[str, Sequence[ToolSpec]]  # backend class -> its documented functions


def entry_tools(entry: Entry, docs: ClassDocs) -> list[ToolSpec]:
    """Every function of the entry's classes, later classes winning a shared name (as BFCL's dispatch)."""
    table = {t.name: t for c in entry.classes for t in docs[c]}
    return list(table.values())


def tools_at_start(entry: Entry, docs: ClassDocs) -> list[ToolSpec]:
    held_out = {name for names in entry.missed.values() for name in names}
    return [t for t in entry_tools(entry, docs) if t.name not in held_out]


def tools_added_at(entry: Entry, turn: int, docs: ClassDocs) -> list[ToolSpec]:
    by_name = {t.name: t for t in entry_tools(entry, docs)}
    return [by_name[name] for name in entry.missed.get(turn, ())]


def user_message(entry: Entry, turn: int, docs: ClassDocs) -> Message:
    if turn in entry.missed:
        return Message("user", added_functions_text(tools_added_at(entry, turn, docs)))
    return Message("user", entry.user_turns[turn])


def new_world(entry: Entry, docs: ClassDocs) -> World:
    allowed = {c: [t.name for t in docs[c]] for c in entry.classes}
    return load_world(entry.classes, entry.initial_config, entry.long_context, allowed)


def build_task(entry: Entry, split: str, docs: ClassDocs) -> Task:
    prompt = (Message("system", system_prompt(tools_at_start(entry, docs))), user_message(entry, 0, docs))
    n_calls = sum(len(t) for t in entry.ground_truth)
    meta = {"category": entry.category, "template": entry.category, "n_turns": len(entry.ground_truth),
            "n_calls": n_calls, "classes": list(entry.classes)}
    return Task(entry.id, split, prompt, reference_messages(entry, docs), "", meta)


def reference_messages(entry: Entry, docs: ClassDocs) -> tuple[Message, ...]:
    world = new_world(entry, docs)
    messages: list[Message] = []
    for k, truth in enumerate(entry.ground_truth):
        if k > 0:
            messages.append(user_message(entry, k, docs))
        calls = [to_tool_call(world, parse_call_string(s)) for s in truth]
        for call in calls:
            messages.append(Message("assistant", tool_call=call))
            messages.append(Message("tool", execute(world, as_literal(call))[0]))
        text = closing_text([c.name for c in calls], (k + 1) in entry.missed, entry.category)
        messages.append(Message("assistant", text))
    return tuple(messages)


def to_tool_call(world: World, call: LiteralCall) -> ToolCall:
    """A ground-truth call as the model would write it: named arguments, JSON values."""
    method = world.methods[call.name]
    bound = inspect.signature(method).bind(*call.args, **call.kwargs)
    return ToolCall(call.name, json.loads(json.dumps(dict(bound.arguments))))


def as_literal(call: ToolCall) -> LiteralCall:
    return LiteralCall(call.name, (), dict(call.arguments))
