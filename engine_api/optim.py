"""Optimizer construction and the ``optimizer_step`` core shared by backends.

Works on plain tensors and on DTensors (FSDP2 sharded params/grads): the global norm of
DTensor grads is a collective (``full_tensor``), so every rank gets the same norm and takes
the same skip/step decision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from engine_api.config import OptimConfig
from engine_api.losses import DeferredNormalizer


def build_adamw(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW from ``cfg`` (``foreach`` left to torch's default for the device)."""
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def clip_and_step(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    clip_grad: float | None,
    deferred: DeferredNormalizer | None = None,
) -> float:
    """Apply deferred normalization, measure the global grad norm, clip, and step.

    Args:
        params: the parameters the optimizer updates (grads already reduced over DP).
        optimizer: steps only when the norm is finite.
        clip_grad: max norm, or None for no clipping.
        deferred: in deferred mode, the window's normalizer; grads are scaled by
            ``1 / denominator`` first and the window is reset.

    Returns:
        The pre-clip global L2 norm. Not finite: params and optimizer state are untouched.
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        raise RuntimeError("optimizer_step with no gradients; fix: call forward_backward_step (not forward_only) first")
    if deferred is not None:
        scale = deferred.grad_scale()
        deferred.reset()
        for p in with_grad:
            p.grad.mul_(scale)
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0)
    # Sharded grads give a partial norm; full_tensor() all-reduces it into the global one.
    norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
    if not math.isfinite(norm):
        return norm
    if clip_grad is not None:
        torch.nn.utils.clip_grads_with_norm_(with_grad, clip_grad, total)
    optimizer.step()
    return norm
