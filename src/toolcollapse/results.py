"""A study's results as the report reads them: arms, their per-task outcomes, and paired comparisons.

Everything here is read from the run directories and the sweep's evaluation of the starting checkpoint; nothing
is recomputed from models. An *arm* is a setting of the study file (for a setting with tries, the chosen try,
tries.py); its *method* is the setting's name without an `_lr...` suffix, its *schedule* comes from its resolved
config, its learning rate is `grpo.lr`.

Outcomes are matrices [seeds, tasks] over the starting checkpoint's tasks, in its order: 0/1 per task for a greedy
evaluation, the mean success of the k samples for `<split>-sampled`. A run evaluated on other tasks or under
other rollout limits than the start is left out of its arm's outcomes (and counted in `unpaired`): its figures
would measure the limits, not the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from toolcollapse.alarms import rolling_mean
from toolcollapse.checkpoint import complete_checkpoints
from toolcollapse.config import MonitorConfig, RunConfig
from toolcollapse.runtime import read_jsonl
from toolcollapse.stats import PairedDiff, compare_arms
from toolcollapse.sweep import eval_splits, start_eval_dir
from toolcollapse.sweep_table import WINDOW, summarize_run
from toolcollapse.tries import base_name, expand, read_selection


def schedule(cfg: RunConfig) -> str:
    """plain | synchronous | interleaved | adaptive | sft_only, from a run's resolved config."""
    s = cfg.supervision
    if s.sft_only_enabled:
        return "sft_only"
    if s.adaptive.enabled:
        return "adaptive"
    if s.ets.enabled:
        return "interleaved"
    if s.ops.enabled or s.hbg.enabled or s.sft_coef > 0 or s.unlikelihood_coef > 0:
        return "synchronous"
    return "plain"


def method_name(setting: str) -> str:
    return re.sub(r"_lr[0-9.eE+-]+$", "", base_name(setting))


@dataclass
class Arm:
    """The runs of one arm (a setting, its chosen try), over seeds."""

    setting: str  # the file's setting name
    run_setting: str  # its run directories' name (`setting` or `setting.t<k>`)
    method: str
    schedule: str
    lr: float
    cfg: RunConfig  # its first run's config
    runs: list[dict[str, Any]] = field(default_factory=list)  # sweep_table.summarize_run rows, with "seed"
    metrics: list[list[dict[str, Any]]] = field(default_factory=list)  # each run's metrics.jsonl rows
    outcomes: dict[str, np.ndarray] = field(default_factory=dict)  # split -> [seeds evaluated, tasks]
    healthy: dict[str, list[float]] = field(default_factory=dict)  # split -> each evaluated seed's healthy-turn rate
    seeds_evaluated: dict[str, list[int]] = field(default_factory=dict)
    unpaired: int = 0  # evaluations left out: other tasks or limits than the start's
    matched: list[str] = field(default_factory=list)  # an sft_only control: the run dirs whose tokens it matched

    @property
    def rl_runs(self) -> list[dict[str, Any]]:
        """The RL runs that took all their steps (an unfinished run has not shown whether it collapses)."""
        return [r for r in self.runs if r.get("steps_done") and r["steps_done"] >= r["steps"]]

    @property
    def finished(self) -> list[dict[str, Any]]:
        return self.rl_runs + [r for r in self.runs if r.get("sft_only")]

    @property
    def collapsed(self) -> list[dict[str, Any]]:
        return [r for r in self.rl_runs if r["collapsed"]]

    def finished_metrics(self) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        return [(r, m) for r, m in zip(self.runs, self.metrics) if m and r in self.rl_runs]

    def success(self, split: str) -> float | None:
        m = self.outcomes.get(split)
        return None if m is None else float(m.mean())


@dataclass
class Study:
    name: str
    out_dir: Path
    splits: list[str]  # greedy evaluations, eval_split first
    sampled: str | None  # the sampled evaluation's name (`<eval_split>-sampled`), if any
    select_split: str | None  # where tries were compared (None: no tries)
    eval_n: int
    tasks: dict[str, list[str]]  # split -> the start's task ids, in order
    start: dict[str, np.ndarray]  # split -> [1, tasks]
    start_limits: dict[str, Any]
    start_healthy: dict[str, float]  # split -> the start's healthy-turn rate there
    arms: list[Arm]
    selection: dict[str, dict[str, Any]]  # tries.read_selection
    monitor: MonitorConfig
    runs_total: int
    runs_done: int = 0  # of runs_total: RL runs at their last step, sft_only runs saved (unchosen tries included)
    sweep: Any = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def first(self) -> str:
        return self.splits[0]

    @property
    def lrs(self) -> list[float]:
        """Learning rates with RL runs, highest first."""
        return sorted({a.lr for a in self.arms if a.schedule != "sft_only"}, reverse=True)

    def plain(self, lr: float | None) -> Arm | None:
        return next((a for a in self.arms if a.lr == lr and a.schedule == "plain" and a.method == "plain"), None)

    @property
    def plain_lrs(self) -> list[float]:
        """Learning rates with a plain GRPO arm, highest first."""
        return sorted({a.lr for a in self.arms if a.schedule == "plain" and a.method == "plain"}, reverse=True)

    def at(self, lr: float, *schedules: str) -> list[Arm]:
        return [a for a in self.arms if a.lr == lr and (not schedules or a.schedule in schedules)]

    def start_arm(self, split: str) -> np.ndarray | None:
        return self.start.get(split)

    def compare(self, a: Arm | str, b: Arm | str, split: str) -> PairedDiff | None:
        """Arm a against arm b (or "start") on `split`, paired on the start's tasks; None where either side has
        no outcomes there."""
        key = (getattr(a, "setting", a), getattr(b, "setting", b), split)
        if key not in self._cache:
            x, y = (self.start.get(split) if s == "start" else s.outcomes.get(split) for s in (a, b))
            self._cache[key] = None if x is None or y is None else compare_arms(x, y)
        return self._cache[key]

    def control_of(self, arm: Arm) -> Arm | None:
        """The sft_only arm matched to `arm`'s runs."""
        dirs = {str(Path(r["run"])) for r in arm.runs}
        return next((c for c in self.arms if c.schedule == "sft_only" and set(c.matched) & dirs), None)


