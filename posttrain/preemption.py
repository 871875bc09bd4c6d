"""Stopping a run at a step boundary when the job is told to stop (SIGTERM: a scheduler
preempting or cancelling the job, torchrun passing its own SIGTERM on; SIGINT: Ctrl-C).

The signal handler only records the signal: the step in flight finishes (a collective or an
optimizer step is never cut in half), then every rank agrees at the step boundary
(:meth:`PreemptionGuard.stop_requested`, one max-all-reduce of a flag, so a signal that reached
one rank stops them all at the same step), the recipe saves a checkpoint of that step and
raises :class:`Preempted`. Its ``exit_code`` is ``128 + signal`` (143 for SIGTERM, 130 for
SIGINT), the shell's convention for "ended by a signal": a job system must not take a
preempted run for a finished one (a Kubernetes Job whose pod exits 0 is complete and never
restarted). A second SIGINT interrupts at once (the usual Ctrl-C Ctrl-C); a second SIGTERM is
only recorded again.

Under torchrun, the agent forwards its SIGTERM to every worker and kills them 30 s later
(``torch.distributed.elastic``): the step in flight plus the save must fit in that window.

Before the first step (the engines being built: minutes with vLLM, which may also compile
kernels) there is nothing to save: :func:`stop_while_starting` turns a signal there into a
one-line reason and exit ``128 + signal`` instead of whatever the library in progress makes of
it (vLLM's crash dump when its compiler child is killed).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from types import FrameType

import torch

from engine_api.dist import all_reduce, comm_device, is_initialized

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped early on a signal, after saving the checkpoint of ``step``.

    Attributes:
        signum: the signal received (the lowest one any rank received).
        step: the last completed step, which the checkpoint holds.
        checkpoint: where it was saved.
    """

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"{signal.Signals(signum).name} received: stopped after step {step}; checkpoint saved to {checkpoint}. "
            "Continue with trainer.resume=true (same trainer.output_dir)"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class PreemptionGuard:
    """A context manager that records SIGTERM / SIGINT while the training loop runs and puts
    the previous handlers back when it exits.

    Handlers can only be installed from the main thread; elsewhere (a recipe run from a worker
    thread) the guard records nothing and the signals keep their previous handlers.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the save
        self.received = signum
        print(f"\n{signal.Signals(signum).name} received: stopping after this step and saving a checkpoint", flush=True)

    def stop_requested(self) -> int | None:
        """The signal to stop on, agreed by every rank (call it on every rank at the same step
        boundary); None: go on. With several signals across ranks the lowest number wins."""
        local = self.received or 0
        if not is_initialized():
            return local or None
        # Max of (a large number - signum) picks the lowest signal any rank got; 0 means none.
        flag = torch.tensor([1000 - local if local else 0], dtype=torch.int64, device=comm_device(None))
        agreed = int(all_reduce(flag, "max", None).item())
        return 1000 - agreed if agreed else None


@contextlib.contextmanager
def stop_while_starting(what: str):
    """While the block runs (``what``: e.g. "building the engines"), SIGTERM / SIGINT end the
    run at once: one line on stderr saying why, then ``SystemExit(128 + signal)`` raised in the
    main thread, so ``finally`` blocks still tear down what was started. Nothing has been
    trained, so nothing is saved. Off the main thread it does nothing (handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        print(
            f"{signal.Signals(signum).name} received while {what} (before the first step): nothing trained, nothing to save; exiting",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
