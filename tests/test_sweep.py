import os
import signal
from pathlib import Path

import pytest
import yaml

from toolcollapse.config import ConfigError
from toolcollapse.alarms import first_step_below, rolling_mean
from toolcollapse.runtime import write_jsonl
from toolcollapse.sweep import load_sweep
from toolcollapse.sweep_table import format_table, summarize_run


def test_rolling_mean_and_first_step_below():
    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert first_step_below([0.9, 0.4, 0.9, 0.3, 0.2, 0.1], 0.5, hold=2) == 3
    assert first_step_below([0.9, 0.4, 0.9], 0.5, hold=2) is None


def _sweep_file(tmp_path, **extra):
    init = tmp_path / "sft"
    init.mkdir(exist_ok=True)
    (init / "config.json").write_text("{}")
    raw = {"base": "configs/tiny_rl.yaml", "init": str(init), "out_dir": str(tmp_path / "study"),
           "seeds": [0, 1], "settings": {"hot": {"grpo.lr": 3.0e-3}, "cold": {"grpo.lr": 1.0e-4}}, **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_sweep_expands_settings_and_seeds_to_named_run_dirs(tmp_path):
    sweep, specs = load_sweep(_sweep_file(tmp_path))
    assert [(s.setting, s.seed) for s in specs] == [("hot", 0), ("hot", 1), ("cold", 0), ("cold", 1)]
    assert specs[1].run_dir == tmp_path / "study" / "hot" / "seed1"
    assert specs[1].cfg.grpo.lr == 3.0e-3 and specs[1].cfg.seed == 1 and specs[2].cfg.grpo.lr == 1.0e-4
    assert specs[0].cfg.init == sweep.init and specs[0].cfg.threads == 1


@pytest.mark.parametrize("extra, message", [
    ({"settings": {"hot": {"grpo.learning_rate": 1.0}}}, "settings.hot: unknown key grpo.learning_rate"),
    ({"init": "/no/such/checkpoint"}, "/no/such/checkpoint"),
    ({"seeds": "zero"}, "seeds"),
    ({"workers_count": 2}, "unknown key workers_count"),
])
def test_bad_sweep_files_are_rejected_before_any_run(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_sweep_file(tmp_path, **extra))


def test_summarize_run_finds_collapse_and_the_first_probe_move(tmp_path):
    healthy = [0.95] * 6 + [0.7, 0.4, 0.2, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    rows = []
    for step, h in enumerate(healthy):
        row = {"step": step, "healthy_rate": h, "reward_mean": h / 2, "frac_groups_informative": 0.5 if h > 0.1 else 0.0}
        if step % 2 == 0:  # the probe runs every 2 steps; <|im_end|> inside calls rises from step 4
            row["probe/im_end/p_forbidden_max"] = 0.01 if step < 4 else 0.4
            row["probe/tool_call/miss_required"] = 0.02 if step < 8 else 0.5
        rows.append(row)
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    s = summarize_run(tmp_path, steps=16, hold=3)
    assert s["healthy_start"] == pytest.approx(0.95)
    assert s["collapsed"] and s["healthy_min_smooth"] == pytest.approx(0.05)
    assert s["collapse_step"] == 7  # 0.4, 0.2, 0.1 < 0.475 from step 7 on (raw rates, held 3 steps)
    assert s["floor_step"] == 9  # 0.1, 0.05, 0.05 < 0.2 (0.2 itself is not below)
    assert s["step_uninformative"] == 9
    assert s["first_probe_move"] == "im_end/p_forbidden_max 0.010->0.400 @4"
    table = format_table([{"setting": "hot", "seed": 0, **s}])
    assert "| hot | 0 | 16/16 |" in table and "yes" in table


def test_sweep_and_diagnose_share_one_collapse_definition(tmp_path):
    """A dip that a 5-step mean smooths away is a collapse when it holds for `hold` raw steps, and the
    sweep table and `diagnose` say so alike; a shorter dip is a collapse for neither."""
    from toolcollapse.diagnose import diagnose_rows

    for healthy, expected in (([0.9, 0.9, 0.9, 0.3, 0.3, 0.3, 0.9, 0.9, 0.9, 0.9], 3),
                              ([0.9, 0.9, 0.9, 0.3, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9], None)):
        rows = [{"step": i, "healthy_rate": h, "reward_mean": 0.0, "frac_groups_informative": 1.0}
                for i, h in enumerate(healthy)]
        write_jsonl(tmp_path / "metrics.jsonl", rows)
        s = summarize_run(tmp_path, steps=len(rows), hold=3)
        d = diagnose_rows(rows, [], [], hold=3)
        assert s["collapse_step"] == d.collapse_step == expected
        assert s["collapsed"] == (expected is not None)


def test_paired_comparison_sign_test():
    from toolcollapse.sweep_table import paired_comparison

    before = [True] * 10 + [False] * 10
    after = [True] * 10 + [True] * 6 + [False] * 4  # 6 gained, 0 lost: p = 2 / 2**6
    r = paired_comparison(before, after)
    assert (r["eval_gained"], r["eval_lost"]) == (6, 0)
    assert r["eval_p_value"] == pytest.approx(2 / 64)
    assert paired_comparison([True, False], [True, False])["eval_p_value"] == 1.0


def test_the_method_table_aggregates_seeds_and_counts_sft_tokens_and_time(tmp_path):
    """Per setting: mean ± sd (sample) over seeds of each split's success, the healthy rate's smoothed
    min, SFT tokens and wall time from the metrics (RL) or the phases (sft_only, which has no RL)."""
    from toolcollapse.sweep_table import format_method_table

    rows = []
    for seed, (success, ood) in enumerate([(0.30, 0.10), (0.40, 0.20)]):
        run = tmp_path / f"ets{seed}"
        run.mkdir()
        write_jsonl(run / "metrics.jsonl", [
            {"step": i, "healthy_rate": h, "reward_mean": 0.5, "frac_groups_informative": 1.0, "seconds": 30.0,
             "sup/sft_tokens_total": 100.0 * (i + 1)} for i, h in enumerate([0.9, 0.8, 0.9])])
        write_jsonl(run / "phases.jsonl", [{"step": 1, "phase": "ets", "phase/tokens": 200.0, "phase/seconds": 60.0}])
        rows.append({"setting": "ets", "seed": seed, **summarize_run(run, 3, 3), "eval_success": success, "eval_n": 200,
                     "ood_content/eval_success": ood})
    only = tmp_path / "only"
    only.mkdir()
    write_jsonl(only / "phases.jsonl", [{"step": 3, "phase": "sft_only", "phase/tokens": 300.0, "phase/seconds": 6.0}])
    rows.append({"setting": "sft_only", "seed": 0, **summarize_run(only, 3, 3), "eval_success": 0.5, "eval_n": 200})
    assert rows[0]["sft_tokens"] == 300.0 and rows[0]["wall_s"] == 150.0  # 3 steps x 30 s + the phase's 60 s
    table = format_method_table(rows, ["test", "ood_content"], {"test": 0.425})
    lines = table.splitlines()
    assert lines[2] == "| start | - | - | - | - | 42.5 | - | 0 | 0 |"
    assert lines[3] == "| ets | 2 | 85.0 ± 0.0 | 86.7 ± 0.0 | 0/2 | 35.0 ± 7.1 | 15.0 ± 7.1 | 300 | 2.5 |"
    assert lines[4] == "| sft_only | 1 | - | - | no RL | 50.0 | - | 300 | 0.1 |"
    assert "no RL (sft_only)" in format_table(rows)


def test_an_sft_only_control_waits_for_the_run_it_matches_and_bad_matches_are_refused(tmp_path):
    from toolcollapse.sweep import run_after

    out = tmp_path / "study"
    settings = {"only": {"supervision.sft_only.match": str(out / "ets" / "seed{seed}")},
                "ets": {"supervision.ets.enabled": True}}
    _, specs = load_sweep(_sweep_file(tmp_path, settings=settings))
    assert run_after(specs) == {out / "only" / f"seed{k}": out / "ets" / f"seed{k}" for k in (0, 1)}

    elsewhere = {"only": {"supervision.sft_only.match": str(tmp_path / "other" / "seed{seed}")}}
    with pytest.raises(ConfigError, match=r"settings.only: .*other/seed0 is not a finished run"):
        load_sweep(_sweep_file(tmp_path, settings=elsewhere))
    itself = {"only": {"supervision.sft_only.match": str(out / "only" / "seed{seed}")}}
    with pytest.raises(ConfigError, match="names the run itself"):
        load_sweep(_sweep_file(tmp_path, settings=itself))
    chain = {"a": {"supervision.sft_only.match": str(out / "b" / "seed{seed}")},
             "b": {"supervision.sft_only.match": str(out / "c" / "seed{seed}")}, "c": {}}
    with pytest.raises(ConfigError, match="matches a run that trains, not another control"):
        load_sweep(_sweep_file(tmp_path, settings=chain))


def test_a_match_written_as_a_relative_path_is_the_same_run(tmp_path):
    from toolcollapse.sweep import run_after

    relative = os.path.relpath(tmp_path / "study" / "ets", Path.cwd())  # out_dir is absolute; the match is not
    path = _sweep_file(tmp_path, settings={"only": {"supervision.sft_only.match": relative + "/seed{seed}"},
                                           "ets": {"supervision.ets.enabled": True}})
    _, specs = load_sweep(path)
    out = tmp_path / "study"
    assert run_after(specs) == {out / "only" / f"seed{k}": out / "ets" / f"seed{k}" for k in (0, 1)}


@pytest.mark.slow
def test_a_worker_killed_outright_stops_the_sweep_instead_of_hanging(tmp_path, monkeypatch):
    """The OOM killer sends SIGKILL: no exception reaches a multiprocessing.Pool callback, and a sweep
    waiting on one would wait forever; the executor's broken pool raises."""
    import concurrent.futures

    import toolcollapse.sweep as sweep_module

    sweep, specs = load_sweep(_sweep_file(tmp_path, seeds=[0]))
    monkeypatch.setattr(sweep_module, "_run_one", _die)  # spawn pickles the function by name: use a module-level one
    with pytest.raises(concurrent.futures.process.BrokenProcessPool):
        sweep_module.run_sweep(sweep, specs[:1])


def _die(job):
    os.kill(os.getpid(), signal.SIGKILL)
