"""Small helpers over ``torch.distributed`` that also work when it is not initialised.

Every helper takes the process group explicitly (``None`` means the default world group),
so callers always say which group a collective runs over. When ``torch.distributed`` is
not initialised the process is treated as a group of one and collectives are no-ops, which
is what lets engines and tests run single-process without a rendezvous.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
