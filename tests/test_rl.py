"""GRPO: batches, the update, the non-finite guard, and exact resume after SIGKILL (a torn last log line too)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from toolcollapse.config import GRPOConfig, RunConfig, WorldConfig, dump_config
from toolcollapse.update import build_batch, grpo_update, policy_logprobs
from toolcollapse.rollout import RolloutEngine, SamplingParams

TIMING_KEYS = {"seconds", "seconds_probe", "seconds_val", "seconds_rollout", "seconds_update", "seconds_signals",
               "ets/seconds",
               "adaptive/seconds"}


@pytest.fixture(scope="module")
def rollouts(tiny_model, tokenizer, world):
    engine = RolloutEngine(tiny_model, tokenizer, world)
    eps = engine.generate(world.tasks("train")[:2], SamplingParams(max_turns=2, max_new_tokens=12), group_size=3)
    return eps


def test_batch_logprobs_match_the_sampling_logprobs(tiny_model, tokenizer, rollouts):
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), tokenizer.pad_token_id)
    assert batch.input_ids.shape[0] == 6 and int(batch.target_mask.sum()) == sum(sum(e.loss_mask) for e in rollouts)
    with torch.no_grad():
        logp, entropy = policy_logprobs(tiny_model, batch)
    torch.testing.assert_close(logp, batch.old_logp[batch.target_mask], atol=2e-4, rtol=0)
    assert (entropy > 0).all()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_first_update_ratio_is_one_at_the_sampling_temperature(tiny_model, tokenizer, world, temperature):
    engine = RolloutEngine(tiny_model, tokenizer, world)
    params = SamplingParams(max_turns=2, max_new_tokens=12, temperature=temperature)
    episodes = engine.generate(world.tasks("train")[:2], params, group_size=3, seed=1)
    batch = build_batch(episodes, torch.zeros(len(episodes)), tokenizer.pad_token_id)
    old = batch.old_logp[batch.target_mask]
    with torch.no_grad():
        ratio = (policy_logprobs(tiny_model, batch, temperature)[0] - old).exp()
        at_t1 = (policy_logprobs(tiny_model, batch, 1.0)[0] - old).exp()
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    if temperature != 1.0:  # the control: log-probs at T = 1, as before, are off by far more
        assert (at_t1 - 1).abs().max() > 0.1


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_all_equal_rewards_move_nothing_without_kl(tiny_model, tokenizer, rollouts):
    model = __import__("copy").deepcopy(tiny_model).train()
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    before = _params(model)
    stats = grpo_update(model, None, opt, batch, GRPOConfig(kl_coef=0.0, micro_batch_size=4))
    assert stats.pg_loss == 0.0 and stats.grad_norm == 0.0 and stats.skipped_nonfinite == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_adam_momentum_moves_weights_even_when_every_advantage_is_zero(tiny_model, tokenizer, rollouts):
    """Why collapse can lock in: once every group is all-0 (or all-1), the gradient is 0,
    but Adam's first moment from earlier steps keeps pushing the weights."""
    model = __import__("copy").deepcopy(tiny_model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    cfg = GRPOConfig(kl_coef=0.0, micro_batch_size=6)
    grpo_update(model, None, opt, build_batch(rollouts, torch.tensor([1.0, -1, 0, 0, 0, 0]),
                                              tokenizer.pad_token_id), cfg)
    before = _params(model)
    stats = grpo_update(model, None, opt, build_batch(rollouts, torch.zeros(6), tokenizer.pad_token_id), cfg)
    assert stats.grad_norm == 0.0
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_nonzero_advantages_move_the_policy_in_the_right_direction(tiny_model, tokenizer, rollouts):
    model = __import__("copy").deepcopy(tiny_model).train()
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    batch = build_batch(rollouts, adv, tokenizer.pad_token_id)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        before = policy_logprobs(model, batch)[0]
    grpo_update(model, None, opt, batch, GRPOConfig(kl_coef=0.0, micro_batch_size=2))
    with torch.no_grad():
        after = policy_logprobs(model, batch)[0]
    rows = batch.target_mask.nonzero()[:, 0]
    assert (after - before)[rows == 0].sum() > 0 > (after - before)[rows == 1].sum()


def test_micro_batches_sum_to_the_full_batch_gradient(tiny_model, tokenizer, rollouts):
    adv = torch.tensor([1.0, -0.5, 0.2, -1.0, 0.3, 0.0])
    batch = build_batch(rollouts, adv, tokenizer.pad_token_id)
    grads = []
    for mb in (6, 1):
        model = __import__("copy").deepcopy(tiny_model).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        orig_step = opt.step
        captured = {}
        opt.step = lambda: captured.setdefault("g", [p.grad.clone() for p in model.parameters()]) and orig_step()
        grpo_update(model, None, opt, batch, GRPOConfig(kl_coef=0.0, micro_batch_size=mb, grad_clip=1e9))
        grads.append(captured["g"])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def _update_grads(model, batch, **grpo):
    """The summed gradient of one `grpo_update` (SGD at lr 0: the weights stay put)."""
    model = __import__("copy").deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = {}
    step = opt.step
    opt.step = lambda: captured.setdefault("g", [p.grad.clone() for p in model.parameters()]) and step()
    grpo_update(model, None, opt, batch, GRPOConfig(kl_coef=0.0, grad_clip=1e9, **grpo))
    return captured["g"]


def _plain_grads(model, batch, g, reference=None):
    """The gradient of `grpo_update`'s loss by the plainest route: one forward of the whole batch through the
    model, no prefix run apart, no micro-batches; with `reference`, g.kl_coef * k3 to its plain forward."""
    import copy

    from toolcollapse.losses import aggregate, kl_k3, ppo_clip_loss

    def logprobs(m):
        select = torch.zeros_like(batch.target_mask)
        select[:, :-1] = batch.target_mask[:, 1:]
        logits = m(input_ids=batch.input_ids).logits[select].float()
        return torch.log_softmax(logits, dim=-1).gather(1, batch.input_ids[batch.target_mask][:, None]).squeeze(1)

    model = copy.deepcopy(model).train()
    logp = logprobs(model)
    seq = batch.target_mask.nonzero()[:, 0]
    loss, _ = ppo_clip_loss(logp, batch.old_logp[batch.target_mask], batch.advantages[seq], g.clip_low, g.clip_high,
                            g.dual_clip)
    if reference is not None:
        with torch.no_grad():
            ref = logprobs(reference)
        loss = loss + g.kl_coef * kl_k3(logp, ref)
    aggregate(loss, seq, g.loss_agg, len(logp), len(batch)).backward()
    return [p.grad for p in model.parameters()], logp.detach()


@pytest.mark.parametrize("rows", ["two tasks", "one row twice", "two rows with nothing sampled"])
def test_the_prefix_run_once_for_all_micro_batches_gives_the_same_gradient(tiny_model, tokenizer, rollouts, rows):
    """The system prompt runs once an update, its keys' and values' gradients from every micro-batch (sorted by
    length, cut) summed and sent back through it once: the gradient of one plain forward of the whole batch,
    and the reference's log-probs by the same plan are its plain ones. "one row twice": the rows share
    everything, sampled tokens too, so the prefix stops before the first."""
    from toolcollapse.update import batch_prefix, reference_logprobs

    episodes, adv = ([rollouts[0]] * 2, [1.0, -0.5]) if rows == "one row twice" else (rollouts, [1.0, -0.5, 0.2, -1.0,
                                                                                                 0.3, 0.0])
    batch = build_batch(episodes, torch.tensor(adv), tokenizer.pad_token_id)
    if rows == "two rows with nothing sampled":  # sorted by length, they make a micro-batch of their own
        batch.target_mask[4:] = False
    first_sampled = int(batch.target_mask[0].nonzero().min())
    length = batch_prefix(tiny_model, batch).length
    assert length > 100 and (length == first_sampled - 1 if rows == "one row twice" else length < first_sampled - 1)
    once = _update_grads(tiny_model, batch, micro_batch_size=2)
    plain, plain_logp = _plain_grads(tiny_model, batch, GRPOConfig(kl_coef=0.0))
    for a, b in zip(once, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    k_proj = [n for n, _ in tiny_model.named_parameters()].index("model.layers.0.self_attn.k_proj.weight")
    assert once[k_proj].abs().max() > 1e-4  # the prefix's keys do carry gradient: without its backward, no match
    with torch.no_grad():  # (in the plan's row order: compared as sorted values)
        ref = torch.cat(reference_logprobs(tiny_model, batch, GRPOConfig(micro_batch_size=2)))
    torch.testing.assert_close(ref.sort().values, plain_logp.sort().values, atol=1e-5, rtol=0)


def test_micro_batches_by_prompt_where_prompts_are_long_give_the_same_update(tiny_model):
    """Where rows' prompts run long past the batch's shared prefix (BFCL: each task its own system prompt),
    `update_plan` cuts micro-batches by prompt, each running its rows' prompt once: the same gradient -- a
    KL term to a different reference included, so the reference's micro-batches must pair with the
    update's -- as one plain forward of the whole batch."""
    import copy

    from toolcollapse import update as upd
    from toolcollapse.model import shared_prefix_len
    from toolcollapse.records import PolicyBatch

    torch.manual_seed(0)
    vocab = tiny_model.config.vocab_size
    common, rows = torch.randint(5, vocab, (40,)), []
    for k in range(3):  # 3 prompts: 40 shared tokens, 300 of their own; 3 rollouts each, 8-19 sampled tokens
        own = torch.randint(5, vocab, (300,))
        rows += [torch.cat([common, own, torch.randint(5, vocab, (8 + 5 * j + k,))]) for j in range(3)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    sampled = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], sampled[i, 340:len(r)] = r, True
    batch = PolicyBatch(ids, sampled, torch.where(sampled, -2.0, 0.0), torch.randn(len(rows)))
    reference = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    g = GRPOConfig(micro_batch_size=2, kl_coef=1.0, grad_clip=1e9)

    def update():
        prefix, parts = upd.update_plan(tiny_model, batch, g)
        model = copy.deepcopy(tiny_model).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        captured, step = {}, opt.step
        opt.step = lambda: captured.setdefault("g", [p.grad.clone() for p in model.parameters()]) and step()
        with torch.no_grad():
            ref = upd.reference_logprobs(reference, batch, g)
        grpo_update(model, ref, opt, batch, g)
        return prefix, parts, captured["g"]

    prefix, parts, by_prompt = update()
    assert prefix is None and len(parts) == 6  # each prompt's 3 rows in micro-batches of 2 and 1
    assert all(shared_prefix_len([r.tolist() for r in mb.input_ids]) >= 340 for mb in parts if len(mb) > 1)
    one_each = upd.update_plan(tiny_model, batch.rows(torch.tensor([0, 3, 6])), g)  # a row a prompt: nothing shared
    assert one_each[0] is not None and len(one_each[1]) == 2
    by_length = upd.update_plan(tiny_model, batch, GRPOConfig(micro_batch_size=2, by_prompt_min_tokens=301))
    assert by_length[0] is not None  # the threshold above the prompts' 300 own tokens: by length, the prefix once
    plain, _ = _plain_grads(tiny_model, batch, g, reference)
    for a, b in zip(by_prompt, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_recomputed_old_logprobs_land_on_their_own_rows_whatever_the_plan(tiny_model, tokenizer, world):
    """`recompute_old_logprobs` (hinted and expert rows) runs its rows as the update would, sorted by length
    into micro-batches and cut, the prefix once: each recomputed row gets its own log-probs (a forward of
    it alone) and every other row keeps its old ones."""
    from toolcollapse.update import recompute_old_logprobs

    engine = RolloutEngine(tiny_model, tokenizer, world)
    eps = engine.generate(world.tasks("train")[:3], SamplingParams(max_turns=3, max_new_tokens=16), group_size=2, seed=4)
    batch = build_batch(eps, torch.zeros(len(eps)), tokenizer.pad_token_id)
    ends = [int(m.nonzero().max()) for m in batch.target_mask]
    rows = sorted({e: i for i, e in enumerate(ends)}.values(), key=lambda i: -ends[i])  # longest first: sorting reorders
    assert len(rows) >= 3 and len(rows) < len(eps)
    with torch.no_grad():
        alone = {i: policy_logprobs(tiny_model, batch.rows(torch.tensor([i])).trimmed())[0] for i in rows}
    for g in (GRPOConfig(micro_batch_size=3), GRPOConfig(micro_batch_size=2), GRPOConfig(micro_batch_size=1)):
        b = build_batch(eps, torch.zeros(len(eps)), tokenizer.pad_token_id)
        b.old_logp[b.target_mask] = -9.0  # stale: the recomputed rows must lose these
        recompute_old_logprobs(tiny_model, b, rows, g)
        for i in range(len(eps)):
            got = b.old_logp[i][b.target_mask[i]]
            if i in rows:
                torch.testing.assert_close(got, alone[i], atol=1e-5, rtol=0)
                assert (b.old_logp[i][~b.target_mask[i]] == 0).all()
            else:
                assert (got == -9.0).all()


def test_nonfinite_guard_skips_the_step(tiny_model, tokenizer, rollouts):
    model = __import__("copy").deepcopy(tiny_model).train()
    batch = build_batch(rollouts, torch.tensor([float("nan"), 1, 0, 0, 0, 0]), tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _params(model)
    stats = grpo_update(model, None, opt, batch, GRPOConfig(kl_coef=0.0, micro_batch_size=6))
    assert stats.skipped_nonfinite == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- resume


def _rl_config(tmp_path, init, temperature=1.0, **grpo):
    cfg = RunConfig(
        seed=3, init=str(init), world=WorldConfig(n_train=40, n_test=4, n_ood=4),
        grpo=GRPOConfig(**{**dict(steps=5, prompts_per_step=2, group_size=2, lr=1e-3, micro_batch_size=2,
                                  checkpoint_every=2, kl_coef=1e-3, samples_per_step=1), **grpo}),
    )
    cfg = __import__("dataclasses").replace(cfg, rollout=__import__("dataclasses").replace(
        cfg.rollout, max_turns=2, max_new_tokens=12, temperature=temperature))
    path = tmp_path / "rl.yaml"
    dump_config(cfg, path)
    return path


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.mark.slow
def test_sigkill_and_resume_reproduce_an_uninterrupted_run(tmp_path, answering_checkpoint):
    """The weights move (informative groups through the format reward; at temperature 2 the answering
    checkpoint writes ~20 % malformed turns, at 1 ~2 %), so a resume that lost the optimizer's moments,
    the RNG state or the step would end elsewhere: metrics and final weights must equal an uninterrupted
    run's."""
    from safetensors.torch import load_file

    config = _rl_config(tmp_path, answering_checkpoint, temperature=2.0, format_reward=1.0, group_size=4)
    cmd = [sys.executable, "-m", "toolcollapse.cli", "rl", "--config", str(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sets = ["--set", "threads=1", "--set", "monitor.grad_share_every=2"]  # the gradient share resumes alike too
    subprocess.run(cmd + ["--out", str(tmp_path / "full"), *sets], check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd + ["--out", str(killed), *sets], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = killed / "checkpoints" / "step_000002" / "COMPLETE"
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    assert not (killed / "checkpoints" / "step_000005").exists()  # it really was cut short
    with open(killed / "metrics.jsonl", "a") as f:  # and it died in the middle of writing a line (issue 20)
        f.write('{"step": 4, "lr": 0.0')
    proc = subprocess.run([sys.executable, "-m", "toolcollapse.cli", "rl", "--resume", str(killed)], check=True,
                          env=env, capture_output=True, text=True)
    said = proc.stdout + proc.stderr
    assert "metrics.jsonl:" in said and "not a whole log line" in said  # said, not silently
    full, resumed = _metrics(tmp_path / "full"), _metrics(killed)
    assert [m["step"] for m in resumed] == list(range(5))
    assert sum(m["frac_groups_informative"] > 0 for m in full) >= 2  # updates that carry a gradient
    assert any("ctrl/grad_sq_share" in m for m in full)  # measured at an informative step 0, 2 or 4
    assert resumed == full
    start = load_file(answering_checkpoint / "model.safetensors")
    ends = [load_file(run / "checkpoints" / "step_000005" / "model.safetensors") for run in (tmp_path / "full", killed)]
    assert any(not torch.equal(start[k], ends[0][k]) for k in start)  # the weights moved ...
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in start)  # ... to the same place


@pytest.mark.slow
def test_skip_uninformative_steps_leaves_the_weights_alone(tmp_path, tiny_checkpoint):
    """The random tiny model never solves a task: every group is all-0. With the skip no update
    runs at all; without it, the update runs (zero advantages, so only the KL term and Adam's
    momentum could move the weights -- see the momentum test above)."""
    from safetensors.torch import load_file

    from toolcollapse.config import load_config
    from toolcollapse.rl import run_rl

    config = _rl_config(tmp_path, tiny_checkpoint)
    init = load_file(tiny_checkpoint / "model.safetensors")
    for skip in (True, False):
        cfg = load_config(config, [f"grpo.skip_uninformative_steps={str(skip).lower()}", "grpo.steps=2",
                                   "monitor.probe_every=0"])
        run_dir = run_rl(cfg, tmp_path / f"skip_{skip}")
        rows = _metrics(run_dir)
        assert all(r["frac_groups_informative"] == 0 for r in rows)
        assert [r["skipped_uninformative"] for r in rows] == [int(skip)] * 2
        assert all(("grad_norm" in r) != skip for r in rows)  # the update ran iff not skipped
        assert all(("ctrl/entropy_mean_other" in r) != skip for r in rows)  # statistics of the update's forward
        if skip:
            final = load_file(run_dir / "checkpoints" / "step_000002" / "model.safetensors")
            assert all(torch.equal(init[k], final[k]) for k in init)


@pytest.mark.slow
def test_a_new_run_replaces_an_old_one_only_with_overwrite_and_resume_keeps_its_config(tmp_path, tiny_checkpoint):
    """Before: a run written over another truncated its metrics and checkpoint rotation deleted the new
    run's checkpoints (the old step numbers sorted as newer)."""
    from toolcollapse.config import ConfigError, load_config
    from toolcollapse.rl import run_rl

    run = tmp_path / "run"
    old = run / "checkpoints" / "step_000050"
    old.mkdir(parents=True)
    (old / "COMPLETE").write_text("50")
    (run / "metrics.jsonl").write_text('{"step": 49}\n')
    (run / "config.yaml").write_text("grpo: {lr: 0.5}\n")
    cfg = load_config(_rl_config(tmp_path, tiny_checkpoint), ["grpo.steps=2", "grpo.checkpoint_every=1",
                                                               "monitor.probe_every=0"])
    with pytest.raises(ConfigError, match="already holds a run"):
        run_rl(cfg, run)
    assert (old / "COMPLETE").is_file()
    run_rl(cfg, run, overwrite=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert [r["step"] for r in _metrics(run)] == [0, 1]
    with pytest.raises(ConfigError, match=r"another config than the one it would resume with \(grpo\.lr: 0\.001 -> 0\.5\)"):
        run_rl(load_config(run / "config.yaml", ["grpo.lr=0.5"]), run, resume=True)


def test_group_slices_hold_whole_groups_in_batch_order():
    from toolcollapse.update import group_slices

    assert group_slices(24, 4, 3) == [(0, 8), (8, 16), (16, 24)]
    assert group_slices(8, 8, 1) == [(0, 8)]
    with pytest.raises(ValueError, match="groups"):
        group_slices(24, 4, 4)


def test_clip_statistics_on_a_batch_whose_ratio_is_known():
    """Ratios exp(logp - old) set by hand: 0.5 and 0.9 with A < 0 (the first below 1 - 0.2: lower clip), 1.5 and
    4.0 with A > 0 (both above 1.2: upper clip), 4.0 with A < 0 (above the dual clip 3)."""
    from toolcollapse.losses import ppo_clip_loss

    ratio = torch.tensor([0.5, 0.9, 1.5, 4.0, 4.0])
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0])
    old = torch.zeros(5)
    loss, s = ppo_clip_loss(ratio.log(), old, adv, 0.2, 0.2, 3.0)
    assert s.clip_frac_low == pytest.approx(1 / 5) and s.clip_frac_high == pytest.approx(2 / 5)
    assert s.dual_clip_frac == pytest.approx(1 / 5)
    assert s.ratio_max == pytest.approx(4.0) and s.ratio_min == pytest.approx(0.5)
    assert s.ratio_mean == pytest.approx(ratio.mean().item())
    # min(r A, clip(r) A), then max(., 3 A) for A < 0: 0.8, 0.9, -1.2, -1.2, 3.0 (loss = -objective)
    torch.testing.assert_close(loss, torch.tensor([0.8, 0.9, -1.2, -1.2, 3.0]))


def test_mini_batches_take_one_optimizer_step_each_and_the_ratio_moves_after_the_first(tiny_model, tokenizer,
                                                                                       rollouts):
    """`grpo.mini_batches: 2` on 2 groups of 3: two optimizer steps; the first sees ratio 1 (the sampling
    policy's log-probs), the second a policy one step away, so its ratio leaves 1. With one mini-batch the
    ratio stays 1 (the control)."""
    from toolcollapse.update import policy_step

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    out = {}
    for k in (1, 2):
        model = __import__("copy").deepcopy(tiny_model).train()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        g = GRPOConfig(kl_coef=0.0, group_size=3, prompts_per_step=2, mini_batches=k, micro_batch_size=3,
                       grad_clip=1e9)
        out[k] = policy_step(model, None, opt, rollouts, rewards, g, tokenizer.pad_token_id, {})
    assert out[1]["optimizer_steps"] == 1 and out[2]["optimizer_steps"] == 2
    assert abs(out[1]["ratio_max"] - 1) < 1e-4 and abs(out[1]["ratio_min"] - 1) < 1e-4
    assert max(out[2]["ratio_max"] - 1, 1 - out[2]["ratio_min"]) > 1e-2
    assert out[2]["clip_frac_low"] + out[2]["clip_frac_high"] > 0  # lr 1: the clip acts in the second step
