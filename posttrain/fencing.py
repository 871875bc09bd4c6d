"""Calling the user's code: loading a callable by its import path or file, and calling it fenced.

User code (reward functions, environments, tools, agents) is named in the user's config, never
read from a checkpoint. It is loaded by :func:`load_callable` and called through :func:`fenced`
(one call) or :func:`fenced_each` (many, in order), which bound its time and turn anything it
raises, ``BaseException``s included (``sys.exit``), into an exception the caller judges.

A Python thread cannot be killed: a fenced call past its limit is abandoned (a daemon thread),
which is fine for a call that is merely slow and wrong for one that never returns (it keeps a
core). Code that must be stoppable runs in a process of its own (``posttrain.agents.tool_runner``).

This module imports nothing heavy (no torch), so a worker process that only loads and calls
user code starts fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence


class UserCodeError(RuntimeError):
    """The user's own code (an environment, a tool, an agent) failed the run. ``user_frame``:
    where in the user's files it was raised (:func:`user_frame`), for a message that shows that
    line instead of the library's frames around it (``posttrain.trainer_utils.run_cli``)."""

    def __init__(self, message: str, user_frame: str | None = None) -> None:
        super().__init__(message)
        self.user_frame = user_frame


def user_frame(exc: BaseException) -> str | None:
    """The innermost frame of ``exc``'s traceback in a file that is neither this project's nor a
    library's (the user's code), formatted as ``  File "...", line N, in fn`` plus its source
    line; None when every frame is the project's or a library's."""
    import sysconfig
    import traceback

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = [os.path.join(here, pkg) + os.sep for pkg in ("posttrain", "engine_api", "roles", "recipes", "backends", "tinker_server")]
    libs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not any(os.path.abspath(f.filename).startswith(p) for p in ours)
        and not any(os.path.abspath(f.filename).startswith(p) for p in libs)
        and not f.filename.startswith("<")
    ]
    if not frames:
        return None
    return "".join(traceback.format_list(frames[-1:])).rstrip()


def is_path_spec(module: str) -> bool:
    """Whether the module part of a ``module:attr`` spec is a file path (``x.py`` or with a slash)."""
    return module.endswith(".py") or os.sep in module or "/" in module


def load_callable(spec: str, key: str) -> Callable[..., object]:
    """The callable ``spec`` names: ``package.module:attr`` (imported) or ``path/to/file.py:attr``
    (the file loaded as a module under a stable name; the user's own code, named in their
    config, never anything read from a checkpoint). ``key``: the config key messages name.

    Raises:
        ValueError: the module, file or attribute cannot be found, or is not callable.
    """
    module_name, _, attr = spec.rpartition(":")
    # A stable, unique module name per file, so pickling and tracebacks name it.
    name = "enginekit_reward_" + re.sub(r"\W", "_", os.path.abspath(module_name))
    try:
        if is_path_spec(module_name):
            path = os.path.abspath(module_name)
            module = sys.modules.get(name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(name, path)
                if loader_spec is None or loader_spec.loader is None:
                    raise ImportError(f"not a Python file: {path}")
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module
                loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        sys.modules.pop(name, None)
        raise
    except BaseException as exc:  # noqa: BLE001 (user code may raise anything while importing, sys.exit included)
        sys.modules.pop(name, None)
        raise ValueError(f"{key} = {spec!r}: cannot load {module_name!r}: {exc!r}; fix: check the module or file") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key} = {spec!r}: {module_name!r} has no callable {attr!r}; fix: name a function or class defined there")
    return fn


def fenced(fn: Callable[[], object], timeout_s: float | None) -> object:
    """``fn()``, bounded by ``timeout_s`` seconds when it is not None: it then runs in a daemon
    thread that is abandoned on timeout (a thread cannot be killed; being a daemon it does not
    keep the process alive). Whatever ``fn`` raises is re-raised here, in the calling thread.

    Raises:
        FencedTimeout: ``fn`` did not return in time.
    """
    if timeout_s is None:
        return fn()
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the calling thread, which judges it)
            box["error"] = exc

    thread = threading.Thread(target=target, name="enginekit-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)  # a Ctrl-C interrupts this wait in the main thread
    if thread.is_alive():
        raise FencedTimeout
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


class FencedTimeout(Exception):
    """A fenced call ran past its time limit."""


class RowFailure(Exception):
    """Call ``index`` of :func:`_fenced_each` raised ``error`` (or timed out: a :class:`FencedTimeout`)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index, error)
        self.index, self.error = index, error


def fenced_each(calls: Sequence[Callable[[], object]], timeout_s: float | None) -> list[object]:
    """Every ``calls[i]()`` in order, each bounded by ``timeout_s`` seconds (as :func:`fenced`
    bounds one), all in one daemon thread: a thread per call cost more than a cheap reward
    function itself (measured: ~0.2 ms a call, a tenth of a tiny GRPO step). None: in the
    calling thread, unbounded.

    Raises:
        RowFailure: the first call that raised (``KeyboardInterrupt`` included) or ran past
            ``timeout_s`` (the thread is then abandoned, as :func:`fenced` does).
    """
    results: list[object] = []
    if timeout_s is None:
        for i, call in enumerate(calls):
            try:
                results.append(call())
            except BaseException as exc:  # noqa: BLE001 (judged by the caller)
                raise RowFailure(i, exc) from exc
        return results
    finished = threading.Event()
    state: dict[str, object] = {"current": (0, time.monotonic())}  # (call index, its start): one assignment, read atomically

    def target() -> None:
        try:
            for i, call in enumerate(calls):
                state["current"] = (i, time.monotonic())
                try:
                    results.append(call())
                except BaseException as exc:  # noqa: BLE001 (handed to the calling thread, which judges it)
                    state["error"] = RowFailure(i, exc)
                    return
        finally:
            finished.set()

    threading.Thread(target=target, name="enginekit-reward", daemon=True).start()
    while True:
        index, started = state["current"]  # type: ignore[misc]
        # A Ctrl-C interrupts this wait in the main thread.
        if finished.wait(max(0.0, started + timeout_s - time.monotonic())):
            break
        if state["current"] == (index, started):  # the same call is still running: past its limit
            raise RowFailure(index, FencedTimeout())
    if "error" in state:
        raise state["error"]  # type: ignore[misc]
    return results
