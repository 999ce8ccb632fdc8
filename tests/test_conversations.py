"""One's own data (toolcollapse.conversations): chat conversations in the OpenAI / TRL format become the
probe `rl` would build from the same conversations, and the SFT term's reference rows; bad lines are named."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolcollapse.config import ConfigError, MonitorConfig, RunConfig
from toolcollapse.conversations import conversation_probe, read_conversations, reference_rows

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "data" / "conversations.jsonl"


def _openai(message):
    """A Message as the OpenAI API writes it: the call's arguments as a JSON string."""
    out = message.to_hf()
    for call in out.get("tool_calls", []):
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


def test_the_probe_of_a_conversations_file_is_the_probe_rl_builds_from_the_same_tasks(tmp_path, world, tokenizer):
    from toolcollapse.monitor import probe_for

    tasks = world.tasks("train")[:6]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"messages": [_openai(m) for m in [*t.prompt, *t.reference]]}) + "\n"
                            for t in tasks))

    class Env:
        def tasks(self, split):
            return tasks

    cfg = RunConfig(monitor=MonitorConfig(probe_size=6, probe_every=1))
    expected, _ = probe_for(cfg, Env(), tokenizer)
    got = conversation_probe(read_conversations(path), tokenizer, cfg.monitor)
    for field in ("input_ids", "select", "slot_of", "targets", "content_of"):
        assert torch.equal(getattr(got, field), getattr(expected, field)), field
    assert got.prefix_len == expected.prefix_len
    assert (got.content_of >= 0).any()  # tool names, arguments and answers are labelled, not only structure


def test_reference_rows_are_the_first_turn_as_the_policy_writes_it_after_the_prompt(world):
    from toolcollapse.chat import render_text

    task = world.tasks("train")[0]
    (row,) = reference_rows([[*task.prompt, *task.reference]])
    assert row["prompt"] == [m.to_hf() for m in task.prompt]
    whole = render_text([*task.prompt, task.reference[0]])
    assert render_text(list(task.prompt), add_generation_prompt=True) + row["reference"] + "\n" == whole
    assert row["reference"].startswith("<tool_call>")


@pytest.mark.parametrize("line, says", [
    ('{"text": "hello"}', "expected {\"messages\": [...]}"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "a role among"),
    ('{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}}, '
     '{"function": {"name": "b", "arguments": {}}}]}]}', "2 tool_calls in one message"),
    ('{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{oops"}}]}]}',
     "are not JSON"),
    ('[{"role": "user", "content": "cut sh', "not JSON"),
    ('{"messages": [{"role": "assistant", "tool_calls": {"function": {"name": "a"}}}]}', "should be a list"),
])
def test_a_line_that_is_not_a_usable_conversation_is_named(tmp_path, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text(SHIPPED.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=rf"bad.jsonl:2\b.*{__import__('re').escape(says)}"):
        read_conversations(path)


def _tokenizer_without_tags(path):
    """A byte-level BPE tokenizer with ChatML's <|im_start|> / <|im_end|> but none of the tool tags (as a
    Qwen2.5 or Llama 3 checkpoint lacks some of ours)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([SHIPPED.read_text()[:20000]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    return path


@pytest.mark.slow
def test_toolcollapse_probe_reads_the_shipped_conversations_with_a_tokenizer_that_lacks_the_tags(tmp_path):
    tok = _tokenizer_without_tags(tmp_path / "tok")
    proc = subprocess.run([sys.executable, "-m", "toolcollapse", "probe", str(SHIPPED), "--tokenizer", str(tok)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the tokenizer lacks <tool_call> </tool_call> <tool_response> </tool_response>" in proc.stdout
    assert "20 conversations" in proc.stdout and "content tool_name:" in proc.stdout
    assert "slot call_open: 66 positions" in proc.stdout  # one per call of the 20 conversations
    calls = sum(1 for line in SHIPPED.read_text().splitlines()
                for m in json.loads(line)["messages"] if m.get("tool_calls"))
    assert calls == 66
    bad = subprocess.run([sys.executable, "-m", "toolcollapse", "probe", str(tmp_path / "missing.jsonl"),
                          "--tokenizer", str(tok)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr


def test_first_turn_reward_pays_the_reference_call_or_answer_and_nothing_else(tokenizer):
    from toolcollapse.conversations import first_turn_reward

    reward = first_turn_reward(tokenizer)
    (row,) = reference_rows(read_conversations(SHIPPED)[:1])
    call = row["reference"]  # '<tool_call>\n{"name": "kb_lookup", ...}\n</tool_call><|im_end|>'
    wrong = call.replace('"attribute": "', '"attribute": "x')
    answer, other = "The answer is 7.<|im_end|>", "The answer is 8.<|im_end|>"

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    completions = [call, call.removesuffix("<|im_end|>"), wrong, "<tool_call>\n{oops\n</tool_call>", answer, other]
    references = [call, call, call, call, answer, answer]
    assert reward(completion_ids=[ids(c) for c in completions], reference=references,
                  completions=["tags dropped"] * 6) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
