"""Rank failure (issue 6, item 5): when one rank fails, every other rank exits with an error in
bounded time instead of hanging.

2 ranks per case, plain processes (``_ckpt_procs.RankGroup``: nothing kills the survivors for
us), every registered HF backend. A rank fails after one good training step
(``_ckpt_targets.fail_one_rank``):

* ``forward``: rank 1 raises inside ``forward_backward_step`` and exits. The survivor is blocked in
  a collective with it; the OS closes the dead rank's sockets and gloo raises
  ``Connection closed by peer``: bounded by seconds, whatever the process-group timeout (these
  cases run with torch's default of 30 minutes).
* ``save``: the first file rank 1 writes inside ``save_checkpoint`` hits a full disk (ENOSPC); the
  backend's writer reports the error to every rank or the rank exits: either way both exit.
* ``upload``: rank 0's remote copy fails, a step of ``save_checkpoint`` only rank 0 runs;
  ``engine_api.ckpt_layout`` shares rank 0's outcome, so every rank raises the same
  ``CheckpointError`` (a caller that catches it keeps all ranks in step).
* ``forward_alive``: rank 1 raises inside ``forward_backward_step`` but swallows the error and
  stays alive, never joining a collective again. Only the process-group timeout can free the
  survivor: the ranks run with ``engine_api.dist.init_process_group(timeout_s=20)``.

The guarantee and what provides it are stated in ``engine_api/dist.py``'s docstring. Every case
runs at once (they are independent), so the module costs about one case's time.
"""

from __future__ import annotations

import os
import re
import tempfile
import time

import pytest
import torch.distributed as dist

from engine_api.dist import TIMEOUT_ENV, init_process_group, process_group_timeout
from tests.reliability import _ckpt_targets as T
from tests.reliability._ckpt_procs import RankGroup
from tests.reliability._step_common import BACKENDS
from tests.support.hf_utils import make_model
from tests.support.launch import run_distributed

START_TIMEOUT_S = 240  # until the failure is injected (16 ranks start at once on 2 cores)
BOUND_S = 30.0  # from the failure to every survivor's exit (measured: under 2 s)
ALIVE_SLACK_S = 10.0  # after the timeout, for the survivor to raise and exit (measured: 0.2 s)
ALIVE_PG_TIMEOUT_S = 20.0  # process-group timeout of the forward_alive cases
WHERES = ("forward", "save", "upload", "forward_alive")
# What the failing rank and the survivor say (the survivor's error must name the cause).
FAILING_SAYS = {"forward": "injected failure in forward_backward_step on rank 1", "save": "No space left on device"}
SURVIVOR_SAYS = {
    "forward": r"Connection (closed|reset) by peer",
    "save": r"No space left on device|Connection (closed|reset) by peer",
    "upload": r"CheckpointError: rank 0 failed committing .*global_step_1",
    "forward_alive": r"Timed out waiting",
}
# megatron builds its data/tensor-parallel groups with its own 30-minute timeout, not the world
# group's, so a survivor waiting in one of them is not freed by the process-group timeout until
# backends/megatron/model.py passes it on (the proposed diff is in the issue-6 report).
# (backend, where) pairs a backend cannot meet yet, as strict xfails; empty since megatron's
# groups take the process-group timeout (backends/megatron/model.py init_parallel).
KNOWN_GAPS: dict[tuple[str, str], str] = {}


def _bound(where: str) -> float:
    """Seconds from the failure by which every survivor must have exited."""
    return ALIVE_PG_TIMEOUT_S + ALIVE_SLACK_S if where == "forward_alive" else BOUND_S


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every (backend, where) case, run concurrently; per case: when the failure was injected,
    each rank's exit code and exit time, and the logs."""
    model_dir = make_model(tmp_path_factory.mktemp("hf") / "llama", "llama")
    cases = [(s, w) for s in BACKENDS for w in WHERES]
    groups, dirs = {}, {}
    try:
        for strategy, where in cases:
            d = dirs[strategy, where] = str(tmp_path_factory.mktemp(f"fail_{strategy}_{where}"))
            timeout = ALIVE_PG_TIMEOUT_S if where == "forward_alive" else None
            groups[strategy, where] = RankGroup(T.fail_one_rank, 2, (strategy, model_dir, where, d), d, pg_timeout_s=timeout)
        return _watch(groups, dirs)
    finally:
        for group in groups.values():
            group.kill()


