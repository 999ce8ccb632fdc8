"""toolcollapse's monitor inside TRL's GRPOTrainer (`pip install 'toolcollapse[trl]'`; TRL 1.16).

Users who train on many GPUs with TRL on `accelerate` (DDP, DeepSpeed ZeRO, FSDP) keep their trainer;
toolcollapse brings its monitor:

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
  log are kept, gathered across ranks at the log, and reduced once over the whole batch.

    trainer = MonitoredGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                   processing_class=tokenizer,
                                   monitor=ControlTokenCallback.for_tool_world(run_config, tokenizer))
    trainer.train()    # logs ctrl/* and probe/*; alarms in <output_dir>/alarms.jsonl

- It also sorts every sampled turn into the four states with toolcollapse's parser (`state/*`,
  `error/*`, `healthy_rate`, summed over ranks), so a collapse shows in the same series as in `rl`.

The series keep the names `rl` gives them, and the output directory holds `monitor.jsonl` (the series,
each row with its step) and `monitor.yaml` (the monitor's config): `toolcollapse diagnose OUTPUT_DIR`
reads a monitored TRL run as it reads one of ours.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from toolcollapse.alarms import Alarm, Watcher, run_rules
from toolcollapse.config import MonitorConfig, RunConfig
from toolcollapse.monitor import ProbeSet, resolve_token_ids, run_probe, sampled_control_stats

try:
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("toolcollapse.integrations.trl needs TRL: pip install 'toolcollapse[trl]'") from err

ALARMS = "alarms.jsonl"  # in the trainer's output_dir: one line per alarm, with the action taken
MONITOR = "monitor.jsonl"  # ... one line per probe and per log: the series with their step, 0-based as in rl's
                           # metrics.jsonl (a probe before that step's update, the rollouts sampled in it)
MONITOR_CONFIG = "monitor.yaml"  # ... the MonitorConfig the rules came from (what `diagnose` replays)


def _append(out_dir: str, name: str, row: Mapping[str, Any]) -> None:
    """One JSON line in <out_dir>/<name>, written by the main process only."""
    from accelerate import PartialState

    if PartialState().is_main_process:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / name, "a") as f:
            f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- distributed helpers


def _gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's [n_i, k] rows, concatenated in rank order on every rank (n_i may differ, and be 0)."""
    from accelerate import PartialState
    from accelerate.utils import gather, pad_across_processes

    if PartialState().num_processes == 1:
        return rows
    device = PartialState().device
    counts = gather(torch.tensor([rows.shape[0]], device=device)).tolist()
    padded = gather(pad_across_processes(rows.to(device), dim=0))  # [world * max_n, k]
    width = max(counts)
    return torch.cat([padded[i * width:i * width + n] for i, n in enumerate(counts)]).cpu()


