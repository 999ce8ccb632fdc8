"""Supervision signals: the synchronous SFT term, unlikelihood, OPS and HBG."""

import copy
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from toolcollapse.chat import PieceEncoder
from toolcollapse.config import GRPOConfig
from toolcollapse.encoding import batch_logits, encode_tasks
from toolcollapse.rollout import RolloutEngine, SamplingParams
from toolcollapse.signals import LuffyShaping, OptimizerStep, SFTTermLoss, Unlikelihood, build_signals, group_rollouts, group_rows
from toolcollapse.supervision import SFTTerm
from toolcollapse.update import build_batch, grpo_update


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}



def _whole(batch, group_size: int) -> OptimizerStep:
    """The one optimizer step of an RL step whose batch is a single mini-batch."""
    return OptimizerStep(batch, 0, len(batch), len(batch), group_size, last_pass=True)

def test_sft_term_gradient_is_coef_times_the_token_mean_nll_gradient(tiny_model, tokenizer, world):
    """Accumulated over micro-batches of 2, normalised by the tokens of all 5 conversations: exactly
    coef * the gradient of the whole batch's token-mean cross-entropy."""
    examples = encode_tasks(PieceEncoder(tokenizer), world.tasks("train")[:5])
    model = copy.deepcopy(tiny_model).train()
    nll_sum, tokens = SFTTerm(0.3, 2, tokenizer.pad_token_id).backward(model, examples)
    got = _grads(model)
    model.zero_grad()
    logits, targets = batch_logits(model, examples, tokenizer.pad_token_id)
    nll = F.cross_entropy(logits, targets)
    (0.3 * nll).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    assert all(torch.allclose(got[k], want[k], atol=1e-7, rtol=1e-5) for k in want)
    assert nll_sum / tokens == pytest.approx(nll.item(), rel=1e-5)
    assert tokens == len(targets) == sum(sum(m[1:]) for _, m in examples)


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
    term = SFTTermLoss(SFTTerm(0.5, 2, tokenizer.pad_token_id), examples)
    term.begin(_whole(batch, group_size=2))
    grpo_update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), batch, g, terms=[term])
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
    from toolcollapse.rl import run_rl
    from toolcollapse.rundir import resume_config

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
    from toolcollapse.update import policy_logprobs

    model = copy.deepcopy(tiny_model).train()
    params = SamplingParams(max_turns=1, max_new_tokens=8)
    episodes = RolloutEngine(model, tokenizer, world).generate(world.tasks("train")[:2], params, group_size=2)
    sampled = [[i for i, m in enumerate(ep.loss_mask) if m] for ep in episodes]
    marked = [sampled[0][:1], [], sampled[2][-1:], []]  # two of the policy's tokens
    batch = build_batch(episodes, torch.zeros(len(episodes)), tokenizer.pad_token_id, unlikely=marked)
    assert int(batch.unlikely.sum()) == 2 and bool((batch.unlikely <= batch.target_mask).all())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = GRPOConfig(micro_batch_size=2, grad_clip=1e9, kl_coef=0.0)
    term = Unlikelihood(0.7, marked)
    term.begin(_whole(batch, group_size=2))
    stats = grpo_update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), batch, g, terms=[term])
    moved = {n: before[n] - p.detach() for n, p in model.named_parameters()}

    reference = copy.deepcopy(tiny_model).train()
    logp, _ = policy_logprobs(reference, batch)
    ul = unlikelihood(logp[batch.unlikely[batch.target_mask]])
    (0.7 * ul.mean()).backward()
    assert term.metrics()["sup/unlikely_tokens"] == 2
    assert term.metrics()["sup/unlikelihood"] == pytest.approx(ul.mean().item(), rel=1e-5)
    assert stats.loss == pytest.approx(0.0, abs=1e-9)  # zero advantages: no policy loss
    assert all(torch.allclose(moved[n], p.grad, atol=1e-6) for n, p in reference.named_parameters())
    assert any(p.grad.abs().max() > 0 for p in reference.parameters())


