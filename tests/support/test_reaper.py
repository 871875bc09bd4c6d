"""An interrupted or killed ``make test`` leaves no process behind (``tests/support/reaper.py``,
issue 60).

A real ``pytest -n 2 --dist loadfile`` (what ``make test`` runs) in its own session, on two tiny
test files: one runs a task in a long-lived world, the other a forked script, both waiting. When
both have started, the world's xdist worker is SIGKILLed (a test process that ends without
``atexit``: only the children noticing their parent is gone can help), then the session gets
SIGINT, as a terminal's Ctrl-C sends it (the other worker ends through its interrupt and
``atexit``). pytest must exit, and then no process it started may be left: not its workers, not
the forkservers, not the ranks or scripts they forked (they lead sessions of their own, which
the SIGINT does not reach), not multiprocessing's resource trackers. Before the reaper, the
servers, the trackers, the rank and the script were all still running after pytest had exited
(the rank and the script until their work ended, the servers and trackers as long as they did).

The processes are found by a marker in their environment, which every process of the run
inherits at its start (forked ones keep their parent's block in ``/proc/<pid>/environ``); a
survivor is killed after the check, so a failure leaves nothing running either. The tiny run's
forkservers preload nothing but the reaper (a fast start; what a server preloads does not change
how it ends). Linux only (``prctl``, ``/proc``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.support.launch import launch_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper and this check use Linux's prctl and /proc")

_TINY = """
import os
import time

from tests.support import launch

launch.FORKSERVER_PRELOAD[:] = []
READY = os.environ["EK_REAPER_READY"]


def _wait(rank, world):
    open(READY + ".{name}", "w").close()
    time.sleep({sleep})


def test_waits():
    with open(READY + ".{name}.worker", "w") as f:
        f.write(str(os.getpid()))
    {body}
"""
_BODIES = {
    "world": "launch.run_distributed(_wait, 1, timeout=600)",
    "forked": "from tests.support.forked import run_forked\n"
    '    run_forked([\'-c\', \'import os, time; open(os.environ["EK_REAPER_READY"] + ".forked", "w").close(); time.sleep({sleep})\'], timeout=600)',
}
# How long the tiny run's rank and script wait. Inside the full suite on a loaded machine the
# interrupted session was seen to end only when they did (its teardown waited on them), so this
# bounds the test's worst case; the kill below comes well before it (checked), so the waits are
# still running when the session is interrupted.
SLEEP_S = 60


def _marked(tag: str) -> dict[int, str]:
    """pid -> command line of every process whose environment carries ``tag``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if tag.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                out[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:  # gone meanwhile, or not ours
            continue
    return out


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_an_interrupted_or_killed_run_leaves_no_process(tmp_path):
    for name, body in _BODIES.items():
        (tmp_path / f"test_{name}.py").write_text(_TINY.format(name=name, body=body.format(sleep=SLEEP_S), sleep=SLEEP_S))
    ready = str(tmp_path / "ready")
    tag = f"EK_REAPER_TAG={uuid.uuid4().hex}"
    env = launch_env(EK_REAPER_READY=ready, EK_REAPER_TAG=tag.split("=", 1)[1])
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--dist",
        "loadfile",
        "test_world.py",
        "test_forked.py",
    ]
    with open(tmp_path / "pytest.log", "w") as log:
        run = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = _wait_until(lambda: all(os.path.exists(f"{ready}.{n}") for n in _BODIES) or run.poll() is not None, 300)
        assert started and run.poll() is None, "the tiny run did not start both waits:\n" + (tmp_path / "pytest.log").read_text()[-3000:]
        waited = time.time() - min(os.path.getmtime(f"{ready}.{n}") for n in _BODIES)
        assert waited < SLEEP_S - 30, f"the waits started {waited:.0f} s ago: they may end before the interrupt"
        with open(f"{ready}.world.worker") as f:
            os.kill(int(f.read()), signal.SIGKILL)  # no atexit in that worker
        os.killpg(run.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the foreground group
        # An interrupted xdist session tears its workers down in seconds alone (7 s measured);
        # inside the full suite it was seen running until its waits ended (SLEEP_S). So after
        # 20 s a second Ctrl-C, as a user presses it; no process may be left either way (the
        # reaper's job).
        try:
            run.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGINT)
            run.wait(timeout=SLEEP_S + 60)
        gone = _wait_until(lambda: not _marked(tag), 15)
        left = _marked(tag)
    finally:
        for pid in [run.pid, *_marked(tag)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.wait(timeout=10)
    assert gone, "left running after pytest exited:\n" + "\n".join(f"{pid}: {cmd}" for pid, cmd in sorted(left.items()))
