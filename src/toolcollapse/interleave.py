"""SFT phases inside an RL run -- ETS, PRS, the adaptive schedule -- and the `sft_only` control.

ETS (erroneous-trajectory supervision; arXiv 2606.26027, docs/DESIGN.md): rounds of `ets.every`
GRPO steps; after a round, the tasks with at least one zero-reward on-policy rollout in the
round's last `ets.window` steps are collected (the released code's rule), and the model is
SFT-trained on their ground-truth conversations, loss on the assistant tokens as `sft`
trains (the released code makes one example per assistant turn; a whole conversation with
every assistant turn trained is the same targets, each in its full context). The next
round's RL starts from that model.

PRS (process-reflection supervision): ETS's phases, plus one example per failed task built
from the judge's verdict on its failed rollout (judge.py): `prs.target: reflection`, the
policy learns to write the reflection from the judge's prompt (the released code);
`correction`, the failed prefix as sampled, the reflection as a user turn, then the
reference's continuation from the mistaken turn -- only that continuation is trained.

The adaptive schedule (the paper's future work): on a monitor alarm, roll back to the newest
checkpoint taken before the alarming step, scale the LR, run an SFT phase on the ground truth
of every task failed so far, and resume RL; each action configurable, each an event in the
step's `metrics.jsonl` row (`adaptive/*`) and in `alarms.jsonl`. It is an `on_alarm` handler
(`adaptive_handler`), the same extension point a user's own handler plugs into.

At a phase change: the phase trains with its own AdamW (constant `phase.lr`), and RL's AdamW
state is reset afterwards -- its moments were estimated on the weights before the phase, and
a fresh verl run from the SFT checkpoint, as the released code starts each round, has none.
The KL reference stays the run's initial model (the released code's fresh run would take the
SFT checkpoint; at kl_coef 1e-4 the difference is small, and one reference keeps the KL
comparable across rounds and methods). Every phase's trained tokens add to the run's
`sup/sft_tokens_total`, so a gain can be told apart from "more SFT" -- which the `sft_only`
control measures: SFT from the same start, on the same kind of ground truth, for as many
trained tokens as a given run spent, no RL.

Failed tasks are logged as they happen (`failures.jsonl`, one line per failed task and step,
with the judge's verdict under PRS), so a resumed run rebuilds its phases' data exactly.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from toolcollapse.chat import IM_END, Piece, PieceEncoder, conversation_pieces, tag
from toolcollapse.judge import Judge, Verdict, judge_all, judge_messages
from toolcollapse.optim import make_optimizer
from toolcollapse.records import Episode, Message, Task
from toolcollapse.runtime import append_jsonl, read_jsonl
from toolcollapse.encoding import Example, encode_tasks
from toolcollapse.supervision import SFTTerm

FAILURES = "failures.jsonl"
PHASES = "phases.jsonl"


@dataclass(frozen=True)
class Failure:
    """A task with a zero-reward on-policy rollout at `step`; under PRS, the judge's verdict on it."""

    step: int
    task_id: str
    turn: int | None = None  # the first mistaken assistant turn (None: none found, or not judged)
    mistake: str = ""
    reflection: str = ""
    judge_prompt: list[dict[str, str]] | None = None  # the judge's chat input (PRS reflection target)
    prefix: list[int] | None = None  # the rollout's tokens through the turn that closes the failed prefix
    closed: bool = False  # the prefix runs on to the next turn's start: the turn's end and its observation in it
    observation: str | None = None  # (not closed) the tool's reply after that turn, if any
    closing_turn: int | None = None  # the rollout's turn that ends the prefix (the mistaken one, or the last)
    resume_turn: int | None = None  # the reference assistant turn the correction continues from