def test_unlikely_positions_mark_the_rejected_token_of_failed_turns_only(tokenizer):
    """Turn 1 is a healthy call, turn 2 an unclosed call ending on <|im_end|>: only that <|im_end|>."""
    from toolcollapse.chat import CONTROL_TAGS
    from toolcollapse.parser import parse_turn_ids
    from toolcollapse.records import Episode, TurnRecord
    from toolcollapse.supervision import unlikely_positions

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


# ----------------------------------------------------------------------------- OPS


def test_luffy_loss_and_gradient_on_three_tokens():
    """-A p / (p + 0.1) at p = 0.9, 0.1, 0.01 with A = 1, 1, -2: -0.9, -0.5, +2/11; the gradient in
    log p is -A * 0.1 p / (p + 0.1)^2: -0.09, -0.25, +2 * 0.001 / 0.0121."""
    from toolcollapse.losses import luffy_loss

    logp = torch.log(torch.tensor([0.9, 0.1, 0.01])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -2.0])
    loss = luffy_loss(logp, adv, 0.1)
    assert loss.tolist() == pytest.approx([-0.9, -0.5, 2 * 0.01 / 0.11], abs=1e-6)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-0.09, -0.25, 2 * 0.001 / 0.0121], abs=1e-6)


def test_expert_episode_is_the_ground_truth_run_through_the_environment(tokenizer, world):
    """The replayed ground truth has exactly the tokens and loss mask SFT trains on (its observations,
    really executed, equal the reference's), healthy turns, and solves the task; cut at the turn
    limit, it ends on max_turns and fails."""
    tasks = [t for t in world.tasks("train")[:20] if t.meta["n_calls"] >= 2][:3]
    engine = RolloutEngine(torch.nn.Linear(1, 1), tokenizer, world)  # replay runs no model
    experts = engine.replay(tasks, SamplingParams(max_turns=8, max_new_tokens=96))
    for ep, (ids, mask) in zip(experts, encode_tasks(engine.encoder, tasks)):
        assert ep.tokens == ids[:len(ep.tokens)] and len(ids) - len(ep.tokens) <= 1  # the last turn's "\n"
        assert ep.loss_mask == mask[:len(ep.tokens)]
        assert ep.success and ep.finish == "answered"
        assert all(t.parsed.state.healthy for t in ep.turns)
        assert sum(t.observation is not None for t in ep.turns) == len(ep.turns) - 1
    cut = engine.replay(tasks[:1], SamplingParams(max_turns=2, max_new_tokens=96))[0]
    assert cut.finish == "max_turns" and not cut.success and len(cut.turns) == 2


def test_a_mixed_group_and_its_advantages(tiny_model, tokenizer, world):
    """OPS with 1 expert row in groups of 4: the expert is the group's last row, rewarded 1; with the
    untrained policy's three rows all failing, its advantage is (1 - 1/4) / std = 3 / sqrt(3) and theirs
    -1/sqrt(3); signals off, group_rollouts is engine.generate exactly."""
    from toolcollapse.advantages import group_advantages
    from toolcollapse.config import OPSConfig, RunConfig, SupervisionConfig
    from toolcollapse.rewards import rewards_tensor

    engine = RolloutEngine(tiny_model, tokenizer, world)
    tasks, params = world.tasks("train")[:2], SamplingParams(max_turns=8, max_new_tokens=64)
    plain, kinds = group_rollouts(engine, tasks, params, 4, group_rows(build_signals(RunConfig())), seed=3)
    assert kinds == ["policy"] * 8
    assert [e.tokens for e in plain] == [e.tokens for e in engine.generate(tasks, params, group_size=4, seed=3)]
    s = SupervisionConfig(ops=OPSConfig(enabled=True, rows=1))
    episodes, kinds = group_rollouts(engine, tasks, params, 4, group_rows(build_signals(RunConfig(supervision=s))), seed=3)
    assert kinds == (["policy"] * 3 + ["expert"]) * 2
    assert [e.task_id for e in episodes] == [tasks[0].id] * 4 + [tasks[1].id] * 4
    rewards = rewards_tensor(episodes)
    assert rewards.tolist() == [0.0, 0.0, 0.0, 1.0] * 2
    advantages, _ = group_advantages(rewards, 4)
    third = 1 / math.sqrt(3)
    assert advantages.tolist() == pytest.approx([-third, -third, -third, 3 * third] * 2, abs=1e-5)


