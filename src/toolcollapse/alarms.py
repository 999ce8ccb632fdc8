"""Early warning: change detectors over metric series, the alarms a run raises, and the
collapse step they are judged against.

A `Rule` watches one metric series with one detector; its **alarm** is the first step
it fires (a rule fires once). Detectors are streaming and causal -- whether they fire at
step t depends on the values up to t only -- so the live `Watcher` inside `rl` and the
offline `replay` over a run's metrics.jsonl are the same code and find the same alarms.

Both detectors learn a series' normal level from its first `warmup` observations and
never fire before that; the warm-up is the price of not knowing the level in advance.
`min_scale` floors the noise scale: the probe's series are deterministic functions of the
policy (fixed inputs), flat until the policy moves, so without a floor a change of 1e-6
would be infinitely significant. Control-token probabilities move over orders of magnitude,
so by default the detectors watch their log-odds (`monitor.alarm_scale`): with threshold 8
and a floor of 0.25 a series must move by 2 in log-odds (x7.4 in odds), and may fire only
once the probability reaches `monitor.alarm_floor` (1e-3). On the absolute scale (floor
0.005) a probability must move by 0.04. Content series (log-probs, falling) have their own
floor in nats (`monitor.content_min_scale`).

**Collapse** (`find_collapse`, the one definition `diagnose`, `sweep` and the tables use):
the first step from which the healthy-turn rate stays below half its initial value (the
step-0 rate, the starting policy) for `hold` consecutive steps; and, as a second
reference point, the first step from which it stays below 20 % for `hold` steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from toolcollapse.chat import SHORT
from toolcollapse.config import MonitorConfig


# ----------------------------------------------------------------------------- detectors


@dataclass
class RobustZ:
    """Rolling robust z-score: (x - median) / (1.4826 * MAD) over the previous `window`
    values, firing beyond `threshold`. direction +1 fires on rises, -1 on falls, 0 both."""

    threshold: float = 8.0
    window: int = 30
    warmup: int = 15
    min_scale: float = 1e-3
    direction: int = 1
    _past: deque = field(default_factory=deque, init=False, repr=False)
    _seen: int = field(default=0, init=False, repr=False)

    def update(self, x: float, steps: int = 1) -> bool:
        """Observe x, `steps` after the last observation (a level test: the gap does not matter); fires?"""
        past = self._past
        fire = False
        if self._seen >= self.warmup:
            values = torch.tensor(list(past), dtype=torch.float64)
            med = values.median().item()
            scale = max(1.4826 * (values - med).abs().median().item(), self.min_scale)
            z = (x - med) / scale
            fire = _beyond(z, self.threshold, self.direction)
        past.append(x)
        self._seen += 1
        if len(past) > self.window:
            past.popleft()
        return fire

    def fires(self, values: Sequence[float]) -> list[bool]:
        """Replay a whole series through a fresh copy of this detector."""
        fresh = RobustZ(self.threshold, self.window, self.warmup, self.min_scale, self.direction)
        return [fresh.update(x) for x in values]


@dataclass
class Cusum:
    """One-sided CUSUM (Page 1954) on deviations from the warm-up mean in warm-up standard
    deviations, summed in steps: S = max(0, S + k (z - drift)) for an observation k steps after the
    last, firing when S > threshold. A series observed every k steps (the probe's) then sums a steady
    drift as one observed every step would, not k times more slowly (docs/LOG.md, 2026-12-05 (6))."""

    threshold: float = 10.0
    drift: float = 1.5
    warmup: int = 10
    min_scale: float = 1e-3
    direction: int = 1
    _base: list = field(default_factory=list, init=False, repr=False)
    _up: float = field(default=0.0, init=False, repr=False)
    _down: float = field(default=0.0, init=False, repr=False)

    def update(self, x: float, steps: int = 1) -> bool:
        """Observe x, `steps` after the last observation; fires?"""
        if len(self._base) < self.warmup:
            self._base.append(x)
            return False
        base = torch.tensor(self._base, dtype=torch.float64)
        z = (x - base.mean().item()) / max(base.std(unbiased=False).item(), self.min_scale)
        self._up = max(0.0, self._up + steps * (z - self.drift))
        self._down = max(0.0, self._down + steps * (-z - self.drift))
        return (self.direction >= 0 and self._up > self.threshold) or (
            self.direction <= 0 and self._down > self.threshold)

    def fires(self, values: Sequence[float]) -> list[bool]:
        fresh = Cusum(self.threshold, self.drift, self.warmup, self.min_scale, self.direction)
        return [fresh.update(x) for x in values]


def _beyond(z: float, threshold: float, direction: int) -> bool:
    return (direction >= 0 and z > threshold) or (direction <= 0 and z < -threshold)


DETECTORS = {"robust_z": RobustZ, "cusum": Cusum}


def first_alarm(fires: Sequence[bool], steps: Sequence[int] | None = None) -> int | None:
    """The step of the first True (steps[i], or i), or None."""
    for i, f in enumerate(fires):
        if f:
            return steps[i] if steps is not None else i
    return None


# ----------------------------------------------------------------------------- rules and alarms


@dataclass(frozen=True)
class Rule:
    """One detector on one metric series. threshold None: the detector's default.
    scale `logodds`: the detector sees log(p / (1 - p)) of the series (a probability), and the
    rule fires only where p >= floor as well."""

    series: str
    detector: str = "robust_z"
    direction: int = 1
    warmup: int = 3  # observations of the series (a probe series has one every monitor.probe_every steps)
    min_scale: float = 0.005
    threshold: float | None = None
    scale: str = "absolute"
    floor: float = 0.0

    def observe(self, x: float) -> float:
        """The value the detector sees."""
        if self.scale == "absolute":
            return x
        p = min(max(x, 1e-12), 1 - 1e-12)
        return math.log(p / (1 - p))

    def may_fire(self, x: float) -> bool:
        return self.scale == "absolute" or x >= self.floor

    @property
    def name(self) -> str:
        arrow = {1: "up", -1: "down", 0: "both"}[self.direction]
        scale = "" if self.scale == "absolute" else f", log-odds >= {self.floor:g}"
        return f"{self.detector}({self.series}, {arrow}{scale})"

    def make(self) -> RobustZ | Cusum:
        kwargs: dict[str, Any] = dict(warmup=self.warmup, min_scale=self.min_scale, direction=self.direction)
        if self.threshold is not None:
            kwargs["threshold"] = self.threshold
        return DETECTORS[self.detector](**kwargs)


@dataclass(frozen=True)
class Alarm:
    step: int
    rule: Rule
    value: float  # the series' value at the alarm

    def describe(self) -> str:
        return f"alarm at step {self.step}: {self.rule.name} = {self.value:.4g}"


class Watcher:
    """Feeds each step's metrics to every rule; returns the alarms raised at that step.

    A series absent from a step (the probe runs every few steps) or non-finite there is
    not an observation. Each rule raises at most one alarm."""

    def __init__(self, rules: Iterable[Rule]):
        self.rules = list(rules)
        self._detectors = [r.make() for r in self.rules]
        self._last: list[int | None] = [None] * len(self.rules)  # each rule's last observed step
        self.alarms: list[Alarm] = []
        self._fired: set[int] = set()

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[Alarm]:
        new = []
        for i, (rule, det) in enumerate(zip(self.rules, self._detectors)):
            x = metrics.get(rule.series)
            if not isinstance(x, (int, float)) or not math.isfinite(x):
                continue
            steps = 1 if self._last[i] is None else max(1, step - self._last[i])
            self._last[i] = step
            fires = det.update(rule.observe(float(x)), steps)
            if fires and rule.may_fire(float(x)) and i not in self._fired:
                self._fired.add(i)
                new.append(Alarm(step, rule, float(x)))
        self.alarms.extend(new)
        return new

    def rearm(self) -> None:
        """Fresh detectors that may fire again (after a recovery: the series start from a new reference);
        the alarms so far stay in `alarms`."""
        self._detectors = [r.make() for r in self.rules]
        self._last = [None] * len(self.rules)
        self._fired.clear()


def replay(rules: Iterable[Rule], rows: Iterable[Mapping[str, Any]]) -> list[Alarm]:
    """The alarms a run with these rules raised (or would have), from its metric rows."""
    watcher = Watcher(rules)
    for row in rows:
        watcher.update(int(row["step"]), row)
    return watcher.alarms


# ----------------------------------------------------------------------------- collapse, from a metric series


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))]


def first_step_below(values: Sequence[float], threshold: float, hold: int = 1) -> int | None:
    """Index of the first value from which `hold` consecutive values are all below `threshold`."""
    run = 0
    for i, v in enumerate(values):
        run = run + 1 if v < threshold else 0
        if run >= hold:
            return i - hold + 1
    return None


def collapse_step(healthy: Sequence[float], hold: int = 3, fraction: float = 0.5) -> int | None:
    """First index from which the healthy-turn rate stays below `fraction` of its first value for `hold` values."""
    return first_step_below(healthy, fraction * healthy[0], hold) if healthy else None


COLLAPSE_FLOOR = 0.2  # the second reference point: healthy-turn rate below 20 %


@dataclass(frozen=True)
class Collapse:
    step: int | None  # healthy rate below half its step-0 value for `hold` consecutive steps
    floor_step: int | None  # ... below COLLAPSE_FLOOR for `hold` consecutive steps

    @property
    def collapsed(self) -> bool:
        return self.step is not None


def find_collapse(rows: Sequence[Mapping[str, Any]], hold: int) -> Collapse:
    """The collapse of a run from its metric rows (their `healthy_rate`), as step numbers."""
    healthy = [r["healthy_rate"] for r in rows]
    at = lambda i: None if i is None else int(rows[i]["step"])  # noqa: E731
    return Collapse(at(collapse_step(healthy, hold)), at(first_step_below(healthy, COLLAPSE_FLOOR, hold)))


SKILL_DROP = 0.7  # the lead table's skill event: validation success at 70 % of its start or below (a 30 % loss)


def skill_collapse_step(rows: Sequence[Mapping[str, Any]], fraction: float = 0.5) -> int | None:
    """The first step whose validation success (`val/success`, rl's grpo.eval_every) is at most
    `fraction` of the first validation's: the skill collapse, which the format may not show.
    None when it never is, or the run has no validation."""
    vals = [(int(r["step"]), r["val/success"]) for r in rows if "val/success" in r]
    if not vals or vals[0][1] <= 0:
        return None
    return next((step for step, v in vals if v <= fraction * vals[0][1]), None)


# ----------------------------------------------------------------------------- the default rules

# (miss_after_call exists only with rollout.call_end: sampled; a series a run never logs never fires)
REQUIRED_SERIES = (*(f"probe/{t}/miss_required" for t in ("tool_call", "tool_call_end", "im_end")),
                   "probe/im_end/miss_after_call")


def control_series(control_tokens: Sequence[str]) -> list[str]:
    """The probe series the alarm watches: miss rates where required, peak mass where forbidden."""
    return [*REQUIRED_SERIES, *(f"probe/{SHORT.get(t, t)}/p_forbidden_max" for t in control_tokens)]


CONTENT_SERIES = tuple(f"probe/content/{c}/logp" for c in ("tool_name", "arg_copied", "arg_computed", "answer"))


def control_rules(m: MonitorConfig, detector: str | None = None, scale: str | None = None) -> list[Rule]:
    """One detector, rising, on each of `m.alarm_series` (default: control_series), on the
    probabilities or their log-odds (`m.alarm_scale`)."""
    series = m.alarm_series or control_series(m.control_tokens)
    scale = scale or m.alarm_scale
    min_scale = m.alarm_min_scale if scale == "absolute" else m.alarm_logodds_min_scale
    return [Rule(s, detector or m.alarm_detector, 1, m.alarm_warmup, min_scale, m.alarm_threshold, scale,
                 m.alarm_floor) for s in series]


def content_rules(m: MonitorConfig, detector: str | None = None) -> list[Rule]:
    """One detector, falling, on the probe's ground-truth log-prob of each content slot (the skill)."""
    return [Rule(s, detector or m.content_detector, -1, m.alarm_warmup, m.content_min_scale, m.alarm_threshold)
            for s in CONTENT_SERIES]


def run_rules(m: MonitorConfig) -> list[Rule]:
    """Every alarm rule of a run: the control tokens, and the content slots unless switched off."""
    return control_rules(m) + (content_rules(m) if m.content_alarms else [])
