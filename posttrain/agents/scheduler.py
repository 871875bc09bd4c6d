"""Per-trajectory scheduling: every trajectory asks for its next model call when it is ready, and
the rollout serves whatever calls are waiting, together (docs/agents.md).

A multi-turn rollout is many trajectories, each alternating a model call with the environment's
(or an external agent's) answer. Run in lock-step, every trajectory waits at each turn for the
slowest one's tool or environment. Here each trajectory runs on its own (a thread in this
process, or an HTTP session of an external agent) and submits its call to :class:`CallScheduler`,
which hands every waiting call to the rollout in one call per distinct length cap and stop set as
soon as the engine is free: a call waits at most for the rollout call before it, never for
another trajectory's tools. With an environment that answers at once, every trajectory's call
arrives together and a call is exactly the lock-step batch.

What a trajectory samples depends on its prompt, its seed and its length cap, and, at float
rounding, on which calls share its rollout call: the rollout contract draws each sample from its
own seed, but an engine's matmuls round a row differently with the number of rows beside it and
its place among them (the ``hf`` backend on CPU: log-probs differ by up to about 5e-7 between a
row served alone and in a block; measured, ``docs/agents.md``). Served per trajectory, which calls
share a rollout call depends on timing, so two runs sample the same tokens (unless a draw falls
within that rounding of a boundary of the sampling distribution) with log-probs equal to about
1e-6. ``lockstep=True`` serves a round's calls only when every running trajectory waits, sorted by
their ``order``: the composition is fixed by the data, reruns and resumes are bit-identical, and
every trajectory waits at each turn for the slowest (``env.schedule``).

Ranks: the trajectories and the scheduler run on rank 0; every rollout call is collective, so
rank 0 broadcasts each call (prompts, seeds, cap, stops) and the other ranks, in
:meth:`CallScheduler.follow`, make the same calls until rank 0 says the round is over (or that it
failed: then every rank raises).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine_api.dist import comm_device, is_initialized
from engine_api.rollout import Sample


@dataclass
class _Call:
    prompt: list[int]
    seed: int
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    order: tuple = ()
    done: threading.Event = field(default_factory=threading.Event)
    sample: Sample | None = None
    error: BaseException | None = None


class _CollectiveFailed(Exception):
    """A rollout call raised: on every rank alike (the rollout role agrees on failures)."""


class RoundFailed(RuntimeError):
    """The round stopped (a rollout call or a trajectory failed); a waiting call gets this."""


class CallScheduler:
    """Serves the model calls of concurrently running trajectories through one rollout role
    (module docstring).

    Args:
        rollout: the ``Rollout`` role (or its Ray stand-in): ``sample(prompts, seeds,
            max_new_tokens=, stop=)``.
        window_s: how long after the latest call arrived to wait for more before serving (at
            most 20 windows in all), unless every running trajectory is already waiting (then
            at once).
        lockstep: serve only when every running trajectory waits (module docstring).
    """

    def __init__(self, rollout, window_s: float = 0.0005, lockstep: bool = False) -> None:
        self.rollout, self.window_s, self.lockstep = rollout, window_s, lockstep
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._running = 0  # trajectories that may still submit a call in this round
        self._failed: BaseException | None = None
        self.calls = 0  # rollout calls made (for metrics and tests)
        self.largest = 0  # the most model calls served by one rollout call

    # ------------------------------------------------------------------ trajectory side
    def started(self, count: int = 1) -> None:
        """``count`` trajectories begin running (they may submit calls)."""
        with self._cond:
            self._running += count

    def ended(self, count: int = 1) -> None:
        """``count`` trajectories will submit no more calls this round (finished, or out of budget)."""
        with self._cond:
            self._running -= count
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """A trajectory failed in a way that stops the run: the round ends with ``error``."""
        with self._cond:
            if self._failed is None:
                self._failed = error
            self._cond.notify_all()

    def sample(self, prompt: Sequence[int], seed: int, max_new_tokens: int, stop: Sequence[str] = (), order: tuple = ()) -> Sample:
        """The next model call of a running trajectory: blocks until the rollout has served it.
        ``order``: where the call goes among those served with it (the trajectory's place in
        the data), so a composition fixed by the data is one call fixed too.

        Raises:
            RoundFailed: the round stopped before it was served.
        """
        call = _Call([int(t) for t in prompt], int(seed), int(max_new_tokens), tuple(stop), tuple(order))
        with self._cond:
            if self._failed is not None:
                raise RoundFailed(f"the round stopped: {self._failed}")
            self._pending.append(call)
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise RoundFailed(f"the round stopped: {call.error}") from call.error
        return call.sample

    # ------------------------------------------------------------------ serving side
    def serve(self) -> None:
        """Rank 0 (or the only rank): serve calls until no trajectory is running. Collective: the
        other ranks are in :meth:`follow`.

        Raises:
            BaseException: what failed the round (a trajectory's error passed to :meth:`fail`, or
                the rollout's), after every waiting call was released and the other ranks told.
        """
        batch: list[_Call] = []
        try:
            while True:
                batch = self._next_batch() or []
                if not batch:
                    break
                self._serve(batch)
        except _CollectiveFailed as exc:  # every rank raised in the same rollout call: nothing to tell them
            self._release(exc.__cause__, batch)
            raise exc.__cause__ from None
        except BaseException as exc:
            self._release(exc, batch)
            self._broadcast(("failed", f"{type(exc).__name__}: {exc}"))
            raise
        self._broadcast(("done",))

    def follow(self) -> None:
        """Ranks other than 0: make every rollout call rank 0 makes until its round ends.

        Raises:
            RuntimeError: rank 0's round failed.
        """
        while True:
            message = self._broadcast(None)
            if message[0] == "done":
                return
            if message[0] == "failed":
                raise RuntimeError(f"the multi-turn rollout failed on rank 0 ({message[1]}); this rank stops too")
            _, prompts, seeds, amount, stop = message
            self._sample([torch.tensor(p, dtype=torch.long) for p in prompts], seeds, amount, stop)

    # ------------------------------------------------------------------ internals
    def _next_batch(self) -> list[_Call] | None:
        with self._cond:
            while not self._pending and self._running > 0 and self._failed is None:
                self._cond.wait()
            if self._failed is not None:
                raise self._failed
            if not self._pending:
                return None
            if self.lockstep:  # every running trajectory's call, whatever the wait
                while len(self._pending) < self._running and self._failed is None:
                    self._cond.wait()
                if self._failed is not None:
                    raise self._failed
                batch, self._pending = self._pending, []
                return batch
            # Calls arriving in a burst (every trajectory starting a round, or answered at once)
            # are served together: wait while they keep coming, ``window_s`` after the last one
            # (at most ``20 * window_s`` in all), unless every running trajectory already waits.
            began = time.monotonic()
            seen, last = len(self._pending), began
            while len(self._pending) < self._running and self._failed is None:
                now = time.monotonic()
                if len(self._pending) > seen:
                    seen, last = len(self._pending), now
                left = min(last + self.window_s, began + 20 * self.window_s) - now
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._pending = self._pending, []
            return batch

    def _serve(self, batch: list[_Call]) -> None:
        groups: dict[tuple[int, tuple[str, ...]], list[_Call]] = {}
        for call in sorted(batch, key=lambda c: c.order):
            groups.setdefault((call.max_new_tokens, call.stop), []).append(call)
        for (amount, stop), calls in sorted(groups.items()):
            message = ("sample", [c.prompt for c in calls], [c.seed for c in calls], amount, list(stop))
            self._broadcast(message)
            try:
                samples = self._sample([torch.tensor(c.prompt, dtype=torch.long) for c in calls], message[2], amount, stop)
            except BaseException as exc:
                raise _CollectiveFailed() from exc
            self.calls += 1
            self.largest = max(self.largest, len(calls))
            for call, s in zip(calls, samples, strict=True):
                call.sample = s
                call.done.set()

    def _sample(self, prompts: list[torch.Tensor], seeds: list[int], amount: int, stop) -> list[Sample]:
        extra = {"stop": tuple(stop)} if stop else {}
        return self.rollout.sample(prompts, seeds, max_new_tokens=amount, **extra)

    def _release(self, error: BaseException, in_flight: list[_Call]) -> None:
        """Every call waiting or in flight gets ``error`` (its trajectory stops)."""
        with self._cond:
            if self._failed is None:
                self._failed = error
            waiting, self._pending = self._pending, []
            self._cond.notify_all()
        for call in [*in_flight, *waiting]:
            if not call.done.is_set():
                call.error = error
                call.done.set()

    @staticmethod
    def _broadcast(message):
        """Rank 0's ``message`` on every rank (a no-op on one rank)."""
        if not is_initialized() or dist.get_world_size() == 1:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0, device=comm_device(None))
        return box[0]
