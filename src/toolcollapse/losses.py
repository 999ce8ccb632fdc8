"""Losses as pure functions of tensors: SFT's cross-entropy, GRPO's clipped surrogate, the k3
KL estimator, LUFFY's shaping of off-policy tokens and unlikelihood; each takes tensors and
returns per-token values or a scalar (plus a small stats record where it has one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SFTStats:
    loss: float  # mean NLL per target token
    accuracy: float  # share of target tokens that are the argmax
    n_tokens: int


def sft_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, SFTStats]:
    """Token-mean negative log-likelihood. logits: [M, V] at the M trained positions; targets: [M]."""
    loss = F.cross_entropy(logits.float(), targets)
    with torch.no_grad():
        acc = (logits.argmax(dim=-1) == targets).float().mean().item() if targets.numel() else 0.0
    return loss, SFTStats(loss=loss.item(), accuracy=acc, n_tokens=targets.numel())


def unlikelihood(logp: torch.Tensor) -> torch.Tensor:
    """-log(1 - p) of tokens the policy should not have written, from their log-probs [K] -> [K]
    (unlikelihood training, arXiv 1908.04319): its gradient in log p is p / (1 - p), steep as p -> 1.
    1e-6 keeps it finite where p rounds to 1."""
    return -torch.log((-torch.expm1(logp)).clamp(min=0.0) + 1e-6)


# ----------------------------------------------------------------------------- policy gradient


@dataclass(frozen=True)
class PolicyLossStats:
    clip_frac_low: float  # A < 0 and ratio < 1 - clip_low: gradient cut by the lower clip
    clip_frac_high: float  # A > 0 and ratio > 1 + clip_high: gradient cut by the upper clip
    dual_clip_frac: float  # A < 0 and ratio > dual_clip: loss bounded by the dual clip
    ratio_mean: float
    ratio_max: float
    ratio_min: float


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                  clip_high: float, dual_clip: float | None) -> tuple[torch.Tensor, PolicyLossStats]:
    """Per-token clipped surrogate loss, [M] -> [M].

    PPO clipping with separate lower and upper ranges (DAPO's clip-higher, arXiv
    2503.14476) and the dual clip of arXiv 1912.09729: for A < 0 the loss is bounded
    by -c * A, so a token whose probability rose far above the old one (ratio > c)
    cannot produce an unbounded update.
    """
    ratio = torch.exp(logp - old_logp)  # [M]
    surrogate = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    objective = torch.minimum(surrogate, clipped)
    negative = advantages < 0
    if dual_clip is not None:
        objective = torch.where(negative, torch.maximum(objective, dual_clip * advantages), objective)
    with torch.no_grad():
        n = max(1, ratio.numel())
        stats = PolicyLossStats(
            clip_frac_low=((ratio < 1 - clip_low) & negative).sum().item() / n,
            clip_frac_high=((ratio > 1 + clip_high) & (advantages > 0)).sum().item() / n,
            dual_clip_frac=((ratio > dual_clip) & negative).sum().item() / n if dual_clip is not None else 0.0,
            ratio_mean=ratio.mean().item() if ratio.numel() else 1.0,
            ratio_max=ratio.max().item() if ratio.numel() else 1.0,
            ratio_min=ratio.min().item() if ratio.numel() else 1.0,
        )
    return -objective, stats


def luffy_loss(logp: torch.Tensor, advantages: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-token loss of off-policy (expert) tokens under LUFFY's policy shaping (arXiv 2504.14945):
    -A * f(p), f(p) = p / (p + gamma), p the current probability; no behaviour-policy ratio, no clip.
    Its gradient, -A * gamma * p / (p + gamma)^2 * grad log p, stays large where p is small and fades
    as p -> 1, so rare expert tokens are learnt without the ratio's blow-up."""
    p = logp.exp()
    return -advantages * p / (p + gamma)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token low-variance estimator of KL(policy || reference) (Schulman's k3):
    exp(ref - logp) - (ref - logp) - 1, non-negative, unbiased for samples of the policy."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def aggregate(values: torch.Tensor, seq_ids: torch.Tensor, mode: str, n_tokens: int, n_seqs: int) -> torch.Tensor:
    """Reduce per-token values [M] to a scalar.

    token_mean: sum over tokens / n_tokens (every token weighs the same; DAPO, the paper);
    seq_mean:   mean over sequences of each sequence's token mean (GRPO's original form).
    `n_tokens` and `n_seqs` count the whole optimizer batch, so micro-batches add up to
    the full-batch loss under gradient accumulation.
    """
    if mode == "token_mean":
        return values.sum() / max(1, n_tokens)
    if mode == "seq_mean":
        per_seq = torch.zeros(int(seq_ids.max().item()) + 1 if seq_ids.numel() else 1, dtype=values.dtype,
                              device=values.device)
        counts = torch.zeros_like(per_seq)
        per_seq = per_seq.index_add(0, seq_ids, values)
        counts = counts.index_add(0, seq_ids, torch.ones_like(values))
        return (per_seq / counts.clamp(min=1)).sum() / max(1, n_seqs)
    raise ValueError(f"unknown loss aggregation {mode!r}")
