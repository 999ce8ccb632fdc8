"""The signal protocol (signals/): the registry builds what a config turns on, in the loop's order, and a new
signal is one class plus one registry line -- shown by a toy signal that lives only here (docs/DESIGN.md,
"Where to add"); tests/test_trl_signals.py runs it through TRL's trainer."""


import pytest
import torch
from safetensors.torch import load_file
from test_rl import _metrics, _rl_config

from toolcollapse import signals
from toolcollapse.config import (ETSConfig, HBGConfig, OPSConfig, PRSConfig, RunConfig, SupervisionConfig,
                                 load_config)
from toolcollapse.signals import LossTerm, Signal, Step, build_signals


def _names(**supervision):
    return [type(s).__name__ for s in build_signals(RunConfig(supervision=SupervisionConfig(**supervision)))]


def test_the_registry_builds_the_signals_a_config_turns_on_in_the_loop_s_order():
    assert _names() == []
    assert _names(ops=OPSConfig(enabled=True), sft_coef=0.5) == ["OPS", "SFTTermSignal"]  # hybrid
    assert _names(ets=ETSConfig(enabled=True)) == ["ETS"]
    assert _names(ets=ETSConfig(enabled=True), prs=PRSConfig(enabled=True)) == ["PRS"]  # ETS's phases, once
    # the rows' order in a group: hinted before expert, as the update and the report expect
    assert _names(ops=OPSConfig(enabled=True), hbg=HBGConfig(enabled=True), unlikelihood_coef=0.1) == [
        "HBG", "OPS", "UnlikelihoodSignal"]


class SampledNLL(LossTerm):
    """A toy term: coef * the mean NLL of the tokens the policy sampled, from the update's own forward."""

    SUMS = ("nll", "calls")

    def __init__(self, coef):
        super().__init__()
        self.coef = coef

    def forward_loss(self, logp, mb):
        nll = -logp.mean()
        self.add(nll=nll.item(), calls=1)
        return self.coef * nll

    @staticmethod
    def metrics_of(sums):
        return {"toy/nll": sums["nll"] / sums["calls"]} if sums["calls"] else {}


class Toy(Signal):
    """A toy signal: its term in every update, and the number of its own rollouts' turns after it."""

    name = "toy"

    @staticmethod
    def enabled(cfg):
        return True

    def terms(self, step: Step):
        return [SampledNLL(5.0)]

    def after_update(self, step: Step):
        return {"toy/turns": float(sum(len(ep.turns) for ep in step.episodes))}


@pytest.mark.slow
def test_a_toy_signal_is_one_class_and_one_registry_line(tmp_path, answering_checkpoint, monkeypatch):
    """The loop calls the toy's hooks without knowing its name: its metrics land in metrics.jsonl, and its term
    moves the weights away from a run without it (the same seed, so the same first rollouts)."""
    from toolcollapse.rl import run_rl

    cfg = load_config(_rl_config(tmp_path, answering_checkpoint, temperature=2.0), ["grpo.steps=2",
                                                                                  "grpo.checkpoint_every=2"])
    plain = run_rl(cfg, tmp_path / "plain")
    monkeypatch.setattr(signals, "SIGNALS", [*signals.SIGNALS, Toy])
    toy = run_rl(cfg, tmp_path / "toy")
    rows, plain_rows = _metrics(toy), _metrics(plain)
    assert all(r["toy/nll"] > 0 and r["toy/turns"] >= cfg.grpo.prompts_per_step * cfg.grpo.group_size
               for r in rows)
    assert not any("toy/nll" in r for r in plain_rows)
    assert rows[0]["reward_mean"] == plain_rows[0]["reward_mean"]  # the first step's rollouts: the same weights
    final = [load_file(run / "checkpoints" / "step_000002" / "model.safetensors") for run in (plain, toy)]
    assert any(not torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_run_rl_never_names_a_signal():
    """The loop's stages reach the signals only through the protocol (issue 19): no signal's config section or
    metric in rl.py's step stages (the sft_only control is not a signal: run_rl hands it over first); each
    stage at most 60 lines."""
    import inspect

    from toolcollapse import rl

    stages = [rl.run_rl, rl.rollout_stage, rl.monitor_stage, rl.update_stage, rl.signals_stage, rl.alarm_stage,
              rl.log_stage]
    for stage in stages:
        source = inspect.getsource(stage)
        for word in ("supervision.ops", "supervision.hbg", "supervision.ets", "supervision.prs", "supervision.adaptive",
                     "sft_coef", "unlikelihood_coef", "adaptive/"):
            assert word not in source, (stage.__name__, word)
        assert len(source.splitlines()) <= 60, stage.__name__
