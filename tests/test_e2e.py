"""End to end from the CLI: a few SFT steps, then the multi-turn eval (about a minute)."""

import json

import pytest
import yaml

from toolcollapse.cli import main
from toolcollapse.runtime import read_jsonl

pytestmark = pytest.mark.slow

SMALL = ["world.n_train=200", "world.n_test=12", "world.n_ood=6", "tokenizer.corpus_tasks=200",
         "tokenizer.vocab_size=512",
         "sft.copy_warmup=[{content: first_call, steps: 3, batch_size: 8},"
         " {content: no_system_prompt, steps: 2, batch_size: 4}]",
         "sft.steps=25", "sft.batch_size=4", "sft.warmup_steps=5", "sft.log_every=5",
         "rollout.max_new_tokens=48", "rollout.max_turns=4"]


def test_sft_then_eval(tmp_path, capsys):
    ckpt = tmp_path / "sft"
    args = ["sft", "--config", "configs/tiny.yaml", "--out", str(ckpt)]
    for o in SMALL:
        args += ["--set", o]
    assert main(args) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "toolcollapse.yaml"):
        assert (ckpt / name).is_file(), name
    saved = yaml.safe_load((ckpt / "toolcollapse.yaml").read_text())
    assert saved["sft"]["steps"] == 25 and saved["world"]["n_test"] == 12
    metrics = read_jsonl(ckpt / "metrics.jsonl")
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses[-1] < losses[0] - 1.0  # it learns something in 30 steps
    phases = [m["phase"] for m in metrics if "loss" in m]
    assert list(dict.fromkeys(phases)) == ["copy warm-up 1", "copy warm-up 2", "sft"]
    assert metrics[-1]["phase"] == "sft" and metrics[-1]["step"] == 3 + 2 + 25 - 1  # steps count across phases
    assert {"val/loss", "val/acc_digit", "val/acc_word", "val/acc_structure"} <= set(metrics[-1])

    capsys.readouterr()
    assert main(["eval", str(ckpt), "--split", "ood_format", "--n", "6"]) == 0
    printed = capsys.readouterr().out
    assert "success" in printed and "healthy turns" in printed
    rows = read_jsonl(ckpt / "eval" / "ood_format.jsonl")
    summary = json.loads((ckpt / "eval" / "ood_format.summary.json").read_text())
    assert len(rows) == summary["n_episodes"] == 6
    assert summary["n_turns"] == sum(len(r["turns"]) for r in rows)
    assert summary["success_rate"] == sum(r["success"] for r in rows) / 6
    assert sum(summary["state_rates"].values()) == pytest.approx(1.0)
    for r in rows:
        assert r["turns"] and all(t["state"] in summary["state_rates"] for t in r["turns"])
