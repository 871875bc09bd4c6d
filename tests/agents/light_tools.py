"""Tools for the agent tests, in a module that imports nothing heavy: the tool worker processes
(``posttrain.agents.tool_worker``) import it by path, and a module importing torch would cost
each worker seconds."""

from __future__ import annotations

import os
import time


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def spin(seconds: float) -> str:
    """Burn CPU for a while, holding the GIL in one long C call when ``seconds`` is large.

    Args:
        seconds: how long.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "spun"


def hold_gil(digits: int) -> str:
    """One C call that holds the GIL for as long as the power takes (no bytecode boundary for a
    thread switch or a timeout check in between).

    Args:
        digits: the exponent.
    """
    return str(len(str(7**digits)))


def pid() -> int:
    """The process the tool runs in."""
    return os.getpid()


def huge(size: int) -> str:
    """A result of ``size`` characters.

    Args:
        size: characters.
    """
    return "x" * size


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def unprintable() -> object:
    """A result whose ``str`` raises."""
    return _Unprintable()


def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "slept"
