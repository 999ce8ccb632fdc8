"""Advantages and policy losses against hand-computed values."""

import math

import pytest
import torch

from toolcollapse.advantages import group_advantages
from toolcollapse.losses import aggregate, kl_k3, ppo_clip_loss


def test_group_advantages_grpo_and_dr_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, stats = group_advantages(rewards, group_size=4)
    std = math.sqrt(0.1875)  # population std of [1, 0, 0, 0]
    torch.testing.assert_close(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6))
    assert adv[4:].tolist() == [0.0] * 4  # all-equal rewards: no signal
    assert stats.frac_groups_informative == 0.5 and stats.reward_mean == 0.625
    assert stats.reward_std_within_group == pytest.approx(std / 2)
    dr, _ = group_advantages(rewards, group_size=4, scale_by_std=False)
    torch.testing.assert_close(dr[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    with pytest.raises(ValueError):
        group_advantages(rewards, group_size=3)


def _loss(ratio, adv, low=0.2, high=0.28, dual=3.0):
    logp = torch.log(torch.tensor([ratio]))
    return ppo_clip_loss(logp, torch.zeros(1), torch.tensor([adv]), low, high, dual)


@pytest.mark.parametrize("ratio, adv, expected, frac", [
    (1.1, 2.0, -2.2, None),  # inside the range: -ratio * A
    (1.5, 2.0, -1.28 * 2.0, "clip_frac_high"),  # A > 0, above 1 + clip_high: clipped
    (0.5, 2.0, -0.5 * 2.0, None),  # A > 0, below the range: not clipped (min picks the surrogate)
    (0.5, -2.0, 0.8 * 2.0, "clip_frac_low"),  # A < 0, below 1 - clip_low: clipped
    (2.0, -1.0, 2.0, None),  # A < 0, above the range, under the dual clip: -ratio * A
    (5.0, -1.0, 3.0, "dual_clip_frac"),  # A < 0, ratio > c = 3: bounded by -c * A
])
def test_ppo_clip_each_side(ratio, adv, expected, frac):
    loss, stats = _loss(ratio, adv)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    for name in ("clip_frac_low", "clip_frac_high", "dual_clip_frac"):
        assert getattr(stats, name) == (1.0 if name == frac else 0.0)


def test_clipped_tokens_get_no_gradient_but_dual_clip_keeps_none_either():
    logp = torch.log(torch.tensor([1.5, 5.0, 1.1])).requires_grad_()
    loss, _ = ppo_clip_loss(logp, torch.zeros(3), torch.tensor([2.0, -1.0, 2.0]), 0.2, 0.28, 3.0)
    loss.sum().backward()
    assert logp.grad[0] == 0 and logp.grad[1] == 0  # upper clip and dual clip: constant in logp
    assert logp.grad[2] == pytest.approx(-1.1 * 2.0)  # d(-ratio*A)/dlogp = -ratio*A


def test_without_dual_clip_the_negative_side_is_unbounded():
    loss, stats = ppo_clip_loss(torch.log(torch.tensor([5.0])), torch.zeros(1), torch.tensor([-1.0]), 0.2, 0.28, None)
    assert loss.item() == pytest.approx(5.0) and stats.dual_clip_frac == 0.0


def test_kl_k3():
    logp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.2]))
    kl = kl_k3(logp, ref)
    assert kl[0].item() == pytest.approx(0.5 - math.log(0.5) - 1)  # r = ref/p = 0.5: r - log r - 1
    assert kl[1].item() == 0.0
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_aggregate_token_and_sequence_mean():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0])
    seq_ids = torch.tensor([0, 0, 0, 1])
    assert aggregate(values, seq_ids, "token_mean", 4, 2).item() == pytest.approx(4.0)
    assert aggregate(values, seq_ids, "seq_mean", 4, 2).item() == pytest.approx((2.0 + 10.0) / 2)
    # a fully masked row contributes nothing, and micro-batches sum to the full-batch value
    part1 = aggregate(values[:3], seq_ids[:3], "token_mean", 4, 2)
    part2 = aggregate(values[3:], seq_ids[3:], "token_mean", 4, 2)
    assert (part1 + part2).item() == pytest.approx(4.0)
    assert aggregate(torch.zeros(0), torch.zeros(0, dtype=torch.long), "token_mean", 0, 0).item() == 0.0
    with pytest.raises(ValueError):
        aggregate(values, seq_ids, "max", 4, 2)
