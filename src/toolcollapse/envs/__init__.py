"""Environments: the synthetic tool world (default) and BFCL v4 multi-turn (`bfcl-eval`).

BFCL's modules are imported where it is chosen: they need the optional `bfcl-eval` package."""

from __future__ import annotations

from toolcollapse.config import ConfigError, RunConfig
from toolcollapse.envs.base import Environment, EpisodeState


def make_env(cfg: RunConfig) -> Environment:
    """The environment `cfg.env` names, built from its config section."""
    if cfg.env == "toolworld":
        from toolcollapse.envs.toolworld import ToolWorld

        return ToolWorld(cfg.world, cfg.tools)
    if cfg.env == "bfcl":
        from toolcollapse.envs.bfcl import BFCL

        return BFCL(cfg.bfcl, cfg.tools)
    raise ValueError(f"unknown environment {cfg.env!r}")


def check_env(cfg: RunConfig) -> None:
    """A missing package or an unsupported BFCL category, as a ConfigError before any work."""
    if cfg.env != "bfcl":
        return
    from toolcollapse.envs.bfcl.data import SPLITS, bfcl_data_dir, check_category

    for key, split in (("eval.split", cfg.eval.split), ("grpo.split", cfg.grpo.split)):
        if split not in SPLITS:
            raise ConfigError(f"{key}: BFCL has no {split!r} split; choose one of {', '.join(SPLITS)}")

    try:
        data = bfcl_data_dir(cfg.bfcl.data_dir)
        for category in cfg.bfcl.categories:
            check_category(category)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"bfcl: {err}") from None
    if not data.is_dir():
        raise ConfigError(f"bfcl.data_dir: not a directory: {data}")


__all__ = ["Environment", "EpisodeState", "check_env", "make_env"]
