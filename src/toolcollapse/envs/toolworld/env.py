"""The tool world as an `Environment`: tasks by split, tool execution, answer check.

Two sets of facts: the real world, and for `ood_facts` the counterfactual one (the same
entities, every fact drawn again); a task's `meta["facts"]` says which its tools answer from.

Calls run in the tool process (`toolcollapse.sandbox`), each within `tools.timeout_s`:
a call past it is answered with an error observation, and nothing a model writes can
hang or crash the episode.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Iterator, Sequence

from toolcollapse.chat import render_text
from toolcollapse.config import SPLITS, ConfigError, ToolsConfig, WorldConfig
from toolcollapse.envs.base import EpisodeState
from toolcollapse.envs.toolworld.functions import WorldTools
from toolcollapse.envs.toolworld.kb import counterfactual, generate_kb
from toolcollapse.envs.toolworld.prompts import STYLES, system_prompt
from toolcollapse.envs.toolworld.tasks import RECIPES, make_tasks
from toolcollapse.records import Message, ParsedTurn, Task, ToolCall
from toolcollapse.sandbox import Sandbox

_ANSWER = re.compile(r"answer is\s*(.*?)\s*\.?\s*$", re.I | re.S)


def carve(train: Sequence[Task], sft_pool: int, n_val: int) -> dict[str, list[Task]]:
    """`val` and `rl` out of the train tasks past the SFT's first `sft_pool`, which it never reads: `val` the
    first `n_val` of them with distinct programs, `rl` every later one whose program is not val's (a task keeps
    its train id). The train split repeats programs at its natural rate (23 % of the tasks past a pool of
    10,000 have a program also in the pool); excluding those too would leave val and rl the rare programs, a
    harder mix than test's (val 3.0 % against test 9.8 % greedy, docs/LOG.md 2026-12-06 (8)). Raises
    ConfigError when the train split is too short to give both."""
    seen: set = set()
    val: list[Task] = []
    rest = list(train[sft_pool:])
    for i, task in enumerate(rest):
        if len(val) == n_val:
            rest = rest[i:]
            break
        if task.meta["key"] not in seen:
            val.append(task)
            seen.add(task.meta["key"])
    else:
        rest = []
    rl = [t for t in rest if t.meta["key"] not in seen]
    if len(val) < n_val or not rl:
        raise ConfigError(f"world: {len(train)} train tasks leave {len(val)} val (of world.n_val={n_val}) and "
                          f"{len(rl)} rl tasks past the SFT pool (world.sft_pool={sft_pool}); raise world.n_train "
                          "or lower world.sft_pool / world.n_val")
    return {"val": val, "rl": rl}


class ToolWorld:
    name = "toolworld"
    splits = SPLITS
    carved = ("val", "rl")  # splits of train tasks (their ids are train's): `carve`

    def __init__(self, cfg: WorldConfig = WorldConfig(), tools: ToolsConfig = ToolsConfig()):
        self.cfg = cfg
        self.kb = generate_kb(cfg.seed, cfg.pool_scale)
        self.kbs = {"real": self.kb, "counterfactual": counterfactual(self.kb, cfg.seed)}
        self.functions = WorldTools(self.kb, distractors=cfg.distractor_tools)  # the oracle's, in this process
        self.tool_table = dict(self.functions.by_name)
        self.sandbox = Sandbox(tools.timeout_s, tools.memory_mb, tools.isolated, preload=(__name__,))
        self._sessions: dict[str, int] = {}  # facts -> the tool process's copy of the functions (no state)
        self._splits: dict[str, list[Task]] = {}

    def tasks(self, split: str, n: int | None = None) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        if split in ("val", "rl") and split not in self._splits:
            self._splits.update(carve(self.tasks("train"), self.cfg.sft_pool, self.cfg.n_val))
        if split not in self._splits:
            sizes = {"train": self.cfg.n_train, "test": self.cfg.n_test}  # every OOD split: n_ood
            held_out = frozenset()
            if split == "train":  # no program of an in-distribution eval split is trained on
                held_out = frozenset(t.meta["key"] for s in ("test", "ood_format") for t in self.tasks(s))
            facts = RECIPES[split].facts
            if facts != "real":  # the trained programs, asked in another world, are not what it tests
                held_out = frozenset(t.meta["key"] for t in self.tasks("train"))
            kb = self.kbs[facts]
            functions = self.functions if facts == "real" else WorldTools(kb, distractors=self.cfg.distractor_tools)
            self._splits[split] = make_tasks(split, sizes.get(split, self.cfg.n_ood), self.cfg.seed, kb, functions,
                                             held_out, self.cfg.quote_entities)
        tasks = self._splits[split]
        return tasks if n is None else tasks[:n]

    def tokenizer_corpus(self, n_conversations: int) -> Iterator[str]:
        """Text a tokenizer for this world is trained on: oracle conversations of the
        train split, plus the tool docs in every prompt style (a tokenizer is trained on
        broad text; the model itself only ever trains on the `qwen` style)."""
        for task in self.tasks("train")[:n_conversations]:
            yield render_text(list(task.prompt) + list(task.reference))
        for style in STYLES:
            yield system_prompt(self.functions.tools, style)

    def reset(self, task: Task) -> EpisodeState:
        return EpisodeState(task=task, tools=self.tool_table)

    def step(self, state: EpisodeState, turn: ParsedTurn) -> list[Message]:
        if turn.end == "call":
            state.n_calls += 1
            if turn.call is None:
                return [Message("tool", json.dumps({"error": f"could not parse the tool call: {turn.detail}"}))]
            return [Message("tool", self.run_call(turn.call, state.task.meta.get("facts", "real")))]
        if turn.end == "answer":
            state.final_text = turn.text
        state.done = True
        return []

    def success(self, state: EpisodeState) -> bool:
        return state.final_text is not None and answer_matches(state.final_text, state.task.answer)

    def run_call(self, call: ToolCall, facts: str = "real") -> str:
        """The observation of one call in the world `facts`, run in the tool process within the
        time limit."""
        if facts not in self._sessions:
            self._sessions[facts] = self.sandbox.open(
                functools.partial(WorldTools, self.kbs[facts], self.cfg.distractor_tools), stateless=True)
        outcome = self.sandbox.call(self._sessions[facts], _observation, call)
        if outcome.ok:
            return outcome.value
        return json.dumps({"error": f"{call.name} did not finish: {outcome.error}"}, ensure_ascii=False)


def _observation(tools: WorldTools, call: ToolCall) -> str:
    return tools.execute(call)[1]


def answer_matches(text: str, expected: str) -> bool:
    """The text after "answer is" equals the expected value (numbers compared as numbers)."""
    m = _ANSWER.search(text)
    got = (m.group(1) if m else text).strip().strip("\"'`")
    if got == expected:
        return True
    try:
        a, b = float(got), float(expected)
    except ValueError:
        return got.casefold() == expected.casefold()
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))