def collect_failures(step: int, episodes: Sequence[Episode], kinds: Sequence[str], tasks: dict[str, Task],
                     judge: Judge | None, decode: Callable[[Sequence[int]], str],
                     generation_prompt_len: int = 0) -> list[Failure]:
    """One Failure per task whose on-policy rows include a failed one (reward 0 unless grpo.format_reward
    shapes it); the first such row is judged."""
    first: dict[str, Episode] = {}
    for ep, kind in zip(episodes, kinds or ["policy"] * len(episodes)):
        if kind == "policy" and not ep.success and ep.task_id not in first:
            first[ep.task_id] = ep
    if judge is None:
        return [Failure(step, task_id) for task_id in first]
    items = [(tasks[task_id], ep) for task_id, ep in first.items()]
    verdicts = judge_all(judge, items, decode)  # a chat-model judge: `concurrency` calls in flight
    return [judged(Failure(step, ep.task_id), task, ep, verdict, decode, generation_prompt_len)
            for (task, ep), verdict in zip(items, verdicts)]


def judged(failure: Failure, task: Task, episode: Episode, judge: Judge | Verdict, decode: Callable,
           generation_prompt_len: int = 0) -> Failure:
    """`failure` with the judge's verdict on `episode` (or the verdict itself), and the failed prefix a
    correction example needs: the rollout's tokens up to the next turn's generation prompt (the turn's end
    and the observations as the policy saw them, roles included), or through the turn when it was the last."""
    verdict = judge if isinstance(judge, Verdict) else judge(task, episode, decode)
    if verdict.turn is None or not episode.turns:
        return dataclasses.replace(failure, mistake=verdict.mistake, reflection=verdict.reflection)
    closing = min(verdict.turn, len(episode.turns) - 1)  # a stopped-early episode: its last turn closes the prefix
    closed = closing + 1 < len(episode.turns)
    end = episode.turns[closing + 1].start - generation_prompt_len if closed else episode.turns[closing].end
    return dataclasses.replace(
        failure, turn=verdict.turn, mistake=verdict.mistake, reflection=verdict.reflection,
        judge_prompt=judge_messages(task, episode, decode, closing), prefix=episode.tokens[:end], closed=closed,
        observation=None if closed else episode.turns[closing].observation, closing_turn=closing,
        resume_turn=verdict.turn)


def log_failures(run_dir: Path, failures: Sequence[Failure]) -> None:
    for f in failures:
        append_jsonl(run_dir / FAILURES, dataclasses.asdict(f))


def read_failures(run_dir: Path) -> list[Failure]:
    path = Path(run_dir) / FAILURES
    return [Failure(**row) for row in read_jsonl(path)] if path.is_file() else []


def latest_per_task(failures: Sequence[Failure], first_step: int = 0) -> list[Failure]:
    """The newest failure of each task from `first_step` on (failures come in step order), in the order
    the tasks first failed there."""
    latest: dict[str, Failure] = {}
    for f in failures:
        if f.step >= first_step:
            latest[f.task_id] = f  # a dict keeps a key's first position
    return list(latest.values())


# ----------------------------------------------------------------------------- a phase's examples


def correction_example(encoder: PieceEncoder, task: Task, failure: Failure) -> Example:
    """The failed prefix as sampled (closed as the template closes a turn), the reflection as a user turn,
    then the reference from the mistaken turn on; only the continuation's assistant tokens are trained.
    An episode that stopped after correct turns gets the reference's reply to its last one first."""
    prefix = list(failure.prefix or [])
    assistant_at = [i for i, m in enumerate(task.reference) if m.role == "assistant"]
    between: list[Piece] = []
    if not failure.closed:
        im_end = encoder.special_ids[IM_END]
        between = [Piece("\n")] if prefix and prefix[-1] == im_end else [tag(IM_END), Piece("\n")]
        if failure.observation is not None:
            between += conversation_pieces([Message("tool", failure.observation)])
        elif failure.closing_turn < failure.resume_turn <= len(assistant_at):  # stopped early, last reply not run
            upto = assistant_at[failure.resume_turn] if failure.resume_turn < len(assistant_at) else None
            between += conversation_pieces(task.reference[assistant_at[failure.closing_turn] + 1:upto])
    between += conversation_pieces([Message("user", f"Review of your attempt: {failure.reflection}")])
    rest = list(task.reference[assistant_at[failure.resume_turn]:]) if failure.resume_turn < len(assistant_at) else []
    ids, _ = encoder.encode(between)
    rest_ids, rest_mask = encoder.encode(conversation_pieces(rest, call_end=encoder.call_end))
    return prefix + ids + rest_ids, [0] * (len(prefix) + len(ids)) + rest_mask


