"""Detectors, alarm rules and the watcher, the collapse step, the lead-time table, the gradient share,
and alarms inside a real (tiny) RL run: on_alarm stop, then resume without re-alarming."""

import json
import math

import pytest
import torch

from toolcollapse.alarms import (Cusum, RobustZ, Rule, Watcher, collapse_step, control_rules, control_series,
                                 first_alarm, replay)
from toolcollapse.config import MonitorConfig
from toolcollapse.diagnose import diagnose_rows, format_lead_table, lead_table
from toolcollapse.monitor import control_gradient_share





def _noise(n: int, seed: int, level: float = 0.05, sd: float = 0.01) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (level + sd * torch.randn(n, generator=g)).tolist()


@pytest.mark.parametrize("detector", [RobustZ(), Cusum()])
def test_detectors_fire_at_an_injected_spike(detector):
    series = _noise(40, seed=0)
    series[25:] = [0.5] * 15  # a control token's forbidden mass jumps at step 25
    assert first_alarm(detector.fires(series)) == 25


@pytest.mark.parametrize("detector", [RobustZ(), Cusum()])
def test_detectors_rarely_fire_on_stationary_noise(detector):
    false_alarms = sum(first_alarm(detector.fires(_noise(60, seed))) is not None for seed in range(200))
    assert false_alarms <= 2  # <= 1 % of series (measured 0-0.5 % over 1000)


def test_detectors_respect_direction_and_warmup():
    falling = [0.9] * 20 + [0.2] * 5  # the healthy rate drops at step 20
    assert first_alarm(RobustZ(direction=1).fires(falling)) is None
    assert first_alarm(RobustZ(direction=-1).fires(falling)) == 20
    assert first_alarm(Cusum(direction=-1).fires(falling)) == 20
    early = [0.0, 0.0, 5.0, 5.0, 5.0, 5.0, 5.0]  # a jump inside the warm-up is the baseline, not an alarm
    assert RobustZ(warmup=5).fires(early)[:5] == [False] * 5


def test_first_alarm_reports_the_step_label():
    assert first_alarm([False, True, True], steps=[10, 12, 14]) == 12


def test_streaming_updates_equal_the_replay_of_the_whole_series():
    series = _noise(40, seed=1)
    series[30:] = [0.3] * 10
    for det in (RobustZ(warmup=5), Cusum(warmup=5)):
        live = det.__class__(warmup=5)
        assert [live.update(x) for x in series] == det.fires(series)


def test_probe_floor_makes_a_flat_series_fire_only_on_a_real_move():
    rule = Rule("probe/im_end/miss_required", warmup=1, min_scale=0.005)  # robust z 8: a move of > 0.04
    flat = [0.002, 0.002, 0.0021, 0.0035, 0.004, 0.03]
    assert first_alarm(rule.make().fires(flat)) is None
    assert first_alarm(rule.make().fires(flat + [0.06])) == 6


def test_watcher_skips_absent_steps_and_alarms_once_per_rule():
    rules = [Rule("probe/x", warmup=1, min_scale=0.01), Rule("y", warmup=1, min_scale=0.01)]
    rows = [{"step": 0, "probe/x": 0.0, "y": 0.0}, {"step": 1, "y": 0.0},  # no probe at step 1
            {"step": 2, "probe/x": 0.5, "y": math.nan}, {"step": 3, "probe/x": 0.9, "y": 1.0}]
    w = Watcher(rules)
    fired = [[a.rule.series for a in w.update(r["step"], r)] for r in rows]
    assert fired == [[], [], ["probe/x"], ["y"]]  # probe/x fires once; NaN is not an observation
    assert [(a.step, a.rule.series, a.value) for a in replay(rules, rows)] == [(2, "probe/x", 0.5), (3, "y", 1.0)]


