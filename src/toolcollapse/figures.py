"""PNG figures of a run's metric rows (matplotlib, no display needed).

Each figure marks the alarms (dashed) and the collapse step (solid red) when known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from toolcollapse.records import ErrorType, TurnState  # noqa: E402

STATE_COLORS = {TurnState.HEALTHY_CALL: "#2b8a3e", TurnState.HEALTHY_RESPONSE: "#74c69d",
                TurnState.TEXT_POLLUTION: "#f59f00", TurnState.FULL_COLLAPSE: "#c92a2a"}


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _mark(ax, diagnosis: Any) -> None:
    if diagnosis is None:
        return
    for a in getattr(diagnosis, "alarms", []):
        ax.axvline(a.step, color="0.3", linestyle="--", linewidth=0.8)
    if getattr(diagnosis, "alarms", None):
        first = min(a.step for a in diagnosis.alarms)
        ax.axvline(first, color="0.3", linestyle="--", linewidth=0.8, label=f"first alarm (step {first})")
    if getattr(diagnosis, "collapse_step", None) is not None:
        ax.axvline(diagnosis.collapse_step, color="#c92a2a", linewidth=1.5,
                   label=f"collapse (step {diagnosis.collapse_step})")


def _save(fig, ax, title: str, path: Path) -> Path:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_control_tokens(rows: Sequence[Mapping[str, Any]], series: Sequence[str], diagnosis: Any,
                        path: Path) -> Path:
    """The probe's control-token series on a log scale: miss rates where required, peak mass where forbidden."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in series:
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, [max(v, 1e-5) for v in values], label=key.removeprefix("probe/"), linewidth=1.2)
    ax.set_yscale("log")
    ax.set_ylabel("probability")
    _mark(ax, diagnosis)
    return _save(fig, ax, "control tokens on the probe set", path)


def plot_states(rows: Sequence[Mapping[str, Any]], diagnosis: Any, path: Path) -> Path:
    """Four-state shares of assistant turns per step, stacked."""
    fig, ax = plt.subplots(figsize=(8, 4))
    steps = [r["step"] for r in rows]
    stacks = [[r.get(f"state/{s.value}", 0.0) for r in rows] for s in TurnState]
    ax.stackplot(steps, stacks, labels=[s.value for s in TurnState], colors=[STATE_COLORS[s] for s in TurnState],
                 alpha=0.9)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of assistant turns")
    _mark(ax, diagnosis)
    return _save(fig, ax, "four turn states", path)


def plot_errors(rows: Sequence[Mapping[str, Any]], diagnosis: Any, path: Path) -> Path:
    """Per-turn rate of each error type that occurs at least once."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for e in ErrorType:
        steps, values = _series(rows, f"error/{e.value}")
        if any(values):
            ax.plot(steps, values, label=e.value, linewidth=1.2)
    ax.set_ylabel("errors per assistant turn")
    _mark(ax, diagnosis)
    return _save(fig, ax, "error types", path)


def plot_content(rows: Sequence[Mapping[str, Any]], diagnosis: Any, path: Path) -> Path:
    """The skill beside the format: the probe's ground-truth log-prob per content slot (left axis) and,
    where the run validated, greedy validation success and the healthy-turn rate (right axis)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in ("tool_name", "arg_copied", "arg_computed", "answer"):
        steps, values = _series(rows, f"probe/content/{key}/logp")
        if steps:
            ax.plot(steps, values, label=f"log p(truth): {key}", linewidth=1.2)
    ax.set_ylabel("mean log-prob of the ground truth (nats)")
    right = ax.twinx()
    for key, style in (("val/success", "-"), ("val/healthy_rate", ":"), ("healthy_rate", "--")):
        steps, values = _series(rows, key)
        if steps:
            right.plot(steps, values, style, color="black", linewidth=1.0, marker="o" if key.startswith("val")
                       else None, markersize=3, label=key)
    right.set_ylim(0, 1.05)
    right.set_ylabel("rate")
    handles, labels = right.get_legend_handles_labels()
    for h, label in zip(handles, labels):
        ax.plot([], [], linestyle=h.get_linestyle(), color="black", label=label)
    _mark(ax, diagnosis)
    return _save(fig, ax, "content on the probe set, validation and format", path)


def plot_states_grid(panels: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str) -> Path:
    """The four-state stacked areas of several runs side by side (a method each), one legend."""
    n = len(panels)
    cols = min(n, 4)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.4 * nrows), sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes.flat, panels.items()):
        steps = [r["step"] for r in rows]
        ax.stackplot(steps, [[r.get(f"state/{s.value}", 0.0) for r in rows] for s in TurnState],
                     colors=[STATE_COLORS[s] for s in TurnState], alpha=0.9)
        ax.set_ylim(0, 1)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=STATE_COLORS[s]) for s in TurnState],
               [s.value for s in TurnState], loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"four turn states by method, {title} (x: RL step)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