def reflection_example(encoder: PieceEncoder, failure: Failure) -> Example:
    """(the judge's prompt -> its reflection): the policy learns to write the reflection."""
    messages = [Message(m["role"], m["content"]) for m in failure.judge_prompt or []]
    return encoder.encode_conversation(messages + [Message("assistant", failure.reflection)])


def phase_examples(failures: Sequence[Failure], tasks: dict[str, Task], encoder: PieceEncoder,
                   prs_target: str | None, max_len: int) -> tuple[list[Example], dict[str, float]]:
    """ETS's examples (each failed task's ground truth) and, with `prs_target`, PRS's (one per judged
    failure); examples longer than the model's context are left out and counted."""
    chosen = [tasks[f.task_id] for f in failures]
    examples = encode_tasks(encoder, chosen)
    n_prs = 0
    if prs_target is not None:
        for f in failures:
            if f.turn is None:
                continue
            examples.append(correction_example(encoder, tasks[f.task_id], f) if prs_target == "correction"
                            else reflection_example(encoder, f))
            n_prs += 1
    kept = [e for e in examples if len(e[0]) <= max_len]
    return kept, {"phase/tasks": float(len(chosen)), "phase/prs_examples": float(n_prs),
                  "phase/too_long": float(len(examples) - len(kept))}


# ----------------------------------------------------------------------------- the phase


def trained_tokens(examples: Sequence[Example]) -> int:
    return sum(sum(m[1:]) for _, m in examples)


def sft_phase(model: Any, examples: Sequence[Example], pc: Any, micro_batch_size: int, pad_id: int, seed: int,
              grad_clip: float = 1.0) -> dict[str, float]:
    """`pc.epochs` shuffled passes over `examples` in batches of `pc.batch_size` (token-mean NLL per batch,
    micro-batched), with a fresh AdamW at constant `pc.lr`. Returns the phase's statistics."""
    if not examples:
        return {"phase/steps": 0.0, "phase/tokens": 0.0}
    optimizer = make_optimizer(model, pc.lr, 0.0, (0.9, 0.95))
    nll = SFTTerm(1.0, micro_batch_size, pad_id)  # the token-mean NLL of a batch, micro-batched
    rng = random.Random(seed)
    losses: list[float] = []
    tokens, skipped = 0, 0
    was_training = model.training
    model.train()
    for _ in range(pc.epochs):
        order = rng.sample(range(len(examples)), len(examples))
        for start in range(0, len(order), pc.batch_size):
            nll_sum, n = nll.backward(model, [examples[i] for i in order[start:start + pc.batch_size]])
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if math.isfinite(nll_sum) and torch.isfinite(norm):  # as grpo_update: skip a non-finite step
                optimizer.step()
                losses.append(nll_sum / max(1, n))
                tokens += n
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    out = {"phase/steps": float(len(losses)), "phase/tokens": float(tokens), "phase/skipped_nonfinite": float(skipped)}
    return out | ({"phase/loss_first": losses[0], "phase/loss_last": losses[-1]} if losses else {})


