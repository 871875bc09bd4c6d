"""Worker processes that run user code one request at a time, each stoppable (killed with its
children) past a time limit, for the callers that cannot trust user code to return: tool calls
(``posttrain.agents.tool_runner``) and agent functions (``posttrain.gateway.agents``).

A worker is ``python -m <module>`` in a session (process group) of its own, importing what this
process imports (its ``sys.path``); it reads one JSON request per line on stdin and writes one
JSON answer per line on a protocol pipe (:func:`serve`, with the module's own ``answer``: e.g.
``posttrain.agents.tool_worker``). :class:`WorkerPool` hands idle workers out one per call and
replaces one that timed out (killed) or died. Workers are started by one long-lived thread, so a
worker's ``PR_SET_PDEATHSIG`` (which follows the thread that started it) fires when this process
ends, not when a round's thread does. A worker's stderr goes where the pool says (a log file of
the run, or this process's stderr).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what it started too
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Timeout:
    """The answer of a call past its time (its worker was killed)."""


class Exited:
    """The answer of a call whose worker ended (``code``: its exit status)."""

    def __init__(self, code: int | None) -> None:
        self.code = code


class WorkerPool:
    """Workers of ``python -m module`` (module docstring).

    Args:
        module: the worker's module (it speaks the line-JSON protocol).
        stderr: where the workers' stderr goes (a file object; None: this process's).
        name: how errors name the pool (``tool``, ``agent``).
    """

    def __init__(self, module: str, stderr: IO | None = None, name: str = "worker") -> None:
        self.module, self.stderr, self.name = module, stderr, name
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._requests: queue.Queue = queue.Queue()
        self._closed = False
        self._spawner: threading.Thread | None = None

    def call(self, request: dict[str, Any], limit: float | None) -> dict[str, Any] | Timeout | Exited:
        """``request`` to an idle worker; its JSON answer, :class:`Timeout` (past ``limit``
        seconds: the worker was killed, with its children) or :class:`Exited` (it died)."""
        worker = self._take()
        try:
            worker.proc.stdin.write((json.dumps(request) + "\n").encode())
            worker.proc.stdin.flush()
            ready = select.select([worker.proc.stdout], [], [], limit)[0] if limit is not None else [worker.proc.stdout]
            line = worker.proc.stdout.readline() if ready else None
        except (BrokenPipeError, OSError, ValueError):
            line = b""
        if line is None:  # past its time: stopped, and replaced by a fresh worker on the next call
            self._drop(worker)
            return Timeout()
        if not line:
            try:
                code = worker.proc.wait(timeout=5)  # it closed its pipe: reap it for its status
            except subprocess.TimeoutExpired:
                code = None
            self._drop(worker)
            return Exited(code)
        self._give_back(worker)
        return json.loads(line)

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = self._all, [], []
        for w in workers:
            w.kill()
        if self._spawner is not None:
            self._requests.put(None)

    # ------------------------------------------------------------------ internals
    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} pool is closed")
            while self._idle:
                w = self._idle.pop()
                if w.alive():
                    return w
                self._all.remove(w)
            if self._spawner is None:
                self._spawner = threading.Thread(target=self._spawn_loop, name=f"enginekit-{self.name}-spawner", daemon=True)
                self._spawner.start()
        box: queue.Queue = queue.Queue()
        self._requests.put(box)
        worker = box.get()
        if isinstance(worker, BaseException):
            raise worker
        with self._lock:
            self._all.append(worker)
            if self._closed:
                worker.kill()
                raise RuntimeError(f"the {self.name} pool is closed")
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)

    def _spawn_loop(self) -> None:
        while True:
            box = self._requests.get()
            if box is None:
                return
            try:
                box.put(_Worker(start_worker(self.module, self.stderr)))
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                box.put(exc)


def start_worker(module: str, stderr: IO | None = None) -> subprocess.Popen:
    """A new ``python -m module`` process that imports what this process imports (its
    ``sys.path``), in a process group of its own (a timeout kills its children too)."""
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if os.path.isdir(p)))
    return subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        start_new_session=True,
    )


# ---------------------------------------------------------------------------------- the worker's side
def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent goes (best effort elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(answer: Callable[[dict, dict], dict]) -> None:
    """A worker's main loop: ``answer(request, cache)`` per JSON line of stdin, each answer a JSON
    line on the protocol pipe (a duplicate of file descriptor 1, which then points at stderr, so
    what user code prints, C code included, cannot corrupt the protocol); ``cache`` lives as long
    as the worker. Dies with its parent; SIGINT is the parent's to handle."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="surrogatepass")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    cache: dict = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        out = answer(json.loads(line), cache)
        sys.stderr.flush()  # what user code printed lands before its answer
        protocol.write(json.dumps(out) + "\n")
        protocol.flush()
