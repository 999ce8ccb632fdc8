"""Optimizer and learning-rate schedule shared by SFT and RL."""

from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                   betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms and biases (1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float,
          schedule: str = "cosine", decay_frac: float = 0.2) -> float:
    """Linear warm-up to `base_lr`, then
    cosine:   cosine decay to `min_lr_ratio * base_lr` at the last step;
    wsd:      stable at `base_lr`, then linear decay over the last `decay_frac` of the steps;
    constant: `base_lr` throughout."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return base_lr
    if schedule == "wsd":
        decay_start = total_steps * (1 - decay_frac)
        progress = min(1.0, max(0.0, (step - decay_start) / max(1.0, total_steps - 1 - decay_start)))
        return base_lr * (1 - (1 - min_lr_ratio) * progress)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