def test_the_update_shapes_expert_tokens_and_clips_the_others(tiny_model, tokenizer, world):
    """SGD at lr 1, no KL: the weights move by the gradient of the clipped surrogate on policy rows
    plus LUFFY's -A p / (p + gamma) on the expert row, token-mean over the batch; with shaping `none`
    the expert row's tokens take the surrogate like the others (ratio 1 on old log-probs recomputed)."""
    from toolcollapse.losses import luffy_loss, ppo_clip_loss
    from toolcollapse.update import policy_logprobs, recompute_old_logprobs

    engine = RolloutEngine(tiny_model, tokenizer, world)
    task = world.tasks("train")[:1]
    params = SamplingParams(max_turns=2, max_new_tokens=8)
    episodes = engine.generate(task, params, group_size=2, seed=1) + engine.replay(task, params)
    g = GRPOConfig(micro_batch_size=2, grad_clip=1e9, kl_coef=0.0)
    batch = build_batch(episodes, torch.tensor([-0.5, -0.5, 1.0]), tokenizer.pad_token_id,
                        expert=[False, False, True])
    recompute_old_logprobs(tiny_model, batch, [2], g)
    assert batch.old_logp[2][batch.target_mask[2]].abs().min() > 0  # the expert's tokens have old log-probs now
    for gamma in (0.1, 0.0):
        model = copy.deepcopy(tiny_model).train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grpo_update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), batch, g,
                    terms=[LuffyShaping(gamma)] if gamma else [])
        moved = {n: before[n] - p.detach() for n, p in model.named_parameters()}
        reference = copy.deepcopy(tiny_model).train()
        logp, _ = policy_logprobs(reference, batch)
        rows = batch.target_mask.nonzero()[:, 0]
        adv = batch.advantages[rows]
        per_token, _ = ppo_clip_loss(logp, batch.old_logp[batch.target_mask], adv, g.clip_low, g.clip_high,
                                     g.dual_clip)
        if gamma:
            per_token = torch.where(rows == 2, luffy_loss(logp, adv, gamma), per_token)
        per_token.mean().backward()
        assert all(torch.allclose(moved[n], p.grad, atol=1e-6) for n, p in reference.named_parameters())
        assert any(p.grad.abs().max() > 0 for p in reference.parameters())


# ----------------------------------------------------------------------------- HBG


def test_hints_are_templated_from_the_ground_truth_and_never_hold_the_answer(world):
    from toolcollapse.supervision import FORMAT_HINT, hint

    task = next(t for t in world.tasks("train") if t.meta["template"] == "extreme_of_three")
    calls = [m.tool_call for m in task.reference if m.tool_call is not None]
    assert hint(task, "format") == FORMAT_HINT
    assert hint(task, "plan") == FORMAT_HINT + "\nPlan: call " + ", then ".join(c.name for c in calls) + "."
    first = hint(task, "calls", 1)
    assert first.endswith("Start with:\n<tool_call>\n" + calls[0].to_json() + "\n</tool_call>")
    every = hint(task, "calls", len(calls))
    assert task.answer in calls[-1].to_json()  # the aggregate's values hold the answer:
    assert calls[-2].to_json() in every and calls[-1].to_json() not in every  # that call is never shown
    assert all(task.answer not in hint(task, level, 9) for level in ("format", "plan", "calls"))


