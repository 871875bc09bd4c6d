"""Dynamic batching: partition sequences into micro-batches under a token budget.

Pure functions over sequence lengths; the engine adds the one collective that makes every
DP rank use the same number of micro-batches (see ``engine_api.microbatch``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def min_num_micro_batches(lengths: Sequence[int], max_tokens: int) -> int:
    """Lower bound on the number of micro-batches: ceil(total tokens / budget).

    Raises:
        ValueError: a sequence is longer than the budget (it could never fit), or the budget
            is not positive.
    """
    if max_tokens <= 0:
        raise ValueError(
            f"max_token_len_per_micro_batch = {max_tokens}: must be positive; fix: set it to at least the longest sequence length"
        )
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} has {n} tokens; fix: every sequence needs at least one token")
        if n > max_tokens:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than max_token_len_per_micro_batch = {max_tokens}; "
                f"fix: raise engine.max_token_len_per_micro_batch to at least {n} or truncate the sequence"
            )
    return max(1, math.ceil(sum(lengths) / max_tokens))


def partition_balanced(lengths: Sequence[int], max_tokens: int, min_parts: int = 1) -> list[list[int]]:
    """Split sequence indices into balanced micro-batches of at most ``max_tokens`` tokens each.

    Tries ``k = max(min_parts, ceil(total / max_tokens))`` parts and up: first
    longest-processing-time-first (each sequence, longest first, goes to the lightest part:
    balanced loads), and when that overflows the budget, best-fit-decreasing into ``k``
    parts (each sequence goes to the fullest part it fits: tighter packing, less balance).
    The first ``k`` that either fits is used. Every part is non-empty and keeps its indices
    in ascending order, and parts are ordered by their first index (deterministic).

    Args:
        lengths: token count of each sequence.
        max_tokens: token budget of one micro-batch.
        min_parts: at least this many parts (the max over DP ranks, so all ranks agree).

    Raises:
        ValueError: a sequence exceeds the budget, or ``min_parts`` exceeds the number of
            sequences (a part would be empty).
    """
    n = len(lengths)
    if n == 0:
        raise ValueError("cannot partition an empty batch; fix: pass at least one sequence")
    if min_parts > n:
        raise ValueError(
            f"{min_parts} micro-batches requested for {n} sequences: a micro-batch would be empty; "
            "fix: give every DP rank the same number of sequences (shard_data does)"
        )
    k = max(min_parts, min_num_micro_batches(lengths, max_tokens))
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    while True:
        parts = _lpt(order, lengths, k)
        if max(sum(lengths[i] for i in p) for p in parts) > max_tokens:
            parts = _best_fit(order, lengths, k, max_tokens)
        if parts is not None and all(parts):
            return sorted((sorted(p) for p in parts), key=lambda p: p[0])
        # k == n always succeeds (one sequence per part, each fits), so this terminates.
        k += 1


def _lpt(order: list[int], lengths: Sequence[int], k: int) -> list[list[int]]:
    heap = [(0, j) for j in range(k)]  # (load, part index); ties broken by part index
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, j = heapq.heappop(heap)
        parts[j].append(i)
        heapq.heappush(heap, (load + lengths[i], j))
    return parts


def _best_fit(order: list[int], lengths: Sequence[int], k: int, max_tokens: int) -> list[list[int]] | None:
    """Best-fit-decreasing into ``k`` parts; None if some sequence fits nowhere."""
    loads = [0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        fits = [j for j in range(k) if loads[j] + lengths[i] <= max_tokens]
        if not fits:
            return None
        j = max(fits, key=lambda j: (loads[j], -j))
        parts[j].append(i)
        loads[j] += lengths[i]
    return parts
