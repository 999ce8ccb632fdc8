"""`toolcollapse study`: SFT, runs, evaluations and the report in one command; run again, it does
nothing twice; an unfinished SFT starts over, a finished one is reused."""

import hashlib
import json
import re
import subprocess
import sys

import pytest
import yaml

SMALL = {"world.n_train": 64, "world.n_test": 8, "world.n_ood": 8}


def _files(root):
    """Every file's hash, but the report's and the locks' (a lock holds its holder's pid)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "report" not in p.parts and p.suffix != ".lock"}


def _sft_file(tmp_path, name="sft.yaml", steps=2):
    sft = {"base": "configs/tiny.yaml", "world": {"n_train": 64, "n_test": 8, "n_ood": 8},
           "tokenizer": {"vocab_size": 400, "corpus_tasks": 64},
           "sft": {"copy_warmup": [], "steps": steps, "batch_size": 2, "warmup_steps": 1}}
    (tmp_path / name).write_text(yaml.safe_dump(sft))
    return tmp_path / name


def _study(tmp_path):
    study = {"base": "configs/tiny_rl.yaml", "sft_config": str(_sft_file(tmp_path)), "init": str(tmp_path / "sft"),
             "out_dir": str(tmp_path / "study"), "seeds": [0], "workers": 2,
             "overrides": {**SMALL, "grpo.steps": 2, "grpo.prompts_per_step": 2, "grpo.group_size": 2,
                           "grpo.checkpoint_every": 1, "monitor.probe_every": 1, "monitor.probe_size": 2,
                           "monitor.grad_share_every": 0, "rollout.max_turns": 2, "rollout.max_new_tokens": 16},
             "eval_split": "test", "eval_extra_splits": ["ood_facts"], "eval_n": 4,
             # the sft_only control comes first and waits for the ETS run it matches (two workers: it would
             # otherwise start at once, and fail on an unfinished match)
             "settings": {"sft_only_lr1e-3": {"grpo.lr": 1e-3, "supervision.sft_only.match":
                                              str(tmp_path / "study" / "ets_lr1e-3" / "seed{seed}")},
                          "ets_lr1e-3": {"grpo.lr": 1e-3, "supervision.ets.enabled": True,
                                         "supervision.ets.every": 1, "supervision.ets.window": 1},
                          "plain_lr1e-3": {"grpo.lr": 1e-3},
                          "sft_term_lr1e-3": {"grpo.lr": 1e-3, "supervision.sft_coef": 0.5}}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def study(*args):
    return subprocess.run([sys.executable, "-m", "toolcollapse", "study", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_a_study_runs_every_stage_and_a_second_call_redoes_nothing(tmp_path):
    path = _study(tmp_path)
    first = study(str(path))
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "study"
    for run in ("plain_lr1e-3/seed0", "sft_term_lr1e-3/seed0", "ets_lr1e-3/seed0", "sft_only_lr1e-3/seed0"):
        assert (out / run / "checkpoints" / "step_000002" / "eval" / "ood_facts.summary.json").is_file()
    assert (out / "start" / "eval" / "test.summary.json").is_file()
    text = (out / "report" / "report.md").read_text()
    assert "## Findings" in text and "| sft_term_lr1e-3 | synchronous | 1 | " in text
    # the control ran after its match, and is paired with it (the Δ sft_only cell of ETS's row)
    assert re.search(r"\| ets_lr1e-3 \| interleaved \| 1 \| [0-9.]+ \| [^|]+ \| [^|]+ \| [+-][0-9.]+ \[", text)
    assert (out / "report" / "report.html").is_file() and (out / "study.yaml").is_file()

    before = _files(tmp_path)
    again = study(str(path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert _files(tmp_path) == before  # no SFT, run or evaluation again (the report is rewritten)

    # results are never mixed across starting checkpoints or recipes
    from toolcollapse.config import ConfigError
    from toolcollapse.study import plan_study

    assert plan_study(path).sft is None
    with pytest.raises(ConfigError, match="was trained with sft.steps=2; sft_config .* says 3"):
        plan_study(path, ["sft_config=" + str(_sft_file(tmp_path, "other.yaml", steps=3))])
    weights = tmp_path / "sft" / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-4] + bytes(4))
    with pytest.raises(ConfigError, match="holds runs started from other weights"):
        plan_study(path)
    weights.write_bytes(original)
    (tmp_path / "sft" / "SFT_COMPLETE").unlink()  # an SFT from before the marker, every file there: finished
    assert plan_study(path).sft is None
    (tmp_path / "sft" / "tokenizer.json").unlink()  # an SFT killed before its end: it would start over...
    with pytest.raises(ConfigError, match="a new SFT would start the rest from other weights"):
        plan_study(path)  # ... but not under runs that started from the old one
    assert plan_study(path, [f"out_dir={tmp_path / 'fresh'}"]).sft is not None


@pytest.mark.slow
def test_a_bad_study_file_exits_2_before_any_work(tmp_path):
    path = _study(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["settings"]["plain_lr1e-3"]["grpo.learning_rate"] = 1.0
    path.write_text(yaml.safe_dump(raw))
    proc = study(str(path))
    assert proc.returncode == 2 and "grpo.learning_rate" in proc.stderr
    assert not (tmp_path / "sft").exists() and not (tmp_path / "study").exists()
    raw["settings"]["plain_lr1e-3"].pop("grpo.learning_rate")
    raw["sft_config"] = str(tmp_path / "missing.yaml")
    path.write_text(yaml.safe_dump(raw))
    proc = study(str(path))
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr and not (tmp_path / "sft").exists()


@pytest.mark.slow
def test_tries_are_chosen_on_val_then_the_chosen_one_runs_its_seeds_and_its_control(tmp_path):
    """Stage 1: the SFT term as written and its alternative run at seed 0 and are scored on val (carved past a
    small SFT pool); the higher one is chosen; stage 2: its seed 1 and the sft_only control of both seeds,
    matched to the chosen runs; the report lists the tries and the paired comparisons."""
    path = _study(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["overrides"].update({"world.sft_pool": 32, "world.n_val": 8, "grpo.split": "rl"})
    raw["seeds"] = [0, 1]
    raw["eval_samples"] = 2
    raw["settings"] = {"sft_term_lr1e-3": {"grpo.lr": 1e-3, "supervision.sft_coef": 0.5,
                                           "tries": [{"supervision.sft_coef": 0.1}]},
                       "sft_only_sft_term": {"grpo.lr": 1e-3, "supervision.sft_only.match": "@sft_term_lr1e-3",
                                             "supervision.phase.epochs": 1}}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = study(str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "study"
    selection = json.loads((out / "selection.json").read_text())["sft_term_lr1e-3"]
    scores = [t["success"] for t in selection["tries"]]
    chosen = selection["tries"][selection["chosen"]]["setting"]
    assert selection["split"] == "val" and selection["chosen"] == (1 if scores[1] > scores[0] else 0)
    for seed in (0, 1):
        final = out / chosen / f"seed{seed}" / "checkpoints" / "step_000002" / "eval"
        assert (final / "val.summary.json").is_file() and (final / "test-sampled.summary.json").is_file()
        control = yaml.safe_load((out / "sft_only_sft_term" / f"seed{seed}" / "config.yaml").read_text())
        assert control["supervision"]["sft_only"]["match"] == str(out / chosen / "seed{seed}")
    other = "sft_term_lr1e-3.t1" if chosen == "sft_term_lr1e-3" else "sft_term_lr1e-3"
    assert not (out / other / "seed1").exists()  # the try not chosen runs its first seed only...
    passed = out / other / "seed0" / "checkpoints" / "step_000002" / "eval"
    assert (passed / "val.summary.json").is_file() and not (passed / "test.summary.json").exists()  # ... scored on val
    text = (out / "report" / "report.md").read_text()
    assert "## Tries: each arm's coefficient chosen on validation" in text and "| chosen |" in text
    assert re.search(r"\| sft_term_lr1e-3 \| synchronous \| 2 \| [0-9.]+ \| [+-][0-9.]+ \[", text)
