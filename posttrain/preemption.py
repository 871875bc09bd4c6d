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
"""

from __future__ import annotations

import signal
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
