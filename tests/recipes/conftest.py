"""Fixtures the recipe tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def own_process_group():
    """In-process runs let the FSDP engine create a 1-rank group; drop it again afterwards
    (if this test created it) so later tests start from the state they expect."""
    import torch.distributed as dist

    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()
