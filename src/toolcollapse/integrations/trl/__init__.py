"""toolcollapse inside TRL's GRPOTrainer (`pip install 'toolcollapse[trl]'`; TRL 1.16).

Users who train on many GPUs with TRL on `accelerate` (DDP, DeepSpeed ZeRO, FSDP) keep their trainer;
toolcollapse brings its monitor, its diagnosis and its supervision signals:

- `ControlTokenCallback` teacher-forces the probe set (oracle conversations, `monitor.build_probe`)
  every `monitor.probe_every` steps before the update, as `rl` does, logs its `probe/*` series, feeds
  them to the same alarm rules (`alarms.run_rules`) and acts on an alarm (`monitor.on_alarm`: log,
  checkpoint, stop) on every rank alike: rank 0's probe values are broadcast, so every rank sees the same
  numbers and takes the same decision. Under ZeRO-3 the probe runs inside TRL's
  `unwrap_model_for_generation`, which gathers the sharded weights, as TRL's own generation does.
- `MonitoredGRPOTrainer` adds the training forward's control-token statistics (`ctrl/*`, as
  `monitor.sampled_control_stats`) from TRL's own per-token log-probs and entropies -- no second forward.
  TRL's `log()` averages each metric's list over the micro-batches and steps since the last log, which
  would turn a maximum into a mean of maxima; here the sampled tokens of every micro-batch since the last
  log are kept, gathered across ranks at the log, and reduced once over the whole batch. It also sorts
  every sampled turn into the four states with our parser (`state/*`, `error/*`, `healthy_rate`, counts
  summed over ranks), so a collapse shows in the same series as in `rl`.
- Supervision, in the same trainer (the dataset's `reference` column: each prompt's ground-truth
  completion, as text in the chat format the policy writes):
  - the synchronous SFT term, `sft_coef` * token-mean NLL of the reference of each prompt of the batch,
    once per prompt, and unlikelihood, `unlikelihood_coef` * -log(1 - p) at the first control token the
    grammar rejects in each sampled turn (`parser.first_rejected_control`), from TRL's own log-probs; both
    in `compute_loss`, scaled for gradient accumulation as TRL's own auxiliary loss; `sup/*` logs them,
    SFT tokens included, so a gain can be told apart from more SFT; both are our trainer's own terms
    (`signals.SFTTermLoss`, its `rows_loss`; `signals.Unlikelihood`, a mean over the optimizer step's
    rejected tokens), `SFTTermSignal(cfg)` and `UnlikelihoodSignal(cfg)` in `signals=[...]` set their
    weights, and any signal's term runs as ours (docs/DESIGN.md, "In TRL");
  - OPS: the last `ops` rows of each group of G are the reference instead of a sample (TRL's groups are
    contiguous blocks of G; `_generate` is where they are filled), rewarded by the same reward functions,
    the advantages over the mixed group; `ops_shaping="none"` trains them with TRL's clipped surrogate
    (the released scripts), `"luffy"` with -A * p / (p + gamma) instead (LUFFY's shaping, the paper's text:
    our `signals.LuffyShaping` term, its `expert_loss`);
  - HBG: the `hbg` rows before them sample from the dataset's `hinted_prompt` column (e.g.
    `supervision.hint` in a system message) and train on the plain prompt: their prompt ids are the plain
    ones, so TRL's old log-probs, where it computes them, are the hint-free ones (first ratio 1);
  - or the signal objects `toolcollapse rl` runs: `signals=[OPS(cfg), HBG(cfg)]` lay out the groups from their
    `rows()` (`signals.row_kinds`, as ours) and shape the expert rows with OPS's own term;
  - expert and hinted rows stay out of `ctrl/*`, the four states and the failures ETS collects;
    with TRL's generation OPS and HBG take text prompts (multi-turn, any prompt: `engine_rollouts`).
- `train_interleaved`: ETS and PRS with TRL's own trainers, GRPO rounds and `SFTTrainer` phases on the
  same model; with `rl_phase_data` the phases train on the examples `toolcollapse rl` builds, token for
  token: each failed task's ground truth, and PRS's from the judge's verdict on the failed rollout
  (TRL's tool loop's or `engine_rollouts`'; `rollout_episode` rebuilds it as our Episode).
- `engine_rollouts` (with `task_dataset`, `episode_success`): our rollout engine as TRL's `rollout_func`, on
  any of our environments -- BFCL multi-turn included, whose later user turns TRL's tool loop cannot play
  -- with OPS's expert rows replayed (the ground truth, its tool calls really run), as `rl` builds them.
- `tool_world_environment`, `tool_world_dataset`, `tool_world_reward`: the tool world for TRL's own
  multi-turn tool loop (`environment_factory`): one method per tool, its signature and docstring from the
  tool's JSON schema, each call run by the world's sandboxed tools. A model trained by toolcollapse runs
  there in its own chat format (`speak_toolcollapse_chat`, done by `MonitoredGRPOTrainer`; the dataset's
  `system_prompt=True`): for well-formed turns TRL's tool loop shows it exactly the tokens our rollouts
  show it (greedy, the same episodes; bench/grpo_multiturn_vs_trl.py); malformed ones it handles its own
  way (a call it cannot parse ends the rollout).

    trainer = MonitoredGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                   processing_class=tokenizer,
                                   monitor=ControlTokenCallback.for_tool_world(run_config, tokenizer))
    trainer.train()    # logs ctrl/*, probe/*, state/*; alarms in <output_dir>/alarms.jsonl

The series keep the names `rl` gives them, and the output directory holds `monitor.jsonl` (the series,
each row with its step) and `monitor.yaml` (the monitor's config): `toolcollapse diagnose OUTPUT_DIR`
reads a monitored TRL run as it reads one of ours.
"""

from __future__ import annotations

try:
    import trl  # noqa: F401
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("toolcollapse.integrations.trl needs TRL: pip install 'toolcollapse[trl]'") from err

from toolcollapse.integrations.trl._common import ALARMS, MONITOR, MONITOR_CONFIG
from toolcollapse.integrations.trl.callback import ControlTokenCallback
from toolcollapse.integrations.trl.environment import (speak_toolcollapse_chat, task_dataset, task_rows, tool_world_dataset, tool_world_environment, tool_world_reward)
from toolcollapse.integrations.trl.interleaved import (reference_rows, reference_token_rows, rl_phase_data, rollout_episode, train_interleaved)
from toolcollapse.integrations.trl.rollout import engine_rollouts, episode_success
from toolcollapse.integrations.trl.stats import Supervision, TurnStates, rejected_controls
from toolcollapse.monitor import SampledTokens
from toolcollapse.integrations.trl.trainer import MonitoredGRPOTrainer

__all__ = ["ALARMS", "MONITOR", "MONITOR_CONFIG", "ControlTokenCallback", "MonitoredGRPOTrainer", "SampledTokens",
           "Supervision", "TurnStates", "engine_rollouts", "episode_success", "reference_rows", "reference_token_rows",
           "rejected_controls", "rl_phase_data", "rollout_episode", "speak_toolcollapse_chat", "task_dataset",
           "task_rows", "tool_world_dataset", "tool_world_environment", "tool_world_reward", "train_interleaved"]
