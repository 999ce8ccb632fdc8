"""The study report on hand-made runs: every verdict of the findings checklist follows the runs'
files, and turning one fact of the data around turns its verdict."""

import json
import re
import shutil

import pytest
import yaml

from toolcollapse.runtime import read_jsonl, write_jsonl
from toolcollapse.sweep import load_sweep

SPLITS = ("test", "ood_format", "ood_facts")
N_TASKS = 100


def _metrics(collapse_at, steps=12, spike=True, content_drop=0.0, pollution=0.0, sft_tokens=0.0):
    """A run's rows: healthy 0.95 until `collapse_at` (None: never), then 0.1; the probe every 2 steps
    with <tool_call>'s miss rate rising x100 two steps before the collapse when `spike`."""
    rows = []
    for step in range(steps):
        down = collapse_at is not None and step >= collapse_at
        h = 0.1 if down else 0.95
        row = {"step": step, "healthy_rate": h, "reward_mean": 0.3, "frac_groups_informative": 0.5, "seconds": 10.0,
               "entropy": 1.0, "grad_norm": 1.0, "approx_kl_old": 0.01, "reward_std_within_group": 0.3,
               "response_tokens": 50.0,
               "state/healthy_call": h * 0.7, "state/healthy_response": h * 0.3,
               "state/text_pollution": (1 - h) * 0.5 if down else pollution,
               "state/full_collapse": (1 - h) * 0.5 if down else 0.0, "sup/sft_tokens_total": sft_tokens}
        if step % 2 == 0:
            late = collapse_at is not None and step >= collapse_at - 2
            row["probe/tool_call/miss_required"] = 0.5 if (late and spike) else 0.005
            row["probe/content/tool_name/logp"] = -0.1 - (content_drop if late else 0.0)
            row["probe/content/arg_copied/logp"] = -0.2 - (content_drop if late else 0.0)
        rows.append(row)
    return rows


def _run(root, setting, seed, rows, success):
    """A finished run; `rows` empty: an sft_only control (a phase, no RL)."""
    run = root / setting / f"seed{seed}"
    final = run / "checkpoints" / f"step_{len(rows) or 12:06d}"
    (final / "eval").mkdir(parents=True)
    (final / "COMPLETE").write_text("")
    if rows:
        write_jsonl(run / "metrics.jsonl", rows)
    else:
        write_jsonl(run / "phases.jsonl", [{"step": 12, "phase": "sft_only", "phase/tokens": 1000.0}])
    for split, rate in success.items():
        _eval(final / "eval", split, rate)


def _eval(eval_dir, split, rate):
    eval_dir.mkdir(parents=True, exist_ok=True)
    wins = round(rate * N_TASKS)
    write_jsonl(eval_dir / f"{split}.jsonl", [{"task_id": f"{split}-{i}", "success": i < wins} for i in range(N_TASKS)])
    (eval_dir / f"{split}.summary.json").write_text(json.dumps({"n_episodes": N_TASKS, "limits": {"max_turns": 8}}))


DEFAULT = {"plain_hi": (6, 6), "plain_lo": (None, None), "spike": True, "content_drop": 0.1, "ets_test": 0.30,
           "ops_test": 0.15, "adaptive_test": 0.28, "adaptive_healthy_dip": False, "sft_only_test": 0.15,
           "ets_ood": (0.30, 0.35)}