def test_cusum_sums_in_steps_so_a_sparse_probe_sees_a_shift_when_a_dense_one_does():
    rule = Rule("probe/content/answer/logp", detector="cusum", direction=-1, warmup=1, min_scale=0.01)
    shift = lambda step: 0.0 if step == 0 else -0.05  # noqa: E731  z = -5: S grows 3.5 a step, fires above 10
    for every in (1, 3):
        rows = [{"step": t, rule.series: shift(t)} for t in range(0, 10, every)]
        assert [a.step for a in replay([rule], rows)] == [3]  # per observation, every 3 would fire at step 9
    rows = [{"step": t, **({rule.series: shift(t)} if t % 3 == 0 else {})} for t in range(10)]
    assert [a.step for a in replay([rule], rows)] == [3]  # the steps between observations count, not the rows


def test_collapse_step_is_half_the_step0_rate_held_for_k_steps():
    healthy = [0.9, 0.8, 0.44, 0.5, 0.4, 0.3, 0.2, 0.6]
    assert collapse_step(healthy, hold=3) == 4  # 0.44 at step 2 does not hold; 0.4, 0.3, 0.2 do
    assert collapse_step(healthy, hold=1) == 2
    assert collapse_step([0.9, 0.9, 0.9], hold=1) is None


def test_default_rules_watch_required_misses_and_forbidden_peaks():
    series = control_series(MonitorConfig().control_tokens)
    assert series[:4] == ["probe/tool_call/miss_required", "probe/tool_call_end/miss_required",
                          "probe/im_end/miss_required", "probe/im_end/miss_after_call"]  # the last: call_end sampled
    assert "probe/tool_call/p_forbidden_max" in series and len(series) == 9
    custom = control_rules(MonitorConfig(alarm_series=("entropy",), alarm_detector="cusum", alarm_warmup=4))
    assert [(r.series, r.detector, r.warmup) for r in custom] == [("entropy", "cusum", 4)]


def _run(healthy, probe):
    return [{"step": i, "healthy_rate": h, "probe/s": p} for i, (h, p) in enumerate(zip(healthy, probe))]


def test_lead_table_counts_leads_misses_and_false_alarms():
    rule = [Rule("probe/s", warmup=1, min_scale=0.01)]
    runs = [("early", _run([0.9] * 6 + [0.1] * 6, [0.0, 0.0, 0.5] + [0.9] * 9)),  # alarm 2, collapse 6: lead 4
            ("late", _run([0.9] * 3 + [0.1] * 9, [0.0] * 4 + [0.9] * 8)),  # alarm 4 after collapse 3: missed
            ("stable", _run([0.9] * 12, [0.0] * 12)),
            ("noisy", _run([0.9] * 12, [0.0] * 5 + [0.7] * 7))]  # alarm without collapse: false alarm
    (row,) = lead_table(runs, {"probe": rule}, hold=3)
    assert (row["n_collapsed"], row["fired_before"], row["leads"], row["lead_ge_3"]) == (2, 1, [4], 1)
    assert row["floor_leads"] == [4] and row["missed"] == ["late"] and row["false_alarms"] == ["noisy"]
    assert "| probe | 1/2 | 1/2 | 4 [4-4] | 4 [4-4] | 1/2 |" in format_lead_table([row])
    d = diagnose_rows(runs[0][1], rule, [], hold=3)
    assert (d.collapse_step, d.below_floor_step, d.first_alarm) == (6, 6, 2)


def test_gradient_share_hand_computed():
    w = torch.tensor([1.0, 1.0], requires_grad=True)
    per_token = torch.stack([3.0 * w[0], 2.0 * w[1], 4.0 * w[1]])  # token-mean: grads /3
    s = control_gradient_share(per_token, torch.tensor([True, False, False]), [w])
    # g_ctrl = [1, 0], g_other = [0, 2]: share 1 / (1 + 4)
    assert s["ctrl/grad_sq_share"] == pytest.approx(0.2) and s["ctrl/token_share"] == pytest.approx(1 / 3)
    assert s["ctrl/grad_norm_ctrl"] == pytest.approx(1.0) and s["ctrl/grad_norm_other"] == pytest.approx(2.0)
    assert w.grad is None  # the parameters' gradients are untouched
    zero = torch.stack([0.0 * w[0], 0.0 * w[1]])
    assert control_gradient_share(zero, torch.tensor([True, False]), [w]) == {}  # no gradient: no series