def _watch(groups: dict, dirs: dict) -> dict:
    """Poll every case until its survivors exited or its deadline passed."""
    start, out, pending = time.time(), {}, set(groups)
    while pending:
        for key in sorted(pending):
            group, flag = groups[key], os.path.join(dirs[key], "injected")
            survivors = [0] if key[1] == "forward_alive" else [0, 1]
            injected = float(open(flag).read()) if os.path.exists(flag) else None
            group.poll()
            done = all(group.exited_at[r] is not None for r in survivors)
            limit = injected + _bound(key[1]) if injected else start + START_TIMEOUT_S
            if done or time.time() > limit:
                out[key] = {
                    "injected": injected,
                    "survivors": survivors,
                    "exitcodes": [p.exitcode for p in group.procs],
                    "waited": [None if t is None or injected is None else t - injected for t in group.exited_at],
                    "logs": [group.log(r) for r in range(2)],
                    "tails": group.logs_tail(),
                }
                pending.discard(key)
        time.sleep(0.2)
    return out


CASES = [
    pytest.param(s, w, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[s, w])) if (s, w) in KNOWN_GAPS else (s, w)
    for s in BACKENDS
    for w in WHERES
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,where", CASES)
def test_when_a_rank_fails_every_surviving_rank_exits_with_an_error_in_bounded_time(outcomes, strategy, where):
    o = outcomes[strategy, where]
    assert o["injected"] is not None, f"the failure was never injected (startup or the first step broke):{o['tails']}"
    bound = _bound(where)
    for r in o["survivors"]:
        assert o["exitcodes"][r] not in (None, 0), f"rank {r} did not exit with an error within {bound:.0f}s of the failure{o['tails']}"
        assert o["waited"][r] <= bound, f"rank {r} took {o['waited'][r]:.1f}s"
    assert re.search(SURVIVOR_SAYS[where], o["logs"][0]), f"rank 0's error does not name the cause:{o['tails']}"
    if where in FAILING_SAYS:
        assert FAILING_SAYS[where] in o["logs"][1], o["tails"]
    if where == "upload":  # rank 0's own failure, shared: rank 1 raises the same error, nobody waits
        assert re.search(SURVIVOR_SAYS[where], o["logs"][1]), o["tails"]
    if where == "forward_alive":  # the failing rank is still alive: the timeout, not a closed connection, freed rank 0
        assert o["exitcodes"][1] is None, o["tails"]


# ----------------------------------------------------------------------------- the timeout itself
def test_init_process_group_refuses_a_bad_timeout_before_initialising(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "ten")
    with pytest.raises(ValueError, match=r"\$ENGINEKIT_DIST_TIMEOUT_S = 'ten': not a number; fix:"):
        init_process_group("gloo", init_method="file:///nonexistent/rendezvous", rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"timeout_s = 0: .* must be positive; fix:"):
        init_process_group("gloo", timeout_s=0)


def _timeouts(rank, world):
    """This rank's group re-made by engine_api's helper; its timeout and a later subgroup's."""
    dist.destroy_process_group()
    init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='ek_pg_')}", rank=0, world_size=1)
    return process_group_timeout().total_seconds(), process_group_timeout(dist.new_group([0])).total_seconds()


def test_the_timeout_comes_from_the_environment_and_subgroups_do_not_inherit_it():
    """Why backends must pass ``process_group_timeout()`` on to the groups they create."""
    # a new rank: the worker replaces its group, reading the variable when it makes the new one
    world, subgroup = run_distributed(_timeouts, 1, env={TIMEOUT_ENV: "17"}, fresh=True)[0]
    assert world == 17.0
    assert subgroup == 1800.0  # torch's default, not the world group's
