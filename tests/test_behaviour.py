"""Behaviour kept against the pre-refactor revision (bench/behaviour_vs_rev.py): the comparison flags what
differs and passes what does not; and, slow, the working tree against that revision on real runs."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("behaviour_vs_rev", ROOT / "bench" / "behaviour_vs_rev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _side(path: Path, tokens, rows, weight) -> Path:
    (path / "run" / "checkpoints" / "step_000001").mkdir(parents=True)
    (path / "rollouts.json").write_text(json.dumps(tokens))
    (path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_file({"w": weight}, path / "run" / "checkpoints" / "step_000001" / "model.safetensors")
    return path


TOKENS = [[[1, 2, 3], [1, 2, 4]], [[5, 6]]]  # two generate calls: 2 episodes, then 1
ROW = {"step": 0, "loss": 0.5, "healthy_rate": 0.75, "seconds": 3.0, "seconds_rollout": 1.0}
WEIGHT = torch.tensor([1.0, -2.0, 3.0])


@pytest.mark.parametrize("change, kept, where", [
    ({}, True, None),
    ({"seconds": 9.0, "seconds_rollout": 0.1}, True, None),  # timings differ run to run
    ({"loss": 0.5 * (1 + 1e-7)}, True, None),  # a reordered float sum, within rtol
    ({"loss": 0.5 * (1 + 1e-3)}, False, "metrics.jsonl[0].loss"),
    ({"extra/key": 1.0}, False, "metrics.jsonl[0]: keys"),
    ({"loss": float("nan")}, False, "metrics.jsonl[0].loss: 0.5 vs nan"),  # a NaN on one side
])
def test_the_comparison_passes_equal_runs_and_names_a_metric_that_differs(tmp_path, change, kept, where):
    bench = _bench()
    old = _side(tmp_path / "rev", TOKENS, [ROW], WEIGHT)
    new = _side(tmp_path / "now", TOKENS, [{**ROW, **change}], WEIGHT)
    diffs, facts = bench.compare_sides(old, new, rtol=1e-5)
    assert (not diffs) == kept, diffs
    if where:
        assert any(d.startswith(where) for d in diffs), diffs
    assert facts["generate calls"] == 2 and facts["episodes"] == 3 and facts["weight files"] == 1


def test_the_comparison_flags_one_changed_token_and_one_changed_weight(tmp_path):
    bench = _bench()
    old = _side(tmp_path / "rev", TOKENS, [ROW], WEIGHT)
    token = _side(tmp_path / "token", [[[1, 2, 3], [1, 2, 5]], [[5, 6]]], [ROW], WEIGHT)
    diffs, _ = bench.compare_sides(old, token, rtol=1e-5)
    assert diffs == ["rollouts: differ from generate call 0 (2 calls in rev, 2 now)"]
    weight = _side(tmp_path / "weight", TOKENS, [ROW], WEIGHT + torch.tensor([0.0, 0.0, 1e-3]))
    diffs, facts = bench.compare_sides(old, weight, rtol=1e-5)
    assert len(diffs) == 1 and diffs[0].startswith("checkpoints/step_000001/model.safetensors.w: max difference")
    assert facts["largest relative difference"] == pytest.approx(1e-3 / 3, rel=1e-3)



def test_an_intended_difference_is_its_scenario_s_listed_metric_values_only(tmp_path):
    """A scenario's listed metric (INTENDED, with its reason) may differ in value; a missing key, another
    metric or another scenario's same metric still counts."""
    bench = _bench()
    old = _side(tmp_path / "rev", TOKENS, [{**ROW, "sup/sft_nll": 0.1}], WEIGHT)
    new = _side(tmp_path / "now", TOKENS, [{**ROW, "sup/sft_nll": 0.2, "loss": 0.6}], WEIGHT)
    diffs, _ = bench.compare_sides(old, new, rtol=1e-5)
    assert len(diffs) == 2
    assert [d for d in diffs if bench._intended("sft_term_minibatches", d)] == [
        "metrics.jsonl[0].sup/sft_nll: 0.1 vs 0.2 (relative 0.5)"]
    assert not any(bench._intended("sft_term", d) for d in diffs)
    nan = _side(tmp_path / "nan", TOKENS, [{**ROW, "sup/sft_nll": float("nan")}], WEIGHT)
    diffs, _ = bench.compare_sides(old, nan, rtol=1e-5)
    assert diffs and not any(bench._intended("sft_term_minibatches", d) for d in diffs)
    gone = _side(tmp_path / "gone", TOKENS, [ROW], WEIGHT)
    diffs, _ = bench.compare_sides(old, gone, rtol=1e-5)
    assert diffs and not any(bench._intended("sft_term_minibatches", d) for d in diffs)

@pytest.mark.slow
def test_the_working_tree_keeps_the_pre_refactor_revision_s_behaviour(tmp_path, answering_checkpoint):
    """Plain GRPO, the adaptive schedule with an alarm that acts, and TRL with OPS rows, 3 steps each, under
    the pre-refactor revision's code (a git worktree) and this checkout's: identical rollouts, metrics,
    logs, checkpoints and optimizer state."""
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", _bench().PRE_REFACTOR],
                                                     capture_output=True).returncode:
        pytest.skip("needs a git checkout that holds the pre-refactor revision")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "behaviour_vs_rev.py"), "--checkpoint",
                           str(answering_checkpoint), "--only", "plain,adaptive,trl_ops"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and "scenario" not in line]
    assert [line.split(" | ")[:2] for line in table] == [["| plain", "yes"], ["| adaptive", "yes"], ["| trl_ops", "yes"]]
