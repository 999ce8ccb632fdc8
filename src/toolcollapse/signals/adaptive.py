"""The adaptive schedule (the paper's future work; interleave.adaptive_handler): on a monitor alarm, roll back
to the newest checkpoint before the alarming step, scale the LR, run an SFT phase on the ground truth of every
task failed so far, resume RL; each action an `adaptive/*` event in the step's row and in alarms.jsonl."""

from __future__ import annotations

from typing import Any, Callable

from toolcollapse.interleave import adaptive_handler
from toolcollapse.signals.base import Signal, Step


class Adaptive(Signal):
    name = "adaptive"

    @staticmethod
    def enabled(cfg) -> bool:
        return cfg.supervision.adaptive.enabled

    def start(self, run: Any) -> None:
        """A resumed run takes up its LR cut and its count of recoveries from the steps taken."""
        self.phases = run.phases
        run.lr_scale = next((r["adaptive/lr_scale"] for r in reversed(run.rows) if "adaptive/lr_scale" in r), 1.0)
        run.recoveries = sum("adaptive/recovery" in r for r in run.rows)
        if self.cfg.supervision.adaptive.rollback and run.fresh:
            run.save(0)  # a rollback target before the first periodic checkpoint

    def after_update(self, step: Step) -> dict[str, float]:
        if self.cfg.supervision.adaptive.sft:  # the phase an alarm may run trains on every failure so far
            self.phases.collect(step.index, step.episodes, step.kinds)
        return {}

    def on_alarm(self) -> Callable[[list, Any], None]:
        return adaptive_handler(self.cfg.supervision.adaptive)
