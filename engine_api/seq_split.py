"""Autograd collectives for backends that split each sequence over a group of ranks (Ulysses
sequence parallelism on FSDP, context parallelism on megatron).

The convention, shared by every function here: the ranks of the group hold the same
micro-batch and each computes the model on its own part of the tokens; per-token outputs are
gathered so that every rank computes the same loss of the whole micro-batch, and each rank's
backward keeps only the gradient of its own part. Summed over the group, the gradients are the
micro-batch's gradient exactly once. A backend whose gradient reduction averages over the group
too (FSDP over DP x SP, megatron DDP over DP x CP) says so with ``StepSpec.grad_reduce_ranks``,
and the step loop multiplies the average back into a sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherDim1(torch.autograd.Function):
    """All-gather along dim 1 in group-rank order; backward keeps this rank's block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[1]
        x = x.contiguous()  # the collective writes flat buffers
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank = dist.get_rank(ctx.group)
        return grad[:, rank * ctx.width : (rank + 1) * ctx.width], None


def gather_dim1(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` ``[R, w, ...]`` side by side along dim 1, ``[R, w * size, ...]``, on
    every rank of ``group`` (equal ``w`` everywhere). Collective; see the module docstring for
    the gradient."""
    return _GatherDim1.apply(x, group)


class _SumKeepGrad(torch.autograd.Function):
    """All-reduce sum whose backward is the identity (each rank keeps its summand's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_keep_grad(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` summed over ``group``, for a statistic of the whole micro-batch that every rank
    then uses alike (e.g. the MoE load-balancing loss's). Collective; the gradient follows
    the module docstring's convention."""
    return _SumKeepGrad.apply(x, group)
