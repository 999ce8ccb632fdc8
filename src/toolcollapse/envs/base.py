"""What the rollout engine needs from an environment.

An environment hands out tasks, starts an episode from one, answers each parsed
assistant turn with observation messages (a tool result, or the next user turn),
and finally says whether the episode succeeded. It never raises on model output:
a malformed call gets an error observation, like any failing tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from toolcollapse.records import Message, ParsedTurn, Task
from toolcollapse.tools import ToolSpec


@dataclass
class EpisodeState:
    task: Task
    tools: Mapping[str, ToolSpec]  # what the parser validates calls against
    final_text: str | None = None
    n_calls: int = 0
    done: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # environment-specific state


class Environment(Protocol):
    name: str
    splits: tuple[str, ...]

    def tasks(self, split: str, n: int | None = None) -> list[Task]: ...

    def reset(self, task: Task) -> EpisodeState: ...

    def step(self, state: EpisodeState, turn: ParsedTurn) -> list[Message]:
        """Observation messages to append; an empty list ends the episode."""
        ...

    def success(self, state: EpisodeState) -> bool: ...