def _from_rank_zero(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if PartialState().num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


# ----------------------------------------------------------------------------- the training forward's statistics


class SampledTokens:
    """The sampled completion tokens of the micro-batches since the last log: the token, its log-prob and
    entropy under the current policy, and its log-prob under the sampling policy; reduced over every rank
    at once (`reduce`), so a maximum is the batch's maximum, not a mean of per-micro-batch maxima."""

    def __init__(self, token_ids: Mapping[str, int]):
        self.token_ids = dict(token_ids)
        self.parts: list[torch.Tensor] = []

    def add(self, targets: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, entropy: torch.Tensor,
            mask: torch.Tensor) -> None:
        """[B, T] tensors of one micro-batch; `mask` the tokens that count (the completion's, tools' excluded)."""
        keep = mask.bool()
        self.parts.append(torch.stack([targets[keep].double(), logp.detach()[keep].double(),
                                       old_logp.detach()[keep].double(), entropy.detach()[keep].double()],
                                      dim=1).cpu())

    def reduce(self) -> dict[str, float]:
        """`ctrl/*` over every rank's tokens since the last call (a collective: call it on every rank)."""
        rows = torch.cat(self.parts) if self.parts else torch.zeros(0, 4, dtype=torch.float64)
        self.parts = []
        rows = _gather_rows(rows)
        if not len(rows):
            return {}
        targets, logp, old, entropy = rows.unbind(dim=1)
        return sampled_control_stats(targets.long(), logp, old, entropy, self.token_ids)


class TurnStates:
    """Four-state and error counts of the sampled turns since the last log, summed over ranks at `reduce`:
    the rates `rl.rollout_stats` logs (`state/*`, `error/*`, `healthy_rate`, `turns_per_episode`)."""

    def __init__(self, tokenizer: Any, tools: Mapping[str, Any] | None = None):
        from toolcollapse.autopsy import control_tag_ids

        self.tokenizer, self.tools = tokenizer, tools
        self.id_to_tag, self.text_tags = control_tag_ids(tokenizer)
        self.counts = torch.zeros(len(self._keys()), dtype=torch.float64)

    @staticmethod
    def _keys() -> list[str]:
        from toolcollapse.records import ErrorType, TurnState

        return (["n_rollouts", "n_turns"] + [f"state/{s.value}" for s in TurnState]
                + [f"error/{e.value}" for e in ErrorType])

    def add(self, completion_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """[B, T] completions of one generation batch (`mask`: their tokens; a multi-turn completion's tool
        responses are split off by the chat format's turn boundaries)."""
        from toolcollapse.autopsy import split_turns
        from toolcollapse.chat import valid_text
        from toolcollapse.parser import parse_turn, parse_turn_ids

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        keys = {k: i for i, k in enumerate(self._keys())}
        for ids, m in zip(completion_ids.tolist(), mask.tolist()):
            turns = [valid_text(t) for t in split_turns(decode([i for i, k in zip(ids, m) if k]))]
            self.counts[keys["n_rollouts"]] += 1
            for turn in turns:
                # every control tag one token: the live parse, on ids; otherwise the tags can only match as text
                parsed = (parse_turn(turn, self.tools) if self.text_tags else
                          parse_turn_ids(self.tokenizer(turn, add_special_tokens=False)["input_ids"], self.id_to_tag,
                                         decode, self.tools))
                self.counts[keys["n_turns"]] += 1
                self.counts[keys[f"state/{parsed.state.value}"]] += 1
                for e in parsed.errors:
                    self.counts[keys[f"error/{e.value}"]] += 1

    def reduce(self) -> dict[str, float]:
        """The rates over every rank's turns since the last call (a collective: call it on every rank)."""
        from toolcollapse.records import TurnState

        counts = _gather_rows(self.counts[None]).sum(dim=0)
        self.counts = torch.zeros_like(self.counts)
        total = dict(zip(self._keys(), counts.tolist()))
        if not total["n_turns"]:
            return {}
        out = {k: v / total["n_turns"] for k, v in total.items() if k.startswith(("state/", "error/"))}
        out["healthy_rate"] = sum(out[f"state/{s.value}"] for s in TurnState if s.healthy)
        out["turns_per_episode"] = total["n_turns"] / total["n_rollouts"]
        return out


# ----------------------------------------------------------------------------- the probe and the alarms


class ControlTokenCallback(TrainerCallback):
    """The probe every `monitor.probe_every` steps, before the update; its `probe/*` series in the logs;
    the alarm rules over them (and over `ctrl/*`, when the trainer is a `MonitoredGRPOTrainer`); on an
    alarm, `monitor.on_alarm` on every rank: log (always: printed and in <output_dir>/alarms.jsonl),
    checkpoint (`control.should_save`), stop (`should_save` and `should_training_stop`)."""

    def __init__(self, probe: ProbeSet | None, token_ids: Mapping[str, int], monitor: MonitorConfig | None = None,
                 temperature: float = 1.0):
        self.probe, self.token_ids = probe, dict(token_ids)
        self.monitor = monitor or MonitorConfig()
        self.temperature = temperature
        self.watcher = Watcher(run_rules(self.monitor))
        self.pending: dict[str, float] = {}  # probe series not yet in a log
        self.alarms: list[Alarm] = []
        self.trainer: Any = None

    @classmethod
    def for_tool_world(cls, cfg: RunConfig, tokenizer: Any) -> ControlTokenCallback:
        """The probe `rl` builds for this run config: `monitor.probe_size` oracle conversations of its
        training split, with their content labels, at `rollout.temperature`."""
        from toolcollapse.envs import make_env
        from toolcollapse.rl import probe_for

        probe, token_ids = probe_for(cfg, make_env(cfg), tokenizer)
        return cls(probe, token_ids, cfg.monitor, cfg.rollout.temperature)

    def attach(self, trainer: Any) -> ControlTokenCallback:
        """Register with `trainer`, first among its callbacks, so the series reach the trainer's own
        log history and every reporter (TensorBoard, W&B) on the same log line."""
        self.trainer = trainer
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        from accelerate import PartialState

        from toolcollapse.config import dump_config

        if PartialState().is_main_process:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            dump_config(self.monitor, Path(args.output_dir) / MONITOR_CONFIG)
        return control

    # -- probe -----------------------------------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        every = self.monitor.probe_every
        if self.probe is None or every <= 0 or state.global_step % every:
            return control
        stats = _from_rank_zero(self._run_probe(model))
        self.pending.update(stats)
        return self.observe(state.global_step, stats, args, control)

    def _run_probe(self, model: Any) -> dict[str, float]:
        if self.trainer is None:
            return run_probe(model, self.probe, self.token_ids, self.temperature)
        from trl.models.utils import unwrap_model_for_generation

        # every rank enters (ZeRO-3 gathers the shards collectively), each computes; rank 0's values count
        with unwrap_model_for_generation(self.trainer.model_wrapped, self.trainer.accelerator) as unwrapped:
            return run_probe(unwrapped, self.probe, self.token_ids, self.temperature)

    # -- alarms ----------------------------------------------------------------------------------------

    def observe(self, step: int, metrics: Mapping[str, Any], args: Any, control: Any) -> Any:
        """Feed the rules; act on what they raise. The same on every rank: `metrics` are identical there."""
        _append(args.output_dir, MONITOR, {"step": step, **metrics})
        alarms = self.watcher.update(step, metrics)
        if not alarms:
            return control
        self.alarms.extend(alarms)
        for a in alarms:
            print(f"toolcollapse: {a.describe()}", flush=True)
            _append(args.output_dir, ALARMS, {"step": a.step, "series": a.rule.series, "detector": a.rule.detector,
                                              "value": a.value, "action": self.monitor.on_alarm})
        if self.monitor.on_alarm in ("checkpoint", "stop"):
            control.should_save = True
        if self.monitor.on_alarm == "stop":
            control.should_training_stop = True
        return control

    # -- logs ------------------------------------------------------------------------------------------

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if logs is not None and self.pending and not any(k.startswith("eval_") for k in logs):
            logs.update(self.pending)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self.pending)  # the trainer appended its copy before the callbacks
            self.pending = {}
        return control


# ----------------------------------------------------------------------------- the trainer


class MonitoredGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with the training forward's `ctrl/*` statistics, reduced over the whole batch on every
    rank, and a `ControlTokenCallback` (`monitor`) whose rules also watch them."""

    def __init__(self, *args: Any, monitor: ControlTokenCallback | None = None,
                 control_tokens: tuple[str, ...] | None = None, tools: Mapping[str, Any] | None = None, **kwargs: Any):
        """`tools`: name -> ToolSpec of the tools the policy may call (None: unknown tools and bad arguments
        are not checked, only the format)."""
        super().__init__(*args, **kwargs)
        names = control_tokens or (monitor.monitor if monitor else MonitorConfig()).control_tokens
        self.sampled = SampledTokens(resolve_token_ids(self.processing_class, names))
        self.turns = TurnStates(self.processing_class, tools)
        self.monitor = monitor.attach(self) if monitor else None
        self._captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self._capture = False

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._capture:
            self._captured = (out[0], out[1])
        return out

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.turns.add(out["completion_ids"], out["completion_mask"])
        return out

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        self._capture = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._capture = False
        logp, entropy = self._captured
        self._captured = None
        if self.model.training:
            mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
            # the sampling policy's log-prob: vLLM's when TRL has it, else the old policy's, else (one update
            # per generation, on-policy) the current one's, as TRL's own loss takes it
            old = inputs.get("sampling_per_token_logps")
            old = inputs.get("old_per_token_logps") if old is None else old
            self.sampled.add(inputs["completion_ids"], logp, logp if old is None else old, entropy, mask)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and not any(k.startswith("eval_") for k in logs):
            stats = {**self.turns.reduce(), **self.sampled.reduce()}  # every rank calls log(): collectives are safe
            logs.update(stats)
            if self.monitor is not None and stats:
                # the step the rollouts were sampled at, 0-based as in rl's metrics.jsonl (TRL's global_step
                # counts the steps done); with logging_steps > 1, the last of the steps they span
                self.control = self.monitor.observe(self.state.global_step - 1, stats, self.args, self.control)
        super().log(logs, start_time)
