"""Memory measurement for the offload-integrity tests: resident set size of this process and,
on a GPU machine, the CUDA caching allocator's live bytes.

RSS is read after ``gc.collect()`` and glibc's ``malloc_trim(0)``: the trim hands freed heap
pages back to the OS, so RSS follows the memory that is still referenced instead of what the
allocator keeps cached for reuse (which moves by a few hundred KiB either way from one cycle to
the next). Referenced memory, i.e. a leak, cannot be trimmed away.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import psutil
import torch

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the garbage collector's view
    (``gc.freeze``), so the ``gc.collect()`` of each later measurement only walks objects
    created since (0.5 s per collection -> milliseconds in a process that imported torch,
    transformers and megatron). Frozen objects are never freed, which only matters for
    objects that were already alive at this baseline."""
    gc.collect()
    gc.freeze()


def rss_bytes() -> int:
    """Resident set size of this process after a full garbage collection and a heap trim."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
    return psutil.Process().memory_info().rss


def cuda_bytes() -> int | None:
    """Bytes held by live CUDA tensors (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def growth(samples: list[int], warmup: int) -> int:
    """Steady-state growth: the last sample minus the sample right after ``warmup`` cycles."""
    return samples[-1] - samples[warmup - 1]