def test_hinted_rows_train_on_the_hint_free_prompt(tiny_model, tokenizer, world):
    """HBG rows sample under the hint; in the batch they sit on the plain prompt, and their old
    log-probs, recomputed there, equal a plain forward over the plain row (ratio 1) and differ from
    the log-probs the hint gave them when sampled."""
    from toolcollapse.config import HBGConfig, RunConfig, SupervisionConfig
    from toolcollapse.update import policy_logprobs, recompute_old_logprobs

    engine = RolloutEngine(tiny_model, tokenizer, world)
    task = world.tasks("train")[:1]
    params = SamplingParams(max_turns=2, max_new_tokens=12)
    s = SupervisionConfig(hbg=HBGConfig(enabled=True, rows=2, level="calls"))
    episodes, kinds = group_rollouts(engine, task, params, 4, group_rows(build_signals(RunConfig(supervision=s))), seed=5)
    assert kinds == ["policy", "policy", "hinted", "hinted"]
    plain_prompt = engine.prompt_ids(task[0])
    assert all(ep.tokens[:ep.prompt_len] == plain_prompt for ep in episodes)
    # the same seed and batch sample the hinted rows again, still carrying the hint and its log-probs
    from toolcollapse.supervision import hint, with_hint
    hinted = with_hint(task[0], hint(task[0], "calls", 1))
    raw = engine.generate([task[0], task[0], hinted, hinted], params, group_size=1, seed=5)[2:]
    assert len(raw[0].tokens) - raw[0].prompt_len == len(episodes[2].tokens) - episodes[2].prompt_len
    assert raw[0].tokens[raw[0].prompt_len:] == episodes[2].tokens[episodes[2].prompt_len:]
    for ep in episodes[2:]:
        turn = ep.turns[0]
        assert ep.loss_mask[turn.start] == 1 and ep.loss_mask[turn.start - 1] == 0
    batch = build_batch(episodes, torch.zeros(4), tokenizer.pad_token_id)
    recompute_old_logprobs(tiny_model, batch, [2, 3], GRPOConfig(micro_batch_size=1))
    plain, _ = policy_logprobs(tiny_model, batch.rows(slice(2, 4)))
    assert torch.allclose(batch.rows(slice(2, 4)).old_logp[batch.rows(slice(2, 4)).target_mask], plain, atol=1e-6)
    sampled = torch.tensor([lp for ep in raw for lp, m in zip(ep.logprobs, ep.loss_mask) if m])
    assert not torch.allclose(plain, sampled, atol=1e-3)  # the hint changed them


def test_signals_that_leave_no_policy_row_are_refused(tmp_path):
    from toolcollapse.config import ConfigError, load_config, rl_problems

    cfg = load_config(None, ["grpo.group_size=4", "supervision.ops.enabled=true", "supervision.ops.rows=2",
                             "supervision.hbg.enabled=true", "supervision.hbg.rows=2"])
    assert "leave none of grpo.group_size=4" in rl_problems(cfg)[0]
    assert not rl_problems(load_config(None, ["grpo.group_size=4", "supervision.ops.rows=3"]))  # off: no rows
    with pytest.raises(ConfigError, match="shaping"):
        load_config(None, ["supervision.ops.shaping=clip"])


@pytest.mark.slow
def test_a_run_with_ops_and_hbg_marks_its_rows_and_reports_on_policy_success(tmp_path, tiny_checkpoint):
    """Groups of 4: 2 sampled, 1 hinted, 1 expert. The expert rows solve their tasks (sup/expert_success
    1) yet the step's `success` is the untrained policy's own (0), and samples.jsonl marks both kinds."""
    from test_rl import _metrics, _rl_config

    from toolcollapse.config import load_config
    from toolcollapse.rl import run_rl

    config = _rl_config(tmp_path, tiny_checkpoint, group_size=4, samples_per_step=1)
    run = run_rl(load_config(config, ["grpo.steps=2", "rollout.max_turns=8", "rollout.max_new_tokens=64",
                                      "supervision.ops.enabled=true", "supervision.hbg.enabled=true",
                                      "supervision.hbg.rows=1"]), tmp_path / "run")
    rows = _metrics(run)
    assert all(r["sup/expert_success"] == 1.0 and r["success"] == 0.0 and "sup/hinted_success" in r for r in rows)
    assert all(r["reward_mean"] == 0.25 and r["frac_groups_informative"] == 1.0 for r in rows)  # the expert's 1
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s.get("kind", "policy") for s in samples] == ["policy", "hinted", "expert"] * 2
    assert [s["reward"] for s in samples if s.get("kind") == "expert"] == [1.0, 1.0]


