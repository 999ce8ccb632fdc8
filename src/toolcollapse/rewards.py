"""Rewards: 1 if the task is solved, else 0, as in the paper (BFCL's state check there).

Two optional shaping terms, both off by default (the paper's reward is binary; shaping is a lever the study
measures, not part of the baseline):
- `format_reward` adds that weight times the share of healthy turns;
- `partial_credit` gives a failed episode that weight times the share of the task's ground-truth calls it
  made, in order from the first (the same tool and arguments): credit for the steps of a chain it got right
  before the one it got wrong. A solved task still scores 1, so the credit never outranks a success.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from toolcollapse.records import Episode, Task


def episode_reward(episode: Episode, format_reward: float = 0.0, partial_credit: float = 0.0,
                   task: Task | None = None) -> float:
    reward = 1.0 if episode.success else 0.0
    if partial_credit and task is not None and not episode.success:
        reward = partial_credit * calls_in_order(episode, task)
    if format_reward and episode.turns:
        reward += format_reward * sum(t.parsed.state.healthy for t in episode.turns) / len(episode.turns)
    return reward


def calls_in_order(episode: Episode, task: Task) -> float:
    """The share of the task's ground-truth calls the episode made, counted from its first turn until a turn that
    is not the next ground-truth call (another call, a malformed turn, an answer)."""
    reference = [m.tool_call for m in task.reference if m.role == "assistant" and m.tool_call is not None]
    right = 0
    for want, turn in zip(reference, episode.turns):
        got = turn.parsed.call
        if not turn.parsed.state.healthy or got is None or (want.name, want.arguments) != (got.name, got.arguments):
            break
        right += 1
    return right / len(reference) if reference else 0.0


def rewards_tensor(episodes: Sequence[Episode], format_reward: float = 0.0, partial_credit: float = 0.0,
                   tasks: Mapping[str, Task] | None = None) -> torch.Tensor:
    return torch.tensor([episode_reward(ep, format_reward, partial_credit, (tasks or {}).get(ep.task_id))
                         for ep in episodes], dtype=torch.float32)
