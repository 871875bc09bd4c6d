"""A pytest plugin (loaded by ``tests/conftest.py``): ``--in-process`` runs only the tests that
start no process, for a fast inner loop while developing (``make test-fast``; CI runs everything).

A test that starts one (ranks, a long-lived world, a forked or real script, torchrun, a Ray
instance, the conformance kit's ranks) is skipped at the moment it tries, with the reason, so
the selection needs no list to keep up to date: whatever a test does decides. It is enforced
where processes are made in the test's own process: ``subprocess.Popen`` and
``multiprocessing``'s ``Process.start``.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

REASON = "starts a process; --in-process (make test-fast) runs in-process tests only, make test runs it"


def pytest_addoption(parser):
    parser.addoption("--in-process", action="store_true", help="skip every test that starts a process (the inner loop, make test-fast)")


@pytest.fixture(scope="session", autouse=True)
def _in_process_only(request):
    """Only where tests run (a pytest-xdist worker, or the single pytest process): the xdist
    controller starts its workers with ``subprocess`` and must keep it."""
    if not request.config.getoption("--in-process"):
        yield
        return
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def refuse(*args, **kwargs):
        pytest.skip(REASON)

    subprocess.Popen.__init__ = refuse
    multiprocessing.process.BaseProcess.start = refuse
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen_init, process_start