PLAIN_GOLDEN = Path(__file__).parent / "data" / "plain_grpo_metrics.json"
# metrics that count what happened (episodes, states, errors, tokens, clipping, skipped steps): equal on any CPU
DISCRETE_METRICS = ("step", "state/", "error/", "finish/", "reward_mean", "reward_std_within_group", "success",
                    "healthy_rate", "frac_groups_informative", "response_tokens", "turns_per_episode", "clip_frac",
                    "dual_clip_frac", "skipped_", "alarms_total", "lr", "val/")


@pytest.mark.slow
def test_with_every_signal_off_plain_grpo_is_unchanged(tmp_path, answering_checkpoint):
    """A 2-step run (informative groups: the weights move) with the default `supervision` (every signal
    off) logs the metrics plain GRPO logged before supervision existed: tests/data/plain_grpo_metrics.json,
    written by this test at commit efcf3e4 (TOOLCOLLAPSE_WRITE_GOLDEN=1) on an AMD EPYC, and rewritten on
    2026-12-05 on an Intel Xeon when the rollout's sampler changed (each sequence its own random stream,
    the same samples in any batch), with 16 prompts a step instead of 4: under the new streams this
    checkpoint's 4 groups were all healthy at every step, and nothing moved. (At temperature 2 they are
    informative, but there a checkpoint trained at another thread count -- other last bits -- already
    samples other episodes; at 1 it gives the same ones, its gradient norms within 4 %: checked.) Since
    then it guards plain GRPO as of that rewrite.

    What the episodes and the update's decisions were -- every reward, state and error rate, token count,
    clip fraction, informative-group share -- must be equal. Float metrics (probabilities, entropies, KL,
    norms) only to 10 %: the starting checkpoint is trained inside the test session, and another CPU
    model's arithmetic gives it other last bits (seen on an Intel Xeon: every discrete metric equal, the
    probe's probabilities within 7 % relative, the largest on values below 1e-5; on the same machine they
    agree to 1e-4). Two steps, both updating: a third step (in the golden until 2026-12-05) sampled from
    weights two updates away from that checkpoint, and on an AMD EPYC its episodes already differed from the
    Xeon's (a sampled token flipped: 3.859 against 3.828 tokens an episode; policy loss 14 % off), with
    steps 0 and 1 equal in every discrete metric and within 5 % in the others. A change to what the update
    computes moves the weights, and with them step 1's samples and the gradient norm, by far more. Entries
    added since (new metrics) are not compared."""
    from test_rl import _metrics, _rl_config

    from toolcollapse.config import load_config
    from toolcollapse.rl import run_rl

    config = _rl_config(tmp_path, answering_checkpoint, group_size=4, format_reward=1.0)
    rows = _metrics(run_rl(load_config(config, ["grpo.steps=2", "grpo.prompts_per_step=16"]), tmp_path / "plain"))
    assert all(r["grad_norm"] > 0 for r in rows)  # the weights move: what the update does is compared
    if os.environ.get("TOOLCOLLAPSE_WRITE_GOLDEN"):
        PLAIN_GOLDEN.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    golden = json.loads(PLAIN_GOLDEN.read_text())
    assert len(rows) == len(golden)
    for got, want in zip(rows, golden):
        assert want.keys() <= got.keys()
        for key, value in want.items():
            if key.startswith(DISCRETE_METRICS) or key in DISCRETE_METRICS:
                assert got[key] == value, key
            else:
                assert got[key] == pytest.approx(value, rel=0.1, abs=1e-6), key
