"""The study report on hand-made runs: every verdict of the findings checklist follows the runs'
files, and turning one fact of the data around turns its verdict."""

import json
import re

import pytest
import yaml

from toolcollapse.runtime import write_jsonl
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


def _study(tmp_path, plain_lo_collapses=False, ets_ood=(0.30, 0.35), adaptive_test=0.28, sft_only_test=0.20):
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
    for seed in (0, 1):
        _run(out, "plain_lr1e-3", seed, _metrics(6, content_drop=0.1), {"test": 0.02, "ood_format": 0.0, "ood_facts": 0.0})
        _run(out, "ets_lr1e-3", seed, _metrics(None, sft_tokens=1000.0), {"test": 0.30, "ood_format": 0.1,
                                                                          "ood_facts": 0.2})
        _run(out, "sft_only_lr1e-3", seed, [], {"test": sft_only_test, "ood_format": 0.1, "ood_facts": 0.2})
        _run(out, "ops_lr1e-3", seed, _metrics(None), {"test": 0.20, "ood_format": 0.1, "ood_facts": 0.2})
        _run(out, "adaptive_lr1e-3", seed, _metrics(None, pollution=0.06, sft_tokens=500.0),
             {"test": adaptive_test, "ood_format": 0.1, "ood_facts": 0.2})
        _run(out, "plain_lr1e-5", seed, _metrics(5 if plain_lo_collapses else None),
             {"test": 0.40, "ood_format": 0.30, "ood_facts": 0.30})
        _run(out, "ets_lr1e-5", seed, _metrics(None), {"test": 0.40, "ood_format": ets_ood[0], "ood_facts": ets_ood[1]})
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
    assert "best interleaved ets 30.0 ± 0.0 % vs best synchronous ops 20.0" in v["f5"].evidence
    assert v["f6"].verdict == "yes" and "2/2 seeds at lr 0.001 and 0/2 at lr 1e-05" in v["f6"].evidence
    assert v["f7"].verdict == "no"  # at 1e-5 ETS is as good as plain on ood_format (30 %) and ood_facts (35 vs 30)
    assert "ets ood_facts +5.0" in v["f7"].evidence
    assert v["own_alarm_leads"].verdict == "yes"
    assert "in 2/2 collapsed runs (leads [2, 2]" in v["own_alarm_leads"].evidence
    assert v["own_adaptive_recovers"].verdict == "yes"
    assert v["own_adaptive_vs_fixed"].verdict == "yes"
    assert "with 500 SFT tokens vs the best fixed, ets" in v["own_adaptive_vs_fixed"].evidence
    assert v["own_signal_vs_sft_only"].verdict == "yes"
    assert "ets_lr1e-3 30.0 ± 0.0 % vs sft_only 20.0" in v["own_signal_vs_sft_only"].evidence


def test_turning_the_data_around_turns_the_verdicts(tmp_path):
    v = _verdicts(*_study(tmp_path, plain_lo_collapses=True, ets_ood=(0.10, 0.10), adaptive_test=0.15,
                          sft_only_test=0.45))
    assert v["f6"].verdict == "no" and "0.001 and 2/2 at lr 1e-05" in v["f6"].evidence
    assert v["f7"].verdict == "yes"  # stabilises at 1e-3, and lower than plain on both OOD splits at 1e-5
    # plain at 1e-5 collapsed now, and no alarm can fire there before step 5 the way the data is made
    assert "false alarms in 0/" in v["own_alarm_leads"].evidence
    assert v["own_adaptive_vs_fixed"].verdict == "no" and v["own_signal_vs_sft_only"].verdict == "no"


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
