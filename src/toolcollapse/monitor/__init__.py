"""What toolcollapse watches during training (arXiv 2606.26027), one module a concern:

  probe.py    the probe set: fixed oracle conversations teacher-forced through the policy, their control
              tokens' probabilities per grammar slot (`probe/*`); the slots and their statistics
  content.py  the same forward's content labels and statistics: the skill, not the format (`probe/content/*`)
  forward.py  the training forward's own statistics (`ctrl/*`: `SampledTokens`, which both trainers' updates
              feed) and TRL's running turn counts (`TurnCounts`, over `turn_stats`' functions)
  Monitor     (here) the probe and the alarm rules (alarms.py) over each step's metrics: `rl`'s loop and TRL's
              callback hold one each and feed it the same way
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from toolcollapse.alarms import Alarm, Watcher, run_rules
from toolcollapse.config import MonitorConfig, RunConfig
from toolcollapse.model import PrefixCache
from toolcollapse.monitor.content import (CONTENT_NAMES, NO_CONTENT, Content, content_labels, content_stats)
from toolcollapse.monitor.forward import SampledTokens, TurnCounts, control_gradient_share, sampled_control_stats
from toolcollapse.monitor.probe import (FORBIDDEN, PROBE_CHUNK, REQUIRED, SLOT_NAMES, ProbeSet, Slot, build_probe,
                                        control_token_stats, probe_for, resolve_token_ids, run_probe, slots)


class Monitor:
    """What both trainers watch, fed the same way (`rl`'s loop; TRL's `ControlTokenCallback` and
    `MonitoredGRPOTrainer`): the probe every `probe_every` steps, on the weights the step's rollouts came
    from, and the alarm rules (`alarms.run_rules`) over each step's metrics -- the probe's `probe/*`, the
    update forward's `ctrl/*` (`sampled_control_stats`), the turn states (`turn_stats`). It says what was
    raised; the trainer acts on it (rl: the alarm handler; TRL: its control flags)."""

    def __init__(self, cfg: MonitorConfig, probe: ProbeSet | None, token_ids: Mapping[str, int],
                 temperature: float = 1.0):
        self.cfg, self.probe, self.token_ids, self.temperature = cfg, probe, dict(token_ids), temperature
        self.watcher = Watcher(run_rules(cfg))

    @classmethod
    def for_run(cls, cfg: RunConfig, env: Any, tokenizer: Any) -> Monitor:
        """The run config's monitor: its probe set (`probe_for`) at `rollout.temperature`."""
        probe, token_ids = probe_for(cfg, env, tokenizer)
        return cls(cfg.monitor, probe, token_ids, cfg.rollout.temperature)

    def probe_due(self, step: int) -> bool:
        return self.probe is not None and self.cfg.probe_every > 0 and step % self.cfg.probe_every == 0

    def run_probe(self, model: Any, prefixes: PrefixCache | None = None) -> dict[str, float]:
        return run_probe(model, self.probe, self.token_ids, self.temperature, prefixes)

    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[Alarm]:
        """The step's metrics through the rules; the alarms they raise."""
        return self.watcher.update(step, metrics)

    def rearm(self) -> None:
        """A recovered run: the rules watch it afresh."""
        self.watcher.rearm()

    def replay(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """The metrics of the steps a resumed run already took (it does not re-alarm on them)."""
        for row in rows:
            self.observe(row["step"], row)
            if "adaptive/recovery" in row:
                self.rearm()

    def actions(self) -> tuple[bool, bool]:
        """What an alarm asks of the trainer (`monitor.on_alarm`): (a checkpoint, a stop). `log` asks neither:
        every alarm is printed and written to alarms.jsonl whatever the action."""
        return self.cfg.on_alarm in ("checkpoint", "stop"), self.cfg.on_alarm == "stop"

    @property
    def alarms(self) -> list[Alarm]:
        return self.watcher.alarms

    @staticmethod
    def record(alarm: Alarm, **extra: Any) -> dict[str, Any]:
        """An alarm's line in alarms.jsonl."""
        return {"step": alarm.step, "series": alarm.rule.series, "detector": alarm.rule.detector,
                "value": alarm.value, **extra}


__all__ = ["CONTENT_NAMES", "FORBIDDEN", "NO_CONTENT", "PROBE_CHUNK", "REQUIRED", "SLOT_NAMES", "Content", "Monitor",
           "ProbeSet", "SampledTokens", "Slot", "TurnCounts", "build_probe", "content_labels", "content_stats",
           "control_gradient_share", "control_token_stats", "probe_for", "resolve_token_ids", "run_probe",
           "sampled_control_stats", "slots"]
