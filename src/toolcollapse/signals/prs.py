"""PRS, process-reflection supervision: ETS's phases, plus one example per failed task built from a judge's
verdict on its failed rollout (judge.py; `prs.target`: the reflection itself, as the released code, or a
correction from the mistaken turn on: interleave.py). The judge's calls and costs are logged (`judge/*`)."""

from __future__ import annotations

from typing import Any

from toolcollapse.judge import Judge, load_judge
from toolcollapse.signals.ets import ETS


class PRS(ETS):
    name = "prs"

    def __init__(self, cfg, judge: Judge | None = None, **given):
        super().__init__(cfg)
        self.judge = judge or load_judge(cfg.supervision.prs.judge)  # a chat model answers once here

    @staticmethod
    def enabled(cfg) -> bool:
        return cfg.supervision.prs.enabled

    def start(self, run: Any) -> None:
        super().start(run)
        run.phases.judge = self.judge

    def metrics(self) -> dict[str, float]:
        return self.judge.metrics() if hasattr(self.judge, "metrics") else {}
