"""Environments: the synthetic tool world (default) and, later, BFCL multi-turn."""

from __future__ import annotations

from toolcollapse.config import WorldConfig
from toolcollapse.envs.base import Environment, EpisodeState


def make_env(name: str, world: WorldConfig) -> Environment:
    if name == "toolworld":
        from toolcollapse.envs.toolworld import ToolWorld

        return ToolWorld(world)
    raise ValueError(f"unknown environment {name!r}")


__all__ = ["Environment", "EpisodeState", "make_env"]
