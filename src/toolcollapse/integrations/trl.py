"""toolcollapse inside TRL's GRPOTrainer (`pip install 'toolcollapse[trl]'`; TRL 1.16).

Users who train on many GPUs with TRL on `accelerate` (DDP, DeepSpeed ZeRO, FSDP) keep their trainer;
toolcollapse brings its monitor, its diagnosis and its supervision signals:

- `ControlTokenCallback` teacher-forces the probe set (oracle conversations, `monitor.build_probe`)
  every `monitor.probe_every` steps before the update, as `rl` does, logs its `probe/*` series, feeds
  them to the same alarm rules (`alarms.run_rules`) and acts on an alarm (`monitor.on_alarm`: log,
  checkpoint, stop) on every rank alike: rank 0's probe values are broadcast, so every rank sees the same
  numbers and takes the same decision. Under ZeRO-3 the probe runs inside TRL's
  `unwrap_model_for_generation`, which gathers the sharded weights, as TRL's own generation does.
- `MonitoredGRPOTrainer` adds the training forward's control-token statistics (`ctrl/*`, as
  `monitor.sampled_control_stats`) from TRL's own per-token log-probs and entropies -- no second forward.
  TRL's `log()` averages each metric's list over the micro-batches and steps since the last log, which
  would turn a maximum into a mean of maxima; here the sampled tokens of every micro-batch since the last
  log are kept, gathered across ranks at the log, and reduced once over the whole batch. It also sorts
  every sampled turn into the four states with our parser (`state/*`, `error/*`, `healthy_rate`, counts
  summed over ranks), so a collapse shows in the same series as in `rl`.
- Supervision, in the same trainer (the dataset's `reference` column: each prompt's ground-truth
  completion, as text in the chat format the policy writes):
  - the synchronous SFT term, `sft_coef` * token-mean NLL of the reference of each prompt of the batch,
    once per prompt, and unlikelihood, `unlikelihood_coef` * -log(1 - p) at the first control token the
    grammar rejects in each sampled turn (`parser.first_rejected_control`), from TRL's own log-probs; both
    in `compute_loss`, scaled for gradient accumulation as TRL's own auxiliary loss; `sup/*` logs them,
    SFT tokens included, so a gain can be told apart from more SFT;
  - OPS: the last `ops` rows of each group of G are the reference instead of a sample (TRL's groups are
    contiguous blocks of G; `_generate` is where they are filled), rewarded by the same reward functions,
    the advantages over the mixed group; `ops_shaping="none"` trains them with TRL's clipped surrogate
    (the released scripts), `"luffy"` with -A * p / (p + 0.1) instead (LUFFY's shaping, the paper's text);
  - HBG: the `hbg` rows before them sample from the dataset's `hinted_prompt` column (e.g.
    `supervision.hint` in a system message) and train on the plain prompt: their prompt ids are the plain
    ones, so TRL's old log-probs, where it computes them, are the hint-free ones (first ratio 1);
  - expert and hinted rows stay out of `ctrl/*`, the four states and the failures ETS collects;
    with TRL's generation OPS and HBG take text prompts (multi-turn, any prompt: `engine_rollouts`).
- `train_interleaved`: ETS and PRS with TRL's own trainers, GRPO rounds and `SFTTrainer` phases on the
  same model; with `rl_phase_data` the phases train on the examples `toolcollapse rl` builds, token for
  token: each failed task's ground truth, and PRS's from the judge's verdict on the failed rollout
  (TRL's tool loop's or `engine_rollouts`'; `rollout_episode` rebuilds it as our Episode).
- `engine_rollouts` (with `task_dataset`, `episode_success`): our rollout engine as TRL's `rollout_func`, on
  any of our environments -- BFCL multi-turn included, whose later user turns TRL's tool loop cannot play
  -- with OPS's expert rows replayed (the ground truth, its tool calls really run), as `rl` builds them.
- `tool_world_environment`, `tool_world_dataset`, `tool_world_reward`: the tool world for TRL's own
  multi-turn tool loop (`environment_factory`): one method per tool, its signature and docstring from the
  tool's JSON schema, each call run by the world's sandboxed tools. A model trained by toolcollapse runs
  there in its own chat format (`speak_toolcollapse_chat`, done by `MonitoredGRPOTrainer`; the dataset's
  `system_prompt=True`): for well-formed turns TRL's tool loop shows it exactly the tokens our rollouts
  show it (greedy, the same episodes; bench/grpo_multiturn_vs_trl.py); malformed ones it handles its own
  way (a call it cannot parse ends the rollout).

    trainer = MonitoredGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                   processing_class=tokenizer,
                                   monitor=ControlTokenCallback.for_tool_world(run_config, tokenizer))
    trainer.train()    # logs ctrl/*, probe/*, state/*; alarms in <output_dir>/alarms.jsonl

The series keep the names `rl` gives them, and the output directory holds `monitor.jsonl` (the series,
each row with its step) and `monitor.yaml` (the monitor's config): `toolcollapse diagnose OUTPUT_DIR`
reads a monitored TRL run as it reads one of ours.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from toolcollapse.alarms import Alarm, Watcher, run_rules
from toolcollapse.autopsy import control_tag_ids, split_turns
from toolcollapse.chat import CHAT_TEMPLATE, IM_END, PieceEncoder, generation_prompt, stop_tags, valid_text
from toolcollapse.config import MonitorConfig, RunConfig, dump_config
from toolcollapse.conversations import conversation_probe, read_conversations
from toolcollapse.envs import make_env
from toolcollapse.envs.toolworld import answer_matches
from toolcollapse.evaluate import sampling_params
from toolcollapse.interleave import Failure, judged, phase_examples
from toolcollapse.judge import judge_all, load_judge
from toolcollapse.losses import luffy_loss, unlikelihood
from toolcollapse.monitor import ProbeSet, probe_for, resolve_token_ids, run_probe, sampled_control_stats
from toolcollapse.parser import parse_turn, parse_turn_ids
from toolcollapse.records import Episode, ToolCall, TurnRecord
from toolcollapse.rollout import RolloutEngine
from toolcollapse.turn_stats import TURN_KEYS, count_turns, turn_rates
from toolcollapse.supervision import load_hint_writer, rejected_positions, with_hint, without_hint

try:
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("toolcollapse.integrations.trl needs TRL: pip install 'toolcollapse[trl]'") from err

ALARMS = "alarms.jsonl"  # in the trainer's output_dir: one line per alarm, with the action taken
MONITOR = "monitor.jsonl"  # ... one line per probe and per log: the series with their step, 0-based as in rl's
                           # metrics.jsonl (a probe before that step's update, the rollouts sampled in it)
MONITOR_CONFIG = "monitor.yaml"  # ... the MonitorConfig the rules came from (what `diagnose` replays)


def _append(out_dir: str, name: str, row: Mapping[str, Any]) -> None:
    """One JSON line in <out_dir>/<name>, written by the main process only."""
    from accelerate import PartialState

    if PartialState().is_main_process:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / name, "a") as f:
            f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- distributed helpers


def _loss_mask(batch: Mapping[str, Any]) -> torch.Tensor:
    """The completion tokens TRL's loss counts: the completion mask, less a multi-turn completion's tool
    responses (`tool_mask`), as `GRPOTrainer._compute_loss` takes it."""
    return batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]


def _sampled_runs(mask: Sequence[Any]) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled tokens (mask 1) of a completion: in TRL's tool loop and in our
    rollouts, one assistant turn each (the tool replies and template tokens between them are 0)."""
    runs, at = [], 0
    for keep, group in itertools.groupby(bool(k) for k in mask):
        n = sum(1 for _ in group)
        if keep:
            runs.append((at, at + n))
        at += n
    return runs


