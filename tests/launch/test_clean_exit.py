"""A script that finished its work exits 0 on every rank (issue 28).

Reported from outside: under ``torchrun --nproc-per-node 2`` a short script without teardown
(the README's API example: build, train a batch, infer) printed its result and then one rank
aborted in C++ static destruction (``terminate called without an active exception``, SIGABRT),
intermittently, on both backends, so the job was marked failed. The engine now destroys the
process groups it created at interpreter exit (``engine_api.dist._teardown_own_group``).

What is asserted: a run of ``exit_script.py`` exits 0 with every rank's output printed and,
deterministically (the abort itself was intermittent), that no process group is left alive for
interpreter shutdown on any rank (recorded by an ``atexit`` handler that runs after
the engine's), and that a plain ``python`` run leaves no rendezvous file behind.
"""

from __future__ import annotations

import glob
import os

import pytest

from tests.support import launch
from tests.support.hf_utils import make_model

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "exit_script.py")
# Per backend; each run is a fresh torchrun job. One: the abort was intermittent, so a repeat
# caught it only sometimes, while ``group_alive=False`` on every rank (no process group left
# for C++ static destruction, the abort's cause) is checked deterministically by every run.
RUNS = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_a_finished_script_exits_zero_on_every_rank(strategy, model_dir, tmp_path):
    for run in range(RUNS):
        out = tmp_path / f"run{run}"
        out.mkdir()
        proc = launch.torchrun([SCRIPT, str(out), model_dir, strategy], nproc=2)
        assert proc.returncode == 0, f"run {run}: rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        assert "done rank 0" in proc.stdout and "done rank 1" in proc.stdout
        for rank in (0, 1):
            assert (out / f"exit{rank}.txt").read_text().strip() == "group_alive=False", f"run {run} rank {rank}"


def test_a_single_process_run_removes_its_rendezvous_file(model_dir, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    proc = launch.python([SCRIPT, str(out), model_dir, "fsdp"], timeout=300, env={"TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "exit0.txt").read_text().strip() == "group_alive=False"
    assert glob.glob(str(tmp / "enginekit_pg_*")) == []
