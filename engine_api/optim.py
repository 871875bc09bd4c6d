"""Optimizer construction and the pieces of ``BaseEngine.optimizer_step`` (the one step
skeleton every backend shares): the skip decision agreed by every rank (:func:`agree_to_skip`,
because a non-finite loss can be rank-local even when the gradient is not) and the post-step
finite check (:func:`check_update_finite`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine_api.config import OptimConfig
from engine_api.dist import all_gather_objects, all_reduce, comm_device


def build_adamw(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW from ``cfg``: torch's fused kernel (one launch for every tensor) when every
    parameter is a floating CUDA tensor, else ``foreach`` as torch picks for the device (CPU:
    today's numbers, bit for bit; the fused CPU kernel rounds differently)."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)
    kwargs = {"fused": True} if fused else {}
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, **kwargs)


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


class NonFiniteUpdateError(RuntimeError):
    """An optimizer step wrote NaN or inf into the parameters (raised on every rank)."""


def check_update_finite(named_params: Iterable[tuple[str, torch.Tensor]], step: int, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`NonFiniteUpdateError` on every rank of ``group`` when any parameter holds
    a NaN or inf after optimizer step ``step``.

    A finite gradient can still produce a non-finite update (an enormous learning rate, a
    zero denominator); the step is then not marked skipped and would silently poison every
    later step and every checkpoint. Cost: one fused L2-norm pass over this rank's shards
    (``torch._foreach_norm``, which propagates NaN and inf; about a tenth of an AdamW step) and
    one all-reduce of a flag; the names are gathered only on failure. Collective.
    """
    named = [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in named_params]
    named = [(n, p) for n, p in named if p.numel()]
    bad_name = None
    if named:
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for n, p in named:
            by_device.setdefault(p.device, []).append((n, p))
        for items in by_device.values():
            # L2 norms propagate NaN and inf and are the fastest fused reduction on CPU and GPU
            # (ord=inf measured 20x slower on CPU); a norm can also overflow for huge but finite
            # weights, so a non-finite norm is confirmed exactly on its own tensor.
            norms = torch.stack(torch._foreach_norm([p.detach() for _, p in items], ord=2.0))
            finite = torch.isfinite(norms)
            if not bool(finite.all()):
                suspects = [items[i] for i in (~finite).nonzero().flatten().tolist()]
                bad_name = next((n for n, p in suspects if not bool(torch.isfinite(p).all())), None)
                if bad_name is not None:
                    break
    flag = torch.tensor([0.0 if bad_name is None else 1.0], device=comm_device(group))
    if not all_reduce(flag, "max", group).item():
        return
    names = [n for n in all_gather_objects(bad_name, group) if n is not None]
    raise NonFiniteUpdateError(
        f"optimizer step {step} wrote non-finite values into the parameters (first: {names[0]}); the engine's weights are "
        "invalid and it refuses to train, save or export them; fix: lower optim.lr (or check optim.eps / weight_decay), "
        "then load_checkpoint() a good checkpoint into this engine"
    )
