"""Experiment configuration: frozen dataclasses nested by stage, loaded from YAML.

One object is the single source of truth: the trainer, the run directory name and
the logged `config.yaml` all read the same `RunConfig`. Loading validates everything
before any work starts: an unknown key, a wrong type or a missing file raises
`ConfigError` naming the dotted key or the path.

Overrides use dotted keys, `--set sft.lr=3e-4`; the value is parsed as YAML, so
`--set eval.n_tasks=null` and `--set world.seed=3` work. A run config may start from
another with `base: configs/tiny.yaml` (a path from the working directory, like every
path in these files): its keys are merged into the base's, section by section.

Every number is range-checked where it is declared: a field typed `Count` must be
at least 1, `Positive` above 0, `Fraction` in [0, 1], and so on (`Range`); no float
may be NaN or infinite. Checks that involve two keys sit next to them; those of one
stage or a checkpoint (`rl_problems`, `pool_problems`) are in checks.py.

The package: schema.py (the sections), files.py (YAML in and out, overrides,
differences), checks.py; everything is imported from here.
"""

from toolcollapse.config.checks import (checkpoint_problems, pool_problems, rl_problems, rl_start_problems,
                                        sft_tasks_read)
from toolcollapse.config.files import (RESULT_NEUTRAL, apply_override, deep_merge, differences, dump_config,
                                       first_difference, from_dict, load_config, migrate_legacy_keys, read_yaml,
                                       to_dict)
from toolcollapse.config.schema import (Split, SPLITS, ConfigError, Range, Count, NonNegInt, Positive, NonNegative,
                                        Fraction, Beta, Checked, WorldConfig, TokenizerConfig, BFCLConfig,
                                        ToolsConfig, LoraConfig, ModelConfig, WarmupPhase, SFTConfig, RolloutConfig,
                                        GRPOConfig, OPSConfig, ChatModelConfig, HBGConfig, PhaseConfig, ETSConfig,
                                        PRSConfig, AdaptiveConfig, SFTOnlyConfig, SupervisionConfig, MonitorConfig,
                                        EvalConfig, RunConfig)

__all__ = ["Split", "SPLITS", "ConfigError", "Range", "Count", "NonNegInt", "Positive", "NonNegative", "Fraction",
           "Beta", "Checked", "WorldConfig", "TokenizerConfig", "BFCLConfig", "ToolsConfig", "LoraConfig",
           "ModelConfig", "WarmupPhase", "SFTConfig", "RolloutConfig", "GRPOConfig", "OPSConfig", "ChatModelConfig",
           "HBGConfig", "PhaseConfig", "ETSConfig", "PRSConfig", "AdaptiveConfig", "SFTOnlyConfig",
           "SupervisionConfig", "MonitorConfig", "EvalConfig", "RunConfig", "RESULT_NEUTRAL", "apply_override",
           "checkpoint_problems", "deep_merge", "differences", "dump_config", "first_difference", "from_dict",
           "load_config", "migrate_legacy_keys", "pool_problems", "read_yaml", "rl_problems", "rl_start_problems", "sft_tasks_read",
           "to_dict"]
