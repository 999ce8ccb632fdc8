"""Token rows for training and scoring: a task's conversation encoded as (token ids, trainable mask), and
rows collated into padded batches.

The encoder (`chat.PieceEncoder`) marks as trainable exactly the tokens a rollout samples -- an assistant
turn's call or answer and its stop token -- so an SFT example, the SFT term and OPS's ground-truth rows, the
probe and a phase of ETS/PRS all train or score the same positions. SFT, RL, the monitor and the supervision
signals share these functions.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Sequence

import torch

from toolcollapse.chat import PieceEncoder
from toolcollapse.model import device_of, logits_at, shared_prefix_len
from toolcollapse.records import Task

Example = tuple[list[int], list[int]]  # (token ids, trainable mask)


def encode_tasks(encoder: PieceEncoder, tasks: Sequence[Task]) -> list[Example]:
    return [encoder.encode_conversation(list(t.prompt) + list(t.reference)) for t in tasks]


def encode_first_calls(encoder: PieceEncoder, tasks: Sequence[Task]) -> list[Example]:
    """The copy warm-up's examples: each task's user question and first assistant turn, no system prompt."""
    return [encoder.encode_conversation([t.prompt[-1], t.reference[0]]) for t in tasks]


def encode_without_system_prompt(encoder: PieceEncoder, tasks: Sequence[Task]) -> list[Example]:
    """Whole conversations minus the system prompt: names *and* numbers to copy, in ~1/4 of the tokens."""
    return [encoder.encode_conversation([t.prompt[-1], *t.reference]) for t in tasks]


def warmup_examples(encoder: PieceEncoder, tasks: Sequence[Task], content: str) -> list[Example]:
    """The copy warm-up's data: first calls, whole conversations without the system prompt, or half of each."""
    if content == "first_call":
        return encode_first_calls(encoder, tasks)
    if content == "no_system_prompt":
        return encode_without_system_prompt(encoder, tasks)
    half = len(tasks) // 2
    return (encode_first_calls(encoder, tasks[:half])
            + encode_without_system_prompt(encoder, tasks[half:]))


def collate(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and the positions whose *next* token is trained [B, T]."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    select = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, (x, m) in enumerate(examples):
        ids[i, :len(x)] = torch.tensor(x)
        select[i, :len(x) - 1] = torch.tensor(m[1:], dtype=torch.bool)
    return ids, select


def length_grouped_batches(examples: Sequence[Example], batch_size: int, rng: random.Random,
                           group: int = 16) -> Iterator[list[Example]]:
    """Endless shuffled batches; with group > 1, of similar lengths: draw `group` batches'
    worth of examples, sort by length, cut, shuffle the batches (padding ~30 % -> ~3 %)."""
    order: list[int] = []
    while True:
        while len(order) < batch_size * group:
            order += rng.sample(range(len(examples)), len(examples))
        pool = order[:batch_size * group]
        del order[:batch_size * group]
        if group > 1:
            pool.sort(key=lambda i: len(examples[i][0]))
        chunks = [pool[i:i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield [examples[i] for i in chunk]


def batch_logits(model: Any, examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [M, V] at the trained positions and their targets [M]; a shared prefix is run once."""
    device = device_of(model)
    ids, select = (t.to(device) for t in collate(examples, pad_id))
    targets = ids[:, 1:][select[:, :-1]]  # [M]
    prefix = shared_prefix_len([x for x, _ in examples])
    return logits_at(model, ids, select, prefix), targets
