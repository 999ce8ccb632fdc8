"""ETS, erroneous-trajectory supervision (interleave.py has the phases): rounds of `ets.every` GRPO steps;
after each, an SFT phase on the ground truth of the tasks with a failed on-policy rollout in the round's last
`ets.window` steps (the released code's rule). Logged on the round's last step: `ets/*` (the phase's
statistics)."""

from __future__ import annotations

from typing import Any

from toolcollapse.signals.base import Signal, Step


class ETS(Signal):
    name = "ets"

    @staticmethod
    def enabled(cfg) -> bool:
        return cfg.supervision.ets.enabled and not cfg.supervision.prs.enabled  # PRS: ETS with a judge

    def start(self, run: Any) -> None:
        self.phases = run.phases

    def after_update(self, step: Step) -> dict[str, float]:
        self.phases.collect(step.index, step.episodes, step.kinds)
        if not self.phases.ets_round_ends(step.index):
            return {}
        stats = self.phases.run("ets", step.index, self.phases.ets_failures(step.index))
        return {f"ets/{k.removeprefix('phase/')}": v for k, v in stats.items()}
