"""The long-lived worlds (``tests/support/worlds.py``) and forked scripts (``forked.py``) the suite
runs on: a task in a reused world sees what a new rank sees, a failure never leaks into the next
task, and a forked script behaves as ``python`` / ``torchrun`` would (output, exit code, ranks)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.distributed as dist

from tests.support import launch, worlds
from tests.support.launch import RankError, run_distributed


def _state(rank, world):
    """What a task can observe of the process state it starts from."""
    from torch.distributed import distributed_c10d as c10d

    return {
        "pid": os.getpid(),
        "draw": torch.rand(3),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "groups": len(c10d._world.pg_map),
        "cwd": os.getcwd(),
        "EK_LEFT": os.environ.get("EK_LEFT"),
        "EK_TASK": os.environ.get("EK_TASK"),
        "rank": (dist.get_rank(), os.environ["RANK"], os.environ["WORLD_SIZE"]),
    }


def _dirty(rank, world):
    """A task that changes everything a later task could trip over."""
    before = _state(rank, world)
    torch.rand(100)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1 if before["threads"] > 1 else 2)
    os.environ["EK_LEFT"] = "x"
    os.chdir("/")
    dist.new_group([0, 1])
    return before


def test_a_reused_world_gives_every_task_the_state_of_a_new_rank():
    first = run_distributed(_dirty, 2)
    second = run_distributed(_state, 2, env={"EK_TASK": "y"})
    new = run_distributed(_state, 2, fresh=True)
    for rank in range(2):
        a, b, c = first[rank], second[rank], new[rank]
        assert a["pid"] == b["pid"]  # the same process served both tasks
        assert torch.equal(a["draw"], b["draw"]) and torch.equal(b["draw"], c["draw"])  # a new rank's RNG
        assert b["dtype"] == torch.float32 and b["grad"] and b["threads"] == a["threads"] == c["threads"]
        assert b["groups"] == c["groups"] == 1  # only the world's own group
        assert b["cwd"] == a["cwd"] == c["cwd"]
        assert b["EK_LEFT"] is None and b["EK_TASK"] == "y" and a["EK_TASK"] is None
        assert b["rank"] == (rank, str(rank), "2")


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever


def _pid(rank, world):
    return os.getpid()


def test_a_failed_task_replaces_the_world():
    before = run_distributed(_pid, 2)
    with pytest.raises(RankError, match=r"(?s)rank 1 ---.*KeyError: 'boom on rank 1'"):
        run_distributed(_fail_on_rank_1, 2, timeout=60)
    after = run_distributed(_pid, 2)
    assert not set(before) & set(after)


def _destroy(rank, world):
    dist.destroy_process_group()


def test_a_task_that_destroys_the_group_is_refused_naming_the_fix():
    with pytest.raises(RankError, match=r"destroyed the world's process group; fix: .*fresh=True"):
        run_distributed(_destroy, 1)
    assert run_distributed(_pid, 1)[0] != os.getpid()  # and the next task has a working world


def test_worlds_are_kept_per_size():
    assert len(set(run_distributed(_pid, 2))) == 2
    assert run_distributed(_pid, 1)[0] not in run_distributed(_pid, 2)
    assert set(worlds._WORLDS) >= {1, 2}


# ----------------------------------------------------------------------------- forked scripts
SCRIPT = (
    "import atexit, os, sys\n"
    "atexit.register(lambda: print('atexit ran'))\n"
    "print(os.environ.get('RANK'), os.environ.get('WORLD_SIZE'), os.environ['EK_EXTRA'], os.getcwd(), sys.argv[1:])\n"
    "print('to stderr', file=sys.stderr)\n"
    "code = int(sys.argv[1])\n"
    "if code == 99:\n"
    "    raise ValueError('uncaught')\n"
    "sys.exit(code)\n"
)


@pytest.mark.parametrize("code", [0, 3, 99])
def test_a_forked_script_behaves_as_python_does(code):
    """Output, exit code (``sys.exit``, an uncaught exception's 1), ``atexit`` and the
    environment of a forked run equal a new interpreter's."""
    forked = launch.run_script(["-c", SCRIPT, str(code)], env={"EK_EXTRA": "x"}, timeout=60)
    real = launch.run_script(["-c", SCRIPT, str(code)], env={"EK_EXTRA": "x"}, timeout=60, fresh=True)
    assert forked.returncode == real.returncode == (1 if code == 99 else code)
    assert forked.stdout == real.stdout == f"None None x {launch.REPO} ['{code}']\natexit ran\n"
    assert forked.stderr.splitlines()[0] == real.stderr.splitlines()[0] == "to stderr"
    if code == 99:
        assert forked.stderr.splitlines()[-1] == real.stderr.splitlines()[-1] == "ValueError: uncaught"


def test_forked_ranks_get_torchruns_variables_and_a_failed_rank_fails_the_run():
    ok = launch.run_script(["-c", SCRIPT, "0"], nproc=2, env={"EK_EXTRA": "x"}, timeout=60)
    assert ok.returncode == 0
    assert ok.stdout.splitlines()[0::2] == [f"{r} 2 x {launch.REPO} ['0']" for r in range(2)]
    failing = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(5)\ntime.sleep(600)\n"
    bad = launch.run_script(["-c", failing], nproc=2, timeout=120)
    assert bad.returncode == 1  # rank 0 was stopped, as torchrun's agent stops it


def test_a_forked_script_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        launch.run_script(["-c", "import time; time.sleep(600)"], timeout=3)
