"""Small helpers over ``torch.distributed`` that also work when it is not initialised.

Every helper takes the process group explicitly (``None`` means the default world group),
so callers always say which group a collective runs over. When ``torch.distributed`` is
not initialised the process is treated as a group of one and collectives are no-ops, which
is what lets engines and tests run single-process without a rendezvous.

Rank failure (issue 6; ``tests/reliability/test_rank_failure.py``). What bounds the time a
surviving rank spends waiting for a failed peer (gloo):

* The failed rank's process exits (an exception nobody catches, a crash, a kill): the OS
  closes its sockets and every peer blocked in, or later entering, a collective with it raises
  ``RuntimeError: ... Connection closed by peer`` within seconds (measured: under 2 s on the
  2-core CI machine), then exits non-zero unless it catches that. No timeout is involved.
* The failed rank stays alive without joining the collective (it swallowed the exception, or
  hangs in I/O): the peers raise ``RuntimeError: ... Timed out waiting <T>ms`` after the
  collective timeout T of the group they wait in. :func:`init_process_group` sets T for the
  world group (``timeout_s``, else ``$ENGINEKIT_DIST_TIMEOUT_S``, else torch's default of 30
  minutes); groups made later with ``new_group`` get torch's default unless their creator passes
  :func:`process_group_timeout` on (megatron's ``initialize_model_parallel`` takes it as
  ``distributed_timeout_minutes``).
* NCCL has neither property without torch's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``);
  under ``torchrun`` the elastic agent also terminates the other ranks when one exits non-zero.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

# Seconds a rank waits in a collective for a missing peer, read by init_process_group.
TIMEOUT_ENV = "ENGINEKIT_DIST_TIMEOUT_S"


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if is_initialized() else 0


def all_reduce(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group`` with ``op`` in {"sum", "max", "min"}.

    A group of one returns ``tensor`` unchanged without touching the backend.
    """
    if group_size(group) == 1:
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def all_gather_objects(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    """Gather one picklable object from every rank of ``group``, in group-rank order."""
    size = group_size(group)
    if size == 1:
        return [obj]
    gathered: list[object] = [None] * size
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device a small collective buffer must live on: CUDA for NCCL, CPU for gloo."""
    if is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(
    backend: str, init_method: str | None = None, rank: int | None = None, world_size: int | None = None, timeout_s: float | None = None
) -> None:
    """``torch.distributed.init_process_group`` with an explicit collective timeout.

    Args:
        backend: ``gloo`` or ``nccl``.
        init_method, rank, world_size: as for torch (``None``: torchrun's environment).
        timeout_s: how long a collective waits for a missing peer before raising; ``None``
            reads ``$ENGINEKIT_DIST_TIMEOUT_S``, and without it torch's default (30 minutes).

    Raises:
        ValueError: the timeout (argument or environment) is not a positive number.
    """
    source = "timeout_s"
    if timeout_s is None and os.environ.get(TIMEOUT_ENV):
        source, raw = f"${TIMEOUT_ENV}", os.environ[TIMEOUT_ENV]
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"{source} = {raw!r}: not a number; fix: the process-group timeout in seconds, e.g. 600") from None
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"{source} = {timeout_s!r}: the process-group timeout must be positive; fix: seconds > 0, e.g. 600")
    # Only the given arguments: torch's own defaults (rank = world_size = -1) mean "read the
    # environment"; passing None instead fails the env:// rendezvous under torchrun.
    given = {"init_method": init_method, "rank": rank, "world_size": world_size}
    kwargs = {k: v for k, v in given.items() if v is not None}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, **kwargs)


def process_group_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The collective timeout of ``group`` (default: the world group), to pass on to groups
    created later: ``new_group`` and megatron's parallel state do not inherit it."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    device = torch.device("cuda") if dist.get_backend(pg) == "nccl" else torch.device("cpu")
    try:
        # No public getter in torch 2.x: the backend's options carry the timeout it was made with.
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def init_single_process_group(backend: str) -> None:
    """Initialise a 1-rank default group if none exists (a plain ``python`` run).

    Backends built on torch.distributed (FSDP2 meshes, megatron parallel_state) then run the
    same code path in one process as under torchrun. The rendezvous is a fresh file, so
    concurrent single-process runs never collide on a port.
    """
    if is_initialized():
        return
    import tempfile

    store = tempfile.NamedTemporaryFile(prefix="enginekit_pg_", delete=False).name
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def barrier(group: dist.ProcessGroup | None) -> None:
    """Barrier over ``group``; a no-op for a group of one."""
    if group_size(group) > 1:
        dist.barrier(group=group)


def broadcast_object(obj: object, src: int, group: dist.ProcessGroup | None) -> object:
    """``obj`` of global rank ``src``, on every rank of ``group`` (picklable objects)."""
    if group_size(group) == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]
