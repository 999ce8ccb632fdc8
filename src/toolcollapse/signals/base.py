"""The signal protocol: a supervision signal is a `Signal` whose hooks the RL loop calls at each stage of a
step, and the `LossTerm`s it hands the update (this package's docstring says when each hook is called)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Sequence

import torch

from toolcollapse.records import Episode, PolicyBatch, Task

RowKind = Literal["policy", "hinted", "expert"]


@dataclass(frozen=True)
class OptimizerStep:
    """Which optimizer step of an RL step a term is in."""

    batch: PolicyBatch  # the mini-batch: whole groups, rows [start, end) of the step's batch
    start: int
    end: int
    batch_rows: int  # the step's batch
    group_size: int
    last_pass: bool  # the last of `grpo.updates_per_batch` passes over the batch
    # what a term's mean over the marked tokens (`batch.unlikely`) divides by; None: `batch`'s own count (ours:
    # `batch` is the whole optimizer step). TRL's micro-batch is a part of one, its losses averaged over the
    # accumulation steps: the step's count over its ranks and micro-batches, per micro-batch (with several
    # optimizer steps a generation batch, the batch's count per step, as TRL's own `dapo` normaliser)
    marked_tokens: float | None = None


class LossTerm:
    """A term of the loss beside the clipped surrogate (the defaults add nothing).

    What it logs is kept as additive sums (`SUMS`, in `self.sums`: over micro-batches, optimizer steps and, in
    TRL, ranks and logging windows) and turned into metrics by `metrics_of`, so every trainer reduces them the
    same way: ours over an RL step, TRL's over its ranks since the last log."""

    marked: Sequence[Sequence[int]] | None = None  # per row, token positions the term reads as `batch.unlikely`
    SUMS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.SUMS, 0.0)

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] += value

    def begin(self, step: OptimizerStep) -> None:
        """An optimizer step starts."""

    def token_loss(self, pg: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mb: PolicyBatch,
                   seq_ids: torch.Tensor) -> torch.Tensor:
        """The per-token policy loss [M] of micro-batch `mb` (`seq_ids` [M]: each token's row); by default the
        clipped surrogate `pg`, with `expert_loss` in its place on the tokens of the batch's expert rows."""
        shaped = self.expert_loss(logp, adv) if mb.expert is not None else None
        return pg if shaped is None else torch.where(mb.expert[seq_ids], shaped, pg)

    def expert_loss(self, logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor | None:
        """The per-token loss of the expert rows' tokens (OPS's) in place of the clipped surrogate, from their
        log-probs and advantages [M]; None: the surrogate. The one reshaping of the surrogate both trainers run
        (TRL's takes its expert rows out of its own surrogate and adds this)."""
        return None

    def forward_loss(self, logp: torch.Tensor, mb: PolicyBatch) -> torch.Tensor | None:
        """A scalar added to the micro-batch's loss, from its log-probs [M] at the sampled tokens."""
        return None

    def backward(self, model: Any) -> bool:
        """After the micro-batches: a loss of its own forward, backpropagated; whether it was finite."""
        return True

    @staticmethod
    def metrics_of(sums: dict[str, float]) -> dict[str, float]:
        """What it logs, from its sums."""
        return {}

    def metrics(self) -> dict[str, float]:
        return self.metrics_of(self.sums)


@dataclass(frozen=True)
class Rows:
    """`n` rows a signal puts in every group, after the policy's own samples. With `prompt`, they are sampled
    in the policy's own generate call from the prompt it returns for a task, and trained on the task's own
    prompt (HBG's hinted rows); without, they are the task's ground truth fed through the environment (OPS)."""

    kind: RowKind
    n: int
    prompt: Callable[[Task], Task] | None = None


@dataclass
class Step:
    """One RL step as the stages fill it in."""

    index: int
    tasks: list[Task]
    episodes: list[Episode] = field(default_factory=list)
    kinds: list[RowKind] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # the step's metrics.jsonl row so far


class Signal:
    """A supervision signal. Built from the run's config before any work (a chat model it needs answers then:
    a wrong address stops the run before the model loads); `given`: objects a caller passes instead of the
    config's (`judge`). The hooks' defaults do nothing."""

    name: ClassVar[str]

    def __init__(self, cfg: Any, **given: Any):
        self.cfg = cfg  # RunConfig

    @staticmethod
    def enabled(cfg: Any) -> bool:
        """Whether the run's config turns this signal on."""
        raise NotImplementedError

    def start(self, run: Any) -> None:
        """The run's objects exist (rl.Run: model, engine, optimizer, phases, ...), fresh or resumed."""

    def rows(self) -> Rows | None:
        """The rows it puts in each group."""
        return None

    def terms(self, step: Step) -> list[LossTerm]:
        """The loss terms it adds to this step's update."""
        return []

    def after_update(self, step: Step) -> dict[str, float]:
        """After the update, before the alarms: what it does between steps (an SFT phase); its metrics."""
        return {}

    def on_alarm(self) -> Callable[[list, Any], None] | None:
        """A handler for the monitor's alarms (rl.AlarmContext); None: the config's `monitor.on_alarm`."""
        return None

    def metrics(self) -> dict[str, float]:
        """What it logs for the step (a chat model's calls and costs so far)."""
        return {}
