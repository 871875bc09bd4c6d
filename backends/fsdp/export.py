"""Bucketed weight export for FSDP2 (issue 18, item 2): full tensors gathered in flat buckets of
a given size, one ``all_gather_into_tensor`` per bucket instead of one collective per tensor.

FSDP2 shards every parameter on dim 0 the way ``torch.chunk`` splits it over the mesh (the last
ranks get smaller or empty chunks when the size does not divide). Each rank concatenates its
local chunks of a bucket into one flat buffer, padded to the largest rank's; one all-gather brings
every rank's buffer; each parameter is then put back together from its per-rank pieces (three
memory passes per byte: the local concatenation, the gather, the reassembly; the per-tensor path
makes one, so on CPU, where memory bandwidth and not collective latency is the cost, buckets are
slower: see BENCHMARKS.md). Tensors
that are not sharded on dim 0 over a 1-D mesh (HSDP's 2-D mesh, plain tensors) fall back to
``full_tensor()`` one at a time, in order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _chunk_rows(rows: int, world: int) -> list[int]:
    """dim-0 sizes of ``torch.chunk`` over ``world`` ranks (empty chunks for the last ranks)."""
    sizes = [c.shape[0] for c in torch.empty(rows, 0).chunk(world)] if rows else []
    return sizes + [0] * (world - len(sizes))


def _bucketable(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.ndim >= 1


def bucketed_full_tensors(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full_tensor)`` in the order of ``named``, gathered in buckets of at most
    ``bucket_bytes`` (a tensor larger than that is a bucket of its own; a bucket holds one
    dtype). Collective over each tensor's mesh; every rank must drain it."""
    bucket: list[tuple[str, DTensor]] = []
    size = 0
    for name, tensor in named:
        if not _bucketable(tensor):
            yield from _gather(bucket)
            bucket, size = [], 0
            yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
            continue
        nbytes = tensor.numel() * tensor.element_size()
        same = not bucket or (bucket[0][1].dtype == tensor.dtype and bucket[0][1].device_mesh == tensor.device_mesh)
        if bucket and (size + nbytes > bucket_bytes or not same):
            yield from _gather(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    yield from _gather(bucket)


def _gather(bucket: list[tuple[str, DTensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    if not bucket:
        return
    mesh = bucket[0][1].device_mesh
    group, world = mesh.get_group(), mesh.size()
    rows = [_chunk_rows(t.shape[0], world) for _, t in bucket]
    row_numel = [math.prod(t.shape[1:]) for _, t in bucket]  # (not t[0]: indexing a DTensor redistributes it)
    per_rank = [sum(r[k] * n for r, n in zip(rows, row_numel, strict=True)) for k in range(world)]
    longest = max(per_rank)
    if world == 1:  # nothing to gather: the local chunks are the full tensors
        for name, tensor in bucket:
            yield name, tensor.to_local().detach()
        return
    local = torch.cat([t.to_local().detach().reshape(-1) for _, t in bucket])
    if local.numel() == longest:
        send = local  # (no padding copy)
    else:
        send = local.new_zeros(longest)
        send[: local.numel()] = local
    received = local.new_empty(world * longest)
    dist.all_gather_into_tensor(received, send, group=group)
    regions = received.view(world, longest)
    offsets = [0] * world
    for (name, tensor), r, n in zip(bucket, rows, row_numel, strict=True):
        pieces = []
        for k in range(world):
            count = r[k] * n
            pieces.append(regions[k, offsets[k] : offsets[k] + count].view(r[k], *tensor.shape[1:]))
            offsets[k] += count
        yield name, torch.cat(pieces).clone()
