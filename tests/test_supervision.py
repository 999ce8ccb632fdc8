"""Supervision signals: the synchronous SFT term (so far)."""

import copy
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
