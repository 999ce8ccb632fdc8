"""A GRPO group's rows: the policy's own samples, then the rows signals put there (`Signal.rows`: HBG's
hinted rows, OPS's expert rows), in the registry's order."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from toolcollapse.records import Episode, Task
from toolcollapse.signals.base import RowKind, Rows
from toolcollapse.supervision import without_hint


def row_kinds(group_size: int, rows: Sequence[Rows]) -> list[RowKind]:
    """A group's rows in order: the policy's own samples, then each of `rows` (the sampled ones, HBG's, before
    the replayed ones, OPS's: `group_rollouts` orders them so). Both trainers lay their groups out by it."""
    return ["policy"] * (group_size - sum(r.n for r in rows)) + [r.kind for r in rows for _ in range(r.n)]


def group_rollouts(engine: Any, tasks: Sequence[Task], params: Any, group_size: int, rows: Sequence[Rows],
                   seed: int) -> tuple[list[Episode], list[RowKind]]:
    """G rows per task, groups contiguous, and each row's kind. Rows with a `prompt` are sampled in one
    generate call with the policy's (each task's policy rows, then its prompted copies), and re-based on the
    task's own prompt; rows without are the task's ground truth replayed through the environment. With no
    signal rows this is `engine.generate(tasks, params, group_size, seed)` exactly."""
    sampled_rows = [r for r in rows if r.prompt is not None]
    replayed = [r for r in rows if r.prompt is None]
    layout = row_kinds(group_size, [*sampled_rows, *replayed])
    n_policy = layout.count("policy")
    n_sampled = n_policy + sum(r.n for r in sampled_rows)
    if not sampled_rows:
        sampled = engine.generate(tasks, params, group_size=n_policy, seed=seed)
    else:
        batch = [x for t in tasks for x in [t] * n_policy + [p for r in sampled_rows for p in [r.prompt(t)] * r.n]]
        sampled = engine.generate(batch, params, group_size=1, seed=seed)
        own = {t.id: engine.prompt_ids(t) for t in tasks}
        sampled = [without_hint(ep, own[ep.task_id]) if i % n_sampled >= n_policy else ep
                   for i, ep in enumerate(sampled)]
    experts = engine.replay(tasks, params) if replayed else []
    episodes: list[Episode] = []
    kinds: list[RowKind] = []
    for i in range(len(tasks)):
        episodes += sampled[i * n_sampled:(i + 1) * n_sampled]
        episodes += [_copy(experts[i]) for _ in range(group_size - n_sampled)]
        kinds += layout
    return episodes, kinds


def _copy(episode: Episode) -> Episode:
    return dataclasses.replace(episode, tokens=list(episode.tokens), loss_mask=list(episode.loss_mask),
                               logprobs=list(episode.logprobs), turns=list(episode.turns))
