"""A model and its tokenizer made ready for toolcollapse's ChatML: the control tags a pretrained tokenizer lacks
added as special tokens (their embedding rows start as the mean of their spelling's), the ones it has marked
special so tool output cannot inject them, the pad token kept apart from a turn's end, and the chat template
checked against ours. `model.load_model` grows a LoRA base the same way; `sources` and `rl` call it on a
fresh pretrained model."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from toolcollapse.chat import CHAT_TEMPLATE, CONTROL_TAGS, ENDOFTEXT, render_text
from toolcollapse.records import Message, ToolCall


def token_ids(tokenizer: Any, tokens: Sequence[str]) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def ready_for_chatml(model: Any, tokenizer: Any) -> tuple[list[str], list[str]]:
    """Control tags added (if missing) and the chat template checked; (added tags, notes)."""
    added, notes = add_control_tokens(model, tokenizer)
    return added, notes + use_chatml(tokenizer)


def add_control_tokens(model: Any, tokenizer: Any) -> tuple[list[str], list[str]]:
    """Add the control tags the tokenizer lacks; initialise their embeddings from their spelling."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in CONTROL_TAGS if t not in vocab]
    notes: list[str] = []
    plain = [t for t in CONTROL_TAGS if t in vocab and t not in tokenizer.all_special_tokens]
    if plain:  # an added but non-special tag would survive `split_special_tokens` in tool output (injection)
        tokenizer.add_special_tokens({"additional_special_tokens": plain}, replace_extra_special_tokens=False)
        notes.append(f"marked {plain} special (same ids), so tool output cannot inject them")
    if missing:
        spellings = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in missing]
        old = len(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            for matrix in _embedding_matrices(model):
                for tag, ids in zip(missing, spellings):
                    matrix[tokenizer.convert_tokens_to_ids(tag)] = matrix[ids].mean(dim=0)
        notes.append(f"added {len(missing)} control tokens {missing} as special tokens (vocabulary {old} -> "
                     f"{len(tokenizer)}); each embedding row starts as the mean of its spelling's tokens")
    if tokenizer.pad_token != ENDOFTEXT:  # SmolLM2 pads with <|im_end|>; padding must never look like a turn end
        notes.append(f"pad token {tokenizer.pad_token!r} -> {ENDOFTEXT!r}")
        tokenizer.pad_token = ENDOFTEXT
        model.config.pad_token_id = tokenizer.pad_token_id
    return missing, notes


def _embedding_matrices(model: Any) -> list[torch.Tensor]:
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    return [inp] if out is None or out.weight is inp else [inp, out.weight]


def use_chatml(tokenizer: Any) -> list[str]:
    """toolcollapse renders ChatML itself; keep the model's template only if it renders a tool
    conversation the same way, else save ours with the checkpoints (and say so)."""
    sample = [Message("system", "S"), Message("user", "Q"), Message("assistant", "", ToolCall("f", {"x": 1})),
              Message("tool", "{\"y\": 2}"), Message("assistant", "A")]
    try:
        theirs = tokenizer.apply_chat_template([m.to_hf() for m in sample], tokenize=False)
    except Exception:  # noqa: BLE001 - any template error means: not our format
        theirs = None
    if theirs == render_text(sample):
        return []
    tokenizer.chat_template = CHAT_TEMPLATE
    return ["the model's chat template renders tool calls differently; checkpoints carry toolcollapse's ChatML "
            "template (the one training and sampling use)"]
