"""BFCL v4 multi-turn as an `Environment`: several user turns, live backends, BFCL's state check.

An episode walks the entry's user turns. An assistant call runs on the episode's live
backend instances and its result is the observation; a text reply closes the user
turn, and the next user message is the observation (at a miss_func turn, that message
carries the held-out docs and `state.tools` gains them); the reply to the last user
turn ends the episode. Every call the model wrote as a parseable call is recorded
under its user turn -- also those rejected without running (unknown or private name),
as BFCL records every decoded call -- and `success` gives BFCL's verdict on them
(`checker.check_turns`, on fresh instances). The parser's verdict labels a turn but
does not gate execution: BFCL runs whatever decodes, so a documented function runs even
with arguments its schema rejects (Python's TypeError, if any, is the result) or when a
miss_func entry has not revealed it yet.

Departures from BFCL's inference loop, forced by the one-call chat protocol: a call
that does not parse gets an error observation and the turn goes on (BFCL ends the turn
on an undecodable reply); only the first of several calls in one assistant turn runs;
BFCL's 20-steps-per-turn cap is left to the rollout's `max_turns`. An episode that
stops before the model has written a turn in the last user turn fails, as BFCL's
force-terminated entries do -- also when its last allowed assistant turn answered a user
turn and the next one came too late to be replied to (`Progress.replied`); a malformed
reply is a reply, as BFCL's empty decode is.

The live instances and the check run in the tool process (`toolcollapse.sandbox`): each
call within `tools.timeout_s`, past which it is stopped, leaves no trace in the state,
is answered "Error during execution: ... did not finish ..." and, in the success check,
counts as a call that ran nothing. BFCL has no such limit (its MathAPI can be asked for
10**(10**12)).
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from toolcollapse.chat import render_text
from toolcollapse.config import BFCLConfig, ToolsConfig
from toolcollapse.envs.base import EpisodeState
from toolcollapse.envs.bfcl.backend import ERROR_PREFIX, World, execute
from toolcollapse.envs.bfcl.calls import LiteralCall
from toolcollapse.envs.bfcl.checker import Verdict, check_turns
from toolcollapse.envs.bfcl.data import (
    SPLITS,
    Entry,
    bfcl_data_dir,
    check_category,
    load_entries,
    split_entries,
)
from toolcollapse.envs.bfcl.schema import load_class_docs
from toolcollapse.envs.bfcl.tasks import (
    ClassDocs,
    as_literal,
    build_task,
    new_world,
    tools_added_at,
    tools_at_start,
    user_message,
)
from toolcollapse.parser import tool_table
from toolcollapse.records import Message, ParsedTurn, Task, ToolCall
from toolcollapse.sandbox import Sandbox
from toolcollapse.tools import ToolSpec

STOPPED = LiteralCall("", (), {})  # a call stopped at the time limit: in the check, a call that ran nothing


@dataclass
class Progress:
    """An episode's BFCL state, kept in `EpisodeState.extra["bfcl"]`."""

    entry: Entry
    session: int  # the sandbox session holding the live instances the model's calls run on
    turn: int = 0  # the user turn in progress
    replied: int = 1  # user turns the model has written at least one turn in (a user turn shown after the
    # last allowed assistant turn was never replied to)
    calls: list[list[ToolCall]] = field(default_factory=lambda: [[]])  # per user turn reached
    stopped: set[tuple[int, int]] = field(default_factory=set)  # (turn, index) of calls stopped at the limit
    rejected: list[str] = field(default_factory=list)  # error observations of calls that ran nothing
    verdict: Verdict | None = None  # set by `success`


