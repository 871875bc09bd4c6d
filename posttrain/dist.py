"""The process group of a training script: joining the launcher's (torchrun) and this
process's rank in it."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from engine_api.dist import ensure_process_group, is_initialized, launcher_world


def init_distributed(timeout_s: float | None = None) -> bool:
    """Join the launcher's process group (torchrun) with the collective timeout ``timeout_s``
    (``engine.dist_timeout_s``); return whether this call created it, so the caller tears
    down only what it set up.

    Single-process runs create nothing here; the engine makes its own 1-rank group.
    """
    if is_initialized() or launcher_world() is None:
        return False
    backend = "gloo"
    if torch.cuda.is_available():
        # One GPU per process; NCCL collectives run on the current device.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    ensure_process_group(backend, timeout_s)
    return True


def rank() -> int:
    """This process's global rank; 0 without a process group."""
    return dist.get_rank() if is_initialized() else 0
