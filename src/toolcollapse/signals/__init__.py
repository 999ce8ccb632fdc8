"""Supervision signals (arXiv 2606.26027; docs/DESIGN.md): one module each, one line each in `SIGNALS`.

A signal is a `base.Signal`, built from the run's config when its `enabled(cfg)` says so. The RL loop
(rl.py) calls its hooks at the stages of every step:

  start         once, when the run's objects exist (model, engine, optimizer, phases; fresh or resumed)
  rows          the rows it puts in each group after the policy's own (HBG's hinted, OPS's expert rows)
  terms         the loss terms it adds to this step's update (below)
  after_update  what it does between steps (ETS's and PRS's SFT phases), before the alarms; its metrics
  on_alarm      a handler for the monitor's alarms (the adaptive schedule)
  metrics       what it logs (a chat model's calls and costs)

The update (update.py) sums the loss terms it is handed and never learns a signal's name. A term
(`base.LossTerm`) is one object per RL step, told at each of the step's optimizer steps which mini-batch it is
(`begin`), and asked, in this order:

  token_loss    the per-token policy loss, reshaped; by default `expert_loss` (OPS's LUFFY shaping) in place
                of the surrogate on the expert rows' tokens, the one reshaping TRL's trainer runs too
  forward_loss  a loss from the update's own forward pass, added to the mini-batch's (unlikelihood)
  backward      a loss with a forward pass of its own, its gradient added to the same optimizer step
                (the SFT term); False when it was not finite, which skips the optimizer step
  metrics       what it logs for the RL step, once its optimizer steps are done

`hybrid` is OPS and the SFT term together: two signals on, no module of its own.
"""

from __future__ import annotations

from typing import Any, Sequence

from toolcollapse.signals.adaptive import Adaptive
from toolcollapse.signals.base import LossTerm, OptimizerStep, RowKind, Rows, Signal, Step
from toolcollapse.signals.ets import ETS
from toolcollapse.signals.hbg import HBG
from toolcollapse.signals.ops import OPS, LuffyShaping
from toolcollapse.signals.prs import PRS
from toolcollapse.signals.rows import group_rollouts, row_kinds
from toolcollapse.signals.sft_term import SFTTermLoss, SFTTermSignal
from toolcollapse.signals.unlikelihood import Unlikelihood, UnlikelihoodSignal

# the order the loop calls them in: rows (hinted before expert), loss terms, phases, alarm handlers
SIGNALS: list[type[Signal]] = [HBG, OPS, UnlikelihoodSignal, SFTTermSignal, ETS, PRS, Adaptive]


def build_signals(cfg: Any, **given: Any) -> list[Signal]:
    """The signals `cfg` (a RunConfig) turns on, in `SIGNALS`' order; `given`: objects in place of the
    config's (`judge`: PRS's)."""
    return [cls(cfg, **given) for cls in SIGNALS if cls.enabled(cfg)]


def group_rows(signals: Sequence[Signal]) -> list[Rows]:
    """The rows the signals put in each group, in order."""
    return [rows for rows in (signal.rows() for signal in signals) if rows is not None]


__all__ = ["SIGNALS", "Adaptive", "ETS", "HBG", "LossTerm", "LuffyShaping", "OPS", "OptimizerStep", "PRS", "RowKind",
           "Rows", "SFTTermLoss", "SFTTermSignal", "Signal", "Step", "Unlikelihood", "UnlikelihoodSignal",
           "build_signals", "group_rollouts", "group_rows", "row_kinds"]
