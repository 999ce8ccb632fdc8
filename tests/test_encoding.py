"""Token rows: a task's conversation as (ids, trainable mask), the copy warm-up's shorter rows, collation
and length-grouped batches (encoding.py)."""

import random

from toolcollapse.chat import PieceEncoder
from toolcollapse.encoding import (collate, encode_first_calls, encode_tasks, encode_without_system_prompt,
                                   length_grouped_batches, warmup_examples)


def test_collate_selects_positions_before_trained_tokens():
    ids, select = collate([([5, 6, 7, 8], [0, 0, 1, 1]), ([5, 9], [0, 1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert select.tolist() == [[False, True, True, False], [True, False, False, False]]
    assert ids[:, 1:][select[:, :-1]].tolist() == [7, 8, 9]


def test_copy_warmup_examples_are_question_and_first_call(world, tokenizer):
    task = world.tasks("train")[0]
    encoder = PieceEncoder(tokenizer)
    (ids, mask), = encode_first_calls(encoder, [task])
    (full_ids, full_mask), = encode_tasks(encoder, [task])
    text = tokenizer.decode(ids)
    assert task.prompt[-1].content in text and "system" not in text  # no system prompt
    assert text.count("<tool_call>") == 1 and "<tool_response>" not in text
    trained = [t for t, m in zip(ids, mask) if m]
    first_call = [t for t, m in zip(full_ids, full_mask) if m][:len(trained)]
    assert trained == first_call  # the same targets as the first assistant turn of the full conversation
    (ids, mask), = encode_without_system_prompt(encoder, [task])
    assert "system" not in tokenizer.decode(ids) and len(ids) < len(full_ids) - 100
    assert [t for t, m in zip(ids, mask) if m] == [t for t, m in zip(full_ids, full_mask) if m]  # every target kept
    tasks = world.tasks("train")[:4]
    both = warmup_examples(encoder, tasks, "both")
    assert both == encode_first_calls(encoder, tasks[:2]) + encode_without_system_prompt(encoder, tasks[2:])


def test_length_grouped_batches_cover_the_data():
    examples = [([0] * random.Random(i).randint(1, 50), [1]) for i in range(64)]
    batches = length_grouped_batches(examples, 4, random.Random(0), group=4)
    seen = [id(e) for _ in range(16) for e in next(batches)]
    assert sorted(seen) == sorted(id(e) for e in examples)  # one pass = every example once
    widths = [max(len(x) for x, _ in b) - min(len(x) for x, _ in b) for b in
              (next(batches) for _ in range(16))]
    assert sum(widths) / 16 < 12  # sorted within groups: rows of a batch have similar lengths
