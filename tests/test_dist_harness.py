"""The multi-process harness surfaces rank errors and never hangs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import RankError, run_distributed


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, float(t)


def _rank1_raises(rank, world):
    if rank == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever


def _rank0_hangs(rank, world):
    if rank == 0:
        time.sleep(600)


def test_results_come_back_by_rank():
    assert run_distributed(_sum_ranks, 2) == [(0, 3.0), (1, 3.0)]


def test_a_failing_rank_is_reported_with_its_traceback_and_peers_are_killed():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 ---.*KeyError: 'boom on rank 1'"):
        run_distributed(_rank1_raises, 2, timeout=120)
    assert time.monotonic() - start < 60  # the grace period, not the timeout, bounds it


def test_a_hanging_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    # The timeout includes process start-up (seconds on a loaded 2-core machine), so it leaves
    # room for rank 1 to start and finish; the bound checks the hang is cut at the timeout.
    with pytest.raises(RankError, match=r"ranks \[0\] did not finish within 25s"):
        run_distributed(_rank0_hangs, 2, timeout=25)
    assert time.monotonic() - start < 60
