"""LR schedules from ``OptimConfig``: linear warmup, then constant, linear or cosine decay.

Backend-independent (plain ``torch.optim.lr_scheduler.LambdaLR``), so every backend builds
the same schedule from the same config.
"""

from __future__ import annotations

import math

import torch

from engine_api.config import OptimConfig


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based).

    Warmup: ``(step + 1) / warmup_steps``, so the first step already learns and the last
    warmup step reaches the peak. Decay runs from the end of warmup to ``total_steps``, down
    to ``min_lr_ratio``, and stays there.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following :func:`lr_factor`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