def _study(tmp_path, **changes):
    """Hand-made runs of a two-rate study (2 seeds); `changes` turn facts of DEFAULT around."""
    d = {**DEFAULT, **changes}
    init = tmp_path / "sft"
    init.mkdir()
    (init / "config.json").write_text("{}")
    out = tmp_path / "study"
    settings = {"plain_lr1e-3": {"grpo.lr": 1e-3}, "ets_lr1e-3": {"grpo.lr": 1e-3, "supervision.ets.enabled": True},
                "ops_lr1e-3": {"grpo.lr": 1e-3, "supervision.ops.enabled": True},
                "adaptive_lr1e-3": {"grpo.lr": 1e-3, "supervision.adaptive.enabled": True,
                                    "grpo.checkpoint_every": 2, "grpo.keep_checkpoints": 3},
                "sft_only_lr1e-3": {"grpo.lr": 1e-3, "supervision.sft_only.match": str(out / "ets_lr1e-3" / "seed{seed}")},
                "plain_lr1e-5": {"grpo.lr": 1e-5}, "ets_lr1e-5": {"grpo.lr": 1e-5, "supervision.ets.enabled": True}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({
        "base": "configs/tiny_rl.yaml", "init": str(init), "out_dir": str(out), "seeds": [0, 1],
        "overrides": {"grpo.steps": 12, "monitor.probe_every": 2}, "eval_split": "test",
        "eval_extra_splits": list(SPLITS[1:]), "eval_n": N_TASKS, "settings": settings}))
    for split in SPLITS:
        _eval(out / "start" / "eval", split, 0.40)
    ood = {"ood_format": 0.1, "ood_facts": 0.2}
    for seed in (0, 1):
        _run(out, "plain_lr1e-3", seed, _metrics(d["plain_hi"][seed], spike=d["spike"], content_drop=d["content_drop"]),
             {"test": 0.02, "ood_format": 0.0, "ood_facts": 0.0})
        _run(out, "ets_lr1e-3", seed, _metrics(None, sft_tokens=1000.0), {"test": d["ets_test"], **ood})
        _run(out, "sft_only_lr1e-3", seed, [], {"test": d["sft_only_test"], **ood})
        _run(out, "ops_lr1e-3", seed, _metrics(None), {"test": d["ops_test"], **ood})
        _run(out, "adaptive_lr1e-3", seed, _metrics(4 if d["adaptive_healthy_dip"] else None, pollution=0.06,
                                                    sft_tokens=500.0), {"test": d["adaptive_test"], **ood})
        _run(out, "plain_lr1e-5", seed, _metrics(d["plain_lo"][seed], spike=d["spike"]),
             {"test": 0.40, "ood_format": 0.30, "ood_facts": 0.30})
        _run(out, "ets_lr1e-5", seed, _metrics(None), {"test": 0.40, "ood_format": d["ets_ood"][0],
                                                      "ood_facts": d["ets_ood"][1]})
    return load_sweep(path)


def _verdicts(sweep, specs):
    from toolcollapse.report import findings, load_study

    return {f.key.split("_")[0] if f.source == "paper" else f.key: f for f in findings(load_study(sweep, specs))}


def test_findings_follow_the_runs(tmp_path):
    v = _verdicts(*_study(tmp_path))
    assert v["f1"].verdict == "yes" and "2/2 seeds collapsed" in v["f1"].evidence and "-0.10" in v["f1"].evidence
    assert v["f2"].verdict == "yes" and "2/2 collapsed runs" in v["f2"].evidence
    assert v["f3"].verdict == "yes"
    assert v["f4"].verdict == "yes" and "ets never collapsed and solves 30.0 ± 0.0 %" in v["f4"].evidence
    assert v["f5"].verdict == "yes"
    assert "best interleaved ets 30.0 ± 0.0 % vs best synchronous ops 15.0" in v["f5"].evidence
    assert v["f6"].verdict == "yes" and "2/2 seeds at lr 0.001 and 0/2 at lr 1e-05" in v["f6"].evidence
    assert v["f7"].verdict == "no"  # at 1e-5 ETS is as good as plain on ood_format (30 %) and ood_facts (35 vs 30)
    assert "ets ood_facts +5.0" in v["f7"].evidence
    assert v["own_alarm_leads"].verdict == "yes"
    assert "in 2/2 collapsed runs (leads [2, 2]" in v["own_alarm_leads"].evidence
    assert v["own_adaptive_recovers"].verdict == "yes"
    assert v["own_adaptive_vs_fixed"].verdict == "yes"
    assert "with 500 SFT tokens vs the best fixed, ets" in v["own_adaptive_vs_fixed"].evidence
    assert v["own_signal_vs_sft_only"].verdict == "yes"
    assert "ets_lr1e-3 30.0 ± 0.0 % vs sft_only 15.0" in v["own_signal_vs_sft_only"].evidence