@dataclass
class PhaseRunner:
    """The SFT phases of an RL run (ETS, PRS, the adaptive schedule): the failures they train on, the judge,
    the logs; RL's AdamW state is reset after each phase (its moments belong to the weights before it)."""

    run_dir: Path
    model: Any
    encoder: PieceEncoder
    tasks: dict[str, Task]  # the training split by id
    cfg: Any  # RunConfig
    failures: list[Failure]  # every failure logged so far
    optimizer: torch.optim.Optimizer | None = None  # RL's
    judge: Judge | None = None  # PRS's (signals/prs.py)
    decode: Callable[[Sequence[int]], str] | None = None
    generation_prompt_len: int = 0  # a turn's `<|im_start|>assistant\n`
    collected: int = -1  # the last step whose failures are in

    def collect(self, step: int, episodes: Sequence[Episode], kinds: Sequence[str]) -> None:
        """The step's failed tasks (judged where PRS can use the verdict), logged to failures.jsonl; once a step
        however many signals ask."""
        if step == self.collected:
            return
        failed = collect_failures(step, episodes, kinds, self.tasks, self.judge_at(step), self.decode,
                                  self.generation_prompt_len)
        log_failures(self.run_dir, failed)
        self.failures += failed
        self.collected = step

    def run(self, name: str, step: int, failures: Sequence[Failure]) -> dict[str, float]:
        """An SFT phase after `step` on `failures`' tasks; logged to phases.jsonl, returned as metrics."""
        s, c = self.cfg.supervision, self.cfg
        t0 = time.time()
        examples, stats = phase_examples(failures, self.tasks, self.encoder,
                                         s.prs.target if s.prs.enabled else None, c.model.max_seq_len)
        stats.update(sft_phase(self.model, examples, s.phase, c.grpo.micro_batch_size,
                               self.encoder.tokenizer.pad_token_id, seed=c.seed * 1_000_003 + step))
        stats["phase/seconds"] = time.time() - t0
        tqdm.write(f"rl: {name} phase after step {step}: {stats['phase/tasks']:.0f} failed tasks, "
                   f"{stats['phase/steps']:.0f} SFT steps, {stats['phase/tokens']:.0f} tokens"
                   + (f", loss {stats['phase/loss_first']:.3f} -> {stats['phase/loss_last']:.3f}"
                      if "phase/loss_first" in stats else ""))
        append_jsonl(self.run_dir / PHASES, {"step": step, "phase": name, **stats})
        if self.optimizer is not None:
            self.optimizer.state.clear()
        return stats

    def judge_at(self, step: int) -> Judge | None:
        """The judge where its verdicts can be used: PRS on, and `step` inside an ETS window (or anywhere
        when the adaptive schedule may run a phase on the failures so far)."""
        s = self.cfg.supervision
        if self.judge is None or not s.prs.enabled:
            return None
        in_window = s.ets.enabled and step % s.ets.every >= s.ets.every - s.ets.window
        return self.judge if in_window or (s.adaptive.enabled and s.adaptive.sft) else None

    def ets_round_ends(self, step: int) -> bool:
        e = self.cfg.supervision.ets
        return e.enabled and (step + 1) % e.every == 0

    def ets_failures(self, step: int) -> list[Failure]:
        """The rule: tasks with a zero-reward rollout in the round's last `window` steps (through `step`)."""
        window = self.cfg.supervision.ets.window
        return latest_per_task([f for f in self.failures if f.step <= step], first_step=step + 1 - window)


# ----------------------------------------------------------------------------- the adaptive schedule


def adaptive_handler(a: Any) -> Callable[[list, Any], None]:
    """monitor alarms -> the recovery `supervision.adaptive` names, through the AlarmContext's actions
    (`rollback`, `scale_lr`, `sft_phase`); each action's outcome goes into `ctx.events`."""

    def handle(alarms: list, ctx: Any) -> None:
        if ctx.recoveries >= a.max_recoveries:
            tqdm.write(f"rl: adaptive: {ctx.recoveries} recoveries done (max_recoveries); alarm only logged")
            return
        events: dict[str, Any] = {"adaptive/recovery": ctx.recoveries + 1}
        if a.rollback:
            events["adaptive/rollback_to"] = ctx.rollback()
        if a.lr_scale != 1.0:
            events["adaptive/lr_scale"] = ctx.scale_lr(a.lr_scale)
        if a.sft:
            events.update({f"adaptive/{k.removeprefix('phase/')}": v for k, v in ctx.sft_phase("adaptive").items()})
        ctx.events.update(events)
        ctx.recovered = True

    return handle
