"""The test process's helper processes end with it, however it ends.

A test process that forks ranks and scripts from multiprocessing's forkserver
(``tests.support.launch.mp_context``) also starts the server itself and multiprocessing's
resource tracker. The server exits when every holder of its "alive" pipe is gone, and every
process it forked holds one; the tracker exits when every holder of its pipe is gone, and the
server and its children hold one. So a rank or a forked script still running when the test
process stops (Ctrl-C of ``make test``: pytest-xdist's workers are killed, no ``atexit`` runs;
the ranks and scripts lead sessions of their own, so the terminal's SIGINT never reaches them)
kept the server, the tracker and itself alive: found after interrupted runs.

Three pieces, each for a path by which the test process can end:

* the server dies with the test process: this module is the server's first preload
  (:data:`PRELOAD`), and imported there it asks the kernel for SIGKILL when its parent dies
  (Linux ``prctl(PR_SET_PDEATHSIG)``), and for the same in every process the server forks the
  moment it is forked (an ``os.register_at_fork`` hook: worlds' ranks, forked scripts, the
  conformance kit's ranks), so they die with the server. Nothing else then holds the tracker's
  pipe, and it exits by itself (after unlinking what the dead processes leaked);
* ``spawn`` ranks and scripts (a machine with CUDA) call :func:`die_with_parent` themselves;
* a normal exit or an interrupt that runs ``atexit``: :func:`stop_forkserver` (registered by
  :func:`install`, which ``tests/conftest.py`` and ``launch.mp_context`` call) kills the server
  after the worlds are closed (their sessions killed), and ``forked.run_forked`` kills its
  scripts' sessions when it is interrupted.

What is left to chance: helpers a rank or script started itself (a checkpoint writer, a vLLM
engine process) when the test process is killed without ``atexit``; they lose their parent and
end by their own means. ``tests/support/test_reaper.py`` interrupts a ``pytest -n 2`` run and
finds no process of it left.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import sys
from multiprocessing import util as mp_util

#: the forkserver preload entry that arms the server (``launch.mp_context`` puts it first)
PRELOAD = __name__
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Set in the forkserver only: the pid whose children the fork hook arms (a child clears it, so
# the processes a rank forks are not tied to the rank by this module).
_server_pid: int | None = None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that started it ends
    (``prctl(PR_SET_PDEATHSIG)``; not inherited by children, kept across ``exec``). Returns
    False where there is no such call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _in_forkserver_preload() -> bool:
    """Whether this import runs inside multiprocessing's forkserver, preloading its modules."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is mp_forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _arm_server() -> None:
    """In the forkserver: die with the test process, and make each child die with the server."""
    global _server_pid
    _server_pid = os.getpid()
    # (A test process that died before this line leaves the server no "alive" pipe holder: it
    # exits on its own as soon as it starts serving.)
    die_with_parent()
    os.register_at_fork(after_in_child=_forked_by_server)


def _forked_by_server() -> None:
    global _server_pid
    server, _server_pid = _server_pid, None
    if server is None:
        return
    if die_with_parent() and os.getppid() != server:
        os.kill(os.getpid(), signal.SIGKILL)  # the server died between the fork and the line above


def install() -> None:
    """In the test process: make the forkserver, if it has not started, preload this module
    first, and register :func:`stop_forkserver` at exit (once). Registered before any world
    exists, it runs after the worlds are closed (``atexit`` runs last-registered first) and
    before multiprocessing's own hook (registered when this module imported it), which would
    wait for its children."""
    global _installed
    server = getattr(mp_forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is None:
        have = [m for m in getattr(server, "_preload_modules", []) if m not in ("__main__", PRELOAD)]
        server.set_forkserver_preload([PRELOAD, *have])
    if not _installed:
        atexit.register(stop_forkserver)
        _installed = True


_installed = False


def stop_forkserver() -> None:
    """Kill this process's forkserver, if it started one (an ``atexit`` hook: by then the worlds
    are closed; a child still running dies with the server). A later fork request starts a new one."""
    server = getattr(mp_forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    address = server._forkserver_address
    if address is not None and not mp_util.is_abstract_socket_namespace(address):
        try:
            os.unlink(address)
        except FileNotFoundError:
            pass
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None


if _in_forkserver_preload():
    _arm_server()
