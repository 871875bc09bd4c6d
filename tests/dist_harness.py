"""Run a function on N spawned gloo ranks, for tests.

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
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# After one rank fails, the others get this long to report their own error before being killed.
_GRACE_S = 5.0
# After every rank reported, they get this long to exit by themselves before being killed.
_EXIT_S = 30.0
# What the forkserver imports before forking ranks (a module that fails to import is skipped).
FORKSERVER_PRELOAD = ["tests.backends.hf_utils", "backends.fsdp", "backends.megatron", "torch.distributed.checkpoint", "recipes.ppo"]


def mp_context(start_method: str = "spawn"):
    """The multiprocessing context for ranks; the forkserver preloads :data:`FORKSERVER_PRELOAD`."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


class RankError(RuntimeError):
    """A rank raised, died, or the group timed out."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (a module-level function) and its arguments and return value
    picklable. ``torch.distributed`` is initialised in each rank before ``fn`` runs and
    destroyed after. ``env`` adds environment variables to every rank.
    ``start_method``: ``spawn`` or ``forkserver`` (see the module docstring).

    Raises:
        RankError: with the failing rank's traceback, or which ranks hung on timeout.
    """
    ctx = mp_context(start_method)
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ek_rdzv_") as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            # Not daemonic, like torchrun's ranks: megatron's checkpoint writer starts helper
            # processes, which daemons may not. The finally below kills every rank regardless.
            ctx.Process(target=_worker, args=(fn, rank, world_size, init_method, results, args, env or {}), daemon=False)
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


def _worker(fn, rank, world_size, init_method, results, args, env) -> None:
    import torch.distributed as dist

    os.setsid()  # a process group of its own, so _stop can kill the helpers a rank starts too
    os.environ.update(env)
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
