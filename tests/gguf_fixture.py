"""A tiny, random-weight, SmolLM2-shaped GGUF for tests that must not touch the real 100 MB file.

`write_tiny_gguf(path)` writes a 2-layer Llama (hidden 64) with a byte-level BPE tokenizer whose
special tokens, ids and ChatML template mimic SmolLM2-135M-Instruct's GGUF. It loads through the same
transformers GGUF path as the real model (`from_pretrained(dir, gguf_file=name)`), so code that
patches the tokenizer (e.g. adding `<tool_call>` tokens) and resizes embeddings is exercised for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2

# Verbatim from SmolLM2-135M-Instruct's GGUF `tokenizer.chat_template`.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Merges are learned from this, so common chat/tool words become single tokens (realistic lengths)
# while anything else still encodes via the 256 byte tokens. No digits: SmolLM2 has no multi-digit
# tokens (" 42" -> "Ġ", "4", "2"), and keeping digits out of the merges reproduces that.
_CORPUS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "system user assistant tool function name arguments result answer question the of and to is",
    'The answer is forty two. {"name": "calculator", "arguments": {"expression": "a * b"}}',
    "Hello world! What is the weather in Paris today? Let me check that for you.",
    "def add(a, b):\n    return a + b\n\nprint(add(x, y))\n",
] * 3

VOCAB_SIZE = 384  # 3 special + 256 bytes + 125 merges

# SmolLM2's architecture ratios, scaled down. head_dim = 64 / 4 = 16.
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 128, 2048


def _train_bpe() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE, in GPT-2's byte-to-unicode spelling as llama.cpp stores it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: transformers rebuilds this as a GPT2Tokenizer, which doesn't add one either.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,  # trainer places these first -> ids 0..2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so any text encodes
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert tokens[:3] == SPECIAL_TOKENS and [vocab[t] for t in tokens] == list(range(len(tokens)))
    assert len(tokens) == VOCAB_SIZE, "corpus too small to learn enough merges"
    # tokenizers serialises merges as ["a", "b"] pairs (newer) or "a b" strings (older); GGUF wants "a b".
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write the tiny model to `path` (a .gguf file path) and return it. Deterministic for a given seed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, merges = _train_bpe()
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "llama")  # also writes general.architecture
    # Key set and value types copied from the real SmolLM2 GGUF (GGUFWriter picks UINT32/FLOAT32/BOOL).
    w.add_type("model")
    w.add_name("tiny-smollm2-fixture")  # must not contain "mistral": transformers would switch arch
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_rope_dimension_count(HIDDEN // HEADS)  # transformers maps this to head_dim for llama
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("gpt2")  # byte-level BPE -> transformers builds a GPT2Tokenizer
    # "smollm" is not in transformers' split-regex table, so GPT-2's default split applies, as for SmolLM2.
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    # 3 = CONTROL: transformers adds these as special tokens so they encode as single ids.
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (n_vocab - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)  # SmolLM2 ids: bos=<|im_start|>, eos=pad=<|im_end|>, unk=<|endoftext|>
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    ones = np.ones(HIDDEN, dtype=np.float32)
    head_dim = HIDDEN // HEADS
    # Shapes in torch (out, in) order; GGUFWriter reverses them into ggml order itself.
    # No output.weight: transformers then sets tie_word_embeddings=True, as for SmolLM2.
    w.add_tensor("token_embd.weight", rand(n_vocab, HIDDEN))
    for i in range(LAYERS):
        for name, t in [
            ("attn_norm", ones),
            ("attn_q", rand(HEADS * head_dim, HIDDEN)),
            ("attn_k", rand(KV_HEADS * head_dim, HIDDEN)),
            ("attn_v", rand(KV_HEADS * head_dim, HIDDEN)),
            ("attn_output", rand(HIDDEN, HEADS * head_dim)),
            ("ffn_norm", ones),
            ("ffn_gate", rand(FFN, HIDDEN)),
            ("ffn_up", rand(FFN, HIDDEN)),
            ("ffn_down", rand(HIDDEN, FFN)),
        ]:
            w.add_tensor(f"blk.{i}.{name}.weight", t)
    w.add_tensor("output_norm.weight", ones)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    import tempfile
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        p = write_tiny_gguf(Path(d) / "tiny.gguf")
        t1 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=p.name)
        t2 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=p.name, dtype=torch.float32)
        t3 = time.perf_counter()
        print(f"file {p.stat().st_size} B; write {t1 - t0:.3f}s", end="; ")
        print(f"load tokenizer {t2 - t1:.3f}s, model {t3 - t2:.3f}s (first load pays lazy imports)")
        print("params", sum(x.numel() for x in model.parameters()), "| len(tok)", len(tok),
              "| config.vocab_size", model.config.vocab_size, "| tied", model.config.tie_word_embeddings)
        print("specials", tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token, tok.eos_token_id)

        text = "<|im_start|>user\nHello 42<|im_end|>\n"
        ids = tok(text)["input_ids"]
        print("ids", ids)
        assert ids[0] == 1 and 2 in ids and tok.decode(ids) == text, tok.decode(ids)
        assert not any(t in tok.get_vocab() for t in ("<tool_call>", "</tool_call>", "<tool_response>"))

        msgs = [{"role": "user", "content": "Hi"}]
        chat = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        print(repr(chat))
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
        assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()
        print("logits", tuple(logits.shape), "finite; total", f"{time.perf_counter() - t0:.3f}s")