class BFCL:
    name = "bfcl"
    splits = SPLITS

    def __init__(self, cfg: BFCLConfig = BFCLConfig(), tools: ToolsConfig = ToolsConfig()):
        for category in cfg.categories:
            check_category(category)
        self.cfg = cfg
        self.sandbox = Sandbox(tools.timeout_s, tools.memory_mb, tools.isolated, preload=(__name__,))
        self._checker: int | None = None  # a sandbox session for success checks (they build fresh worlds)
        self.data_dir = bfcl_data_dir(cfg.data_dir)
        self._docs: dict[str, list[ToolSpec]] = {}
        self._entries: dict[str, Entry] = {}
        self._categories: dict[str, list[Entry]] = {}
        self._splits: dict[str, list[Task]] = {}

    def tasks(self, split: str, n: int | None = None) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown BFCL split {split!r}; choose one of {', '.join(SPLITS)}")
        if split not in self._splits:
            self._splits[split] = [build_task(e, split, self.docs(e)) for e in self.entries(split)]
        tasks = self._splits[split]
        return tasks if n is None else tasks[:n]

    def entries(self, split: str) -> list[Entry]:
        """The split's entries, the categories interleaved (the first of each in `cfg.categories`
        order, then the second of each, ...), so any prefix -- SFT's examples, the probe set,
        `eval --n` -- covers every category."""
        per_category = [split_entries(self._load(c), self.cfg.split_seed, self.cfg.n_train, self.cfg.n_test)[split]
                        for c in self.cfg.categories]
        return [e for group in itertools.zip_longest(*per_category) for e in group if e is not None]

    def entry(self, task: Task) -> Entry:
        if task.id not in self._entries:
            self._load(task.meta["category"])
        return self._entries[task.id]

    def docs(self, entry: Entry) -> ClassDocs:
        for c in entry.classes:
            if c not in self._docs:
                self._docs[c] = load_class_docs(self.data_dir, c)
        return {c: self._docs[c] for c in entry.classes}

    def tokenizer_corpus(self, n_conversations: int) -> Iterator[str]:
        """Reference conversations of the train split (their system prompts carry every doc)."""
        for task in self.tasks("train")[:n_conversations]:
            yield render_text(list(task.prompt) + list(task.reference))

    def reset(self, task: Task) -> EpisodeState:
        entry = self.entry(task)
        docs = self.docs(entry)
        progress = Progress(entry, self.sandbox.open(functools.partial(new_world, entry, docs)))
        state = EpisodeState(task=task, tools=tool_table(tools_at_start(entry, docs)), extra={"bfcl": progress})
        self.sandbox.track(state, progress.session)  # the instances go when the episode does
        return state

    def step(self, state: EpisodeState, turn: ParsedTurn) -> list[Message]:
        progress: Progress = state.extra["bfcl"]
        progress.replied = progress.turn + 1  # the model wrote a turn in the user turn in progress
        if turn.end == "call":
            state.n_calls += 1
            return [self._run_call(progress, turn)]
        if turn.end == "answer":
            state.final_text = turn.text
            return self._next_user_turn(state)
        state.done = True
        return []

    def success(self, state: EpisodeState) -> bool:
        """BFCL's verdict on the user turns the model replied in (`check_turns`), run in the tool process."""
        progress: Progress = state.extra["bfcl"]
        model_turns = [[STOPPED if (k, i) in progress.stopped else as_literal(c) for i, c in enumerate(turn)]
                       for k, turn in enumerate(progress.calls[:progress.replied])]
        if self._checker is None:
            self._checker = self.sandbox.open(dict, stateless=True)
        n_calls = sum(map(len, model_turns)) + sum(map(len, progress.entry.ground_truth))
        outcome = self.sandbox.call(self._checker, _check, progress.entry, self.docs(progress.entry), model_turns,
                                    timeout_s=self.sandbox.timeout_s * (2 + n_calls))
        progress.verdict = outcome.value if outcome.ok else Verdict(False, "toolcollapse:check_failed", -1,
                                                                    outcome.error)
        return progress.verdict.valid

    def instances(self, state: EpisodeState) -> dict[str, Any]:
        """A copy of the episode's live backend instances (for inspection: changing it changes nothing)."""
        outcome = self.sandbox.call(state.extra["bfcl"].session, _instances, record=False)
        if not outcome.ok:
            raise RuntimeError(f"the episode's instances are unavailable: {outcome.error}")
        return outcome.value

    # ------------------------------------------------------------------ internals

    def _run_call(self, progress: Progress, turn: ParsedTurn) -> Message:
        if turn.call is None:
            return Message("tool", json.dumps({"error": f"could not parse the tool call: {turn.detail}"}))
        calls = progress.calls[progress.turn]
        calls.append(turn.call)
        outcome = self.sandbox.call(progress.session, execute, as_literal(turn.call))
        if not outcome.ok:  # stopped at the time limit, or the tool process died: the call left no trace
            progress.stopped.add((progress.turn, len(calls) - 1))
            return Message("tool", f"{ERROR_PREFIX}{turn.call.name[:80]} did not finish ({outcome.error}); "
                                   "it was stopped and changed nothing")
        result, ran = outcome.value
        if not ran:
            progress.rejected.append(result)
        return Message("tool", result)

    def _next_user_turn(self, state: EpisodeState) -> list[Message]:
        progress: Progress = state.extra["bfcl"]
        entry = progress.entry
        if progress.turn + 1 >= len(entry.ground_truth):
            state.done = True
            return []
        progress.turn += 1
        progress.calls.append([])
        docs = self.docs(entry)
        added = tools_added_at(entry, progress.turn, docs)
        if added:
            state.tools = {**state.tools, **tool_table(added)}
        return [user_message(entry, progress.turn, docs)]

    def _load(self, category: str) -> list[Entry]:
        if category not in self._categories:
            self._categories[category] = load_entries(self.data_dir, category)
            self._entries.update((e.id, e) for e in self._categories[category])
        return self._categories[category]


def _check(_: Any, entry: Entry, docs: ClassDocs, model_turns: Sequence[Sequence[LiteralCall]]) -> Verdict:
    return check_turns(new_world(entry, docs), new_world(entry, docs), model_turns, entry.ground_truth)


def _instances(world: World) -> dict[str, Any]:
    return world.instances
