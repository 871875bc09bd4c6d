"""Make ``torch.distributed``'s object collectives raise, to show a code path does not use them.

The object collectives pickle each rank's data to host bytes (on NCCL: a device->host copy, a
pickle and a host->device copy per call), so per-step paths must move data with tensor
collectives only (issue 18). Used by ``tests/reliability/test_no_pickled_collectives.py`` for
steps and gathers and by ``tests/backends/test_megatron_export_buckets.py`` for weight export.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


@contextlib.contextmanager
def no_object_collectives():
    """Every object collective of ``torch.distributed`` raises inside the block."""
    saved = {name: getattr(dist, name) for name in OBJECT_COLLECTIVES}

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"torch.distributed.{name} (a pickled collective) called on a per-step path")

        return call

    for name in OBJECT_COLLECTIVES:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
