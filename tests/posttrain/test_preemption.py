"""``posttrain.preemption``: the handler records the signal, the ranks agree on it, the previous
handlers come back (the recipes' end-to-end stop and resume: tests/recipes/test_preemption.py)."""

from __future__ import annotations

import os
import signal

import pytest

from posttrain.preemption import Preempted, PreemptionGuard
from tests.support.launch import run_distributed


def test_a_signal_is_recorded_not_raised_and_the_old_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionGuard() as guard:
        assert guard.stop_requested() is None
        os.kill(os.getpid(), signal.SIGTERM)  # would end the test process without the guard
        assert guard.stop_requested() == signal.SIGTERM
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_second_ctrl_c_interrupts_at_once():
    with PreemptionGuard() as guard, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.stop_requested() == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)


def test_the_exit_code_is_128_plus_the_signal_and_the_message_says_how_to_resume():
    exc = Preempted(signal.SIGTERM, 7, "/ckpt/global_step_7")
    assert exc.exit_code == 143 and Preempted(signal.SIGINT, 1, "x").exit_code == 130
    assert "after step 7" in str(exc) and "/ckpt/global_step_7" in str(exc) and "trainer.resume=true" in str(exc)


def _one_rank_signalled(rank: int, world_size: int) -> list:
    with PreemptionGuard() as guard:
        first = guard.stop_requested()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return [first, guard.stop_requested()]


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_boundary():
    assert run_distributed(_one_rank_signalled, 2) == [[None, signal.SIGTERM], [None, signal.SIGTERM]]
