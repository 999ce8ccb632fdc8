"""Statistics of a training step's own forward: the control tokens at the tokens the policy sampled (`ctrl/*`),
their share of the gradient, and the turn states of the step's rollouts. `SampledTokens` is what both trainers'
updates feed (ours over an RL step, TRL's over its ranks and logging window); `TurnCounts` is TRL's running
form of the `count_turns` and `turn_rates` our loop calls on a step's episodes (`turn_stats.rollout_stats`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from toolcollapse.chat import SHORT
from toolcollapse.records import ParsedTurn
from toolcollapse.turn_stats import TURN_KEYS, count_turns, turn_rates

Gather = Callable[[torch.Tensor], torch.Tensor]  # every rank's [n_i, k] rows, joined (TRL: over its processes)


def sampled_control_stats(targets: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, entropy: torch.Tensor,
                          token_ids: Mapping[str, int], prefix: str = "ctrl") -> dict[str, float]:
    """Control-token statistics at the tokens the policy sampled, from the update's own forward.

    targets, logp, old_logp, entropy: [M] over the sampled tokens of a batch -- the token,
    its log-prob under the current policy, under the sampling policy, and the current
    policy's entropy there. Per control token c sampled at least once: its sampling
    probability (mean, max) where it was sampled; over all control tokens vs all other
    tokens: the importance ratio exp(logp - old_logp) (mean, max) and the entropy (mean).
    """
    out: dict[str, float] = {}
    is_ctrl = torch.zeros_like(targets, dtype=torch.bool)
    for name, tid in token_ids.items():
        here = targets == tid
        is_ctrl |= here
        if here.any():
            p = old_logp[here].exp()
            key = f"{prefix}/{SHORT.get(name, name)}"
            out[f"{key}/p_sampled_mean"] = p.mean().item()
            out[f"{key}/p_sampled_max"] = p.max().item()
            out[f"{key}/n_sampled"] = float(here.sum().item())
    ratio = (logp - old_logp).exp()
    for label, where in (("ctrl", is_ctrl), ("other", ~is_ctrl)):
        if where.any():
            out[f"{prefix}/ratio_mean_{label}"] = ratio[where].mean().item()
            out[f"{prefix}/ratio_max_{label}"] = ratio[where].max().item()
            out[f"{prefix}/entropy_mean_{label}"] = entropy[where].mean().item()
    return out


def control_gradient_share(per_token_loss: torch.Tensor, is_ctrl: torch.Tensor, params: Sequence[torch.Tensor],
                           prefix: str = "ctrl") -> dict[str, float]:
    """How much of the gradient of a token-mean loss comes from control-token positions.

    per_token_loss: [M] with a graph to `params`; is_ctrl: [M] bool. The loss splits into
    its control-token and other parts, L = L_ctrl + L_other; `grad_sq_share` is
    |g_ctrl|^2 / (|g_ctrl|^2 + |g_other|^2), to compare with `token_share`, the control
    tokens' share of positions. A few low-probability tokens dominating the gradient is a
    known collapse route (SimpleTIR, arXiv 2509.02479). Empty when the loss has no gradient.
    """
    m = per_token_loss.numel()
    parts = [(per_token_loss * is_ctrl).sum() / m, (per_token_loss * ~is_ctrl).sum() / m]
    sq = []
    for k, part in enumerate(parts):
        grads = torch.autograd.grad(part, params, retain_graph=k == 0, allow_unused=True)
        sq.append(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    if sq[0] + sq[1] == 0:
        return {}
    return {f"{prefix}/grad_sq_share": sq[0] / (sq[0] + sq[1]), f"{prefix}/grad_norm_ctrl": sq[0] ** 0.5,
            f"{prefix}/grad_norm_other": sq[1] ** 0.5, f"{prefix}/token_share": is_ctrl.float().mean().item()}


class SampledTokens:
    """The sampled tokens of a trainer's forwards since the last `reduce`: the token, its log-prob under the
    current policy and under the sampling policy, and the current policy's entropy there. `reduce` gives their
    `ctrl/*` statistics over all of them at once, so a maximum is the batch's, not a mean of per-micro-batch
    maxima. `gather`: how a trainer on several ranks joins them (TRL's); None, one process: the tensors stay
    as given (device, dtype) until `reduce`."""

    def __init__(self, token_ids: Mapping[str, int], gather: Gather | None = None):
        self.token_ids, self.gather = dict(token_ids), gather
        self.parts: list[Any] = []

    def add(self, targets: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, entropy: torch.Tensor) -> None:
        """[M] each, over the tokens that count (the policy's own samples)."""
        part = (targets, logp.detach(), old_logp.detach(), entropy.detach())
        # with ranks: [M, 4] float64 rows on the CPU now, what `gather` joins (a logging window holds no GPU memory)
        self.parts.append(part if self.gather is None else torch.stack([t.double() for t in part], dim=1).cpu())

    def reduce(self) -> dict[str, float]:
        """The statistics since the last call (with `gather`, a collective: call it on every rank)."""
        parts, self.parts = self.parts, []
        if self.gather is None:
            if not parts:
                return {}
            targets, logp, old, entropy = (torch.cat(column) for column in zip(*parts))
            return sampled_control_stats(targets, logp, old, entropy, self.token_ids)
        rows = self.gather(torch.cat(parts) if parts else torch.zeros(0, 4, dtype=torch.float64))
        if not len(rows):
            return {}
        targets, logp, old, entropy = rows.unbind(dim=1)
        return sampled_control_stats(targets.long(), logp, old, entropy, self.token_ids)


class TurnCounts:
    """The four turn states and the named errors of the rollouts since the last `reduce` (`count_turns`), as
    the rates a run logs (`turn_rates`: `state/*`, `error/*`, `healthy_rate`, `turns_per_episode`); `gather`:
    as `SampledTokens`'."""

    KEYS = ("n_rollouts", "n_turns", *TURN_KEYS)

    def __init__(self, gather: Gather | None = None):
        self.gather = gather
        self.counts = torch.zeros(len(self.KEYS), dtype=torch.float64)

    def add(self, rollouts: Iterable[Sequence[ParsedTurn]]) -> None:
        """Rollouts as their parsed assistant turns."""
        counts = count_turns(rollouts)
        self.counts += torch.tensor([counts[k] for k in self.KEYS], dtype=torch.float64)

    def reduce(self) -> dict[str, float]:
        """The rates since the last call; {} without a turn (with `gather`, a collective)."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        if self.gather is not None:
            counts = self.gather(counts[None]).sum(dim=0)
        total = dict(zip(self.KEYS, counts.tolist()))
        return turn_rates(total) if total["n_turns"] else {}
