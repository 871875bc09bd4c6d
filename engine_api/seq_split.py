"""What a backend that splits each sequence over a group of ranks (Ulysses sequence parallelism
on FSDP, context parallelism on megatron) needs beyond its model: autograd collectives and the
per-token outputs from each rank's columns.

The convention, shared by every function here: the ranks of the group hold the same
micro-batch and each computes the model on its own part of the tokens; per-token outputs are
gathered so that every rank computes the same loss of the whole micro-batch, and each rank's
backward keeps only the gradient of its own part. Summed over the group, the gradients are the
micro-batch's gradient exactly once. A backend whose gradient reduction averages over the group
too (FSDP over DP x SP) says so with ``StepSpec.grad_reduce_ranks``, and the step loop
multiplies the average back into a sum (megatron's schedule multiplies each loss by CP itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_api.batch import unpack
from engine_api.logprobs import align_to_tokens, next_token_entropy, next_token_log_probs


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


def outputs_from_columns(
    mb: TensorDict, logits: torch.Tensor, following: torch.Tensor, whole: Callable[[torch.Tensor], torch.Tensor], head: str
) -> TensorDict:
    """A split forward's per-token outputs (the engine contract's ``log_probs`` / ``entropy`` or
    ``values``) from this rank's columns.

    Args:
        mb: the micro-batch (jagged ``input_ids``; metadata ``temperature``, ``calculate_entropy``).
        logits: this rank's columns of the model output, ``[rows, w, vocab]`` (or ``[rows, w, 1]``
            for ``head: value``).
        following: ``[rows, w]``, the token each of those columns predicts (the next one in its row).
        whole: gathers a per-column ``[rows, w]`` prediction from every rank of the split and
            returns it for every real token in packed order but the last, ``[tokens - 1]``
            (collective; its backward keeps this rank's columns, :func:`gather_dim1`).
        head: ``lm`` or ``value``.

    Each column's prediction about its next token is computed on the local logits (no rank holds
    more than its share of ``[tokens, vocab]``), gathered by ``whole`` and aligned as an unsplit
    forward aligns them (``align_to_tokens``).
    """
    ids = mb["input_ids"]
    cu = ids.offsets()
    if head == "value":
        return TensorDict({"values": unpack(align_to_tokens(whole(logits[..., 0].float()), cu), ids)}, batch_size=mb.batch_size)
    temperature = float(mb.get_non_tensor("temperature", 1.0))
    logits = logits / temperature if temperature != 1.0 else logits
    out = {"log_probs": unpack(align_to_tokens(whole(next_token_log_probs(logits, following)), cu), ids)}
    if mb.get_non_tensor("calculate_entropy", False):
        out["entropy"] = unpack(align_to_tokens(whole(next_token_entropy(logits)), cu), ids)
    return TensorDict(out, batch_size=mb.batch_size)
