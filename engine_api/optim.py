"""Optimizer construction and the ``optimizer_step`` core shared by backends.

Works on plain tensors and on DTensors (FSDP2 sharded params/grads): the global norm of
DTensor grads is a collective (``full_tensor``), so every rank gets the same norm. The
skip decision is agreed explicitly as well (:func:`agree_to_skip`), because a non-finite loss
can be rank-local even when the gradient is not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine_api.config import OptimConfig
from engine_api.dist import all_reduce, comm_device
from engine_api.losses import DeferredNormalizer


def build_adamw(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW from ``cfg`` (``foreach`` left to torch's default for the device)."""
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def agree_to_skip(grad_norm: float, nonfinite_loss: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank skips this optimizer step: True when, on *any* rank of ``group``, the
    grad norm or a loss of the window was not finite.

    Collective (one all-reduce of one flag, ``max``). The grad norm is normally global already,
    but a loss is not always: tensor-parallel peers each compute the loss from gathered
    logits, and a user loss may read rank-local data. Without this agreement one rank could
    step while another skips, and the replicas would silently diverge.
    """
    local = (not math.isfinite(grad_norm)) or nonfinite_loss
    flag = torch.tensor([1.0 if local else 0.0], device=comm_device(group))
    return bool(all_reduce(flag, "max", group).item())


def skipped_norm(grad_norm: float) -> float:
    """The value ``optimizer_step`` returns for a skipped step: always non-finite (callers
    test ``math.isfinite``), the norm itself when it was the cause, else NaN."""
    return grad_norm if not math.isfinite(grad_norm) else math.nan


def clip_and_step(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    clip_grad: float | None,
    deferred: DeferredNormalizer | None = None,
    *,
    window: DeferredNormalizer | None = None,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Apply deferred normalization, measure the global grad norm, clip, and step.

    Args:
        params: the parameters the optimizer updates (grads already reduced over DP).
        optimizer: steps only when every rank agrees the window is finite.
        clip_grad: max norm, or None for no clipping.
        deferred: in deferred mode, the window's normalizer; grads are scaled by
            ``1 / denominator`` first.
        window: the window's bookkeeping (usually the same object as ``deferred``); a
            non-finite loss recorded in it skips the step. Both are reset here: the next
            window starts clean whether this step runs or is skipped.
        group: the ranks that agree on skipping (None: the default group); collective.

    Returns:
        The pre-clip global L2 norm; a non-finite value means the step was skipped on every
        rank and params and optimizer state are untouched (see :func:`skipped_norm`).
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        raise RuntimeError("optimizer_step with no gradients; fix: call forward_backward_step (not forward_only) first")
    nonfinite_loss = window is not None and window.nonfinite_loss
    if deferred is not None:
        scale = deferred.grad_scale()
        deferred.reset()
        for p in with_grad:
            p.grad.mul_(scale)
    if window is not None:
        window.reset()
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0)
    # Sharded grads give a partial norm; full_tensor() all-reduces it into the global one.
    norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
    if agree_to_skip(norm, nonfinite_loss, group):
        return skipped_norm(norm)
    if clip_grad is not None:
        torch.nn.utils.clip_grads_with_norm_(with_grad, clip_grad, total)
    optimizer.step()
    return norm
