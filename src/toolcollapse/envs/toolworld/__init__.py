"""The synthetic multi-step tool world, the default environment."""

from toolcollapse.envs.toolworld.env import ToolWorld, answer_matches

__all__ = ["ToolWorld", "answer_matches"]
