"""Rewards: 1 if the task is solved, else 0, as in the paper (BFCL's state check there).

An optional format-shaping term adds `format_reward` times the share of healthy
turns; it is off by default, because shaping the format is one of the remedies the
study compares, not part of the baseline.
"""

from __future__ import annotations

from typing import Sequence

import torch

from toolcollapse.records import Episode


def episode_reward(episode: Episode, format_reward: float = 0.0) -> float:
    reward = 1.0 if episode.success else 0.0
    if format_reward and episode.turns:
        reward += format_reward * sum(t.parsed.state.healthy for t in episode.turns) / len(episode.turns)
    return reward


def rewards_tensor(episodes: Sequence[Episode], format_reward: float = 0.0) -> torch.Tensor:
    return torch.tensor([episode_reward(ep, format_reward) for ep in episodes], dtype=torch.float32)
