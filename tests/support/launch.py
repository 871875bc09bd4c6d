"""Start ranks for tests, both ways the suite needs, with one environment and one port helper.

In-process functions on spawned ranks (:func:`run_distributed`):

* Rendezvous through a fresh ``file://`` in a temporary directory, so concurrent tests never
  collide on a port.
* A rank that raises sends its traceback to the parent, which re-raises it as
  :class:`RankError` naming the rank; a rank that dies without a word (segfault, kill) is
  reported by exit code.
* On the first failure, or when ``timeout`` expires, every remaining rank is killed with the
  processes it started, so a rank stuck in a collective never hangs the suite; ranks that
  reported get time to exit cleanly first (their helper processes shut down with them).
* ``start_method="forkserver"`` forks ranks from a server process that has imported torch,
  transformers and both backends once (:data:`FORKSERVER_PRELOAD`): a rank starts in about a
  second instead of 5-10 s of imports. The ranks are still fresh processes as far as training
  state goes (the server only imported modules: no engine, process group or RNG use).

Scripts the way users start them (:func:`python`, :func:`torchrun`, :func:`run_script`,
:func:`torchrun_nodes`): plain ``python``, ``torchrun`` with one agent, or several torchrun
agents that rendezvous like the nodes of a multi-node job (c10d on localhost).

Both get their environment from :func:`launch_env`, so a rank sees the same variables however it
was started.
"""

from __future__ import annotations

