"""HBG, hint-based guidance: `hbg.rows` of each group sample with a hint appended to the system message
(`hbg.hint_writer`: templated from the ground truth -- the format reminder, the tools to call, the first
calls, never the answer -- or a chat model's summary, supervision.LLMHintWriter), in the same generate call
as the policy's rows; the update trains them on the hint-free prompt, their old log-probs recomputed there."""

from __future__ import annotations

from toolcollapse.records import Task
from toolcollapse.signals.base import Rows, Signal
from toolcollapse.supervision import load_hint_writer, with_hint


class HBG(Signal):
    name = "hbg"

    def __init__(self, cfg, **given):
        super().__init__(cfg)
        self.write = load_hint_writer(cfg.supervision.hbg)  # a chat model answers once here

    @staticmethod
    def enabled(cfg) -> bool:
        return cfg.supervision.hbg.enabled

    def rows(self) -> Rows:
        return Rows("hinted", self.cfg.supervision.hbg.rows, self.hinted)

    def hinted(self, task: Task) -> Task:
        return with_hint(task, self.write(task))

    def metrics(self) -> dict[str, float]:
        return self.write.metrics() if hasattr(self.write, "metrics") else {}
