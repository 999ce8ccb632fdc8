import math

import pytest
import torch

from toolcollapse.chat import PieceEncoder
from toolcollapse.encoding import collate, encode_tasks
from toolcollapse.losses import sft_loss
from toolcollapse.model import logits_at, shared_prefix_len
from toolcollapse.optim import lr_at
from toolcollapse.sft import token_kinds


def test_sft_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # p(target) = 1/2 and 3/4
    loss, stats = sft_loss(logits, torch.tensor([1, 0]))
    assert loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.75)) / 2, abs=1e-6)
    assert stats.accuracy == 0.5 and stats.n_tokens == 2


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


def test_lr_schedules():
    assert lr_at(0, 1.0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_at(99, 1.0, 10, 100, 0.1) == pytest.approx(0.1)  # cosine reaches the floor at the last step
    assert lr_at(50, 1.0, 10, 100, 0.1, "wsd", 0.2) == 1.0  # stable phase
    assert lr_at(99, 1.0, 10, 100, 0.1, "wsd", 0.2) == pytest.approx(0.1)
    assert 0.1 < lr_at(90, 1.0, 10, 100, 0.1, "wsd", 0.2) < 1.0
    assert lr_at(99, 1.0, 10, 100, 0.1, "constant") == 1.0


def test_token_kinds(world, tokenizer):
    task = world.tasks("test")[0]
    example = PieceEncoder(tokenizer).encode_conversation(list(task.prompt) + list(task.reference))
    kinds = token_kinds(example, tokenizer)
    assert len(kinds) == sum(example[1])
    assert {"digit", "word", "structure"} <= set(kinds)