def read_outcomes(path: Path) -> dict[str, float]:
    """{task id: success} of an evaluation file; a task with several (sampled) episodes: their mean."""
    wins: dict[str, list[float]] = {}
    for r in read_jsonl(path):
        wins.setdefault(r["task_id"], []).append(float(r["success"]))
    return {k: sum(v) / len(v) for k, v in wins.items()}


def _summary(path: Path) -> dict[str, Any]:
    summary = path.with_suffix(".summary.json")
    return json.loads(summary.read_text()) if summary.is_file() else {}


def evaluation_names(sweep: Any) -> tuple[list[str], str | None]:
    return eval_splits(sweep), (f"{sweep.eval_split}-sampled" if getattr(sweep, "eval_samples", 0) else None)


def load_study(sweep: Any, specs: Sequence[Any]) -> Study:
    splits, sampled = evaluation_names(sweep)
    names = splits + ([sampled] if sampled else [])
    start_dir = start_eval_dir(sweep)
    tasks, start, limits, start_healthy = {}, {}, {}, {}
    for name in names:
        path = start_dir / f"{name}.jsonl"
        if path.is_file():
            outcomes = read_outcomes(path)
            tasks[name] = list(outcomes)
            start[name] = np.array([list(outcomes.values())])
            summary = _summary(path)
            limits[name], start_healthy[name] = summary.get("limits"), summary.get("healthy_rate")
    selection = read_selection(sweep.out_dir)
    tried = {s.base for s in expand(sweep.settings, sweep.seeds) if s.try_index is not None}
    chosen = {base: rec["tries"][rec["chosen"]]["setting"] for base, rec in selection.items()}
    arms: dict[str, Arm] = {}
    done_runs = 0
    for spec in specs:
        done = complete_checkpoints(spec.run_dir)
        done_runs += bool(done) and done[-1].name == f"step_{spec.cfg.grpo.steps:06d}"
        base = base_name(spec.setting)
        if base in tried and chosen.get(base) != spec.setting:
            continue  # a try not (yet) chosen: listed with the tries, not an arm
        arm = arms.setdefault(base, Arm(base, spec.setting, method_name(base), schedule(spec.cfg), spec.cfg.grpo.lr,
                                        spec.cfg))
        row = {"seed": spec.seed, **summarize_run(spec.run_dir, spec.cfg.grpo.steps, spec.cfg.monitor.collapse_hold)}
        arm.runs.append(row)
        path = Path(spec.run_dir) / "metrics.jsonl"
        arm.metrics.append(read_jsonl(path) if path.is_file() else [])
        match = spec.cfg.supervision.sft_only.match
        if match:
            arm.matched.append(str(Path(match.replace("{seed}", str(spec.seed)))))
        for name in names:
            path = done[-1] / "eval" / f"{name}.jsonl" if done else None
            if name not in tasks or path is None or not path.is_file():
                continue
            outcomes, summary = read_outcomes(path), _summary(path)
            if set(outcomes) != set(tasks[name]) or summary.get("limits") != limits[name]:
                arm.unpaired += 1
                continue
            arm.healthy.setdefault(name, []).append(summary.get("healthy_rate"))
            row = np.array([[outcomes[t] for t in tasks[name]]])
            arm.outcomes[name] = row if name not in arm.outcomes else np.vstack([arm.outcomes[name], row])
            arm.seeds_evaluated.setdefault(name, []).append(spec.seed)
    monitor = specs[0].cfg.monitor if specs else MonitorConfig()
    return Study(Path(sweep.out_dir).name, Path(sweep.out_dir), splits, sampled,
                 sweep.select_split if selection else None, sweep.eval_n, tasks, start, limits, start_healthy,
                 list(arms.values()),
                 selection, monitor, len(specs), done_runs, sweep)


def healthy_through(rows: Sequence[dict[str, Any]], step: int) -> float | None:
    """The lowest 5-step trailing mean of the healthy-turn rate over steps 0..`step` (None: the run has not
    reached it). A mean: one step's rate, ~250 sampled turns at T = 1, moves by a few points on its own."""
    early = [r["healthy_rate"] for r in rows if r["step"] <= step]
    return min(rolling_mean(early, WINDOW)) if rows and rows[-1]["step"] >= step else None


def mean_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r and r[key] == r[key]]
    return sum(values) / len(values) if values else None
