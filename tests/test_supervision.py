"""Supervision signals: the synchronous SFT term (so far)."""

import copy
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from toolcollapse.chat import PieceEncoder
from toolcollapse.config import GRPOConfig
from toolcollapse.rl import build_batch, grpo_update
from toolcollapse.rollout import RolloutEngine, SamplingParams
from toolcollapse.sft import batch_logits, encode_tasks
from toolcollapse.supervision import SFTTerm


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sft_term_gradient_is_coef_times_the_token_mean_nll_gradient(tiny_model, tokenizer, world):
    """Accumulated over micro-batches of 2, normalised by the tokens of all 5 conversations: exactly
    coef * the gradient of the whole batch's token-mean cross-entropy."""
    examples = encode_tasks(PieceEncoder(tokenizer), world.tasks("train")[:5])
    model = copy.deepcopy(tiny_model).train()
    stats = SFTTerm(0.3, 2, tokenizer.pad_token_id).backward(model, examples)
    got = _grads(model)
    model.zero_grad()
    logits, targets = batch_logits(model, examples, tokenizer.pad_token_id)
    nll = F.cross_entropy(logits, targets)
    (0.3 * nll).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    assert all(torch.allclose(got[k], want[k], atol=1e-7, rtol=1e-5) for k in want)
    assert stats["sup/sft_nll"] == pytest.approx(nll.item(), rel=1e-5)
    assert stats["sup/sft_tokens"] == len(targets) == sum(sum(m[1:]) for _, m in examples)


def test_with_zero_advantages_the_step_is_the_sft_step(tiny_model, tokenizer, world):
    """Equal rewards (GRPO contributes no gradient), no KL, SGD at lr 1 without clipping: the weights
    move by exactly -coef * the SFT gradient of the step's ground truth."""
    tasks = world.tasks("train")[:2]
    model = copy.deepcopy(tiny_model).train()
    episodes = RolloutEngine(model, tokenizer, world).generate(tasks, SamplingParams(max_turns=2, max_new_tokens=12),
                                                               group_size=2)
    batch = build_batch(episodes, torch.zeros(len(episodes)), tokenizer.pad_token_id)
    examples = encode_tasks(PieceEncoder(tokenizer), tasks)
    g = GRPOConfig(micro_batch_size=2, grad_clip=1e9, kl_coef=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    term = SFTTerm(0.5, 2, tokenizer.pad_token_id)
    grpo_update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), batch, g,
                extra=lambda: bool(term.backward(model, examples)))
    moved = {n: before[n] - p.detach() for n, p in model.named_parameters()}

    reference = copy.deepcopy(tiny_model).train()
    logits, targets = batch_logits(reference, examples, tokenizer.pad_token_id)
    (0.5 * F.cross_entropy(logits, targets)).backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    assert any(w.abs().max() > 0 for w in want.values())
    assert all(torch.allclose(moved[n], want[n], atol=1e-6) for n in want)


@pytest.mark.slow
def test_sft_term_in_a_run_logs_its_tokens_and_resumes_their_total(tmp_path, tiny_checkpoint):
    """Off by default (no sup/ series); on, every step logs the term and the SFT tokens so far, and a
    run resumed from step 1 ends with the same total as the uninterrupted one."""
    from test_rl import _metrics, _rl_config

    from toolcollapse.config import load_config
    from toolcollapse.rl import resume_config, run_rl

    config = _rl_config(tmp_path, tiny_checkpoint)
    plain = _metrics(run_rl(load_config(config, ["grpo.steps=2"]), tmp_path / "plain"))
    assert not any(k.startswith("sup/") for r in plain for k in r)
    run = run_rl(load_config(config, ["grpo.steps=3", "grpo.checkpoint_every=1", "grpo.keep_checkpoints=3",
                                      "supervision.sft_coef=0.5"]),
                 tmp_path / "sft")
    rows = _metrics(run)
    assert all(r["sup/sft_nll"] > 0 and r["sup/sft_tokens"] > 0 for r in rows)
    assert [r["sup/sft_tokens_total"] for r in rows] == [sum(r["sup/sft_tokens"] for r in rows[:i + 1])
                                                         for i in range(3)]
    shutil.rmtree(run / "checkpoints" / "step_000003")
    shutil.rmtree(run / "checkpoints" / "step_000002")
    run_rl(resume_config(run), run, resume=True)  # from step_000001: steps 1 and 2 again
    assert _metrics(run) == rows


def test_unlikelihood_value_and_gradient():
    """-log(1 - p) at p = 0.5 and 0.2: log 2 and -log 0.8; d/d(log p) = p / (1 - p): 1 and 0.25."""
    from toolcollapse.losses import unlikelihood

    logp = torch.log(torch.tensor([0.5, 0.2])).requires_grad_()
    value = unlikelihood(logp)
    assert value.tolist() == pytest.approx([math.log(2), -math.log(0.8)], abs=1e-5)
    value.sum().backward()
    assert logp.grad.tolist() == pytest.approx([1.0, 0.25], abs=1e-4)
    assert torch.isfinite(unlikelihood(torch.tensor([0.0]))).all()  # p = 1: large, finite


