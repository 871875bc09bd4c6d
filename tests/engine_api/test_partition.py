"""Dynamic batching: balanced partitions under a token budget."""

from __future__ import annotations

import math
import random

import pytest

from engine_api.partition import min_num_micro_batches, partition_balanced


@pytest.mark.parametrize("seed", range(20))
def test_partition_is_complete_within_budget_and_near_optimal(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 200) for _ in range(rng.randint(1, 64))]
    budget = rng.randint(max(lengths), max(lengths) * 4)
    parts = partition_balanced(lengths, budget)
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(len(lengths)))  # every sequence exactly once
    assert all(p and p == sorted(p) for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) <= budget
    assert len(parts) <= _first_fit_decreasing_count(lengths, budget)


def _first_fit_decreasing_count(lengths, budget):
    """Independent yardstick: classic first-fit-decreasing (<= 11/9 OPT + 6/9 bins)."""
    bins = []
    for n in sorted(lengths, reverse=True):
        for j, load in enumerate(bins):
            if load + n <= budget:
                bins[j] += n
                break
        else:
            bins.append(n)
    return len(bins)


def test_partition_balances_skewed_lengths():
    rng = random.Random(0)
    lengths = [min(1024, max(16, int(rng.lognormvariate(5, 0.8)))) for _ in range(256)]
    parts = partition_balanced(lengths, 4096)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) / (sum(loads) / len(loads)) <= 1.05
    assert len(parts) <= math.ceil(sum(lengths) / 4096) + 1


def test_min_parts_is_honoured_and_deterministic():
    lengths = [5, 1, 1, 1, 1, 1]
    parts = partition_balanced(lengths, 100, min_parts=3)
    assert len(parts) == 3
    assert parts == partition_balanced(lengths, 100, min_parts=3)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens.*max_token_len_per_micro_batch = 8"):
        partition_balanced([3, 9], 8)
    with pytest.raises(ValueError, match="empty"):
        partition_balanced([3, 4], 8, min_parts=3)
    with pytest.raises(ValueError, match="must be positive"):
        min_num_micro_batches([1], 0)
