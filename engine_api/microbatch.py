"""Micro-batch planning shared by every backend.

:func:`make_micro_batches` turns one ``forward_backward_step`` call's local batch into
micro-batches by the engine config (fixed size, dynamic token budget, or the whole batch)
and remembers the order so per-micro-batch outputs can be put back in the caller's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_api.batch import cat_rows, relayout, restore_order, seq_lengths, split_by_size, take_rows
from engine_api.dist import all_reduce, comm_device
from engine_api.partition import partition_balanced


@dataclass(frozen=True)
class MicroBatches:
    """Micro-batches of one local batch.

    Attributes:
        batches: the micro-batches, in execution order.
        order: original row index of each row of ``torch.cat(batches)``.
    """

    batches: list[TensorDict]
    order: torch.Tensor

    def restore(self, outputs: list[TensorDict], like: torch.Tensor | None = None) -> TensorDict:
        """Concatenate one output TensorDict per micro-batch and restore the original order.

        With ``like`` (the caller's jagged ``input_ids``), jagged outputs are laid onto its
        offsets, so they combine directly with the caller's other jagged fields.
        """
        if len(outputs) != len(self.batches):
            raise ValueError(f"got {len(outputs)} outputs for {len(self.batches)} micro-batches")
        merged = restore_order(cat_rows(outputs), self.order)
        return relayout(merged, like.offsets()) if like is not None else merged


def make_micro_batches(
    batch: TensorDict,
    micro_batch_size: int | None,
    max_token_len: int | None,
    dp_group: dist.ProcessGroup | None,
) -> MicroBatches:
    """Split a local batch into micro-batches.

    Exactly one of ``micro_batch_size`` (fixed number of sequences) and ``max_token_len``
    (dynamic batching: balanced parts under a real-token budget) may be set; with neither,
    the whole batch is one micro-batch.

    Collective over ``dp_group`` in dynamic mode: the number of micro-batches is the max over
    DP ranks, because FSDP/DDP/megatron need every rank to run the same number of
    forward/backward passes. Fixed-size mode needs no collective: ``shard_batch`` gives every
    rank the same number of sequences.
    """
    size = batch.batch_size[0]
    if micro_batch_size is not None and max_token_len is not None:
        raise ValueError(
            f"micro_batch_size = {micro_batch_size} and max_token_len_per_micro_batch = {max_token_len} "
            "are both set; fix: set only one of them"
        )
    if max_token_len is None:
        parts = split_by_size(batch, micro_batch_size or size)
        return MicroBatches(batches=parts, order=torch.arange(size))
    lengths = seq_lengths(batch).tolist()
    index_lists = _agreed_partition(lengths, max_token_len, dp_group)
    order = torch.tensor([i for part in index_lists for i in part], dtype=torch.int64)
    batches = [take_rows(batch, torch.tensor(part, dtype=torch.int64)) for part in index_lists]
    return MicroBatches(batches=batches, order=order)


def _agreed_partition(lengths: list[int], max_tokens: int, dp_group: dist.ProcessGroup | None) -> list[list[int]]:
    """Balanced partition whose part count is the same on every rank of ``dp_group``.

    Each rank partitions with at least ``k`` parts; one all-reduce of (max, -min) of the part
    counts tells whether all ranks agree. If not, everyone retries with the max, which is
    strictly larger than ``k``, so the loop ends (at the latest at the local batch size, which
    is equal on all ranks).
    """
    k = 1
    while True:
        parts = partition_balanced(lengths, max_tokens, min_parts=k)
        counts = torch.tensor([len(parts), -len(parts)], dtype=torch.int64, device=comm_device(dp_group))
        all_reduce(counts, "max", dp_group)
        most, fewest = int(counts[0]), -int(counts[1])
        if most == fewest:
            return parts
        k = most