# ----------------------------------------------------------------------------- alarms in a run


@pytest.mark.slow
def test_on_alarm_stop_checkpoints_stops_and_resume_does_not_realarm(tmp_path, tiny_model, tokenizer):
    from toolcollapse.config import GRPOConfig, RunConfig, WorldConfig
    from toolcollapse.rl import run_rl
    from toolcollapse.runtime import read_jsonl

    init = tmp_path / "init"
    tiny_model.save_pretrained(init)
    tokenizer.save_pretrained(init)
    # `step` is a metric too: 0, 1, 2, ... -- with warm-up 1 and a unit scale it fires at step 1 for sure
    monitor = MonitorConfig(probe_every=1, probe_size=2, alarm_series=("step",), alarm_min_scale=1.0,
                            alarm_threshold=0.5, on_alarm="stop")
    cfg = RunConfig(seed=1, init=str(init), threads=1, world=WorldConfig(n_train=40, n_test=4, n_ood=4),
                    grpo=GRPOConfig(steps=4, prompts_per_step=1, group_size=2, micro_batch_size=2,
                                    checkpoint_every=10, samples_per_step=0), monitor=monitor)
    cfg = __import__("dataclasses").replace(cfg, rollout=__import__("dataclasses").replace(
        cfg.rollout, max_turns=1, max_new_tokens=8))
    run_dir = run_rl(cfg, tmp_path / "run")
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1]  # stopped after step 1
    assert read_jsonl(run_dir / "alarms.jsonl") == [{"step": 1, "series": "step", "detector": "robust_z",
                                                    "value": 1.0}]
    assert (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    seen = []
    run_rl(cfg, run_dir, resume=True, on_alarm=lambda alarms, ctx: seen.append(alarms))
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert seen == [] and len(read_jsonl(run_dir / "alarms.jsonl")) == 1  # the step-1 alarm is not raised again
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["alarms_total"] == 1
    from toolcollapse.cli import main

    assert main(["diagnose", str(run_dir), "--out", str(tmp_path / "diag")]) == 0
    summary = json.loads((tmp_path / "diag" / "summary.json").read_text())
    assert summary["steps_done"] == 4 and [a["step"] for a in summary["alarms"]] == [1]
    assert all((tmp_path / "diag" / f).stat().st_size > 1000 for f in ("control_tokens.png", "states.png", "errors.png"))


def test_diagnose_cli_autopsies_a_dump_and_rejects_bad_paths(tmp_path, tokenizer, capsys):
    from toolcollapse.cli import main

    tokenizer.save_pretrained(tmp_path / "tok")
    call = '<tool_call>\n{"name": "kb_lookup", "arguments": {"entity": "Oslo"}}\n</tool_call>'
    rows = [{"step": 0, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": call},
                                     {"role": "tool", "content": "r"}, {"role": "assistant", "content": "42"}]},
            {"step": 1, "messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "sure " + call}]}]
    dump = tmp_path / "dump.jsonl"
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["diagnose", str(dump), "--tokenizer", str(tmp_path / "tok"), "--no-figures"]) == 0
    summary = json.loads((tmp_path / "dump_diagnose" / "summary.json").read_text())
    assert [r["healthy_rate"] for r in summary["rows"]] == [1.0, 0.0]
    assert summary["rows"][1]["state/text_pollution"] == 1.0
    assert main(["diagnose", str(dump)]) == 2  # a dump needs --tokenizer
    assert main(["diagnose", str(tmp_path / "nowhere")]) == 2
    assert "--tokenizer" in capsys.readouterr().err
