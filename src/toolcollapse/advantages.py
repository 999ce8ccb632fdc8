"""Group-relative advantages (GRPO, arXiv 2402.03300) and the Dr. GRPO variant (arXiv 2503.20783).

Rewards of the G rollouts of one prompt are centred on their group mean; GRPO also
divides by the group's standard deviation, Dr. GRPO does not (the division
up-weights groups that are nearly all right or all wrong). A group whose rewards
are all equal gets advantage 0 for every member: it carries no learning signal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdvantageStats:
    reward_mean: float
    reward_std_within_group: float  # mean over groups of the within-group std
    frac_groups_informative: float  # share of groups whose rewards are not all equal


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> tuple[torch.Tensor, AdvantageStats]:
    """rewards: [N] with N = n_groups * group_size, groups contiguous -> advantages [N]."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)  # [n_groups, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)  # [n_groups, 1]
    adv = centred / (std + eps) if scale_by_std else centred
    informative = (grouped.max(dim=1).values > grouped.min(dim=1).values).float()
    stats = AdvantageStats(reward_mean=rewards.float().mean().item(), reward_std_within_group=std.mean().item(),
                           frac_groups_informative=informative.mean().item())
    return adv.view(-1), stats