import multiprocessing.forkserver as mp_forkserver
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from tests.support import costs, reaper

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Set by launchers; a test process may carry them (e.g. from a fixture's own group), and a
# launched process must see only the ones its own launcher sets.
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# A launched job's collective timeout: a hung rank fails in 2 minutes, not torch's 30.
DIST_TIMEOUT_S = "120"

# After one rank fails, the others get this long to report their own error before being killed.
_GRACE_S = 5.0
# After every rank reported, they get this long to exit by themselves before being killed.
_EXIT_S = 30.0
# What the forkserver imports before forking ranks (a module that fails to import is skipped).
FORKSERVER_PRELOAD = [
    "tests.support.hf_utils",
    "backends.fsdp",
    "backends.megatron",
    "torch.distributed.checkpoint",
    "recipes.ppo",
    "recipes.sft",
    "engine_api.conformance.checks",
    "tests.reference_engine",
    "backends.rollout.vllm",  # with vllm itself (5 s of imports); skipped where vllm is not installed
]


# ----------------------------------------------------------------------------- shared pieces
def launch_env(**extra: str) -> dict:
    """The environment of a launched process or rank: this process's, without launcher
    variables, with the repo importable, one OpenMP thread (several ranks share a small
    machine), :data:`DIST_TIMEOUT_S` as ``$ENGINEKIT_DIST_TIMEOUT_S``; ``extra`` wins over all.

    A spawned rank has imported torch before it applies this, so its own intra-op thread count
    is unchanged (workers call ``torch.set_num_threads``); processes it starts get one thread.
    """
    out = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out.update({"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "ENGINEKIT_DIST_TIMEOUT_S": DIST_TIMEOUT_S, **extra})
    return out


def free_port() -> int:
    """A TCP port free on localhost right now (for a c10d rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- functions on ranks
def mp_context(start_method: str = "spawn"):
    """The multiprocessing context for ranks; the forkserver preloads :data:`FORKSERVER_PRELOAD`.

    On a machine with CUDA every request is answered with ``spawn``: a process forked from one
    that has touched CUDA cannot use it (``Cannot re-initialize CUDA in forked subprocess``),
    and the forkserver is such a process there (its preloads probe the device while importing;
    torch marks any child forked after ``torch.cuda.device_count()`` as unusable). Without CUDA
    (CI) nothing can be poisoned, and ranks keep starting from the preloaded server.
    """
    start_method = start_method_for(start_method)
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # One server per process, shared with the conformance kit's launcher: add to what it
        # will preload while it has not started (once started, its list is fixed). The reaper
        # goes first: it ties the server, and every process it forks, to this process's life.
        reaper.install()
        server = getattr(mp_forkserver, "_forkserver", None)
        if server is not None and getattr(server, "_forkserver_pid", None) is None:
            have = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
            ctx.set_forkserver_preload(have + [m for m in FORKSERVER_PRELOAD if m not in have])
    return ctx


def start_method_for(start_method: str) -> str:
    """``start_method``, or ``spawn`` in its place where CUDA is available (see :func:`mp_context`)."""
    import torch

    if start_method in ("fork", "forkserver") and torch.cuda.is_available():
        return "spawn"
    return start_method


class RankError(RuntimeError):
    """A rank raised, died, or the group timed out."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict | None = None,
    fresh: bool = False,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (a module-level function) and its arguments and return value
    picklable. ``torch.distributed`` is initialised in each rank before ``fn`` runs. Each
    rank's environment is :func:`launch_env` with ``env`` added, plus its ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK``.

    By default ``fn`` runs in the long-lived world of ``world_size`` ranks
    (:mod:`tests.support.worlds`: started once per test process, process state reset between
    tasks). ``fresh=True`` starts new ranks for this call and destroys them after, for tests
    whose subject is the process itself (start-up, exit, signals, a dead rank, what is read
    from the environment at import or ``init_process_group``); ``start_method``: ``forkserver``
    (ranks forked from the preloaded server) or ``spawn`` (new interpreters).

    Raises:
        RankError: with the failing rank's traceback, or which ranks hung on timeout.
    """
    if not fresh:
        from tests.support import worlds

        return worlds.run_in_world(fn, world_size, *args, env=launch_env(**(env or {})), timeout=timeout)
    rank_env = launch_env(**(env or {}))
    ctx = mp_context(start_method)
    results: mp.Queue = ctx.Queue()
    with costs.timed(f"new ranks ({start_method}, fresh=True)"), tempfile.TemporaryDirectory(prefix="ek_rdzv_") as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            # Not daemonic, like torchrun's ranks: megatron's checkpoint writer starts helper
            # processes, which daemons may not. The finally below kills every rank regardless.
            ctx.Process(target=_worker, args=(fn, rank, world_size, init_method, results, args, rank_env), daemon=False)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        finished = False
        try:
            out = _collect(procs, results, world_size, timeout)
            finished = True
            return out
        finally:
            _stop(procs, wait_s=_EXIT_S if finished else 0.0)


def _stop(procs: list, wait_s: float) -> None:
    """Let ranks that reported exit by themselves for up to ``wait_s`` (their exit runs the
    finalizers that stop helper processes, e.g. the queue manager megatron's checkpoint writer
    spawns; killing a rank right after it reported left those behind, ~270 MB each), then
    SIGKILL what is left, with its helpers: each rank leads its own process group."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.join(timeout=10)


def _collect(procs: list, results: mp.Queue, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(outputs) + len(errors) < world_size:
        now = time.monotonic()
        if now > deadline:
            missing = sorted(set(range(world_size)) - set(outputs) - set(errors))
            raise RankError(f"ranks {missing} did not finish within {timeout:.0f}s (killed)" + _fmt(errors))
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in outputs and rank not in errors and p.exitcode not in (None, 0):
                    errors[rank] = f"rank {rank} died with exit code {p.exitcode} before reporting"
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            continue
        if ok:
            outputs[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    if errors:
        raise RankError(_fmt(errors))
    return [outputs[r] for r in range(world_size)]


def _fmt(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))


def _worker(fn, rank, world_size, init_method, results, args, rank_env) -> None:
    import torch.distributed as dist

    os.setsid()  # a process group of its own, so _stop can kill the helpers a rank starts too
    reaper.die_with_parent()  # a spawned rank (a forkserver's child already is): never outlive the test process
    # The launcher variables a forkserver may carry must not reach the rank; whatever its
    # preloaded imports set is kept (they ran once, in the server).
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    os.environ.update(rank_env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        # Plain pickle bytes, not torch's shared-memory reductions: a shared tensor's file
        # descriptor disappears when this process exits before the parent reads it.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- scripts
def python(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` (one process, no launcher) in the repo, output captured;
    ``env`` adds to :func:`launch_env`."""
    with costs.timed("new interpreters (python, torchrun)"):
        return subprocess.run(
            [sys.executable, *args], cwd=REPO, env=launch_env(**(env or {})), capture_output=True, text=True, timeout=timeout
        )


def torchrun(args: list[str], nproc: int, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC ARGS`` (one agent); ``env`` adds to :func:`launch_env`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    with costs.timed("new interpreters (python, torchrun)"):
        return subprocess.run(cmd, cwd=REPO, env=launch_env(**(env or {})), capture_output=True, text=True, timeout=timeout)


def run_script(
    args: list[str], nproc: int = 1, timeout: float = 300, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """``ARGS`` on ``nproc`` processes, one with no launcher (a user's plain run), more with
    torchrun's variables. By default in processes forked from the preloaded server
    (:mod:`tests.support.forked`: the same run without 5-10 s of imports per process);
    ``fresh=True``: :func:`python` for one, :func:`torchrun` for more, for tests whose subject
    is the interpreter or the launcher (start-up, import-time output, torchrun itself)."""
    if not fresh:
        from tests.support.forked import run_forked

        return run_forked(args, nproc=nproc, timeout=timeout, env=env)
    if nproc == 1:
        return python(args, timeout=timeout, env=env)
    return torchrun(args, nproc=nproc, timeout=timeout, env=env)


def torchrun_nodes(args: list[str], nnodes: int, timeout: float = 300, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """``nnodes`` torchrun agents, one process each, started as the nodes of one job:
    ``--nnodes N --node-rank i --rdzv-backend c10d --rdzv-endpoint localhost:PORT``."""
    port, job = free_port(), uuid.uuid4().hex[:8]
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{port}",
            f"--rdzv-id={job}",
            *args,
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=launch_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    done = []
    start = time.monotonic()
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        costs.record("new interpreters (python, torchrun)", time.monotonic() - start)
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done
