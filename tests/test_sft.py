import math
import random

import pytest
import torch

from toolcollapse.chat import PieceEncoder
from toolcollapse.losses import sft_loss
from toolcollapse.model import logits_at, shared_prefix_len
from toolcollapse.optim import lr_at
from toolcollapse.sft import (collate, encode_first_calls, encode_tasks, encode_without_system_prompt,
                              length_grouped_batches, token_kinds, warmup_examples)


def test_sft_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # p(target) = 1/2 and 3/4
    loss, stats = sft_loss(logits, torch.tensor([1, 0]))
    assert loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.75)) / 2, abs=1e-6)
    assert stats.accuracy == 0.5 and stats.n_tokens == 2


def test_collate_selects_positions_before_trained_tokens():
    ids, select = collate([([5, 6, 7, 8], [0, 0, 1, 1]), ([5, 9], [0, 1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert select.tolist() == [[False, True, True, False], [True, False, False, False]]
    assert ids[:, 1:][select[:, :-1]].tolist() == [7, 8, 9]


def test_shared_prefix_len():
    rows = [[1] * 40 + [2, 3, 4], [1] * 40 + [5, 6]]
    assert shared_prefix_len(rows) == 40
    assert shared_prefix_len([[1] * 40, [1] * 40 + [2]]) == 39  # every row keeps at least its last token
    assert shared_prefix_len([[1] * 10 + [2], [1] * 10 + [3]]) == 0  # too short to bother


@pytest.mark.parametrize("same_task", [False, True])
def test_shared_prefix_forward_equals_plain_forward(world, tokenizer, tiny_model, same_task):
    """The shared prefix runs once -- the system prompt, or (rows of one task, as a GRPO group) also
    the question and the first turns, trained positions included -- and changes nothing."""
    tasks = world.tasks("train")[:1] * 3 if same_task else world.tasks("train")[:3]
    examples = encode_tasks(PieceEncoder(tokenizer), tasks)
    if same_task:  # the rows part after the first observation
        examples = [(x[:len(x) - 5 * i], m[:len(x) - 5 * i]) for i, (x, m) in enumerate(examples)]
    ids, select = collate(examples, tokenizer.pad_token_id)
    prefix = shared_prefix_len([x for x, _ in examples])
    assert prefix > 100  # the system prompt
    assert same_task == bool(select[:, :prefix].any())  # trained positions inside the shared prefix
    grads = []
    for p in (0, prefix):
        tiny_model.zero_grad()
        logits = logits_at(tiny_model, ids, select, p)
        logits.logsumexp(-1).sum().backward()
        grads.append([q.grad.clone() for q in tiny_model.parameters()])
        if p == 0:
            plain = logits.detach()
    torch.testing.assert_close(logits.detach(), plain, atol=1e-5, rtol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    tiny_model.zero_grad()


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


def test_lr_schedules():
    assert lr_at(0, 1.0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_at(99, 1.0, 10, 100, 0.1) == pytest.approx(0.1)  # cosine reaches the floor at the last step
    assert lr_at(50, 1.0, 10, 100, 0.1, "wsd", 0.2) == 1.0  # stable phase
    assert lr_at(99, 1.0, 10, 100, 0.1, "wsd", 0.2) == pytest.approx(0.1)
    assert 0.1 < lr_at(90, 1.0, 10, 100, 0.1, "wsd", 0.2) < 1.0
    assert lr_at(99, 1.0, 10, 100, 0.1, "constant") == 1.0


def test_length_grouped_batches_cover_the_data():
    examples = [([0] * random.Random(i).randint(1, 50), [1]) for i in range(64)]
    batches = length_grouped_batches(examples, 4, random.Random(0), group=4)
    seen = [id(e) for _ in range(16) for e in next(batches)]
    assert sorted(seen) == sorted(id(e) for e in examples)  # one pass = every example once
    widths = [max(len(x) for x, _ in b) - min(len(x) for x, _ in b) for b in
              (next(batches) for _ in range(16))]
    assert sum(widths) / 16 < 12  # sorted within groups: rows of a batch have similar lengths


def test_token_kinds(world, tokenizer):
    task = world.tasks("test")[0]
    example = PieceEncoder(tokenizer).encode_conversation(list(task.prompt) + list(task.reference))
    kinds = token_kinds(example, tokenizer)
    assert len(kinds) == sum(example[1])
    assert {"digit", "word", "structure"} <= set(kinds)