@pytest.mark.parametrize("turn, call_end, rejected", [
    (["<tool_call>", "x", "</tool_call>"], "template", None),  # a healthy call
    (["x", "<|im_end|>"], "template", None),  # a healthy answer
    (["<tool_call>", "x", "<|im_end|>"], "template", 2),  # the unclosed call of full collapse
    (["x", "</tool_call>"], "template", 1),  # a stray </tool_call>
    (["x", "<tool_response>", "y", "<|im_end|>"], "template", 1),
    (["x", "<|endoftext|>"], "template", 1),
    (["<tool_call>", "x", "<tool_call>"], "template", 2),  # nested
    (["<tool_call>", "x", "</tool_call>", "<|im_end|>"], "sampled", None),
    (["<tool_call>", "x", "</tool_call>", "<tool_call>"], "sampled", 3),  # a second call
])
def test_first_rejected_control(turn, call_end, rejected):
    from toolcollapse.chat import CONTROL_TAGS
    from toolcollapse.parser import first_rejected_control

    tag_id = {t: 100 + i for i, t in enumerate(CONTROL_TAGS)}
    ids = [tag_id.get(t, 7) for t in turn]
    assert first_rejected_control(ids, {i: t for t, i in tag_id.items()}, call_end) == rejected


def test_unlikelihood_term_gradient_in_the_update(tiny_model, tokenizer, world):
    """Zero advantages, no KL, SGD at lr 1: the weights move by -coef * the gradient of the mean
    -log(1 - p) over the marked tokens, and the logged policy loss leaves the term out."""
    from toolcollapse.losses import unlikelihood
    from toolcollapse.rl import policy_logprobs

    model = copy.deepcopy(tiny_model).train()
    params = SamplingParams(max_turns=1, max_new_tokens=8)
    episodes = RolloutEngine(model, tokenizer, world).generate(world.tasks("train")[:2], params, group_size=2)
    sampled = [[i for i, m in enumerate(ep.loss_mask) if m] for ep in episodes]
    marked = [sampled[0][:1], [], sampled[2][-1:], []]  # two of the policy's tokens
    batch = build_batch(episodes, torch.zeros(len(episodes)), tokenizer.pad_token_id, unlikely=marked)
    assert int(batch.unlikely.sum()) == 2 and bool((batch.unlikely <= batch.target_mask).all())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = GRPOConfig(micro_batch_size=2, grad_clip=1e9, kl_coef=0.0)
    stats = grpo_update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), batch, g, unlikelihood_coef=0.7)
    moved = {n: before[n] - p.detach() for n, p in model.named_parameters()}

    reference = copy.deepcopy(tiny_model).train()
    logp, _ = policy_logprobs(reference, batch)
    ul = unlikelihood(logp[batch.unlikely[batch.target_mask]])
    (0.7 * ul.mean()).backward()
    assert stats.terms["sup/unlikely_tokens"] == 2
    assert stats.terms["sup/unlikelihood"] == pytest.approx(ul.mean().item(), rel=1e-5)
    assert stats.loss == pytest.approx(0.0, abs=1e-9)  # zero advantages: no policy loss
    assert all(torch.allclose(moved[n], p.grad, atol=1e-6) for n, p in reference.named_parameters())
    assert any(p.grad.abs().max() > 0 for p in reference.parameters())


def test_unlikely_positions_mark_the_rejected_token_of_failed_turns_only(tokenizer):
    """Turn 1 is a healthy call, turn 2 an unclosed call ending on <|im_end|>: only that <|im_end|>."""
    from toolcollapse.chat import CONTROL_TAGS
    from toolcollapse.parser import parse_turn_ids
    from toolcollapse.records import Episode, TurnRecord
    from toolcollapse.rl import unlikely_positions

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in CONTROL_TAGS}
    id_to_tag = {i: t for t, i in ids.items()}
    text = tokenizer('{"name": "kb_lookup", "arguments": {}}', add_special_tokens=False)["input_ids"]
    decode = lambda x: tokenizer.decode(x)  # noqa: E731
    healthy = [ids["<tool_call>"], *text, ids["</tool_call>"]]
    broken = [ids["<tool_call>"], *text, ids["<|im_end|>"]]
    prompt, observation = [5, 6, 7], [8, 9]
    tokens = prompt + healthy + observation + broken
    turns = [TurnRecord(3, 3 + len(healthy), parse_turn_ids(healthy, id_to_tag, decode)),
             TurnRecord(len(tokens) - len(broken), len(tokens), parse_turn_ids(broken, id_to_tag, decode))]
    assert turns[0].parsed.state.healthy and not turns[1].parsed.state.healthy
    episode = Episode("t", tokens, [0] * len(tokens), [0.0] * len(tokens), 3, turns)
    assert unlikely_positions([episode], id_to_tag, "template") == [[len(tokens) - 1]]
