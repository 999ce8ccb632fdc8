"""`ControlTokenCallback`: the probe and the alarms inside a TRL trainer."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accelerate import PartialState
from transformers import TrainerCallback

from toolcollapse.alarms import Alarm
from toolcollapse.config import MonitorConfig, RunConfig, dump_config
from toolcollapse.conversations import conversation_probe, read_conversations
from toolcollapse.envs import make_env
from toolcollapse.integrations.trl._common import (ALARMS, MONITOR, MONITOR_CONFIG, _append, _from_rank_zero, _generation_model)
from toolcollapse.monitor import Monitor, ProbeSet, resolve_token_ids


class ControlTokenCallback(TrainerCallback):
    """The probe every `monitor.probe_every` steps, before the update; its `probe/*` series in the logs;
    the alarm rules over them (and over `ctrl/*`, when the trainer is a `MonitoredGRPOTrainer`); on an
    alarm, `monitor.on_alarm` on every rank: log (always: printed and in <output_dir>/alarms.jsonl),
    checkpoint (`control.should_save`), stop (`should_save` and `should_training_stop`)."""

    def __init__(self, probe: ProbeSet | None, token_ids: Mapping[str, int], monitor: MonitorConfig | None = None,
                 temperature: float = 1.0):
        self.monitor = monitor or MonitorConfig()
        self.watch = Monitor(self.monitor, probe, token_ids, temperature)  # the probe and the rules rl runs
        self.pending: dict[str, float] = {}  # probe series not yet in a log
        self.trainer: Any = None
        self.step_offset = 0  # steps of earlier trainers on this policy (`train_interleaved`'s rounds)

    @classmethod
    def for_tool_world(cls, cfg: RunConfig, tokenizer: Any) -> ControlTokenCallback:
        """The probe `rl` builds for this run config: `monitor.probe_size` oracle conversations of its
        training split, with their content labels, at `rollout.temperature`."""
        watch = Monitor.for_run(cfg, make_env(cfg), tokenizer)
        return cls(watch.probe, watch.token_ids, cfg.monitor, watch.temperature)

    @classmethod
    def from_conversations(cls, path: str | Path, cfg: RunConfig, tokenizer: Any) -> ControlTokenCallback:
        """The probe built from one's own data: the first `monitor.probe_size` conversations of a JSON-lines
        file (`toolcollapse.conversations`; `toolcollapse probe FILE` shows what it watches)."""
        probe = conversation_probe(read_conversations(path), tokenizer, cfg.monitor, cfg.rollout.call_end)
        return cls(probe, resolve_token_ids(tokenizer, cfg.monitor.control_tokens), cfg.monitor,
                   cfg.rollout.temperature)

    def attach(self, trainer: Any) -> ControlTokenCallback:
        """Register with `trainer`, first among its callbacks, so the series reach the trainer's own
        log history and every reporter (TensorBoard, W&B) on the same log line."""
        self.trainer = trainer
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if PartialState().is_main_process:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            dump_config(self.monitor, Path(args.output_dir) / MONITOR_CONFIG)
        return control

    # -- probe -----------------------------------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        if not self.watch.probe_due(state.global_step):
            return control
        t0 = time.perf_counter()
        stats = _from_rank_zero(self._run_probe(model))
        self.pending.update(stats)
        control = self.observe(self.step_offset + state.global_step, stats, args, control)
        self.pending["monitor/seconds_probe"] = time.perf_counter() - t0  # its cost, beside TRL's step_time
        return control

    def _run_probe(self, model: Any) -> dict[str, float]:
        if self.trainer is None:
            return self.watch.run_probe(model)
        # every rank enters (ZeRO-3 and FSDP gather the shards collectively), each computes; rank 0's values count
        with _generation_model(self.trainer) as unwrapped:
            return self.watch.run_probe(unwrapped)

    @property
    def probe(self) -> ProbeSet | None:
        return self.watch.probe

    @property
    def token_ids(self) -> dict[str, int]:
        return self.watch.token_ids

    @property
    def alarms(self) -> list[Alarm]:
        return self.watch.alarms

    # -- alarms ----------------------------------------------------------------------------------------

    def observe(self, step: int, metrics: Mapping[str, Any], args: Any, control: Any) -> Any:
        """Feed the rules; act on what they raise. The same on every rank: `metrics` are identical there."""
        _append(args.output_dir, MONITOR, {"step": step, **metrics})
        alarms = self.watch.observe(step, metrics)
        for a in alarms:
            print(f"toolcollapse: {a.describe()}", flush=True)
            _append(args.output_dir, ALARMS, Monitor.record(a, action=self.monitor.on_alarm))
        if not alarms:
            return control
        checkpoint, stop = self.watch.actions()  # as rl's `config_handler`
        control.should_save = control.should_save or checkpoint
        control.should_training_stop = control.should_training_stop or stop
        return control

    # -- logs ------------------------------------------------------------------------------------------

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if logs is not None and self.pending and not any(k.startswith("eval_") for k in logs):
            logs.update(self.pending)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self.pending)  # the trainer appended its copy before the callbacks
            self.pending = {}
        return control
