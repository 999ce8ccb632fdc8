"""Devices and dtypes: `device:` resolves (and refuses a GPU that is not there), `model.dtype:
bfloat16` runs every forward in bfloat16 with float32 weights, and SFT, RL and eval run with
`device: cpu` given explicitly in both dtypes, writing float32 checkpoints that load back."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from toolcollapse.config import ConfigError
from toolcollapse.model import device_of, load_model, logits_at, place, precision, resolve_device
from toolcollapse.runtime import read_jsonl


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="device: cuda, but torch .* sees no GPU"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_bfloat16_runs_the_forward_in_bfloat16_with_float32_weights(tiny_model, tokenizer, world):
    from toolcollapse.chat import PieceEncoder
    from toolcollapse.encoding import collate, encode_tasks

    examples = encode_tasks(PieceEncoder(tokenizer), world.tasks("train")[:3])
    ids, select = collate(examples, tokenizer.pad_token_id)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        model = place(copy.deepcopy(tiny_model), torch.device("cpu"), dtype)
        seen = []
        hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        with torch.no_grad():
            logits[dtype] = logits_at(model, ids, select)
        hook.remove()
        assert seen == [getattr(torch, dtype)]  # the layer computed in the run's dtype
        assert logits[dtype].dtype == torch.float32  # log-probs are taken in float32 either way
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the master weights stay float32
        assert device_of(model) == torch.device("cpu")
    diff = (logits["bfloat16"] - logits["float32"]).abs().max().item()
    assert 0 < diff < 0.1  # bfloat16 rounding: not the same numbers, nearly the same distribution
    with precision(tiny_model):  # a model `place` never saw runs as it is
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sft_rl_and_eval_on_explicit_cpu(tmp_path, dtype):
    """The whole device path with `device: cpu` given: SFT, two RL steps (probe, reference, a
    checkpoint), a resume on `device: auto`, and eval; every checkpoint float32 and loadable."""
    from test_e2e import SMALL

    from toolcollapse.cli import main

    common = ["device=cpu", f"model.dtype={dtype}"] + SMALL
    sets = lambda items: [a for item in items for a in ("--set", item)]  # noqa: E731
    sft = tmp_path / "sft"
    assert main(["sft", "--config", "configs/tiny.yaml", "--out", str(sft)] + sets(common)) == 0
    losses = [m["loss"] for m in read_jsonl(sft / "metrics.jsonl") if "loss" in m]
    assert losses[-1] < losses[0] - 1.0  # it learns in either dtype
    weights = load_file(sft / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}

    rl = tmp_path / "rl"
    rl_sets = common + [f"init={sft}", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
                        "grpo.micro_batch_size=2", "grpo.checkpoint_every=1", "grpo.lr=1e-3", "grpo.kl_coef=1e-3",
                        "monitor.probe_every=1", "monitor.probe_size=4"]
    assert main(["rl", "--config", "configs/tiny_rl.yaml", "--out", str(rl)] + sets(rl_sets)) == 0
    rows = read_jsonl(rl / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["kl_ref"], r["probe/im_end/miss_required"]])).all()
               for r in rows)
    assert all(r["skipped_nonfinite"] == 0 and r["grad_norm"] >= 0 for r in rows)  # the update ran, finite
    step2 = rl / "checkpoints" / "step_000002"
    assert {w.dtype for w in load_file(step2 / "model.safetensors").values()} == {torch.float32}
    assert load_model(step2).dtype == torch.float32

    # resumed from step 1 under another device setting: accepted (device is result-neutral, like threads; a
    # resume with another config key is refused) and the same step 1. The exactness of resume itself, with
    # weights that move, is test_rl's SIGKILL test: here the untrained model's groups are all uninformative.
    import shutil
    from dataclasses import replace

    from toolcollapse.rl import run_rl

    from toolcollapse.rundir import resume_config

    shutil.rmtree(step2)
    run_rl(replace(resume_config(rl), device="auto"), rl, resume=True)
    timing = lambda r: {k: v for k, v in r.items() if not k.startswith("seconds")}  # noqa: E731
    assert [timing(r) for r in read_jsonl(rl / "metrics.jsonl")] == [timing(r) for r in rows]

    assert main(["eval", str(step2), "--split", "test", "--n", "4", "--set", "device=cpu",
                 "--set", f"model.dtype={dtype}"]) == 0
    summary = json.loads((step2 / "eval" / "test.summary.json").read_text())
    assert summary["n_episodes"] == 4
    assert summary["limits"].get("dtype") == (None if dtype == "float32" else "bfloat16")


def test_a_gpu_that_is_not_there_is_refused_before_any_work(tmp_path, monkeypatch):
    from toolcollapse.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "sft"
    assert main(["sft", "--config", "configs/tiny.yaml", "--out", str(out), "--set", "device=cuda"]) != 0
    assert not out.exists()
