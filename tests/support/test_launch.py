"""The launcher: ranks (in a long-lived world or new) surface their errors and never hang; ranks
and scripts get the same environment; the forkserver preloads modules that exist."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support import launch
from tests.support.launch import RankError, run_distributed


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


@pytest.mark.parametrize("fresh", [False, True], ids=["world", "new-ranks"])
def test_a_failing_rank_is_reported_with_its_traceback_and_peers_are_killed(fresh):
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 ---.*KeyError: 'boom on rank 1'"):
        run_distributed(_rank1_raises, 2, timeout=120, fresh=fresh)
    assert time.monotonic() - start < 60  # the grace period, not the timeout, bounds it


@pytest.mark.parametrize("fresh", [False, True], ids=["world", "new-ranks"])
def test_a_hanging_rank_is_killed_at_the_timeout(fresh):
    run_distributed(_sum_ranks, 2, fresh=fresh)  # the server (or world) started: not timed here
    start = time.monotonic()
    # New ranks start inside the timeout (forked from the preloaded server: well under a second);
    # the bound checks the hang is cut at the timeout.
    with pytest.raises(RankError, match=r"ranks \[0\] did not finish within 12s"):
        run_distributed(_rank0_hangs, 2, timeout=12, fresh=fresh)
    assert time.monotonic() - start < 60


def _env_of_rank(rank, world):
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "ENGINEKIT_DIST_TIMEOUT_S", "OMP_NUM_THREADS", "EK_EXTRA")}


def test_the_environment_drops_the_test_process_launcher_variables_and_extras_win(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("WORLD_SIZE", "7")
    env = launch.launch_env(ENGINEKIT_DIST_TIMEOUT_S="5")
    assert "MASTER_PORT" not in env and "WORLD_SIZE" not in env
    assert env["PYTHONPATH"] == launch.REPO and env["OMP_NUM_THREADS"] == "1"
    assert env["ENGINEKIT_DIST_TIMEOUT_S"] == "5"  # the default is 120; a caller's value wins


def test_spawned_ranks_get_the_same_environment_as_scripts(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1")  # e.g. left by a fixture's own group: no rank may see it
    ranks = run_distributed(_env_of_rank, 2, env={"EK_EXTRA": "x"})
    for rank, got in enumerate(ranks):
        want = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_PORT": None, "ENGINEKIT_DIST_TIMEOUT_S": launch.DIST_TIMEOUT_S}
        assert got == {**want, "OMP_NUM_THREADS": "1", "EK_EXTRA": "x"}, rank


def test_a_script_runs_in_the_repo_with_that_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = "import os; print(os.getcwd(), os.environ.get('WORLD_SIZE'), os.environ['EK_EXTRA'])"
    proc = launch.run_script(["-c", code], env={"EK_EXTRA": "x"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [launch.REPO, "None", "x"]  # one process: plain python, no launcher


def test_every_forkserver_preload_module_exists():
    """A module that fails to import is skipped silently, and ranks start slowly again."""
    missing = [name for name in launch.FORKSERVER_PRELOAD if importlib.util.find_spec(name) is None]
    assert not missing, f"FORKSERVER_PRELOAD names modules that do not exist: {missing}"


def test_ranks_are_spawned_where_cuda_is_available(monkeypatch):
    """A process forked after CUDA was touched cannot use it (issue 52: the offload tests' ranks,
    forked from the preloaded server, failed on the GPU); without CUDA the fast start stays."""
    assert launch.mp_context("forkserver").get_start_method() == "forkserver"
    assert launch.start_method_for("fork") == "fork"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [launch.start_method_for(m) for m in ("fork", "forkserver", "spawn")] == ["spawn"] * 3
    assert launch.mp_context("forkserver").get_start_method() == "spawn"
