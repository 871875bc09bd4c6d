"""Per-trajectory scheduling (issue 62, item 3; ``posttrain.agents.scheduler``): each trajectory
asks for its next call when it is ready and the rollout serves whatever waits, so a fast
trajectory never waits for a slow one's environment; calls that arrive together are served in
one rollout call; one trajectory's failure stops the round on every trajectory.

The loop test at the end holds the multi-turn loop itself to it: with one environment that
takes a second per turn and three that answer at once, the fast trajectories finish all their
turns while the slow one is in its first step (lock-step made them wait at every turn)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine_api.rollout import Sample
from posttrain.agents import StepResult
from posttrain.agents.scheduler import CallScheduler, RoundFailed
from tests.agents.scripted import HERMES, Scripted, _chat_tokenizer, _loop, _meta


class Echoes:
    """A rollout stand-in: every prompt's response is its last token, once; records its calls."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def sample(self, prompts, seeds, max_new_tokens=None, stop=()):
        self.calls.append([int(p[-1]) for p in prompts])
        return [Sample(p[-1:].clone(), torch.zeros(1), "stop", 1) for p in prompts]


def _run(scheduler: CallScheduler, bodies) -> list:
    """Each body in a thread (a trajectory); the scheduler serves them; their results."""
    results: list = [None] * len(bodies)

    def wrap(i, body):
        try:
            results[i] = body()
        except BaseException as exc:  # noqa: BLE001 (the test reads it)
            results[i] = exc
            if not isinstance(exc, RoundFailed):
                scheduler.fail(exc)
        finally:
            scheduler.ended()

    scheduler.started(len(bodies))
    threads = [threading.Thread(target=wrap, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    try:
        scheduler.serve()
    finally:
        for t in threads:
            t.join()
    return results


def test_calls_that_arrive_together_are_served_in_one_rollout_call():
    rollout = Echoes()
    scheduler = CallScheduler(rollout, window_s=0.05)
    out = _run(scheduler, [lambda k=k: scheduler.sample([k], k, 4).token_ids.tolist() for k in range(8)])
    assert out == [[k] for k in range(8)]
    assert scheduler.calls == 1 and scheduler.largest == 8 and sorted(rollout.calls[0]) == list(range(8))


def test_a_fast_trajectory_never_waits_for_a_slow_ones_environment():
    """The slow trajectory's environment takes 1 s after its first call; the fast one makes five
    calls meanwhile (lock-step would have made it wait at every turn)."""
    rollout = Echoes()
    scheduler = CallScheduler(rollout)
    order: list[str] = []

    def slow():
        scheduler.sample([1], 1, 4)
        time.sleep(1.0)  # its environment
        order.append("slow 1")
        scheduler.sample([1], 1, 4)

    def fast():
        for k in range(5):
            scheduler.sample([2], 2, 4)
            order.append(f"fast {k}")

    _run(scheduler, [slow, fast])
    assert order.index("fast 4") < order.index("slow 1"), order


def test_one_trajectorys_failure_stops_the_round_and_is_what_serve_raises():
    rollout = Echoes()
    scheduler = CallScheduler(rollout)
    gate = threading.Event()

    def fails():
        scheduler.sample([1], 1, 4)
        gate.set()
        raise KeyError("its environment broke")

    def waits():
        gate.wait()
        time.sleep(0.05)
        return scheduler.sample([2], 2, 4)

    with pytest.raises(KeyError, match="its environment broke"):
        _run(scheduler, [fails, waits])


class SlowOnFirst:
    """An environment whose trajectory ``slow`` (the row's column) takes a second per turn."""

    order: list[str] = []

    def __init__(self, prompt: str, slow: bool, name: str, **columns) -> None:
        self.slow, self.name = slow, name

    def step(self, turn):
        if self.slow:
            time.sleep(1.0)
        SlowOnFirst.order.append(f"{self.name} {turn.index}")
        return StepResult(None, 1.0, True) if turn.index + 1 >= 3 else StepResult("obs", 0.0, False)


def test_the_multi_turn_loop_schedules_each_trajectory_on_its_own(monkeypatch):
    monkeypatch.setattr(SlowOnFirst, "order", [])
    tok = _chat_tokenizer(HERMES)
    metas = [_meta("a", slow=True, name="slow"), *(_meta(c, slow=False, name=f"fast{c}") for c in "bcd")]
    rollout = Scripted(tok, lambda p: "x")
    out = _loop(tok, function=f"{__name__}:SlowOnFirst", max_turns=3).run(rollout, metas, [1, 2, 3, 4], max_new_tokens=4)
    assert out.metrics["env/turns_max"] == 3 and out.scores.tolist() == [1.0] * 4
    order = SlowOnFirst.order
    assert max(order.index(f"fast{c} 2") for c in "bcd") < order.index("slow 0"), order  # every fast one done first


class Recorded(Scripted):
    """Scripted, recording each rollout call's prompts."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.prompts: list[list[list[int]]] = []

    def sample(self, prompts, seeds, **kwargs):
        self.prompts.append([p.tolist() for p in prompts])
        return super().sample(prompts, seeds, **kwargs)


def test_lockstep_serves_a_turn_when_every_trajectory_asked_in_the_datas_order(monkeypatch):
    """``env.schedule=lockstep``: the same loop serves each turn's calls together, in the
    trajectories' order (whatever order they asked in), so the slow environment holds every fast
    trajectory at each turn and the rollout calls are fixed by the data: two runs whose
    trajectories ask in different orders make the same rollout calls."""
    tok = _chat_tokenizer(HERMES)
    metas = [_meta("a", slow=True, name="slow"), *(_meta(c, slow=False, name=f"fast{c}") for c in "bcd")]
    calls = []
    for _ in range(2):
        monkeypatch.setattr(SlowOnFirst, "order", [])
        rollout = Recorded(tok, lambda p: "x")
        loop = _loop(tok, function=f"{__name__}:SlowOnFirst", max_turns=3, schedule="lockstep")
        out = loop.run(rollout, metas, [1, 2, 3, 4], max_new_tokens=4)
        assert out.scores.tolist() == [1.0] * 4
        order = SlowOnFirst.order
        assert order.index("slow 0") < min(order.index(f"fast{c} 1") for c in "bcd"), order  # the fast ones waited
        calls.append(rollout.prompts)
    assert len(calls[0]) == 3 and calls[0] == calls[1]
    # The scheduler alone: calls asked in reverse are served in their order, once all asked.
    scheduler = CallScheduler(Echoes(), lockstep=True)
    bodies = [lambda k=k: (time.sleep(0.02 * (4 - k)), scheduler.sample([k], k, 1, order=(k,)))[1] for k in range(4)]
    _run(scheduler, bodies)
    assert scheduler.rollout.calls == [[0, 1, 2, 3]]
