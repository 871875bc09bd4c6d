"""Where the suite's time goes, by kind of fixed cost: the helpers that start worlds, forked
scripts, real processes, vLLM engines and Ray instances record their wall time here, and
``tests/support/timing.py`` adds it up per kind at the end of the run (also across pytest-xdist
workers: each test's share travels in its report's ``user_properties``)."""

from __future__ import annotations

import time
from contextlib import contextmanager

_pending: dict[str, float] = {}


def record(kind: str, seconds: float) -> None:
    """Add ``seconds`` of wall time to ``kind`` for the test running now."""
    _pending[kind] = _pending.get(kind, 0.0) + seconds


@contextmanager
def timed(kind: str):
    """Record the wall time of the ``with`` body under ``kind``."""
    start = time.monotonic()
    try:
        yield
    finally:
        record(kind, time.monotonic() - start)


def take() -> dict[str, float]:
    """What was recorded since the last call (and forget it)."""
    out = dict(_pending)
    _pending.clear()
    return out
