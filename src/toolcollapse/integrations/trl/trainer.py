"""`MonitoredGRPOTrainer`: TRL's GRPOTrainer with the monitor's statistics and the supervision signals."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from toolcollapse.config import MonitorConfig
from toolcollapse.integrations.trl._common import _from_rank_zero, _gather_rows, _loss_mask
from toolcollapse.integrations.trl.callback import ControlTokenCallback
from toolcollapse.integrations.trl.environment import speak_toolcollapse_chat
from toolcollapse.integrations.trl.interleaved import rollout_episode, tag_of_ids
from toolcollapse.integrations.trl.stats import Supervision, TermSums, TurnStates, rejected_controls
from toolcollapse.monitor import SampledTokens, resolve_token_ids
from toolcollapse.records import PolicyBatch
from toolcollapse.signals import (LossTerm, LuffyShaping, OptimizerStep, Rows, SFTTermLoss, SFTTermSignal, Signal, Step,
                                  Unlikelihood, UnlikelihoodSignal, row_kinds)
from toolcollapse.supervision import SFTTerm

# signals whose `start` needs our loop, which this trainer runs on its own batches: the argument each one sets
_AS_ARGUMENT = {SFTTermSignal: "sft_coef", UnlikelihoodSignal: "unlikelihood_coef"}


class MonitoredGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with the training forward's `ctrl/*` statistics, reduced over the whole batch on every
    rank, and a `ControlTokenCallback` (`monitor`) whose rules also watch them."""

    def __init__(self, *args: Any, monitor: ControlTokenCallback | None = None,
                 control_tokens: tuple[str, ...] | None = None, tool_specs: Mapping[str, Any] | None = None,
                 sft_coef: float = 0.0, unlikelihood_coef: float = 0.0, reference_column: str = "reference",
                 ops: int = 0, ops_shaping: str = "luffy", luffy_gamma: float = 0.1, hbg: int = 0,
                 hint_column: str = "hinted_prompt", call_end: str = "template", signals: Sequence[Signal] = (),
                 **kwargs: Any):
        """`tool_specs`: name -> ToolSpec of the tools the policy may call, what our parser checks calls
        against (None: unknown tools and bad arguments are not checked, only the format; TRL's own `tools`,
        its callables, pass through). `sft_coef` > 0 needs a text `reference_column` in the training
        dataset: the ground-truth completion of the row's prompt, in the chat format the policy writes.
        `call_end`: for a toolcollapse model in TRL's tool loop, who writes a call turn's <|im_end|> -- the
        template (the default of our SFT: `</tool_call>` ends the turn) or the model (`sampled`).
        `signals`: supervision signals (`toolcollapse.signals.Signal`, ours or one's own), the objects our
        trainer runs: their `rows()` join each group (OPS's expert rows, as `ops`; HBG's hinted rows, as
        `hbg`, sampled from the signal's prompt under `engine_rollouts`), and their loss terms run in this
        trainer's update: for each generation batch their `terms(Step)` (the step's rollouts as our Episodes,
        their row kinds), and in every micro-batch each term's `forward_loss` (on TRL's log-probs of the
        sampled tokens) over the accumulation steps, as TRL's own auxiliary loss, and its `expert_loss` on
        the expert rows in place of TRL's surrogate there (OPS's LUFFY shaping); their metrics are logged,
        the terms' summed over ranks. `unlikelihood_coef` and `ops_shaping="luffy"` are such terms. The SFT
        term's and unlikelihood's signals (`SFTTermSignal`, `UnlikelihoodSignal`) set `sft_coef` and
        `unlikelihood_coef` from their config: their terms (`SFTTermLoss`'s `rows_loss`, `Unlikelihood`) run on
        this trainer's own batches (the reference column, its rejected controls). Refused: a term with its own
        `token_loss` or `backward` (a forward of its own), a signal that needs our loop (`start`, `on_alarm`:
        ETS and PRS are `train_interleaved`'s rounds; adaptive is not supported). A signal's `after_update` runs
        after the optimizer step that ends its generation batch's updates, before that step's log (and the
        monitor's alarms); what it returns is logged there (rank 0's, as the signals' `metrics`, so that every
        rank's alarms read the same; the last batch's in a window)."""
        self._call_end_id: int | None = None
        tokenizer, model = kwargs.get("processing_class"), kwargs.get("model", args[0] if args else None)
        if kwargs.get("tools") or kwargs.get("environment_factory"):
            training = kwargs.get("args", args[2] if len(args) > 2 else None)
            self._call_end_id = speak_toolcollapse_chat(tokenizer, model, call_end,
                                                        use_vllm=bool(getattr(training, "use_vllm", False)))
        super().__init__(*args, **kwargs)
        names = control_tokens or (monitor.monitor if monitor else MonitorConfig()).control_tokens
        self.sampled = SampledTokens(resolve_token_ids(self.processing_class, names), _gather_rows)
        self.turns = TurnStates(self.processing_class, tool_specs, call_end)
        coefs = self._coefs_of(signals, sft_coef=sft_coef, unlikelihood_coef=unlikelihood_coef)
        sft_coef, unlikelihood_coef = coefs["sft_coef"], coefs["unlikelihood_coef"]
        self.supervision = Supervision(sft_coef, reference_column)
        if unlikelihood_coef < 0:
            raise ValueError(f"unlikelihood_coef {unlikelihood_coef} must be >= 0")
        self.unlikelihood_coef = unlikelihood_coef
        self.signals = [signal for signal in signals if type(signal) not in _AS_ARGUMENT]
        # what `_signal_terms` parses each batch's rows with (it refuses a tokenizer without every tag, now)
        self._tag_of = tag_of_ids(self.processing_class) if self.signals else {}
        self.call_end = call_end
        self._terms: list[LossTerm] = []  # the loss terms of the generation batch in use
        self._sft: SFTTermLoss | None = None  # its SFT term (`sft_coef`), run by `_supervision_loss`
        # the generation batches in their updates, as the signals' Steps, with the micro-batch count (`_step`)
        # that ends each one's updates
        self._updating: list[tuple[int, Step]] = []
        self._after: dict[str, float] = {}  # the signals' `after_update` metrics, for the next log
        if self.signals:
            self.add_callback(_AfterUpdate(self))
        self.term_sums = TermSums()
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
        self._shaping = [LuffyShaping(luffy_gamma)] if ops and ops_shaping == "luffy" else []
        self.hint_prompt: Callable[[Any], Any] | None = None  # a signal's hinted prompt (`engine_rollouts`)
        ops, hbg = self._signal_rows(ops, hbg)
        self._check_supervision(sft_coef, ops, hbg, reference_column, hint_column)
        self.ops, self.hbg, self.hint_column = ops, hbg, hint_column
        self._layout = row_kinds(self.num_generations, [Rows("hinted", hbg), Rows("expert", ops)])  # as ours
        self._inputs: list[dict[str, Any]] = []  # the generation batch's rows, for `_generate`
        self._expert = self._hinted = torch.zeros(0, dtype=torch.bool)
        self.monitor = monitor.attach(self) if monitor else None
        self._captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self._capture = False

    @staticmethod
    def _coefs_of(signals: Sequence[Signal], **coefs: float) -> dict[str, float]:
        """The trainer's `sft_coef` and `unlikelihood_coef`, with those of the signals that set them."""
        for signal in signals:
            argument = _AS_ARGUMENT.get(type(signal))
            if argument is None:
                continue
            if coefs[argument]:
                raise ValueError(f"{argument} from both {type(signal).__name__} and the trainer's {argument}: pick one")
            coefs[argument] = getattr(signal.cfg.supervision, argument)
        return coefs

    def _signal_rows(self, ops: int, hbg: int) -> tuple[int, int]:
        """The signals checked, and their rows added to `ops` and `hbg`."""
        for signal in self.signals:
            needs = [hook for hook in ("start", "on_alarm") if getattr(type(signal), hook) is not getattr(Signal, hook)]
            if needs:
                raise ValueError(f"signal {type(signal).__name__} needs our loop's {needs}, which TRL's trainer does not "
                                 "run: ETS and PRS are train_interleaved's rounds; the adaptive schedule is "
                                 "toolcollapse rl's")
            rows = signal.rows()
            if rows is None:
                continue
            if (rows.kind == "expert" and ops) or (rows.kind == "hinted" and hbg):
                raise ValueError(f"{rows.kind} rows from both {type(signal).__name__} and the trainer's "
                                 f"{'ops' if rows.kind == 'expert' else 'hbg'}: pick one")
            if rows.prompt is not None and self.rollout_func is None:
                raise ValueError(f"{type(signal).__name__}'s {rows.kind} rows sample from its own prompt: that needs "
                                 "rollout_func=engine_rollouts(...) (TRL's own generation takes hinted prompts from "
                                 "the dataset's hint column: the trainer's hbg=)")
            if rows.kind == "expert":
                passes = signal.cfg.grpo.updates_per_batch
                if passes != self.num_iterations:  # its after_update counts the expert tokens trained, per pass
                    raise ValueError(f"{type(signal).__name__}: the config's grpo.updates_per_batch={passes} and "
                                     f"GRPOConfig.num_iterations={self.num_iterations} differ; set them equal")
                ops = rows.n
            else:
                hbg, self.hint_prompt = rows.n, rows.prompt
        return ops, hbg

    def _check_supervision(self, sft_coef: float, ops: int, hbg: int, reference_column: str, hint_column: str) -> None:
        columns = self.train_dataset.column_names or ()
        if ops < 0 or hbg < 0 or ops + hbg >= self.num_generations:
            raise ValueError(f"ops={ops}, hbg={hbg}: a group of num_generations={self.num_generations} keeps at least "
                             "one row of the policy's own")
        if hbg and self.rollout_func is None and hint_column not in columns:
            raise ValueError(f"hbg needs the training dataset's {hint_column!r} column (each prompt with its hint); "
                             f"it has {self.train_dataset.column_names}")
        if ops and self.use_vllm:
            raise ValueError("ops with use_vllm: the expert rows have no vLLM sampling log-probs; not supported yet")
        if (sft_coef > 0 or (ops and self.rollout_func is None)) and reference_column not in columns:
            raise ValueError(f"sft_coef and ops need the training dataset's {reference_column!r} column (the "
                             f"ground-truth completion of each prompt); it has {self.train_dataset.column_names}")

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
        """TRL's generation, with a group's rows laid out as our trainer's (`signals.row_kinds`): its last `ops`
        rows the reference (OPS), the `hbg` rows before them sampled from their hinted prompt (HBG). A group is
        G contiguous rows of the global batch."""
        if not ((self.ops or self.hbg) and self.model.training):
            return super()._generate(prompts)
        g, first = self.num_generations, self.accelerator.process_index * len(prompts)
        kinds = [self._layout[(first + i) % g] for i in range(len(prompts))]
        self._expert = torch.tensor([k == "expert" for k in kinds])
        self._hinted = torch.tensor([k == "hinted" for k in kinds])
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
        if self.unlikelihood_coef > 0:
            out["unlikely"] = rejected_controls(out["completion_ids"], mask, self.turns.id_to_tag)
            # the marked tokens of the whole generation batch, every rank's (a scalar, as sft_tokens_in_batch)
            out["unlikely_in_batch"] = self.accelerator.gather(out["unlikely"].sum()).sum()
        self._terms = self._signal_terms(inputs, out, mask)
        self.term_sums.live += self._terms
        if self.supervision.sft_coef > 0:
            self._sft = SFTTermLoss(SFTTerm(self.supervision.sft_coef, 1, self.processing_class.pad_token_id))
            self.term_sums.live.append(self._sft)
            out["sft_ids"], out["sft_mask"] = self._references(inputs, out)
            # the SFT tokens of the whole generation batch, every rank's (a scalar: TRL's split keeps it whole)
            out["sft_tokens_in_batch"] = self.accelerator.gather((out["sft_mask"] == 2).sum()).sum()
        return out

    def _signal_terms(self, inputs: list[dict[str, Any]], out: dict[str, Any], mask: torch.Tensor) -> list[LossTerm]:
        """The generation batch's loss terms: unlikelihood's, then each signal's `terms` of this batch's Step."""
        terms: list[LossTerm] = list(self._shaping)
        if self.unlikelihood_coef > 0:
            terms.append(Unlikelihood(self.unlikelihood_coef, None))
        if not self.signals:
            return terms
        kinds = ["expert" if e else "hinted" if h else "policy"
                 for e, h in zip(out["expert"].tolist(), out["hinted"].tolist())]
        episodes = []  # as _keep_failed_rollouts keeps them: the completion, which of its tokens were sampled
        for i, x in enumerate(inputs):
            keep = out["completion_mask"][i].bool()
            episodes.append(rollout_episode(SimpleNamespace(id=x.get("task_id", str(i))),
                                            out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist(),
                                            out["completion_ids"][i][keep].tolist(), mask[i][keep].tolist(),
                                            self.processing_class, call_end=self.call_end, id_to_tag=self._tag_of))
        step = Step(self.step_offset + self.state.global_step, [], episodes, kinds)
        self._updating.append((self._step + self._per_batch(), step))
        for signal in self.signals:
            for term in signal.terms(step):
                own = [hook for hook in ("token_loss", "backward") if _overrides(term, hook)]
                if own:
                    raise ValueError(f"{type(signal).__name__}'s term {type(term).__name__} defines {own}: TRL's "
                                     "update runs a term's forward_loss only")
                terms.append(term)
        if len([t for t in terms if _shapes(t)]) > 1:
            raise ValueError(f"{[type(t).__name__ for t in terms if _shapes(t)]}: more than one term reshapes the "
                             "expert rows' loss")
        return terms

    def _per_batch(self) -> int:
        """The micro-batches a generation batch is trained in (TRL's `_step` counts them)."""
        return self.args.steps_per_generation * self.num_iterations

    def _after_update(self) -> None:
        """After an optimizer step: for each generation batch whose micro-batches are all in it or before it
        (also where the accumulation steps do not line up with the batches), each signal's `after_update`."""
        while self._updating and self._updating[0][0] <= self._step:
            _, step = self._updating.pop(0)
            for signal in self.signals:
                self._after.update(signal.after_update(step))

    def _term_losses(self, inputs: dict[str, Any], logp: torch.Tensor, old: torch.Tensor) -> torch.Tensor | None:
        """The loss terms' `forward_loss` on this micro-batch (its sampled tokens: TRL's loss mask), each told
        that the micro-batch is its optimizer step (`begin`; a mean over marked tokens divides by the whole
        step's count, `marked_tokens`) and divided over the accumulation steps. `marked_tokens` is the generation
        batch's count per optimizer step, as TRL's `dapo` normaliser: the step's own count with one optimizer
        step a generation batch (`steps_per_generation` = `gradient_accumulation_steps`, TRL's default), their
        average with several. Terms with neither hook (OPS's LUFFY shaping: `expert_loss` alone, run by
        `_compute_loss`) are not asked."""
        terms = [t for t in self._terms if _overrides(t, "begin") or _overrides(t, "forward_loss")]
        if not terms:
            return None
        mask = _loss_mask(inputs).bool()
        batch = PolicyBatch(inputs["completion_ids"], mask, old, inputs["advantages"], inputs.get("unlikely"),
                            inputs["expert"])
        marked = inputs.get("unlikely_in_batch")
        if marked is not None:
            marked = float(self._window(marked)) / self.current_gradient_accumulation_steps if marked else 0.0
        # this micro-batch's pass over its generation batch (TRL's `_step`: the micro-batches before it)
        last = (self._step % self._per_batch()) // self.args.steps_per_generation == self.num_iterations - 1
        added = []
        for term in terms:
            term.begin(OptimizerStep(batch, 0, len(batch), len(batch), self.num_generations, last_pass=last,
                                     marked_tokens=marked))
            loss = term.forward_loss(logp[mask], batch)
            if loss is not None:
                added.append(loss / self.current_gradient_accumulation_steps)
        return sum(added) if added else None

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

    def _supervision_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor | None:
        """The SFT term of one micro-batch (`SFTTermLoss.rows_loss`) on its reference rows, over the window's
        count (`_window`), so an optimizer step's terms add up to its token mean."""
        if self._sft is None:
            return None
        # a forward on every micro-batch of every rank, with or without a reference row in it: under ZeRO-3,
        # FSDP and DDP each forward is a collective, and ranks whose shuffle dealt them no reference would
        # otherwise do one fewer than the others
        rows = (inputs["sft_mask"] == 2).any(dim=1)
        rows[0] = rows[0] | ~rows.any()  # none here: one row, padding only, for a forward that trains nothing
        ids, kind = inputs["sft_ids"][rows], inputs["sft_mask"][rows]
        width = max(1, int((kind > 0).sum(dim=1).max()))
        return self._sft.rows_loss(model, ids[:, :width], kind[:, :width], self._window(inputs["sft_tokens_in_batch"]))

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        training = self.model.training
        expert = inputs["expert"] if training else None
        shaping = next((t for t in self._terms if _shapes(t)), None) if training else None
        luffy = shaping is not None and bool(expert.any())
        # a term's expert_loss (OPS's LUFFY): TRL's surrogate on the policy's rows only (through tool_mask, which
        # masks the loss alone: the completion mask is also the forward's attention mask); the expert rows'
        # shaped loss is added below
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
            # the sampling policy's log-prob: vLLM's when TRL has it, else the old policy's, else (one update
            # per generation, on-policy) the current one's, as TRL's own loss takes it
            old = inputs.get("sampling_per_token_logps")
            old = inputs.get("old_per_token_logps") if old is None else old
            old = logp.detach() if old is None else old
            for extra in (self._term_losses(inputs, logp, old), self._supervision_loss(model, inputs)):
                loss = loss if extra is None else loss + extra
            if luffy:
                rows = inputs["completion_mask"].bool() & expert[:, None]
                advantages = inputs["advantages"]
                advantages = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
                shaped = shaping.expert_loss(logp[rows], advantages[rows])
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
            keep = (_loss_mask(inputs) * ~(expert | inputs["hinted"])[:, None]).bool()
            self.sampled.add(inputs["completion_ids"][keep], logp[keep], old[keep], entropy[keep])
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and not any(k.startswith("eval_") for k in logs):
            # every rank calls log(): the collectives are safe here
            terms = self.term_sums.reduce([*self._terms, *([self._sft] if self._sft else [])])
            stats = {**self.turns.reduce(), **self.sampled.reduce(), **terms,
                     **self.supervision.reduce(terms.get("sup/sft_tokens", 0.0))}
            signal_stats = dict(self._after)
            self._after = {}
            for signal in self.signals:
                signal_stats.update(signal.metrics())
            stats.update(_from_rank_zero(signal_stats) if self.signals else signal_stats)
            logs.update(stats)
            if self.monitor is not None and stats:
                # the step the rollouts were sampled at, 0-based as in rl's metrics.jsonl (TRL's global_step
                # counts the steps done); with logging_steps > 1, the last of the steps they span
                step = self.monitor.step_offset + self.state.global_step - 1
                self.control = self.monitor.observe(step, stats, self.args, self.control)
        super().log(logs, start_time)


class _AfterUpdate(TrainerCallback):
    """Calls the trainer's `_after_update` after each optimizer step (before that step's log)."""

    def __init__(self, trainer: MonitoredGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.trainer._after_update()
        return control


def _overrides(term: LossTerm, hook: str) -> bool:
    return getattr(type(term), hook) is not getattr(LossTerm, hook)


def _shapes(term: LossTerm) -> bool:
    """Whether a term puts its own loss on the expert rows' tokens (`LossTerm.expert_loss`)."""
    return _overrides(term, "expert_loss")
