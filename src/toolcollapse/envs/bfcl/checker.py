"""BFCL's multi-turn success check, reimplemented: state and execution responses per user turn.

Mirrors `eval_checker/multi_turn_eval/multi_turn_checker.py::multi_turn_checker` and the
force-termination check of `eval_runner.py::_evaluate_single_multi_turn_entry`:

  0. fewer model turns than user turns (the episode ended early) -> force_terminated;
  1. per user turn k, the model's calls of turn k run on one set of instances and the
     ground-truth calls of turn k on another (state carries over between turns);
  2. a turn whose ground truth is empty is not checked (its model calls still ran);
  3. otherwise the model must have made at least one call in turn k
     (empty_turn_model_response), every non-private attribute of every ground-truth
     instance must equal the model instance's (instance_state_mismatch), and the
     ground-truth results of turn k must be contained, as a multiset, in the model's
     results of turns 0..k (execution_response_mismatch);
  4. the first failing turn decides; otherwise the entry passes.

BFCL's `method_invoke_order_checker` is commented out in BFCL and not used here either.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from toolcollapse.envs.bfcl.backend import World, execute
from toolcollapse.envs.bfcl.calls import LiteralCall, parse_call_string


@dataclass(frozen=True)
class Verdict:
    valid: bool
    error_type: str = ""  # BFCL's name, e.g. "multi_turn:instance_state_mismatch"
    turn: int = -1  # the first failing user turn
    detail: str = ""


def check_turns(model: World, truth: World, model_turns: Sequence[Sequence[LiteralCall]],
                ground_truth: Sequence[Sequence[str]]) -> Verdict:
    """BFCL's verdict for the model's calls per user turn; `model` and `truth` are fresh worlds."""
    if len(model_turns) != len(ground_truth):
        return Verdict(False, "multi_turn:force_terminated", len(model_turns),
                       f"{len(model_turns)} model turns for {len(ground_truth)} user turns")
    model_results: list[str] = []
    for k, (calls, truth_calls) in enumerate(zip(model_turns, ground_truth)):
        model_results += [execute(model, c)[0] for c in calls]
        truth_results = [execute(truth, parse_call_string(s))[0] for s in truth_calls]
        if not truth_calls:
            continue
        if not calls:
            return Verdict(False, "multi_turn:empty_turn_model_response", k, "no call in a turn that needs one")
        differences = state_differences(model.instances, truth.instances)
        if differences:
            return Verdict(False, "multi_turn:instance_state_mismatch", k, ", ".join(differences))
        missing = missing_results(truth_results, model_results)
        if missing:
            return Verdict(False, "multi_turn:execution_response_mismatch", k, repr(missing)[:200])
    return Verdict(True)


def state_differences(model: dict[str, Any], truth: dict[str, Any]) -> list[str]:
    """`Class.attribute` for each public attribute of a ground-truth instance the model's differs on
    (BFCL's `state_checker` / `_compare_instances`: `!=` on `vars()` without leading underscore)."""
    missing = object()
    return [f"{name}.{attr}" for name, instance in truth.items() for attr, value in vars(instance).items()
            if not attr.startswith("_") and getattr(model[name], attr, missing) != value]


def missing_results(expected: Sequence[str], got: Sequence[str]) -> list[str]:
    """Items of `expected` not matched one-for-one in `got`, order ignored (BFCL's
    `_is_subsequence_unordered`)."""
    left = Counter(got)
    missing = []
    for item in expected:
        if left[item] > 0:
            left[item] -= 1
        else:
            missing.append(item)
    return missing
