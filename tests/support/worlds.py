"""Long-lived gloo worlds: N rank processes started once per test process and reused by every
test that runs a function on N ranks (the way PyTorch's continuous multi-process test base
keeps its world between test functions).

Starting a world costs a fork per rank from the preloaded forkserver and one rendezvous; a
test that runs its body in an existing world pays neither, only a round trip over a pipe. What
a test body may assume about its ranks is what a fresh process gives, restored between tasks
(:func:`_reset`):

* the torch, Python and NumPy RNG states of a fresh rank, the default dtype, grad mode, the
  intra-op thread count, ``os.environ`` (plus the task's ``env`` for the task's duration), the
  working directory and the warning filters;
* no process group but the world's own default group: every group a task created (engines'
  device meshes, megatron's parallel groups) is destroyed after it, megatron's parallel state
  and global buffers are torn down and its CPU compat layer is released.

A world that fails a task in any way (a rank raised, died, or outlived the timeout) is killed
with every process it started and replaced by a fresh one for the next task, so one broken
test cannot leave a half-finished collective behind for the next. A task can also ask for a
fresh world when it is done (``retire=True``): for bodies that change process state the reset
above does not cover.

What this does not give, and which tests keep their own processes for (``launch.run_distributed(...,
fresh=True)``, ``launch.python`` / ``launch.torchrun``): process start-up and exit themselves,
signals, killed ranks, anything read from the environment at import or at
``init_process_group`` (e.g. the collective timeout), and launchers.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from tests.support import costs, reaper
from tests.support.launch import RankError

# How long the ranks of a failed task get to report their own error before the world is killed.
_GRACE_S = 5.0
# Threads a rank may have beyond its fresh count after a task before the world is replaced.
_THREAD_SLACK = 32

_WORLDS: dict[int, World] = {}


class WorldError(RankError):
    """A rank of a long-lived world raised, died, or the task timed out."""


class World:
    """``size`` gloo ranks in one default process group, waiting for tasks."""

    def __init__(self, size: int, env: dict[str, str]) -> None:
        from tests.support.launch import mp_context

        self.size = size
        start = time.monotonic()
        ctx = mp_context("forkserver")
        self._tmp = tempfile.TemporaryDirectory(prefix="ek_world_")
        init_method = f"file://{os.path.join(self._tmp.name, 'rendezvous')}"
        self._results = ctx.Queue()
        self._conns = []
        self.procs = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_loop, args=(rank, size, init_method, child, self._results, env), daemon=False)
            proc.start()
            child.close()
            self._conns.append(parent)
            self.procs.append(proc)
        self._task = 0
        self._busy = False  # a task sent and not collected (an interrupted one, at exit)
        # Every rank says it joined the group before the world takes work.
        self._collect(("ready",), timeout=300)
        costs.record("world start", time.monotonic() - start)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple, env: dict[str, str], timeout: float, retire: bool = False) -> list[Any]:
        """``fn(rank, size, *args)`` on every rank; results by rank. Raises :class:`WorldError`
        (and kills the world) when a rank fails or the task outlives ``timeout``."""
        self._task += 1
        task = pickle.dumps((self._task, fn, args, env))
        self._busy = True
        for conn in self._conns:
            conn.send_bytes(task)
        out = self._collect((self._task,), timeout=timeout, retire=retire)
        self._busy = False
        return out

    def _collect(self, task: tuple, timeout: float, retire: bool = False) -> list[Any]:
        import queue

        deadline = time.monotonic() + timeout
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        worn = False
        while len(outputs) + len(errors) < self.size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.size)) - set(outputs) - set(errors))
                self.kill()
                raise WorldError(f"ranks {missing} did not finish within {timeout:.0f}s (world killed)" + _fmt(errors))
            try:
                rank, tag, ok, payload, keep = self._results.get(timeout=0.2)
            except queue.Empty:
                for rank, p in enumerate(self.procs):
                    if rank not in outputs and rank not in errors and not p.is_alive():
                        errors[rank] = f"rank {rank} died with exit code {p.exitcode} before reporting"
                if errors:
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                continue
            if (tag,) != task:
                continue  # a late answer of a task whose world was replaced: cannot happen, ignored
            worn = worn or not keep
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if errors or retire or worn:
            self.kill()
        if errors:
            raise WorldError(_fmt(errors))
        return [outputs[r] for r in range(self.size)]

    def kill(self) -> None:
        """SIGKILL every rank with the processes it started (each leads its own session)."""
        for p in self.procs:
            if p.is_alive():
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._tmp.cleanup()
        if _WORLDS.get(self.size) is self:
            del _WORLDS[self.size]

    def close(self) -> None:
        """Ask every rank to leave (destroying its group), then kill what is left; ranks still
        running a task (the caller was interrupted) cannot read the request and are killed."""
        if self._busy:
            self.kill()
            return
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


def run_in_world(fn: Callable[..., Any], size: int, *args: Any, env: dict | None = None, timeout: float = 120.0, retire: bool = False):
    """``fn(rank, size, *args)`` on the long-lived world of ``size`` ranks (started on first use).

    ``env`` is each rank's whole environment for this task (``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` are the world's); the rank's own is restored after it. Raises
    :class:`WorldError` with the failing ranks' tracebacks; the world is then replaced for the
    next task.
    """
    from tests.support.launch import LAUNCHER_VARS, launch_env

    world = _WORLDS.get(size)
    if world is None or not world.alive():
        if world is not None:
            world.kill()
        world = _WORLDS[size] = World(size, launch_env())
        # Registered after multiprocessing's own exit hook, so it runs first (atexit is LIFO):
        # that hook joins non-daemonic children, which the ranks are, and would wait forever.
        atexit.unregister(close_all)
        atexit.register(close_all)
    task_env = {k: v for k, v in (env or launch_env()).items() if k not in LAUNCHER_VARS}
    return world.run(fn, args, task_env, timeout, retire=retire)


def close_all() -> None:
    """Close every world of this process (the suite calls it when the session ends; it is also
    registered at exit)."""
    for world in list(_WORLDS.values()):
        world.close()


def _fmt(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))


# ----------------------------------------------------------------------------- inside a rank
def _rank_loop(rank: int, size: int, init_method: str, conn, results, env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    from tests.support.launch import LAUNCHER_VARS

    os.setsid()  # a session of its own, so kill() takes the helpers a task starts too
    reaper.die_with_parent()  # a spawned rank (a forkserver's child already is): never outlive the test process
    os.environ.clear()  # exactly the parent's launch_env (the forkserver's own may be older)
    os.environ.update({k: v for k, v in env.items() if k not in LAUNCHER_VARS})
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    fresh = _Snapshot(torch)
    # What the forkserver imported lives as long as the rank: out of the collector's sight, so
    # the full collection after every task (freeing engines kept alive by cycles) scans only
    # what tasks made (0.25 s -> milliseconds).
    gc.collect()
    gc.freeze()
    results.put((rank, "ready", True, pickle.dumps(None), True))
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            break
        if not message:
            break
        task, fn, args, task_env = pickle.loads(message)
        world_vars = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        os.environ.clear()
        os.environ.update({**task_env, **world_vars})
        try:
            out = (rank, task, True, pickle.dumps(fn(rank, size, *args)))
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            out = (rank, task, False, traceback.format_exc())
        try:
            if not dist.is_initialized():
                raise RuntimeError(
                    "the task destroyed the world's process group; fix: run it on new ranks (run_distributed(..., fresh=True))"
                )
            keep = _reset(fresh)
        except BaseException:  # noqa: BLE001 - a rank that cannot be reset fails the task and is replaced
            out, keep = (rank, task, False, "resetting the rank after the task failed:\n" + traceback.format_exc()), False
        results.put((*out, keep))
    if dist.is_initialized():
        dist.destroy_process_group()


class _Snapshot:
    """The process state of a fresh rank that tasks may change and :func:`_reset` restores."""

    def __init__(self, torch) -> None:
        import random

        import numpy as np

        self.torch_rng = torch.get_rng_state()
        self.py_rng = random.getstate()
        self.np_rng = np.random.get_state()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.filters = list(warnings.filters)
        self.threads_alive = _threads()


def _holds_group(value) -> bool:
    from torch.distributed import ProcessGroup

    if isinstance(value, ProcessGroup):
        return True
    return type(value) in (list, tuple) and any(isinstance(v, ProcessGroup) for v in value)


def _clear_caches(prefix: str) -> None:
    """Empty the ``functools`` caches of modules under ``prefix`` and of their classes: a cached
    method keeps its instances (and what they hold: megatron's RotaryEmbedding.forward keeps
    the model's context-parallel group, and its gloo threads) for the life of the process."""
    import functools
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for value in list(vars(module).values()):
            owners = [value] if not isinstance(value, type) else [value, *vars(value).values()]
            for item in owners:
                if isinstance(item, functools._lru_cache_wrapper):
                    item.cache_clear()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _reset(fresh: _Snapshot) -> bool:
    """Put the rank back to ``fresh``; False when it cannot be (threads left running by groups
    or libraries the reset does not know), so the world must be replaced."""
    import random
    import sys

    import numpy as np
    import torch
    import torch.distributed as dist

    # megatron: parallel state, the global memory buffer, and the CPU compat layer the engine
    # holds for the life of a process (a later FSDP task must not run under it).
    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.destroy_global_memory_buffer()
        # megatron-core 0.16's destroy_model_parallel leaves some groups set (e.g.
        # _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP): each would keep its gloo threads alive.
        for name, value in list(vars(parallel_state).items()):
            if name.startswith("_") and name.isupper() and _holds_group(value):
                setattr(parallel_state, name, None)
        _clear_caches("megatron.")
    compat = sys.modules.get("backends.megatron.cpu_compat")
    if compat is not None and compat.leftovers():
        compat.release_all()
    gc.collect()
    # Every group but the world's default one: engines make meshes and megatron its groups.
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD and group is not c10d._get_default_group():
            dist.destroy_process_group(group)
    torch.set_rng_state(fresh.torch_rng)
    random.setstate(fresh.py_rng)
    np.random.set_state(fresh.np_rng)
    torch.set_default_dtype(fresh.dtype)
    torch.set_grad_enabled(True)
    torch.set_num_threads(fresh.threads)
    os.environ.clear()
    os.environ.update(fresh.environ)
    os.chdir(fresh.cwd)
    warnings.filters[:] = fresh.filters
    gc.collect()
    # Each gloo group runs 3 threads; a few groups still alive (held by something the reset does
    # not know) are harmless, hundreds accumulated over a run are not: replace the world then.
    return _threads() <= fresh.threads_alive + _THREAD_SLACK
