"""Paired statistics for comparing two arms of a study on the same tasks.

An arm is a matrix of per-task outcomes, [seeds, tasks]: 0/1 for a greedy evaluation, a fraction for the
mean of k sampled episodes per task. Two arms are compared only on the same tasks, in the same column order.

- `paired_bootstrap`: the difference of mean success (arm a minus arm b) and its percentile 95 % interval from
  a two-level bootstrap: each replicate draws the tasks with replacement (one draw shared by both arms: the
  pairing) and, independently for each arm, its seeds with replacement. With one seed an arm contributes
  only the task-level noise; with several, the spread between seeds widens the interval as it should.
- `mcnemar`: an exact sign test on the tasks where the two arms differ: a task counts for arm a when its success
  (mean over a's seeds, and over the k samples of a sampled evaluation) is above b's, for b when below. With one
  greedy run on each side this is McNemar's exact test; with several seeds it tests the per-task means, so a
  seed is never counted as a task of its own. The verdicts read the bootstrap interval, not this.
- `verdict`: "yes" or "no" only when the interval excludes zero, else "undecided".

Pure functions of arrays; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

Verdict = Literal["yes", "no", "undecided"]


@dataclass(frozen=True)
class PairedDiff:
    diff: float  # mean(a) - mean(b), over seeds and tasks
    low: float  # the 95 % bootstrap interval of diff
    high: float
    n_tasks: int
    seeds_a: int
    seeds_b: int
    gained: int  # tasks where a's success (mean over its seeds) is above b's
    lost: int  # ... below b's
    p_value: float  # the exact two-sided sign test on those tasks (McNemar's test for one greedy run a side)

    def describe(self, scale: float = 100.0, unit: str = " points") -> str:
        p = f", sign test p = {self.p_value:.2g}"
        return (f"{scale * self.diff:+.1f}{unit} (95 % CI {scale * self.low:+.1f} to {scale * self.high:+.1f}; "
                f"{self.n_tasks} tasks x {self.seeds_a}/{self.seeds_b} seeds{p})")


def as_matrix(outcomes: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    """[seeds, tasks] float array; a flat sequence is one seed."""
    m = np.asarray(outcomes, dtype=float)
    if m.ndim == 1:
        m = m[None, :]
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise ValueError(f"outcomes must be [seeds, tasks] with at least one of each, got shape {m.shape}")
    return m


def paired_bootstrap(a: np.ndarray, b: np.ndarray, n_boot: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the percentile interval of the two-level bootstrap (module docstring)."""
    a, b = as_matrix(a), as_matrix(b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"paired arms need the same tasks: {a.shape[1]} against {b.shape[1]}")
    rng = np.random.default_rng(seed)
    n = a.shape[1]
    diffs = np.empty(n_boot)
    chunk = max(1, 2_000_000 // max(1, n * (a.shape[0] + b.shape[0])))  # replicates at once, bounded memory
    for start in range(0, n_boot, chunk):
        k = min(chunk, n_boot - start)
        tasks = rng.integers(0, n, size=(k, n))  # [k, n] one draw of tasks for both arms
        diffs[start:start + k] = _resampled_mean(a, tasks, rng) - _resampled_mean(b, tasks, rng)
    tail = (1 - level) / 2
    low, high = np.quantile(diffs, [tail, 1 - tail])
    return float(a.mean() - b.mean()), float(low), float(high)


def _resampled_mean(m: np.ndarray, tasks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[k] mean over resampled seeds and the given resampled tasks of an arm [S, n]."""
    seeds = rng.integers(0, m.shape[0], size=(tasks.shape[0], m.shape[0]))  # [k, S]
    per_seed = m[seeds[:, :, None], tasks[:, None, :]]  # [k, S, n]
    return per_seed.mean(axis=(1, 2))


def mcnemar(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p-value: the binomial(gained + lost, 1/2) probability of a split as uneven."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def discordant(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(tasks where a is above b, tasks where it is below), on the per-task means over seeds."""
    a, b = as_matrix(a).mean(axis=0), as_matrix(b).mean(axis=0)
    return int((a > b).sum()), int((a < b).sum())


def compare_arms(a: Sequence[Sequence[float]] | np.ndarray, b: Sequence[Sequence[float]] | np.ndarray,
                 n_boot: int = 10_000, seed: int = 0) -> PairedDiff:
    """Arm a against arm b on the same tasks: the difference, its bootstrap interval and the sign test."""
    a, b = as_matrix(a), as_matrix(b)
    diff, low, high = paired_bootstrap(a, b, n_boot, seed)
    gained, lost = discordant(a, b)
    return PairedDiff(diff, low, high, a.shape[1], a.shape[0], b.shape[0], gained, lost, mcnemar(gained, lost))


def verdict(low: float, high: float) -> Verdict:
    """For the claim "a is above b": yes when the whole interval is above zero, no when it is below, else
    undecided."""
    if low > 0:
        return "yes"
    if high < 0:
        return "no"
    return "undecided"
