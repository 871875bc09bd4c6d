"""Run a script (``-m module``, ``path.py`` or ``-c code``) the way ``python`` / ``torchrun``
would, in processes forked from the preloaded forkserver instead of new interpreters.

A new interpreter spends 5-9 CPU-seconds importing torch, tensordict, transformers, megatron-core
and the recipes before the script's first line; a recipe test that takes 3 short steps is mostly
that. Forked from a server that imported them once, a run starts in well under a second and is
otherwise a new process like any other: its own pid and session, ``sys.argv``, ``os.environ``
(exactly :func:`launch.launch_env` plus ``env``), working directory (the repo), stdout/stderr
(captured to files), ``__main__`` module, exit code (``SystemExit``, an uncaught exception's 1,
a signal's negative number), non-daemon threads joined and ``atexit`` handlers run at exit.

What differs from ``python -m``, and which tests therefore use real interpreters
(:func:`launch.python`, :func:`launch.torchrun`): modules the server preloaded were imported
before the script's environment was applied (a variable read at import time, e.g. by
transformers' logging setup, keeps the server's value), and what they print while importing
went to the server's console, not the script's (the recipes' "no library noise on the
console" checks run in real processes: ``tests/recipes/test_ppo.py::test_same_roles_on_fsdp_and_megatron``). Several ranks
(``nproc > 1``) get the variables torchrun gives its workers (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and, like torchrun's
agent, a failed rank stops the others; their outputs are joined in rank order, and the return
code is 0 when every rank exits 0, else 1 (torchrun's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

from tests.support import costs, reaper
from tests.support.launch import REPO, free_port, launch_env, mp_context

# After one rank fails, the others get this long to stop by themselves (torchrun's agent sends
# SIGTERM, then SIGKILL).
_STOP_S = 10.0


def run_forked(args: list[str], nproc: int = 1, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` (``nproc == 1``) or ``torchrun --nproc-per-node NPROC ARGS`` in forked
    processes; returns what :func:`subprocess.run` would (``stdout``/``stderr`` as text).

    Raises:
        subprocess.TimeoutExpired: the run outlived ``timeout`` (every rank is killed first).
    """
    base = launch_env(**(env or {}))
    port = free_port() if nproc > 1 else None
    ctx = mp_context("forkserver")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ek_forked_") as tmp:
        procs, outs = [], []
        for rank in range(nproc):
            rank_env = dict(base)
            if nproc > 1:
                rank_env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                    GROUP_RANK="0",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            out, err = os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")
            proc = ctx.Process(target=_child, args=(list(args), rank_env, out, err), daemon=False)
            proc.start()
            procs.append(proc)
            outs.append((out, err))
        try:
            codes = _wait(procs, start + timeout)
        except subprocess.TimeoutExpired:
            _kill(procs)
            raise subprocess.TimeoutExpired(["(forked)", *args], timeout, *_read(outs)) from None
        except BaseException:  # interrupted (Ctrl-C): the scripts lead sessions the terminal's SIGINT misses
            _kill(procs)
            raise
        finally:
            costs.record("forked scripts", time.monotonic() - start)
        stdout, stderr = _read(outs)
    code = codes[0] if nproc == 1 else (0 if all(c == 0 for c in codes) else 1)
    return subprocess.CompletedProcess(["(forked)", *args], code, stdout, stderr)


def _wait(procs: list, deadline: float) -> list[int]:
    stop_at = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            return codes
        if stop_at is None and any(c not in (None, 0) for c in codes):
            # torchrun's agent: one worker failed, so the others are told to stop, then killed
            for p in procs:
                if p.exitcode is None:
                    _signal(p, signal.SIGTERM)
            stop_at = time.monotonic() + _STOP_S
        if stop_at is not None and time.monotonic() > stop_at:
            _kill(procs)
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("(forked)", 0)
        time.sleep(0.05)


def _signal(proc, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _kill(procs: list) -> None:
    for p in procs:
        if p.exitcode is None:
            _signal(p, signal.SIGKILL)
    for p in procs:
        p.join(timeout=10)


def _read(outs: list[tuple[str, str]]) -> tuple[str, str]:
    def text(path: str) -> str:
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    return "".join(text(o) for o, _ in outs), "".join(text(e) for _, e in outs)


def _child(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The forked process: become ``python ARGS`` and never return to multiprocessing."""
    import atexit
    import io
    import runpy
    import sys
    import threading
    import traceback

    os.setsid()
    reaper.die_with_parent()  # a spawned script (a forkserver's child already is): never outlive the test process
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # Fresh text streams over the redirected descriptors, buffered as python buffers them on a
    # file (stderr line-buffered with backslash escapes), and an empty stdin.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    threads = env.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))  # what the variable gives a new interpreter
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            # As in a new interpreter, where `python -m pkg.mod` has not imported pkg.mod: the
            # server's copy is dropped (runpy would warn about it and run the module anyway).
            package, _, leaf = args[1].rpartition(".")
            if sys.modules.pop(args[1], None) is not None and package in sys.modules:
                vars(sys.modules[package]).pop(leaf, None)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 - the test's own code
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    # The interpreter's exit: join non-daemon threads, run atexit handlers, flush.
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - nothing left to report it to
                pass
    if code < 0:  # died of SIGINT, as python does after an uncaught KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=__import__("sys").stderr)
    return 1
