"""Suite-wide pytest setup: ``@pytest.mark.gpu`` tests skip cleanly without CUDA, no test leaves
the megatron CPU compat layer (``backends.megatron.cpu_compat``) switched on in this process, the
long-lived worlds (``tests/support/worlds.py``) are closed when the session ends, the forkserver
and what it forks end with the test process (``tests/support/reaper.py``), and the time
report (``tests/support/timing.py``) is printed at the end. A test module that needs a missing
optional extra is skipped on a machine without the extras (a bare GPU machine's ``pytest -m gpu``)
and is an error where every extra must be installed (``tests/support/extras.py``)."""

from __future__ import annotations

import sys

import pytest
import torch

pytest_plugins = ["tests.support.timing", "tests.support.inner_loop", "tests.support.extras"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU-only path); run on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_cpu_compat_left_behind():
    """Fail a test that leaves megatron's CPU compat layer (``backends/megatron/cpu_compat.py``)
    on, or any of its globals patched, in the pytest process: it rewrites every torch call of
    the process, so the tests after it would run under it. Cheap and import-free: it looks only
    when the module is already imported (most megatron tests run in spawned processes)."""
    yield
    compat = sys.modules.get("backends.megatron.cpu_compat")
    left = compat.leftovers() if compat is not None else []
    if left:
        compat.release_all()  # so the tests after this one run without it
        pytest.fail(f"the test left megatron's CPU compat layer in place: {left}; fix: cpu_compat.disable() / `with cpu_compat.active():`")


@pytest.fixture
def own_process_group():
    """In-process runs let the FSDP engine create a 1-rank group; drop it again afterwards
    (if this test created it) so later tests start from the state they expect."""
    import torch.distributed as dist

    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


def pytest_configure(config):
    # The forkserver, whoever starts it (the worlds, forked scripts, the conformance kit), and the
    # processes it forks end with this process (tests/support/reaper.py).
    from tests.support import reaper

    reaper.install()


def pytest_sessionfinish(session, exitstatus):
    worlds = sys.modules.get("tests.support.worlds")
    if worlds is not None:
        worlds.close_all()
