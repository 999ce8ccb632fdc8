"""The study report on hand-made runs: every number and verdict word follows the runs' files, the learning
rates are picked by their rules, and turning one fact of the data around turns its verdict."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from toolcollapse.runtime import read_jsonl, write_jsonl
from toolcollapse.sweep import load_sweep

N = 200  # tasks in every split
SPLITS = ("test", "ood_format", "ood_facts", "val")
STEPS = 20
LIMITS = {"max_turns": 8, "greedy": True}


def _metrics(healthy_at, spike_at=None, content_drop=0.0, sft_tokens=0.0):
    """A run's rows: the healthy-turn rate `healthy_at(step)`; the probe every 2 steps, <tool_call>'s miss rate x100
    from `spike_at` on."""
    rows = []
    for step in range(STEPS):
        h = healthy_at(step)
        row = {"step": step, "healthy_rate": h, "reward_mean": 0.05, "frac_groups_informative": 0.25, "seconds": 10.0,
               "entropy": 0.2 + 0.01 * step, "grad_norm": 1.0, "approx_kl_old": 0.01, "reward_std_within_group": 0.1,
               "response_tokens": 50.0, "ratio_max": 1.3, "ratio_min": 0.7, "clip_frac_low": 0.01,
               "clip_frac_high": 0.02, "dual_clip_frac": 0.0, "optimizer_steps": 3,
               "state/healthy_call": h * 0.7, "state/healthy_response": h * 0.3,
               "state/text_pollution": (1 - h) * 0.5, "state/full_collapse": (1 - h) * 0.5,
               "sup/sft_tokens_total": sft_tokens}
        if step % 2 == 0:
            spiking = spike_at is not None and step >= spike_at
            row["probe/tool_call/miss_required"] = 0.5 if spiking else 0.005
            row["probe/content/tool_name/logp"] = -0.1 - (content_drop if spiking else 0.0)
            row["probe/content/arg_copied/logp"] = -0.2 - (content_drop if spiking else 0.0)
        rows.append(row)
    return rows


STEADY = lambda step: 0.95  # noqa: E731
COLLAPSE = lambda step: 0.95 if step < 6 else 0.1  # noqa: E731
SLOW = lambda step: 0.95 - 0.02 * max(0, step - 10)  # noqa: E731  (0.95 through step 10, 0.77 at the end)


def _eval(eval_dir, name, solved):
    """An evaluation of N tasks, solved: the task indices solved (a set), or for `-sampled` {index: fraction}."""
    eval_dir.mkdir(parents=True, exist_ok=True)
    split = name.removesuffix("-sampled")
    records = []
    for i in range(N):
        if name.endswith("-sampled"):
            wins = round(4 * solved.get(i, 0.0))
            records += [{"task_id": f"{split}-{i}", "success": k < wins, "sample": k} for k in range(4)]
        else:
            records.append({"task_id": f"{split}-{i}", "success": i in solved})
    write_jsonl(eval_dir / f"{name}.jsonl", records)
    limits = dict(LIMITS, **({"greedy": False, "samples": 4, "temperature": 1.0} if name.endswith("-sampled") else {}))
    (eval_dir / f"{name}.summary.json").write_text(json.dumps({"n_episodes": len(records), "limits": limits}))


def _solved(rate, offset=0):
    """round(rate * N) tasks solved, starting at task `offset` (the start solves 0..39: 20 %)."""
    return set(range(offset, offset + round(rate * N)))


def _run(root, setting, seed, rows, rates):
    run = root / setting / f"seed{seed}"
    final = run / "checkpoints" / f"step_{STEPS:06d}"
    (final / "eval").mkdir(parents=True)
    (final / "COMPLETE").write_text("")
    if rows:
        write_jsonl(run / "metrics.jsonl", rows)
    else:
        write_jsonl(run / "phases.jsonl", [{"step": STEPS, "phase": "sft_only", "phase/tokens": 1000.0}])
    for name, solved in rates.items():
        _eval(final / "eval", name, solved)


def _all(rate, offset=0, ood=None, sampled=None):
    out = {s: _solved(rate, offset) for s in SPLITS}
    out.update(ood or {})
    out["test-sampled"] = sampled if sampled is not None else {i: 0.25 for i in _solved(rate, offset)}
    return out


DEFAULT = {"up_rate": 0.30, "down_rate": 0.12, "ets_rate": 0.40, "ets_offset": 0, "control_rate": 0.25,
           "sft_term_rate": 0.16, "prs_rate": 0.45, "spike": 4, "ets_ood": 0.20, "tries": (0.20, 0.25), "prs_seeds": [0, 1]}


def _study(tmp_path, **changes):
    """A scan of plain GRPO at three rates (collapsing 1e-3, slowly losing 3e-4, gaining 3e-5) and the signals at
    3e-4 with their controls, 2 seeds; the SFT term chosen between two tries on val. `changes` turn facts of
    DEFAULT around."""
    d = {**DEFAULT, **changes}
    init = tmp_path / "sft"
    init.mkdir(parents=True)
    (init / "config.json").write_text("{}")
    out = tmp_path / "study"
    settings = {"plain_lr1e-3": {"grpo.lr": 1e-3}, "plain_lr3e-4": {"grpo.lr": 3e-4}, "plain_lr3e-5": {"grpo.lr": 3e-5},
                "ets": {"grpo.lr": 3e-4, "supervision.ets.enabled": True},
                "prs": {"grpo.lr": 3e-4, "supervision.ets.enabled": True, "supervision.prs.enabled": True,
                        "seeds": d["prs_seeds"]},
                "sft_term": {"grpo.lr": 3e-4, "supervision.sft_coef": 0.1, "tries": [{"supervision.sft_coef": 0.5}]},
                "sft_only_ets": {"grpo.lr": 3e-4, "supervision.sft_only.match": "@ets"}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({
        "base": "configs/tiny_rl.yaml", "init": str(init), "out_dir": str(out), "seeds": [0, 1],
        "overrides": {"grpo.steps": STEPS, "monitor.probe_every": 2, "grpo.split": "rl"}, "eval_split": "test",
        "eval_extra_splits": ["ood_format", "ood_facts"], "eval_n": N, "eval_samples": 4, "settings": settings}))
    for name, solved in _all(0.20).items():
        _eval(out / "start" / "eval", name, solved)
    (out / "selection.json").write_text(json.dumps({"sft_term": {
        "chosen": int(d["tries"][1] > d["tries"][0]), "split": "val", "seed": 0,
        "tries": [{"setting": "sft_term", "overrides": {}, "success": d["tries"][0]},
                  {"setting": "sft_term.t1", "overrides": {"supervision.sft_coef": 0.5}, "success": d["tries"][1]}]}}))
    chosen = "sft_term.t1" if d["tries"][1] > d["tries"][0] else "sft_term"
    ood = {"ood_format": _solved(d["ets_ood"]), "ood_facts": _solved(d["ets_ood"])}
    for seed in (0, 1):
        _run(out, "plain_lr1e-3", seed, _metrics(COLLAPSE, spike_at=d["spike"]), _all(0.0))
        _run(out, "plain_lr3e-4", seed, _metrics(SLOW), _all(d["down_rate"]))
        _run(out, "plain_lr3e-5", seed, _metrics(STEADY), _all(d["up_rate"]))
        _run(out, "ets", seed, _metrics(STEADY, sft_tokens=1000.0), _all(d["ets_rate"], d["ets_offset"], ood))
        _run(out, "prs", seed, _metrics(STEADY, sft_tokens=1500.0), _all(d["prs_rate"]))
        _run(out, chosen, seed, _metrics(STEADY, sft_tokens=800.0), _all(d["sft_term_rate"]))
        _run(out, "sft_only_ets", seed, [], _all(d["control_rate"]))
    return load_sweep(path)


def _verdicts(sweep, specs):
    from toolcollapse.findings import findings
    from toolcollapse.results import load_study

    return {f.key.split("_")[0] if f.source == "paper" else f.key: f for f in findings(load_study(sweep, specs))}


def test_the_rates_are_picked_by_their_rules(tmp_path):
    from toolcollapse.findings import rates
    from toolcollapse.results import load_study

    r = rates(load_study(*_study(tmp_path)))
    assert (r.up, r.down, r.signals, r.scan_split) == (3e-5, 3e-4, 3e-4, "val")
    # 1e-3 ends below the start too, but its healthy-turn rate falls by step 10: not the slow regime
    r = rates(load_study(*_study(tmp_path / "b", up_rate=0.21)))
    assert r.up is None  # +1 point on 200 tasks: its interval spans zero


def test_findings_follow_the_runs(tmp_path):
    v = _verdicts(*_study(tmp_path))
    assert v["f1"].verdict == "yes" and "2/2 seeds collapsed" in v["f1"].evidence
    assert v["f2"].verdict == "yes" and v["f3"].verdict == "yes"
    assert v["f4"].verdict == "yes" and "above both: ets, prs" in v["f4"].evidence  # the SFT term: not above start
    assert v["f5"].verdict == "yes"  # prs (interleaved, 45 %) against sft_term (synchronous, 16 %)
    assert v["f6"].verdict == "yes"  # 3e-5 (30 %) above 1e-3 (0 %)
    assert v["f7"].verdict == "yes"  # ETS's OOD 20 % against its control's 25 %: a cost beyond its SFT tokens
    assert v["f8"].verdict == "yes" and "prs - ets +5.0" in v["f8"].evidence
    assert v["own_plain_improves"].verdict == "yes" and "lr_up = 3e-05 (chosen on val)" in v["own_plain_improves"].evidence
    assert v["own_signal_improves"].verdict == "yes" and "all three: ets" in v["own_signal_improves"].evidence
    assert v["own_signal_vs_sft_only"].verdict == "yes"
    assert v["own_alarm_leads"].verdict == "yes" and "in 2/2 collapsed runs" in v["own_alarm_leads"].evidence


@pytest.mark.parametrize("changes, expected", [
    # ETS solves as many tasks as the start, other ones: +0 with a wide interval, no longer above the start
    ({"ets_rate": 0.20, "ets_offset": 100, "prs_rate": 0.20}, {"f4": "undecided", "own_signal_improves": "undecided"}),
    ({"ets_rate": 0.10, "prs_rate": 0.05}, {"f4": "no", "f8": "no", "own_signal_improves": "no"}),
    ({"control_rate": 0.45}, {"own_signal_vs_sft_only": "no"}),  # the control beats ETS: the gain was its SFT tokens
    ({"ets_ood": 0.45}, {"f7": "no"}),  # ETS above its control out of distribution: no cost
    ({"up_rate": 0.21}, {"own_plain_improves": "undecided"}),
    ({"spike": None}, {"f2": "no", "own_alarm_leads": "no"}),
])
def test_turning_the_data_around_turns_the_verdicts(tmp_path, changes, expected):
    v = _verdicts(*_study(tmp_path, **changes))
    assert {k: v[k].verdict for k in expected} == expected


def test_paired_comparisons_in_the_arms_table(tmp_path):
    from toolcollapse.report import arms_table
    from toolcollapse.results import load_study

    study = load_study(*_study(tmp_path))
    _, header, rows = arms_table(study, 3e-4)
    ets = next(r for r in rows if r[0] == "ets")
    cell = dict(zip(header, ets))
    assert cell["test %"] == "40.0" and cell["Δ start"].startswith("+20.0 [+") and cell["Δ start"].endswith(" yes")
    assert cell["Δ plain"].startswith("+28.0") and cell["Δ sft_only"].startswith("+15.0")
    sft_term = dict(zip(header, next(r for r in rows if r[0] == "sft_term")))
    assert sft_term["Δ sft_only"] == "-"  # no control in this study
    assert next(r for r in rows if r[0] == "sft_only_ets")[2] == "2"


def test_a_verdict_flips_when_one_number_changes(tmp_path):
    """The fixture the issue asks for: ETS's test success 2 points above the start on 200 tasks is undecided; 20
    points above is yes. Nothing else differs."""
    from toolcollapse.results import load_study
    from toolcollapse.stats import verdict

    for rate, word in ((0.22, "undecided"), (0.40, "yes")):
        study = load_study(*_study(tmp_path / str(rate), ets_rate=rate, ets_offset=20))
        d = study.compare(next(a for a in study.arms if a.setting == "ets"), "start", "test")
        assert verdict(d.low, d.high) == word


def test_the_chosen_try_is_the_arm_and_the_tries_are_listed(tmp_path):
    from toolcollapse.report import tries_table
    from toolcollapse.results import load_study

    study = load_study(*_study(tmp_path))
    arm = next(a for a in study.arms if a.setting == "sft_term")
    assert arm.run_setting == "sft_term.t1" and len(arm.runs) == 2
    _, _, rows = tries_table(study)
    assert rows == [["sft_term", "as written", "20.0", ""],
                    ["sft_term", "supervision.sft_coef=0.5", "25.0", "chosen"]]


def test_report_files(tmp_path):
    from toolcollapse.report import write_report

    sweep, specs = _study(tmp_path)
    md = write_report(sweep, specs)
    text = md.read_text()
    assert text.startswith("# Study report: study")
    assert "**Model and start.**" in text and "**Provenance.**" in text and "`toolcollapse report " in text
    assert "| start: success % | 20.0 | 20.0 | 20.0 | 20.0 | 5.0 |" in text  # test, ood x2, val; sampled 1/4 of 20 %
    assert "| plain RL (GRPO) | 3.50 | plain |" in text  # the paper's figures in their own table
    assert "lr_up = 3e-05" in text and "lr_down = 0.0003" in text
    assert "**Seeds.**" not in text  # every arm has both seeds
    for fig in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text):
        assert (md.parent / fig).is_file()
    page = (md.parent / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(re.findall(r"!\[", text)) >= 3
    assert page.count("<table>") == len(re.findall(r"^\|(?:---\|)+$", text, re.M))


def test_an_evaluation_under_other_limits_is_left_out(tmp_path):
    from toolcollapse.results import load_study

    sweep, specs = _study(tmp_path)
    summary = tmp_path / "study" / "ets" / "seed1" / "checkpoints" / f"step_{STEPS:06d}" / "eval" / "test.summary.json"
    summary.write_text(json.dumps({"n_episodes": N, "limits": {"max_turns": 10, "greedy": True}}))
    ets = next(a for a in load_study(sweep, specs).arms if a.setting == "ets")
    assert ets.outcomes["test"].shape == (1, N) and ets.unpaired == 1


def test_unfinished_runs_are_not_counted(tmp_path):
    from toolcollapse.report import blocks
    from toolcollapse.results import load_study

    sweep, specs = _study(tmp_path)
    run = tmp_path / "study" / "plain_lr1e-3" / "seed1"
    write_jsonl(run / "metrics.jsonl", read_jsonl(run / "metrics.jsonl")[:3])  # killed at step 3...
    (run / "checkpoints" / f"step_{STEPS:06d}" / "COMPLETE").unlink()  # ... before its last checkpoint was whole
    study = load_study(sweep, specs)
    assert len(study.plain(1e-3).rl_runs) == 1
    v = _verdicts(sweep, specs)
    assert "1/1 seeds collapsed" in v["f1"].evidence
    assert blocks(study, [])[1][1].startswith("13/")


@pytest.mark.parametrize("setting, expected", [("plain_lr1e-3", "plain"), ("ets_lr1e-5", "ets"),
                                               ("sft_term.t1", "sft_term"), ("hybrid", "hybrid")])
def test_method_names(setting, expected):
    from toolcollapse.results import method_name

    assert method_name(setting) == expected


def test_provenance_names_the_commit_of_the_code_that_runs_not_of_the_working_directory(tmp_path, monkeypatch):
    from toolcollapse.report import git_commit

    source = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=source)
    if head.returncode:
        pytest.skip("the tests do not run from a git checkout")
    monkeypatch.chdir(tmp_path)  # not a git checkout
    assert git_commit().split()[0] == head.stdout.strip()


def test_the_arms_table_names_a_chat_model_judge_and_says_deterministic_when_every_reflection_fell_back():
    from toolcollapse.config import load_config
    from toolcollapse.report import authors_cell
    from toolcollapse.results import Arm

    sets = ["supervision.ets.enabled=true", "supervision.prs.enabled=true", "supervision.prs.judge.kind=openai",
            "supervision.prs.judge.base_url=http://x/v1", "supervision.prs.judge.model=qwen-judge"]
    cfg = load_config(None, sets)
    counts = lambda a, r, f: {"judge/accepted": a, "judge/rejected": r, "judge/failed": f,  # noqa: E731
                              "judge/calls": a + r + f, "judge/tokens_in": 100, "judge/tokens_out": 20}
    arm = Arm("prs", "prs", "prs", "ets", 1e-4, cfg, metrics=[[{"step": 0}, {"step": 1, **counts(3, 1, 0)}],
                                                           [{"step": 1, **counts(2, 2, 1)}]])
    assert authors_cell(arm) == "; judge openai qwen-judge: 5/9 accepted, 9 calls, 240 tokens"
    arm.metrics = [[{"step": 1, **counts(0, 3, 1)}]]
    assert authors_cell(arm) == "; judge openai qwen-judge: deterministic (all 4 replies fell back)"
    assert authors_cell(Arm("prs", "prs", "prs", "ets", 1e-4, load_config(None, sets[:2]))) == ""


def test_the_report_says_which_arms_ran_fewer_seeds(tmp_path):
    """Issue 18's budget rule (every seed for plain GRPO and the best signals, one for the rest): the setup
    names the arms at each seed count."""
    from toolcollapse.report import write_report

    text = write_report(*_study(tmp_path, prs_seeds=[0])).read_text()
    line = next(x for x in text.splitlines() if x.startswith("**Seeds.**"))
    assert line.startswith("**Seeds.** 2 seeds: ") and line.split("; ")[1].startswith("1 seed: prs")
    assert "prs" not in line.split("; ")[0]

