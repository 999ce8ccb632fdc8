"""Models: Llama-architecture presets trained from scratch, and loading of checkpoints.

Presets are plain `transformers.LlamaConfig`s (tied embeddings, RoPE, SwiGLU), so a
tiny-tier checkpoint is a standard `save_pretrained` directory that any HF tool
loads. Parameter counts with the default 1024-token vocabulary: tiny ~1.0 M,
small ~5.1 M, base ~19.6 M.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import (AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM,
                          PreTrainedModel)

from toolcollapse.attention import cascade, causal_mask
from toolcollapse.config import ConfigError
from toolcollapse.kvcache import cascade_cache, prefix_kv
from toolcollapse.tags import add_control_tokens

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=352),
    "small": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=704),
    "base": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=1376),
}


def build_model(preset: str, vocab_size: int, max_seq_len: int, pad_token_id: int, eos_token_id: int,
                seed: int) -> LlamaForCausalLM:
    """A randomly initialised Llama of the given preset (deterministic in `seed`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    dims = PRESETS[preset]
    config = LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_seq_len, tie_word_embeddings=True,
        num_key_value_heads=dims["num_attention_heads"], rms_norm_eps=1e-5, rope_theta=10_000.0,
        pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None, attention_dropout=0.0, **dims,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used -- an unreadable or truncated file, non-finite weights --
    named with the file and the fault, found before anything is written."""


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, trainable: bool = False) -> PreTrainedModel:
    """A checkpoint directory: a full `save_pretrained` model, or LoRA adapters (peft's
    adapter_config.json) on top of the base model they name, trainable or frozen.
    Raises CheckpointError for a file that does not load or a weight that is not finite."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        from peft import PeftConfig, PeftModel

        base_path = Path(PeftConfig.from_pretrained(path).base_model_name_or_path)
        if not (base_path / "config.json").is_file():
            raise CheckpointError(f"{path} holds LoRA adapters on {base_path}, which is not a model directory")
        base = load_model(base_path, dtype)
        # adapters trained on a model that RL gave extra control tags: grow the base the same way
        # (the adapters then carry the grown embedding matrices themselves)
        add_control_tokens(base, load_tokenizer(base_path))
        try:
            model = PeftModel.from_pretrained(base, path, is_trainable=trainable)
        except Exception as err:
            raise CheckpointError(f"{path}: the LoRA adapters do not load: {_file_fault(path) or err}") from None
        return check_finite(model, path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a checkpoint directory (no config.json); "
                              "pass the directory that `toolcollapse sft` wrote")
    try:  # the resolved path is what LoRA adapters trained on this model record as their base
        model = AutoModelForCausalLM.from_pretrained(path.resolve(), dtype=dtype)
    except Exception as err:  # safetensors' SafetensorError, a bad config.json, a missing shard ...
        raise CheckpointError(f"{path}: the model does not load: {_file_fault(path) or err}") from None
    return check_finite(model, path)


# a local tokenizer keeps its vocabulary in one of these (fast, sentencepiece, BPE and WordPiece formats) or a *.tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


def load_tokenizer(path: str | Path) -> Any:
    local = Path(path)
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES) \
            and not any(local.glob("*.tiktoken")):
        raise CheckpointError(f"{path}: no tokenizer there ({' / '.join(TOKENIZER_FILES)} missing): copy the "
                              "tokenizer files of the model it was trained from into it")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise CheckpointError(f"{path}: the tokenizer does not load ({type(err).__name__}: {err})") from None


def _file_fault(path: Path) -> str:
    """Which weight file of a checkpoint directory is unreadable, and why ('' if none is)."""
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    f.get_slice(key)
        except Exception as err:
            return f"{file}: {err}"
    return ""


def check_finite(model: torch.nn.Module, path: Path) -> Any:
    """The model, if every weight is finite; else CheckpointError naming the first bad tensor."""
    for name, p in model.named_parameters():
        bad = ~torch.isfinite(p.detach())
        if bad.any():
            raise CheckpointError(f"{path}: weight {name} holds {int(bad.sum())} non-finite values (NaN or inf) "
                                  f"of {p.numel()}; the checkpoint is unusable")
    return model


# ----------------------------------------------------------------------------- devices and precision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`device:` of a run config as a torch device: auto is the GPU when torch sees one.
    ConfigError for cuda on a machine without one (before any work)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: cuda, but torch {torch.__version__} sees no GPU "
                          f"(torch.version.cuda={torch.version.cuda}); use device: auto or cpu, or install a CUDA "
                          "build of torch")
    return torch.device(name)