@pytest.mark.parametrize("changes, expected", [
    ({"plain_hi": (6, None), "plain_lo": (5, 5)}, {"f6": "no", "f7": "inconclusive"}),  # no stable plain at 1e-5
    ({"ets_ood": (0.10, 0.10)}, {"f7": "yes"}),  # stabilises at 1e-3, and lower than plain on both OOD splits at 1e-5
    ({"spike": False, "content_drop": 2.0}, {"f1": "no", "f2": "no", "own_alarm_leads": "no"}),
    ({"ets_test": 0.02, "ops_test": 0.02, "adaptive_test": 0.02, "adaptive_healthy_dip": True},
     {"f4": "no", "own_adaptive_recovers": "no"}),
    ({"ets_test": 0.02, "ops_test": 0.30}, {"f5": "no", "own_signal_vs_sft_only": "no"}),
    ({"adaptive_test": 0.05, "sft_only_test": 0.45}, {"own_adaptive_vs_fixed": "no", "own_signal_vs_sft_only": "no"}),
    ({"plain_hi": (None, None)}, {"f1": "no", "f4": "inconclusive", "f7": "inconclusive",
                                  "own_adaptive_recovers": "inconclusive"}),
])
def test_turning_the_data_around_turns_the_verdicts(tmp_path, changes, expected):
    v = _verdicts(*_study(tmp_path, **changes))
    assert {k: v[k].verdict for k in expected} == expected


def test_unfinished_runs_and_missing_evaluations_are_inconclusive_not_counted(tmp_path):
    from toolcollapse.report import blocks, load_study

    sweep, specs = _study(tmp_path)
    out = tmp_path / "study"
    rows = read_jsonl(out / "plain_lr1e-3" / "seed1" / "metrics.jsonl")
    write_jsonl(out / "plain_lr1e-3" / "seed1" / "metrics.jsonl", rows[:3])  # killed at step 3 of 12
    for run in ("plain_lr1e-3", "ets_lr1e-3", "ops_lr1e-3", "adaptive_lr1e-3"):
        for seed in (0, 1):  # killed before the evaluations
            shutil.rmtree(out / run / f"seed{seed}" / "checkpoints" / "step_000012" / "eval")
    study = load_study(sweep, specs)
    v = _verdicts(sweep, specs)
    assert "1/1 seeds collapsed" in v["f1"].evidence  # the unfinished seed is not a run that did not collapse
    assert v["f4"].verdict == v["own_adaptive_recovers"].verdict == "inconclusive"
    assert "not evaluated yet" in v["f4"].evidence
    assert "13/14 runs done" in blocks(study, [])[1][1]


def test_report_files(tmp_path):
    from toolcollapse.report import write_report

    sweep, specs = _study(tmp_path)
    md = write_report(sweep, specs)
    text = md.read_text()
    assert text.startswith("# Study report: study")
    assert "| plain | plain | 2/2 | 2/2 | 2.0 ± 0.0 | 0.0 ± 0.0 | 0.0 ± 0.0 | 0 | 3.50 (plain RL) |" in text
    assert "| start checkpoint | - | - | - | 40.0 | 40.0 | 40.0 | 0 |  |" in text
    for fig in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text):
        assert (md.parent / fig).is_file()
    page = (md.parent / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3  # control tokens, states at each of 2 lrs
    assert page.count("<table>") == len(re.findall(r"^\|(?:---\|)+$", text, re.M)) == 5  # findings, 2 lrs, lr, monitor


@pytest.mark.parametrize("setting, expected", [("plain_lr1e-3", "plain"), ("ets_lr1e-5", "ets"),
                                               ("sft_term_lr5e-4", "sft_term"), ("hybrid", "hybrid")])
def test_method_names(setting, expected):
    from toolcollapse.report import method_name

    assert method_name(setting) == expected