def _gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's [n_i, k] rows, concatenated in rank order on every rank (n_i may differ, and be 0)."""
    from accelerate import PartialState
    from accelerate.utils import gather, pad_across_processes

    if PartialState().num_processes == 1:
        return rows
    device = PartialState().device
    counts = gather(torch.tensor([rows.shape[0]], device=device)).tolist()
    padded = gather(pad_across_processes(rows.to(device), dim=0))  # [world * max_n, k]
    width = max(counts)
    return torch.cat([padded[i * width:i * width + n] for i, n in enumerate(counts)]).cpu()


def _from_rank_zero(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if PartialState().num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


@contextlib.contextmanager
def _generation_model(trainer: Any) -> Iterator[Any]:
    """The trainer's plain model, whole, as TRL's own generation takes it (grpo_trainer.py, transformers
    path): `unwrap_model_for_generation` (ZeRO-3 gathers the shards) and FSDP's full parameters. Every
    rank must enter (the gathers are collectives)."""
    from trl.models.utils import unwrap_model_for_generation

    t, args = trainer, trainer.args
    dist = getattr(t, "_dist", None)
    with (unwrap_model_for_generation(t.model_wrapped, t.accelerator,
                                      gather_deepspeed3_params=args.ds3_gather_for_generation,
                                      gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs) as unwrapped,
          dist.summon_full_params(t.model_wrapped, recurse=False) if dist else contextlib.nullcontext()):
        yield unwrapped


# ----------------------------------------------------------------------------- the training forward's statistics


class SampledTokens:
    """The sampled completion tokens of the micro-batches since the last log: the token, its log-prob and
    entropy under the current policy, and its log-prob under the sampling policy; reduced over every rank
    at once (`reduce`), so a maximum is the batch's maximum, not a mean of per-micro-batch maxima."""

    def __init__(self, token_ids: Mapping[str, int]):
        self.token_ids = dict(token_ids)
        self.parts: list[torch.Tensor] = []

    def add(self, targets: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, entropy: torch.Tensor,
            mask: torch.Tensor) -> None:
        """[B, T] tensors of one micro-batch; `mask` the tokens that count (the completion's, tools' excluded)."""
        keep = mask.bool()
        self.parts.append(torch.stack([targets[keep].double(), logp.detach()[keep].double(),
                                       old_logp.detach()[keep].double(), entropy.detach()[keep].double()],
                                      dim=1).cpu())

    def reduce(self) -> dict[str, float]:
        """`ctrl/*` over every rank's tokens since the last call (a collective: call it on every rank)."""
        rows = torch.cat(self.parts) if self.parts else torch.zeros(0, 4, dtype=torch.float64)
        self.parts = []
        rows = _gather_rows(rows)
        if not len(rows):
            return {}
        targets, logp, old, entropy = rows.unbind(dim=1)
        return sampled_control_stats(targets.long(), logp, old, entropy, self.token_ids)


class TurnStates:
    """The turn rates `turn_stats.rollout_stats` logs (`state/*`, `error/*`, `healthy_rate`,
    `turns_per_episode`), from TRL's completions: this adapter splits them into turns and parses them; the
    counting and the rates are turn_stats' (`count_turns`, `turn_rates`), summed over ranks at `reduce`."""

    def __init__(self, tokenizer: Any, tools: Mapping[str, Any] | None = None, call_end: str = "template"):
        self.tokenizer, self.tools, self.call_end = tokenizer, tools, call_end
        self.id_to_tag, self.text_tags = control_tag_ids(tokenizer)
        self.keys = ["n_rollouts", "n_turns", *TURN_KEYS]
        self.counts = torch.zeros(len(self.keys), dtype=torch.float64)

    def add(self, completion_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """[B, T] completions of one generation batch (`mask`: their tokens; a multi-turn completion's tool
        responses are split off by the chat format's turn boundaries)."""
        counts = count_turns(self.parse(ids, m) for ids, m in zip(completion_ids.tolist(), mask.tolist()))
        self.counts += torch.tensor([counts[k] for k in self.keys], dtype=torch.float64)

    def parse(self, ids: list[int], mask: list[Any]) -> list[Any]:
        """One completion's assistant turns, parsed."""
        def decode(part: list[int]) -> str:
            return self.tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        turns = [valid_text(t) for a, b in _sampled_runs(mask) for t in split_turns(decode(ids[a:b]))]
        # every control tag one token: the live parse, on ids; otherwise the tags can only match as text
        return [parse_turn(turn, self.tools, self.call_end) if self.text_tags else
                parse_turn_ids(self.tokenizer(turn, add_special_tokens=False)["input_ids"], self.id_to_tag, decode,
                               self.tools, self.call_end) for turn in turns]

    def reduce(self) -> dict[str, float]:
        """The rates over every rank's turns since the last call (a collective: call it on every rank)."""
        counts = _gather_rows(self.counts[None]).sum(dim=0)
        self.counts = torch.zeros_like(self.counts)
        total = dict(zip(self.keys, counts.tolist()))
        return turn_rates(total) if total["n_turns"] else {}


def rejected_controls(completion_ids: torch.Tensor, mask: torch.Tensor, id_to_tag: Mapping[int, str]) -> torch.Tensor:
    """[B, T] bool: in each sampled turn of each completion, its first control token the grammar rejects
    (`supervision.rejected_positions`, as our trainer's unlikelihood marks them)."""
    out = torch.zeros_like(completion_ids, dtype=torch.bool)
    for b, (ids, m) in enumerate(zip(completion_ids.tolist(), mask.tolist())):
        for position in rejected_positions(ids, _turn_spans(ids, m, id_to_tag), dict(id_to_tag)):
            out[b, position] = True
    return out


def _turn_spans(ids: Sequence[int], mask: Sequence[Any], id_to_tag: Mapping[int, str]) -> list[tuple[int, int]]:
    """[start, end) of a completion's turns: its runs of sampled tokens (`mask`: a multi-turn completion's tool
    responses are 0 there), each cut after its `<|im_end|>`."""
    spans = []
    for start, end in _sampled_runs(mask):
        for t in range(start, end):
            if id_to_tag.get(ids[t]) == IM_END:
                spans.append((start, t + 1))
                start = t + 1
        if start < end:
            spans.append((start, end))
    return spans


class Supervision:
    """The synchronous SFT term and unlikelihood for `MonitoredGRPOTrainer`, and their counts since the last
    log (summed over ranks at `reduce`)."""

    KEYS = ("sft_nll_sum", "sft_tokens", "unlikelihood_sum", "unlikely_tokens", "expert_rows", "expert_loss_sum",
            "expert_tokens", "hinted_rows")

    def __init__(self, sft_coef: float, unlikelihood_coef: float, reference_column: str):
        if sft_coef < 0 or unlikelihood_coef < 0:
            raise ValueError(f"sft_coef {sft_coef} and unlikelihood_coef {unlikelihood_coef} must be >= 0")
        self.sft_coef, self.unlikelihood_coef, self.column = sft_coef, unlikelihood_coef, reference_column
        self.counts = torch.zeros(len(self.KEYS), dtype=torch.float64)
        self.tokens_total = 0.0

    def count(self, key: str, value: float) -> None:
        self.counts[self.KEYS.index(key)] += value

    def reduce(self) -> dict[str, float]:
        counts = dict(zip(self.KEYS, _gather_rows(self.counts[None]).sum(dim=0).tolist()))
        self.counts = torch.zeros_like(self.counts)
        out = {}
        if self.sft_coef > 0:
            self.tokens_total += counts["sft_tokens"]
            out["sup/sft_tokens"] = counts["sft_tokens"]
            out["sup/sft_tokens_total"] = self.tokens_total
            if counts["sft_tokens"]:
                out["sup/sft_nll"] = counts["sft_nll_sum"] / counts["sft_tokens"]
        if self.unlikelihood_coef > 0:
            out["sup/unlikely_tokens"] = counts["unlikely_tokens"]
            if counts["unlikely_tokens"]:
                out["sup/unlikelihood"] = counts["unlikelihood_sum"] / counts["unlikely_tokens"]
        if counts["hinted_rows"]:
            out["sup/hinted_rows"] = counts["hinted_rows"]
        if counts["expert_rows"]:
            out["sup/expert_rows"] = counts["expert_rows"]
            if counts["expert_tokens"]:
                out["sup/expert_luffy_loss"] = counts["expert_loss_sum"] / counts["expert_tokens"]
        return out


# ----------------------------------------------------------------------------- the probe and the alarms


class ControlTokenCallback(TrainerCallback):
    """The probe every `monitor.probe_every` steps, before the update; its `probe/*` series in the logs;
    the alarm rules over them (and over `ctrl/*`, when the trainer is a `MonitoredGRPOTrainer`); on an
    alarm, `monitor.on_alarm` on every rank: log (always: printed and in <output_dir>/alarms.jsonl),
    checkpoint (`control.should_save`), stop (`should_save` and `should_training_stop`)."""

    def __init__(self, probe: ProbeSet | None, token_ids: Mapping[str, int], monitor: MonitorConfig | None = None,
                 temperature: float = 1.0):
        self.probe, self.token_ids = probe, dict(token_ids)
        self.monitor = monitor or MonitorConfig()
        self.temperature = temperature
        self.watcher = Watcher(run_rules(self.monitor))
        self.pending: dict[str, float] = {}  # probe series not yet in a log
        self.alarms: list[Alarm] = []
        self.trainer: Any = None
        self.step_offset = 0  # steps of earlier trainers on this policy (`train_interleaved`'s rounds)

    @classmethod
    def for_tool_world(cls, cfg: RunConfig, tokenizer: Any) -> ControlTokenCallback:
        """The probe `rl` builds for this run config: `monitor.probe_size` oracle conversations of its
        training split, with their content labels, at `rollout.temperature`."""
        probe, token_ids = probe_for(cfg, make_env(cfg), tokenizer)
        return cls(probe, token_ids, cfg.monitor, cfg.rollout.temperature)

    @classmethod
    def from_conversations(cls, path: str | Path, cfg: RunConfig, tokenizer: Any) -> ControlTokenCallback:
        """The probe built from one's own data: the first `monitor.probe_size` conversations of a JSON-lines
        file (`toolcollapse.conversations`; `toolcollapse probe FILE` shows what it watches)."""
        probe = conversation_probe(read_conversations(path), tokenizer, cfg.monitor, cfg.rollout.call_end)
        return cls(probe, resolve_token_ids(tokenizer, cfg.monitor.control_tokens), cfg.monitor,
                   cfg.rollout.temperature)

    def attach(self, trainer: Any) -> ControlTokenCallback:
        """Register with `trainer`, first among its callbacks, so the series reach the trainer's own
        log history and every reporter (TensorBoard, W&B) on the same log line."""
        self.trainer = trainer
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        from accelerate import PartialState

        if PartialState().is_main_process:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            dump_config(self.monitor, Path(args.output_dir) / MONITOR_CONFIG)
        return control

    # -- probe -----------------------------------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        every = self.monitor.probe_every
        if self.probe is None or every <= 0 or state.global_step % every:
            return control
        t0 = time.perf_counter()
        stats = _from_rank_zero(self._run_probe(model))
        self.pending.update(stats)
        control = self.observe(self.step_offset + state.global_step, stats, args, control)
        self.pending["monitor/seconds_probe"] = time.perf_counter() - t0  # its cost, beside TRL's step_time
        return control

    def _run_probe(self, model: Any) -> dict[str, float]:
        if self.trainer is None:
            return run_probe(model, self.probe, self.token_ids, self.temperature)
        # every rank enters (ZeRO-3 and FSDP gather the shards collectively), each computes; rank 0's values count
        with _generation_model(self.trainer) as unwrapped:
            return run_probe(unwrapped, self.probe, self.token_ids, self.temperature)

    # -- alarms ----------------------------------------------------------------------------------------

    def observe(self, step: int, metrics: Mapping[str, Any], args: Any, control: Any) -> Any:
        """Feed the rules; act on what they raise. The same on every rank: `metrics` are identical there."""
        _append(args.output_dir, MONITOR, {"step": step, **metrics})
        alarms = self.watcher.update(step, metrics)
        if not alarms:
            return control
        self.alarms.extend(alarms)
        for a in alarms:
            print(f"toolcollapse: {a.describe()}", flush=True)
            _append(args.output_dir, ALARMS, {"step": a.step, "series": a.rule.series, "detector": a.rule.detector,
                                              "value": a.value, "action": self.monitor.on_alarm})
        if self.monitor.on_alarm in ("checkpoint", "stop"):
            control.should_save = True
        if self.monitor.on_alarm == "stop":
            control.should_training_stop = True
        return control

    # -- logs ------------------------------------------------------------------------------------------

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if logs is not None and self.pending and not any(k.startswith("eval_") for k in logs):
            logs.update(self.pending)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self.pending)  # the trainer appended its copy before the callbacks
            self.pending = {}
        return control


# ----------------------------------------------------------------------------- the trainer


class MonitoredGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with the training forward's `ctrl/*` statistics, reduced over the whole batch on every
    rank, and a `ControlTokenCallback` (`monitor`) whose rules also watch them."""

    def __init__(self, *args: Any, monitor: ControlTokenCallback | None = None,
                 control_tokens: tuple[str, ...] | None = None, tool_specs: Mapping[str, Any] | None = None,
                 sft_coef: float = 0.0, unlikelihood_coef: float = 0.0, reference_column: str = "reference",
                 ops: int = 0, ops_shaping: str = "luffy", luffy_gamma: float = 0.1, hbg: int = 0,
                 hint_column: str = "hinted_prompt", call_end: str = "template", **kwargs: Any):
        """`tool_specs`: name -> ToolSpec of the tools the policy may call, what our parser checks calls
        against (None: unknown tools and bad arguments are not checked, only the format; TRL's own `tools`,
        its callables, pass through). `sft_coef` > 0 needs a text `reference_column` in the training
        dataset: the ground-truth completion of the row's prompt, in the chat format the policy writes.
        `call_end`: for a toolcollapse model in TRL's tool loop, who writes a call turn's <|im_end|> -- the
        template (the default of our SFT: `</tool_call>` ends the turn) or the model (`sampled`)."""
        self._call_end_id: int | None = None
        tokenizer, model = kwargs.get("processing_class"), kwargs.get("model", args[0] if args else None)
        if kwargs.get("tools") or kwargs.get("environment_factory"):
            training = kwargs.get("args", args[2] if len(args) > 2 else None)
            self._call_end_id = speak_toolcollapse_chat(tokenizer, model, call_end,
                                                        use_vllm=bool(getattr(training, "use_vllm", False)))
        super().__init__(*args, **kwargs)
        names = control_tokens or (monitor.monitor if monitor else MonitorConfig()).control_tokens
        self.sampled = SampledTokens(resolve_token_ids(self.processing_class, names))
        self.turns = TurnStates(self.processing_class, tool_specs, call_end)
        self.supervision = Supervision(sft_coef, unlikelihood_coef, reference_column)
        # this rank's rollouts with reward <= 0 in the last `failure_window` steps (step, prompt, reference,
        # task_id, their tokens): what ETS/PRS phases train on; None (the default) keeps none -- set by
        # `train_interleaved` to its window
        self.failures: list[dict[str, Any]] = []
        self.failure_window: int | None = None
        self.step_offset = 0  # steps of earlier trainers on this policy (`train_interleaved`'s rounds)
        # where this trainer's checkpoint-N go under output_dir (None: output_dir itself); `train_interleaved`
        # gives round k `round_<k>`, as each round's step count, which names them, starts over
        self.checkpoint_subdir: str | None = None
        if ops_shaping not in ("luffy", "none"):
            raise ValueError(f"ops_shaping {ops_shaping!r}: luffy or none")
        if ops < 0 or hbg < 0 or ops + hbg >= self.num_generations:
            raise ValueError(f"ops={ops}, hbg={hbg}: a group of num_generations={self.num_generations} keeps at least "
                             "one row of the policy's own")
        if hbg and self.rollout_func is None and hint_column not in (self.train_dataset.column_names or ()):
            raise ValueError(f"hbg needs the training dataset's {hint_column!r} column (each prompt with its hint); "
                             f"it has {self.train_dataset.column_names}")
        if ops and self.use_vllm:
            raise ValueError("ops with use_vllm: the expert rows have no vLLM sampling log-probs; not supported yet")
        if (sft_coef > 0 or (ops and self.rollout_func is None)) and reference_column not in (
                self.train_dataset.column_names or ()):
            raise ValueError(f"sft_coef and ops need the training dataset's {reference_column!r} column (the "
                             f"ground-truth completion of each prompt); it has {self.train_dataset.column_names}")
        self.ops, self.ops_shaping, self.luffy_gamma = ops, ops_shaping, luffy_gamma
        self.hbg, self.hint_column = hbg, hint_column
        self._inputs: list[dict[str, Any]] = []  # the generation batch's rows, for `_generate`
        self._expert = self._hinted = torch.zeros(0, dtype=torch.bool)
        self.monitor = monitor.attach(self) if monitor else None
        self._captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self._capture = False

    def _get_output_dir(self, trial: Any) -> str:  # transformers' hook for where checkpoints are saved and rotated
        root = super()._get_output_dir(trial)
        return root if self.checkpoint_subdir is None else str(Path(root) / self.checkpoint_subdir)

    def _get_tool_suffix_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """What TRL appends after a tool-calling turn: a turn our model ended at `</tool_call>` still needs
        the <|im_end|> the template writes (as `rollout.call_end: template`; masked out like the reply)."""
        suffix = super()._get_tool_suffix_ids(tool_messages)
        return suffix if self._call_end_id is None else [self._call_end_id, *suffix]

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._capture:
            self._captured = (out[0], out[1])
        return out

    def _generate(self, prompts: list) -> tuple:
        """TRL's generation, with a group's last `ops` rows the reference (OPS) and the `hbg` rows before them
        sampled from their hinted prompt (HBG). A group is G contiguous rows of the global batch."""
        if not ((self.ops or self.hbg) and self.model.training):
            return super()._generate(prompts)
        g, first = self.num_generations, self.accelerator.process_index * len(prompts)
        place = [(first + i) % g for i in range(len(prompts))]
        self._expert = torch.tensor([j >= g - self.ops for j in place])
        self._hinted = torch.tensor([g - self.ops - self.hbg <= j < g - self.ops for j in place])
        if self.rollout_func is not None:  # engine_rollouts plays the expert and hinted rows itself (multi-turn)
            return super()._generate(prompts)
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError("ops and hbg with TRL's generation: text prompts only (conversational prompts and "
                             "multi-turn OPS: rollout_func=engine_rollouts(...))")
        sampled_from = [self._inputs[i][self.hint_column] if h else p
                        for i, (p, h) in enumerate(zip(prompts, self._hinted.tolist()))]
        prompt_ids, completion_ids, tool_mask, completions, logprobs, *rest = super()._generate(sampled_from)
        for i in self._hinted.nonzero().flatten().tolist():  # trained on the plain prompt
            prompt_ids[i] = self._tokenize_prompts([prompts[i]])[0][0]
        for i in self._expert.nonzero().flatten().tolist():
            reference = self._inputs[i][self.supervision.column]
            ids = self.processing_class(reference, add_special_tokens=False)["input_ids"]
            completion_ids[i], completions[i] = ids, reference
            if tool_mask is not None:
                tool_mask[i] = [1] * len(ids)
            if logprobs is not None:
                logprobs[i] = [0.0] * len(ids)  # not sampled; TRL uses them only with vLLM, refused above
        return (prompt_ids, completion_ids, tool_mask, completions, logprobs, *rest)

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._inputs = inputs
        self._expert = self._hinted = torch.zeros(len(inputs), dtype=torch.bool)
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out
        mask = _loss_mask(out)
        self._keep_failed_rollouts(out, mask)
        out["expert"] = self._expert.to(mask.device)
        out["hinted"] = self._hinted.to(mask.device)
        self.supervision.count("expert_rows", float(self._expert.sum()))
        self.supervision.count("hinted_rows", float(self._hinted.sum()))
        own = ~(out["expert"] | out["hinted"])  # the policy's own samples
        self.turns.add(out["completion_ids"][own], mask[own])
        if self.supervision.unlikelihood_coef > 0:
            out["unlikely"] = rejected_controls(out["completion_ids"], mask, self.turns.id_to_tag)
        if self.supervision.sft_coef > 0:
            out["sft_ids"], out["sft_mask"] = self._references(inputs, out)
            # the SFT tokens of the whole generation batch, every rank's (a scalar: TRL's split keeps it whole)
            out["sft_tokens_in_batch"] = self.accelerator.gather((out["sft_mask"] == 2).sum()).sum()
        return out

    def _window(self, total: torch.Tensor) -> torch.Tensor:
        """What a sum over one micro-batch's tokens is divided by, so that the terms of one optimizer step add
        up to a mean over its tokens on every rank: `total` (the generation batch's count, all ranks) over
        the ranks and the micro-batches per step -- TRL's own normaliser for `loss_type` dapo."""
        return (total.clamp(min=1.0) / self.accelerator.num_processes
                * self.current_gradient_accumulation_steps / self.args.steps_per_generation)

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.model.training and self.failure_window is not None:
            # TRL gathers every rank's rows in rank order; this rank's are its slice (as TRL slices advantages)
            rank, n = self.accelerator.process_index, len(prompts)
            local = rewards_per_func[rank * n:(rank + 1) * n]
            rewards = (local * self.reward_weights.to(local.device).unsqueeze(0)).nansum(dim=1)
            step = self.state.global_step
            self.failures = [f for f in self.failures if f["step"] > step - self.failure_window]
            self.failures += [{"step": step, "prompt": x["prompt"],
                               "reference": x.get(self.supervision.column), "task_id": x.get("task_id"), "row": i}
                              for i, (x, r, e) in enumerate(zip(inputs, rewards.tolist(),
                                                                (self._expert | self._hinted).tolist()))
                              if r <= 0 and not e]
        return rewards_per_func

    def _keep_failed_rollouts(self, out: Mapping[str, torch.Tensor], mask: torch.Tensor) -> None:
        """The tokens of this generation batch's failed rollouts, on their failures (what ETS/PRS phases
        are built from): prompt, completion, and which completion tokens the policy sampled (`mask`)."""
        for f in reversed(self.failures):  # this batch's are the last
            if "row" not in f:
                break
            i = f.pop("row")
            keep = out["completion_mask"][i].bool()
            f["prompt_ids"] = out["prompt_ids"][i][out["prompt_mask"][i].bool()].to("cpu", torch.int32)
            f["completion_ids"] = out["completion_ids"][i][keep].to("cpu", torch.int32)
            f["sampled"] = mask[i][keep].to("cpu", torch.bool)

    def _references(self, inputs: list[dict[str, Any]], out: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L] rows (right-padded) of prompt + ground-truth completion, and [B, L] what each token is:
        0 padding, 1 context (the prompt), 2 trained (the reference). One row per prompt of this rank's
        batch carries it (a group's G rows share the prompt), the others are all padding; the rows ride
        with the batch through TRL's shuffle and split."""
        pad = self.processing_class.pad_token_id
        rows, seen = [], set()
        for x, p_ids, p_mask in zip(inputs, out["prompt_ids"].tolist(), out["prompt_mask"].tolist()):
            key = json.dumps(x["prompt"], sort_keys=True, default=str)
            if key in seen:
                rows.append(([], []))
                continue
            seen.add(key)
            prompt = [t for t, k in zip(p_ids, p_mask) if k]
            ref = self.processing_class(x[self.supervision.column], add_special_tokens=False)["input_ids"]
            rows.append((prompt + ref, [1] * len(prompt) + [2] * len(ref)))
        width = max(1, max(len(ids) for ids, _ in rows))
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        kind = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, m) in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            kind[i, :len(m)] = torch.tensor(m, dtype=torch.long)
        device = out["completion_ids"].device
        return ids.to(device), kind.to(device)

    def _supervision_loss(self, model: Any, inputs: dict[str, Any], logp: torch.Tensor) -> torch.Tensor | None:
        """The auxiliary terms of one micro-batch: unlikelihood a mean over this micro-batch's marked tokens over
        the accumulation steps (as TRL's aux loss); the SFT term a sum over this micro-batch's reference tokens
        over the window's count (`_window`), so an optimizer step's terms add up to its token mean."""
        s, terms = self.supervision, []
        if s.unlikelihood_coef > 0 and inputs["unlikely"].any():
            values = unlikelihood(logp[inputs["unlikely"]])
            s.count("unlikelihood_sum", values.detach().sum().item())
            s.count("unlikely_tokens", values.numel())
            terms.append(s.unlikelihood_coef * values.mean() / self.current_gradient_accumulation_steps)
        if s.sft_coef > 0:
            # a forward on every micro-batch of every rank, with or without a reference row in it: under ZeRO-3,
            # FSDP and DDP each forward is a collective, and ranks whose shuffle dealt them no reference would
            # otherwise do one fewer than the others
            rows = (inputs["sft_mask"] == 2).any(dim=1)
            rows[0] = rows[0] | ~rows.any()  # none here: one row, padding only, for a forward that trains nothing
            ids, kind = inputs["sft_ids"][rows], inputs["sft_mask"][rows]
            width = max(1, int((kind > 0).sum(dim=1).max()))
            ids, kind = ids[:, :width], kind[:, :width]
            train = kind == 2
            select = torch.zeros_like(train)
            select[:, :-1] = train[:, 1:]  # the position before a trained token predicts it
            attention = (kind > 0).long()
            attention[:, 0] = 1  # a padding-only row still attends somewhere (a fully masked row gives NaN)
            logits = model(input_ids=ids, attention_mask=attention).logits
            nll = torch.nn.functional.cross_entropy(logits[select].float(), ids[train], reduction="sum")
            s.count("sft_nll_sum", nll.item())
            s.count("sft_tokens", int(train.sum()))
            terms.append(s.sft_coef * nll / self._window(inputs["sft_tokens_in_batch"]) + 0.0 * logits.sum())
        return sum(terms) if terms else None

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        training = self.model.training
        expert = inputs["expert"] if training else None
        luffy = training and self.ops_shaping == "luffy" and bool(expert.any())
        # LUFFY: TRL's surrogate on the policy's rows only (through tool_mask, which masks the loss alone: the
        # completion mask is also the forward's attention mask); the expert rows' shaped loss is added below
        seen = inputs
        if luffy:
            own = (~expert[:, None]).expand_as(inputs["completion_mask"]).to(inputs["completion_mask"].dtype)
            seen = {**inputs, "tool_mask": inputs["tool_mask"] * own if "tool_mask" in inputs else own}
        self._capture = True
        try:
            loss = super()._compute_loss(model, seen)
        finally:
            self._capture = False
        logp, entropy = self._captured
        self._captured = None
        if training:
            extra = self._supervision_loss(model, inputs, logp)
            loss = loss if extra is None else loss + extra
            if luffy:
                rows = inputs["completion_mask"].bool() & expert[:, None]
                advantages = inputs["advantages"]
                advantages = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
                shaped = luffy_loss(logp[rows], advantages[rows], self.luffy_gamma)
                self.supervision.count("expert_loss_sum", shaped.detach().sum().item())
                self.supervision.count("expert_tokens", shaped.numel())
                # weighted as TRL weighs the policy's tokens: with dapo (TRL's default) by the generation batch's
                # token count, which counts the expert tokens too; otherwise a token mean of this micro-batch
                if self.loss_type in ("dapo", "cispo", "vespo"):
                    loss = loss + shaped.sum() / self._window(inputs["num_items_in_batch"])
                else:
                    tokens = inputs["completion_mask"].sum().clamp(min=1)
                    loss = loss + shaped.sum() / tokens / self.current_gradient_accumulation_steps
            # the monitor watches the policy's own samples: not the expert rows, not the hinted ones (sampled
            # from another prompt: their sampling log-probs, where the rollout gives them, are not this one's)
            mask = _loss_mask(inputs) * ~(expert | inputs["hinted"])[:, None]
            # the sampling policy's log-prob: vLLM's when TRL has it, else the old policy's, else (one update
            # per generation, on-policy) the current one's, as TRL's own loss takes it
            old = inputs.get("sampling_per_token_logps")
            old = inputs.get("old_per_token_logps") if old is None else old
            self.sampled.add(inputs["completion_ids"], logp, logp if old is None else old, entropy, mask)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and not any(k.startswith("eval_") for k in logs):
            # every rank calls log(): the collectives are safe here
            stats = {**self.turns.reduce(), **self.sampled.reduce(), **self.supervision.reduce()}
            logs.update(stats)
            if self.monitor is not None and stats:
                # the step the rollouts were sampled at, 0-based as in rl's metrics.jsonl (TRL's global_step
                # counts the steps done); with logging_steps > 1, the last of the steps they span
                step = self.monitor.step_offset + self.state.global_step - 1
                self.control = self.monitor.observe(step, stats, self.args, self.control)
        super().log(logs, start_time)


# ----------------------------------------------------------------------------- interleaved schedules


def train_interleaved(make_grpo: Any, make_sft: Any, rounds: int, window: int,
                      output_dir: str | Path | None = None, phase_data: Any = None) -> list[dict[str, Any]]:
    """ETS (and PRS) with TRL's trainers: `rounds` times, a GRPO round (`make_grpo(round)`: a
    MonitoredGRPOTrainer on the policy, its `args.max_steps` the round's steps, its dataset the round's part
    of the data, as a new trainer starts its data order over), then an SFT phase (`make_sft(dataset)`: e.g.
    TRL's SFTTrainer on the same model object) on the tasks with a reward <= 0 rollout, on any rank, in the
    round's last `window` steps -- the rule of ours and of the paper's released code.

    `phase_data(failures) -> (dataset, trained tokens per epoch)` builds the phase's data from the round's
    failures (each task's newest): by default `reference_rows` (prompt/completion text rows from the dataset's
    reference column: train the completion only); for our environments, `rl_phase_data(cfg, tokenizer,
    prs_target=...)`: our own examples, token for token, PRS's included (pre-tokenized rows, `labels` -100
    where nothing is trained, which SFTTrainer takes as they are).

    At a phase change, as in `toolcollapse rl`: each trainer brings a fresh optimizer (the moments of the
    weights before a phase do not carry over); the monitor's callback, if the trainers share one, keeps its
    rules and numbers the steps on across rounds. One difference: with beta > 0 TRL takes each round's KL
    reference from the model it is given (the post-SFT one; ours keeps the initial model). A round stopped
    by an alarm (`monitor.on_alarm: stop`) ends the schedule. Returns the phases' records, also written to
    <output_dir>/phases.jsonl (default: the first GRPO trainer's output_dir)."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    phases: list[dict[str, Any]] = []
    offset = 0
    for round_ in range(rounds):
        grpo = make_grpo(round_)
        grpo.step_offset, grpo.failure_window = offset, window
        if rounds > 1 and hasattr(grpo, "checkpoint_subdir"):  # checkpoint-N of one round kept from the next's
            grpo.checkpoint_subdir = f"round_{round_}"
        if grpo.monitor is not None:
            grpo.monitor.step_offset = offset
        output_dir = Path(output_dir or grpo.args.output_dir)
        grpo.train()
        steps = grpo.state.global_step
        failed = sorted(gather_object([f for f in grpo.failures if f["step"] >= steps - window]),
                        key=lambda f: f["step"])  # rank order -> step order: the newest of each task last
        newest = list({json.dumps(f["prompt"], sort_keys=True, default=str): f for f in failed}.values())
        stopped = steps < grpo.args.max_steps
        offset += steps
        record: dict[str, Any] = {"step": offset, "round": round_, "phase": "ets", "tasks": len(newest)}
        if newest and not stopped:
            build = phase_data or functools.partial(reference_rows, tokenizer=grpo.processing_class)
            # built once, on rank 0 (a judge need not be deterministic), so every rank trains the same rows
            data, tokens, stats = _from_rank_zero(build(newest) if PartialState().is_main_process else None)
            record.update(stats)
            sft = make_sft(data)
            sft.train()
            epochs = sft.args.num_train_epochs if sft.args.max_steps <= 0 else None
            record["phase/tokens"] = tokens * epochs if epochs else None
            record["phase/steps"] = sft.state.global_step
            record["phase/loss"] = next((h["train_loss"] for h in reversed(sft.state.log_history)
                                         if "train_loss" in h), None)
        phases.append(record)
        _append(str(output_dir), "phases.jsonl", record)
        if stopped:
            break
    return phases


def reference_rows(failures: list[dict[str, Any]], tokenizer: Any) -> tuple[Any, int, dict[str, float]]:
    """ETS's data from the failures' reference column: text prompt/completion rows (SFTTrainer trains the
    completion), their completion tokens, and no stats."""
    from datasets import Dataset

    if any(f.get("reference") is None for f in failures):
        raise ValueError("ETS phases from reference rows need the training dataset's reference column; for our "
                         "environments pass phase_data=rl_phase_data(cfg, tokenizer)")
    rows = [{"prompt": f["prompt"], "completion": f["reference"]} for f in failures]
    tokens = sum(len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) for r in rows)
    return Dataset.from_list(rows), tokens, {}


def reference_token_rows(failures: list[dict[str, Any]], tokenizer: Any) -> tuple[Any, int, dict[str, float]]:
    """ETS's data token for token as the SFT term trains it: each failed prompt's tokens as TRL fed them
    (`prompt_ids`, kept by MonitoredGRPOTrainer) with its reference completion tokenized after them, trained
    on the completion only. Pre-tokenized rows (`input_ids`, `labels` -100 on the prompt), so any prompt
    works: text, or the messages of one's own conversations (`conversations.reference_rows`)."""
    from datasets import Dataset

    if any(f.get("reference") is None or f.get("prompt_ids") is None for f in failures):
        raise ValueError("reference_token_rows needs each failure's reference (the dataset's reference column) and "
                         "prompt_ids (failures kept by MonitoredGRPOTrainer)")
    rows, tokens = [], 0
    for f in failures:
        prompt = [int(i) for i in f["prompt_ids"]]
        reference = tokenizer(f["reference"], add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": prompt + reference, "labels": [-100] * len(prompt) + reference})
        tokens += len(reference)
    return Dataset.from_list(rows), tokens, {}


def rollout_episode(task: Any, prompt_ids: Any, completion_ids: Any, sampled: Any, tokenizer: Any,
                    env: Any = None, call_end: str = "template") -> Any:
    """A rollout played in TRL (its tool loop, or `engine_rollouts`), in toolcollapse's chat format, as our
    `Episode`: each run of sampled tokens one turn, parsed as our rollouts parse it -- against the tools the
    task offers at that turn (`env`, one of ours, stepped through the turns: BFCL adds tools on the way;
    None: the tools are not checked, only the format) -- and what came between two runs (tool replies, a next
    user turn) its observation: what the judge and the PRS examples read. (Success is not rescored: the
    rollouts kept are failures.)"""
    import re

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    prompt, completion = [int(i) for i in prompt_ids], [int(i) for i in completion_ids]
    mask = [int(bool(k)) for k in sampled]
    encoder = PieceEncoder(tokenizer)
    id_to_tag = {i: t for t, i in encoder.special_ids.items() if i is not None}
    ep = Episode(task.id, prompt + completion, [0] * len(prompt) + mask, [0.0] * (len(prompt) + len(mask)),
                 len(prompt))
    runs = _sampled_runs(mask)
    state = env.reset(task) if env is not None else None
    for k, (start, end) in enumerate(runs):
        parsed = parse_turn_ids(completion[start:end], id_to_tag, decode, state.tools if state else None, call_end)
        if state is not None and k + 1 < len(runs):
            env.step(state, parsed)  # the tools of the next turn
        record = TurnRecord(len(prompt) + start, len(prompt) + end, parsed)
        if k + 1 < len(runs):  # what the environment said between two turns: tool replies, a next user turn
            gap = decode(completion[end:runs[k + 1][0]])
            said = [m.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
                    for m in re.findall(r"<\|im_start\|>(?:user|tool)\n(.*?)<\|im_end\|>", gap, re.S)]
            record.observation = "\n".join(said)
        ep.turns.append(record)
    last = ep.turns[-1].parsed if ep.turns else None
    ep.finish = ("answered" if last is not None and last.end == "answer" else
                 "max_turns" if last is not None and last.end == "call" else "malformed")
    ep.final_text = last.text if last is not None and last.end == "answer" else None
    return ep


def rl_phase_data(cfg: RunConfig, tokenizer: Any, prs_target: str | None = None, judge: Any = None,
                  call_end: str = "template", max_len: int | None = None) -> Any:
    """`phase_data` for `train_interleaved` on any of our environments (rows with `task_id`: from
    `tool_world_dataset` or `task_dataset`): the phase's examples as `toolcollapse rl` builds them
    (`interleave.phase_examples`): each failed task's ground truth (ETS) and, with `prs_target` (reflection
    or correction), one example per failure from the judge's verdict on its rollout (`judge`: default the
    config's `supervision.prs.judge`), rebuilt with `rollout_episode`. Rows are pre-tokenized: `input_ids` and `labels`
    (-100 where the example trains nothing); SFTTrainer takes them as they are with `SFTConfig(max_length=
    None)` (its default, 1024, would cut long prompts such as BFCL's)."""
    from datasets import Dataset

    if prs_target not in (None, "reflection", "correction"):
        raise ValueError(f"prs_target {prs_target!r}: None (ETS), reflection or correction")
    world, encoder = make_env(cfg), PieceEncoder(tokenizer)
    # the config's judge (supervision.prs.judge: deterministic, a chat model, a factory), asked once now
    judge = judge or (load_judge(cfg.supervision.prs.judge) if prs_target is not None else None)
    task = _task_lookup(world, cfg)
    generation_prompt_len = len(encoder.encode(generation_prompt())[0])

    def decode(ids: Any) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def build(failures: list[dict[str, Any]]) -> tuple[Any, int, dict[str, float]]:
        if any(f.get("task_id") is None for f in failures):
            raise ValueError("rl_phase_data needs each row's task_id: train on tool_world_dataset or task_dataset rows")
        tasks = {f["task_id"]: task(f["task_id"]) for f in failures}
        ours = [Failure(f["step"], f["task_id"]) for f in failures]
        if prs_target is not None:
            items = [(tasks[f["task_id"]], rollout_episode(tasks[f["task_id"]], f["prompt_ids"], f["completion_ids"],
                                                           f["sampled"], tokenizer, world, call_end)) for f in failures]
            verdicts = judge_all(judge, items, decode)  # a chat-model judge: `concurrency` calls in flight
            ours = [judged(failure, task, episode, verdict, decode, generation_prompt_len)
                    for failure, (task, episode), verdict in zip(ours, items, verdicts)]
        examples, stats = phase_examples(ours, tasks, encoder, call_end, prs_target, max_len or cfg.model.max_seq_len)
        if hasattr(judge, "metrics"):
            stats = {**stats, **judge.metrics()}
        rows = [{"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]} for ids, mask in examples]
        return Dataset.from_list(rows), sum(sum(mask) for _, mask in examples), stats

    return build


# ----------------------------------------------------------------------------- the tool world as a TRL environment


def speak_toolcollapse_chat(tokenizer: Any, model: Any, call_end: str = "template",
                            use_vllm: bool = False) -> int | None:
    """Let TRL's tool loop run a model trained by toolcollapse, in its own chat format (`chat.CHAT_TEMPLATE`:
    ChatML with Qwen's `<tool_call>` JSON; the tools are documented in the prompt's system message, see
    `tool_world_dataset(system_prompt=True)`). TRL parses calls only for chat templates it knows: this sets
    Qwen's response parser on the tokenizer (the same call syntax), and with `call_end` template adds
    `</tool_call>` to the model's generation config's end tokens (kept in checkpoints saved from it), as in
    our rollouts. Returns the <|im_end|> id the tool reply must then start with (TRL's suffix begins after
    it), else None. Any other chat template is left to TRL. `MonitoredGRPOTrainer` calls this itself.

    For well-formed turns TRL's loop then shows the model exactly the tokens our rollouts show it (greedy,
    the same episodes). Malformed turns are TRL's own: a call it cannot parse ends the rollout (ours answers
    it with an error and goes on), an unknown tool gets TRL's error text, arguments are typed by the tool's
    schema before the call (transformers >= 5.15), and no turn has a token cap of its own -- for our exact
    rollouts inside TRL, `engine_rollouts`. vLLM generation takes its end tokens elsewhere: refused."""
    from trl.chat_template_utils import _SUPPORTS_RESPONSE_TEMPLATE, qwen3_schema, qwen3_template

    if getattr(tokenizer, "chat_template", None) != CHAT_TEMPLATE:
        return None
    if call_end not in ("template", "sampled"):
        raise ValueError(f"call_end {call_end!r}: template or sampled (the checkpoint's rollout.call_end)")
    if use_vllm:
        raise ValueError("a toolcollapse chat model in TRL's tool loop with vLLM generation: not supported yet (vLLM "
                         "would not stop at </tool_call>); generate with transformers, or use engine_rollouts")
    if getattr(model, "generation_config", None) is None:  # a path; a PreTrainedModel or a PeftModel has one
        raise ValueError("a toolcollapse chat model in TRL's tool loop: pass the model object "
                         "(toolcollapse.model.load_model(path)), not a path, so its stop tokens can be set")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        if _SUPPORTS_RESPONSE_TEMPLATE:  # transformers >= 5.13; before, only the legacy schema is read
            tokenizer.response_template = dict(qwen3_template)
        else:
            tokenizer.response_schema = dict(qwen3_schema)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in stop_tags(call_end)]
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    model.generation_config.eos_token_id = eos + [i for i in stops if i not in eos]  # TRL cuts completions there
    return tokenizer.convert_tokens_to_ids(IM_END) if call_end == "template" else None


_JSON_TYPES = {"string": str, "number": float, "integer": int, "boolean": bool, "array": list, "object": dict}


def _tool_method(spec: Any) -> Any:
    """A method `name(self, **arguments) -> str` whose signature, type hints and Google-style docstring say what
    `spec.parameters` (JSON schema) says, so `transformers.utils.get_json_schema` renders the same tool."""
    import inspect

    props, required = spec.parameters.get("properties", {}), set(spec.parameters.get("required", ()))

    def method(self: Any, **arguments: Any) -> str:
        return self._call(spec.name, arguments)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    lines = []
    for name, schema in props.items():
        kind = _JSON_TYPES.get(schema.get("type", "string"), str)
        optional = name not in required
        annotations[name] = kind | None if optional else kind
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotations[name],
                                        default=None if optional else inspect.Parameter.empty))
        doc = schema.get("description") or name.replace("_", " ")
        lines.append(f"    {name}: {doc}" + (f" (choices: {json.dumps(schema['enum'])})" if "enum" in schema else ""))
    method.__name__ = method.__qualname__ = spec.name
    method.__signature__ = inspect.Signature(params, return_annotation=str)
    method.__annotations__ = annotations
    method.__doc__ = (f"{spec.description}\n\n" + ("Args:\n" + "\n".join(lines) + "\n\n" if lines else "")
                      + "Returns:\n    The tool's result, as JSON.")
    return method


def _task_lookup(env: Any, cfg: RunConfig) -> Any:
    """task_id -> the environment's Task (each split loaded when first needed: the tool world's ids name
    theirs, <split>-<index>; otherwise the splits are searched in order)."""
    tasks: dict[str, Any] = {}

    def task(task_id: str) -> Any:
        guess = task_id.rsplit("-", 1)[0]
        searched = [s for s in env.splits if s not in getattr(env, "carved", ())]  # val, rl: train tasks
        for split in ([guess] if guess in searched else []) + [s for s in searched if s != guess]:
            if task_id in tasks:
                break
            tasks.update({t.id: t for t in env.tasks(split)})
        if task_id not in tasks:
            raise KeyError(f"task {task_id!r} is not a task of this {env.name} environment (see the run config)")
        return tasks[task_id]

    return task


def tool_world_environment(cfg: RunConfig) -> Any:
    """A factory of environments for TRL's `environment_factory`, on the tool world of `cfg` (its world and
    tools sections): `reset(task_id=...)` starts a task of the dataset row (`tool_world_dataset`), one method
    per tool runs a call in the world's sandbox, with the task's facts (`ood_facts`: the counterfactual
    world). Every instance shares one world (its tool process, its tasks)."""
    world = make_env(cfg)
    if getattr(world, "name", "") != "toolworld":
        raise ValueError(f"tool_world_environment needs env: toolworld, not {cfg.env!r}")
    task = _task_lookup(world, cfg)

    def reset(self: Any, task_id: str, **row: Any) -> None:
        self.task, self.calls = task(task_id), []
        return None  # the question is the dataset row's prompt

    def _call(self: Any, name: str, arguments: dict[str, Any]) -> str:  # private: TRL offers public methods as tools
        arguments = {k: v for k, v in arguments.items() if v is not None}  # optional arguments not given
        self.calls.append((name, arguments))
        return world.run_call(ToolCall(name, arguments), self.task.meta.get("facts", "real"))

    methods = {spec.name: _tool_method(spec) for spec in world.tool_table.values()}
    cls = type("ToolWorldEnvironment", (), {"reset": reset, "_call": _call, "world": world, "task": None, **methods,
                                           "__doc__": "The tool world, one task at a time (toolcollapse)."})
    return cls


# ----------------------------------------------------------------------------- our rollout engine inside TRL


def task_rows(tasks: Sequence[Any], system_prompt: bool = True) -> Any:
    """Our Tasks as TRL rows: `prompt` (the task's messages: its system prompt documenting the tools and the
    first user turn; without `system_prompt`, the user turn alone, for a chat template that renders the
    tools itself), `task_id` (what `engine_rollouts` and the environment's `reset` look up) and `answer`."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": m.role, "content": m.content}
                                          for m in (t.prompt if system_prompt else t.prompt[-1:])],
                               "task_id": t.id, "answer": t.answer} for t in tasks])


def task_dataset(cfg: RunConfig, split: str = "train", n: int | None = None) -> Any:
    """The split's tasks of any of our environments (the tool world, BFCL multi-turn) as TRL rows for
    `engine_rollouts` (`task_rows`)."""
    return task_rows(make_env(cfg).tasks(split, n))


def _prompt_key(prompt: Any) -> int:
    if isinstance(prompt, str):
        return hash(prompt)
    return hash(tuple((m["role"], m["content"]) for m in prompt))


def engine_rollouts(cfg: RunConfig, tokenizer: Any, split: str = "train", tasks: Sequence[Any] | None = None) -> Any:
    """A TRL `rollout_func` in which toolcollapse's own engine plays the batch's episodes, on any of our
    environments (`cfg.env`): the tool world, and BFCL multi-turn, whose later user turns TRL's tool loop
    cannot play (it ends a rollout at the first reply without a call). The rows' prompts must be the tasks'
    (`task_dataset(cfg, split)`; `tasks` or the whole `split` are looked up). Rollouts take `cfg.rollout`'s
    limits (turns, tokens per turn, context) and the KV-cached engine (one prefill per prompt and group, the
    shared system prompt attended once); TRL's `temperature` must equal `rollout.temperature` (the
    log-probs the engine returns are at it). Returns, per row, the prompt and completion ids, `env_mask` (1
    where the policy sampled: TRL's loss and our monitor see only those), the sampling log-probs, and for
    reward functions `success` (the environment's verdict: `episode_success`) and `finish`. The OPS rows of
    a `MonitoredGRPOTrainer` (`ops`) are the task's ground truth replayed, its tool replies really run
    (`RolloutEngine.replay`, as `toolcollapse rl` builds OPS's expert rows); its HBG rows (`hbg`) sample
    with the hint `supervision.hbg` templates from the ground truth (its `level`, `calls`) in the system
    message and return the hint-free prompt to train on, as `rl` does (`signals.group_rollouts`)."""
    env = make_env(cfg)
    pool = list(tasks if tasks is not None else env.tasks(split))
    by_id = {t.id: t for t in pool}
    writers: dict[str, Any] = {}  # HBG's hint writer, once a batch has hinted rows
    index: dict[int, Any] = {}
    for t in pool:  # two tasks with one prompt: only the rows' task_id can tell them apart
        key = _prompt_key([{"role": m.role, "content": m.content} for m in t.prompt])
        index[key] = None if key in index else t
    params = sampling_params(cfg, greedy=False)
    checked: set[int] = set()  # the training datasets already checked against the tasks

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if abs(trainer.temperature - params.temperature) > 1e-9:
            raise ValueError(f"engine_rollouts: GRPOConfig.temperature {trainer.temperature} differs from the run "
                             f"config's rollout.temperature {params.temperature}; set them equal")
        deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        if getattr(trainer, "is_fsdp_enabled", False) or (
                deepspeed is not None and deepspeed.zero_stage == 3 and not trainer.args.ds3_gather_for_generation):
            # each forward there is a collective, and the engine's number of forwards differs across ranks
            raise ValueError("engine_rollouts runs the whole model on each rank: use DDP or DeepSpeed ZeRO (with "
                             "ZeRO-3, ds3_gather_for_generation=True), not FSDP")
        if id(trainer.train_dataset) not in checked:  # the whole dataset at once, on every rank alike: a row
            checked.add(id(trainer.train_dataset))      # unknown to one rank's batch only would hang the others
            data = trainer.train_dataset
            ids = data["task_id"] if "task_id" in (data.column_names or ()) else None
            unknown = ([i for i in ids if i not in by_id] if ids is not None else
                       [p for p in data["prompt"] if index.get(_prompt_key(p)) is None])
            if unknown:
                raise ValueError(f"engine_rollouts: {len(unknown)} rows of the training dataset are none of the tasks' "
                                 f"(build it with task_dataset(cfg, {split!r}), or pass the tasks; rows whose prompts "
                                 "are equal need a task_id column)")
        inputs = getattr(trainer, "_inputs", None)  # a MonitoredGRPOTrainer's rows: their task_id
        if inputs is not None and len(inputs) == len(prompts) and all("task_id" in x for x in inputs):
            rows = [by_id.get(x["task_id"]) for x in inputs]
        else:
            rows = [index.get(_prompt_key(p)) for p in prompts]
        if any(t is None for t in rows):
            raise ValueError("engine_rollouts: a row that is none of the tasks' (rows whose prompts are equal need "
                             "their task_id and a MonitoredGRPOTrainer)")

        def flags(name: str) -> list[bool]:  # a MonitoredGRPOTrainer's OPS / HBG rows of this batch
            value = getattr(trainer, name, None)
            return value.tolist() if value is not None and len(value) == len(rows) else [False] * len(rows)

        expert, hinted = flags("_expert"), flags("_hinted")
        sampled = [i for i, e in enumerate(expert) if not e]
        if any(hinted) and "hints" not in writers:  # the config's hint writer, loaded (and asked once) at first use
            writers["hints"] = load_hint_writer(cfg.supervision.hbg)
        prompts = [with_hint(rows[i], writers["hints"](rows[i])) if hinted[i] else rows[i] for i in sampled]
        # G contiguous rows of a prompt: one prefill, its cache repeated (the engine's groups)
        runs = [len(list(g)) for _, g in itertools.groupby((rows[i].id, hinted[i]) for i in sampled)]
        group = runs[0] if runs and len(set(runs)) == 1 else 1
        step = getattr(trainer, "step_offset", 0) + trainer.state.global_step  # on across train_interleaved rounds
        rank = trainer.accelerator.process_index
        seed = (trainer.args.seed * 1_000_003 + step * 1_009 + rank) % 2**63
        episodes: dict[int, Any] = {}
        with _generation_model(trainer) as model:
            engine = RolloutEngine.from_config(model, tokenizer, env, cfg.rollout)
            own = engine.generate(prompts[::group], params, group_size=group, seed=seed)
            episodes.update((i, without_hint(ep, engine.prompt_ids(rows[i])) if hinted[i] else ep)
                            for i, ep in zip(sampled, own))
            replayed = [i for i, e in enumerate(expert) if e]
            episodes.update(zip(replayed, engine.replay([rows[i] for i in replayed], params)))
        out: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "success",
                                                    "finish")}
        for i in range(len(rows)):
            ep = episodes[i]
            n = ep.prompt_len
            out["prompt_ids"].append(ep.tokens[:n])
            out["completion_ids"].append(ep.tokens[n:])
            out["logprobs"].append(ep.logprobs[n:])
            out["env_mask"].append(ep.loss_mask[n:])
            out["success"].append(float(ep.success))
            out["finish"].append(ep.finish)
        return out

    return rollout


def episode_success(completions: list[Any], success: list[float] | None = None, **_: Any) -> list[float]:
    """The environment's verdict on each episode `engine_rollouts` played: 1 solved, else 0."""
    if success is None:
        raise ValueError("episode_success needs the rollouts of engine_rollouts (rollout_func=engine_rollouts(...))")
    return [float(x) for x in success]


def tool_world_dataset(cfg: RunConfig, split: str = "train", n: int | None = None,
                       system_prompt: bool = False) -> Any:
    """The split's tasks as TRL rows for the environment (`task_rows`): the question alone, TRL's chat
    template rendering the tools; with `system_prompt`, after the task's own system message, which
    documents them as our rollouts do (a model in toolcollapse's chat format, whose template does not
    render `tools`)."""
    return task_rows(make_env(cfg).tasks(split, n), system_prompt)


def tool_world_reward(completions: list[Any], environments: list[Any] | None = None, **_: Any) -> list[float]:
    """1 when the completion's last assistant message states the task's answer (`answer_matches`), else 0."""
    if environments is None:
        raise ValueError("tool_world_reward needs the environments: train with environment_factory")
    out = []
    for completion, env in zip(completions, environments):
        messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        out.append(float(env.task is not None and answer_matches(last, env.task.answer)))
    return out