def place(model: torch.nn.Module, device: torch.device, dtype: str = "float32") -> Any:
    """The model on `device`, its weights float32, its forwards to run in `dtype` (see `precision`)."""
    model = model.to(device=device, dtype=torch.float32)
    model.compute_dtype = DTYPES[dtype]  # read by `precision`; travels with the model object
    return model


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def precision(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Mixed precision for a forward of `model`: bfloat16 autocast when `place` asked for it,
    else nothing. Only forwards run inside it; backward follows the dtypes autocast chose."""
    dtype = getattr(model, "compute_dtype", torch.float32)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_of(model).type, dtype=dtype)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the KV-cache argument of `model.forward` (`cache` from transformers 5.2x)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model passes kwargs on
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None, cache: Any = None, logits_to_keep: int = 0) -> Any:
    """`model(...)` with the cache argument under whichever name this transformers uses."""
    kwargs = {cache_kwarg(model): cache} if cache is not None else {}
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 use_cache=cache is not None, logits_to_keep=logits_to_keep, **kwargs)


def hidden_states(model: PreTrainedModel, input_ids: torch.Tensor, prefix_len: int = 0) -> torch.Tensor:
    """Last hidden states [B, T, D] of right-padded rows that share their first `prefix_len` tokens.

    The shared prefix -- the system prompt; in a GRPO group also the question and whatever
    the group's rollouts wrote alike -- is run once: its hidden states serve every row, and
    the rest of each row attends to its one copy of keys and values (`rest_hidden_states`).
    Gradients flow through both, so the result equals a plain forward over every row.
    Right padding needs no attention mask: causal attention never looks ahead at the pads.
    """
    decoder = model.get_decoder()
    if prefix_len == 0:
        return decoder(input_ids=input_ids).last_hidden_state
    head, prefix = _run_prefix(model, input_ids[:1, :prefix_len])
    rest = rest_hidden_states(model, prefix, input_ids[:, prefix_len:])
    return torch.cat([head.expand(len(input_ids), -1, -1), rest], dim=1)  # [B, T, D]


def shared_prefix_len(rows: list[list[int]], min_len: int = 32) -> int:
    """Length of the prefix all rows share, leaving each at least its last token (0 when short)."""
    limit = min(len(r) for r in rows) - 1
    first = rows[0]
    n = 0
    while n < limit and all(r[n] == first[n] for r in rows):
        n += 1
    return n if n >= min_len else 0


def logits_at(model: PreTrainedModel, input_ids: torch.Tensor, select: torch.Tensor,
              prefix_len: int = 0) -> torch.Tensor:
    """Next-token logits at the positions where `select` is True, float32. input_ids, select: [B, T] -> [M, V],
    on the model's device, which the inputs must be on.

    The LM head runs only on the selected rows: on the tool world a training batch
    predicts ~12 % of its positions, so the full [B, T, V] logits would be waste.
    """
    with precision(model):
        hidden = hidden_states(model, input_ids, prefix_len)  # [B, T, D]
        return model.get_output_embeddings()(hidden[select]).float()  # [M, V]


def run_prefix(model: PreTrainedModel, prefix_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values [1, Hkv, P, D] of every layer for one prefix [1, P] run alone: what
    `logits_after` attends to, computed once for any number of batches that share it."""
    return _run_prefix(model, prefix_ids)[1]


@torch.no_grad()
def prompt_prefix(model: PreTrainedModel, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`run_prefix` without a gradient, through the model's own call (so any model with Hugging Face's
    signature, a wrapper too: what the rollout engine accepts); the same numbers, bit for bit (test)."""
    cache = DynamicCache(config=model.config)
    with precision(model):
        forward(model, torch.tensor([ids], device=device_of(model)), cache=cache, logits_to_keep=1)
    return prefix_kv(cache)


class PrefixCache:
    """The keys and values of the prefixes run under the current weights, for the forwards that start with
    them: an RL step's rollout, probe and validation all begin with the same ~650-token system prompt.
    No gradient. Whoever changes the weights clears it (`rl` does at every step)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self._kv: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`prompt_prefix` of `ids`, run once until `clear`."""
        key = tuple(ids)
        if key not in self._kv:
            self._kv[key] = prompt_prefix(self.model, ids)
        return self._kv[key]

    def clear(self) -> None:
        self._kv.clear()


def _run_prefix(model: PreTrainedModel, prefix_ids: torch.Tensor
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The prefix's last hidden states [1, P, D] and its keys and values (`run_prefix`)."""
    decoder = model.get_decoder()
    cache = DynamicCache(config=model.config)
    with precision(model):
        head = decoder(input_ids=prefix_ids, use_cache=True, **{cache_kwarg(decoder): cache}).last_hidden_state
    return head, prefix_kv(cache)


def rest_hidden_states(model: PreTrainedModel, prefix: list[tuple[torch.Tensor, torch.Tensor]],
                       input_ids: torch.Tensor) -> torch.Tensor:
    """Last hidden states [B, S, D] of right-padded rows [B, S] that continue the prefix `run_prefix` ran:
    they attend to its one copy (`cascade`; on the CPU two flash kernels, `prefix_causal_attention`)."""
    decoder = model.get_decoder()
    batch, width = input_ids.shape
    start = prefix[0][0].shape[-2]
    positions = torch.arange(start, start + width, device=input_ids.device).expand(batch, -1)
    cache = cascade_cache(model.config, prefix, store=False)
    with cascade(model), precision(model):
        return decoder(input_ids=input_ids, position_ids=positions, attention_mask=causal_mask(width, width,
                       input_ids.device), use_cache=True, **{cache_kwarg(decoder): cache}).last_hidden_state


def logits_after(model: PreTrainedModel, prefix: list[tuple[torch.Tensor, torch.Tensor]], input_ids: torch.Tensor,
                 select: torch.Tensor) -> torch.Tensor:
    """`logits_at` for rows that all start with the prefix `run_prefix` ran: input_ids, select [B, S]
    are the rows without it. The rows attend to the one copy of the prefix (`cascade`)."""
    hidden = rest_hidden_states(model, prefix, input_ids)
    with precision(model):
        return model.get_output_embeddings()(hidden[select]).float()  # [M, V]
