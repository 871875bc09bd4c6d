"""A pytest plugin (loaded by ``tests/conftest.py``): at the end of a run, the time per test
file and per kind of fixed cost (:mod:`tests.support.costs`), and the run's wall time.

pytest's own ``--durations=25`` (``make test`` passes it) lists the slowest tests; this adds the
two views that say where to cut: which files cost the most, and how much of the run went to
starting worlds, scripts, vLLM engines and Ray instances rather than to the checks themselves.
Works under pytest-xdist: the numbers travel in each test's report to the controller.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict

import pytest

from tests.support import costs

_KEY = "enginekit_costs"
_files: dict[str, float] = defaultdict(float)
_kinds: dict[str, float] = defaultdict(float)
_tests: set[str] = set()
_start = time.monotonic()


def pytest_runtest_setup(item):
    _time_vllm_starts()


def _time_vllm_starts() -> None:
    """Record vLLM engine starts in this process (``VLLMRollout.__init__``: the engine, its
    worker and the model load) under their own kind. Wrapped once the module is imported (by a
    test module at collection, or by an earlier test), never imported here: that alone costs
    seconds, and most runs of one file need no vLLM."""
    module = sys.modules.get("backends.rollout.vllm")
    cls = getattr(module, "VLLMRollout", None)
    if cls is None or getattr(cls.__init__, "_enginekit_timed", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def timed_init(self, *args, **kwargs):
        with costs.timed("vLLM engine starts (in the pytest process)"):
            init(self, *args, **kwargs)

    timed_init._enginekit_timed = True
    cls.__init__ = timed_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown":
        spent = costs.take()
        if spent:
            report.user_properties.append((_KEY, spent))


def pytest_runtest_logreport(report):
    _files[report.nodeid.split("::")[0]] += report.duration
    _tests.add(report.nodeid)
    for key, value in report.user_properties:
        if key == _KEY:
            for kind, seconds in value.items():
                _kinds[kind] += seconds


def pytest_terminal_summary(terminalreporter):
    if not _files:
        return
    write = terminalreporter.write_line
    wall = time.monotonic() - _start
    busy = sum(_files.values())
    terminalreporter.section("time per test file (setup + call + teardown, 20 costliest)")
    for path, seconds in sorted(_files.items(), key=lambda kv: -kv[1])[:20]:
        write(f"{seconds:8.1f}s {100 * seconds / busy:5.1f}%  {path}")
    if _kinds:
        terminalreporter.section("fixed costs inside those tests (wall time, by kind)")
        for kind, seconds in sorted(_kinds.items(), key=lambda kv: -kv[1]):
            write(f"{seconds:8.1f}s {100 * seconds / busy:5.1f}%  {kind}")
    write(f"total: {len(_tests)} tests, {busy / 60:.1f} test-minutes in {wall / 60:.1f} minutes of wall time")
