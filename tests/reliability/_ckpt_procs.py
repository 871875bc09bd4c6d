"""Rank processes a test can watch, stop at a chosen point, and SIGKILL.

``tests.support.launch.run_distributed`` kills every rank as soon as one fails, which is right
for ordinary tests and exactly wrong here: the crash tests kill a saving process on purpose,
and the rank-failure tests must see whether the *surviving* ranks exit by themselves. So each
rank here is a plain process (forked from the harness's preloaded forkserver) that

* leads its own process group (``setsid``), so ``kill()`` also reaches the helper processes a
  rank starts (megatron's checkpoint writers fork workers and spawn a queue manager);
* writes stdout/stderr to ``rank<r>.log`` in the work directory;
* joins a gloo group through a fresh ``file://`` rendezvous with an optional collective
  timeout (``engine_api.dist.init_process_group``), then runs ``target(rank, world, *args)``;
  an uncaught exception exits non-zero with the traceback in the log, like a real rank.

Targets signal progress by writing files (:func:`signal`) that the test polls (:func:`wait_for`).
"""

from __future__ import annotations

import os
import signal as _signal
import time
from collections.abc import Callable

from tests.support.launch import mp_context


class RankGroup:
    """``world_size`` rank processes running ``target``; see the module docstring."""

    def __init__(self, target: Callable, world_size: int, args: tuple, workdir: str, pg_timeout_s: float | None = None) -> None:
        os.makedirs(workdir, exist_ok=True)
        ctx = mp_context("forkserver")
        init_method = f"file://{os.path.join(workdir, 'rendezvous')}"
        self.logs = [os.path.join(workdir, f"rank{r}.log") for r in range(world_size)]
        self.procs = [
            ctx.Process(target=_entry, args=(target, r, world_size, init_method, self.logs[r], args, pg_timeout_s), daemon=False)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.exited_at: list[float | None] = [None] * world_size

    def poll(self) -> list[int | None]:
        """Exit codes by rank (None: still running); records when each exit was first seen."""
        codes = [p.exitcode for p in self.procs]
        now = time.time()
        for r, code in enumerate(codes):
            if code is not None and self.exited_at[r] is None:
                self.exited_at[r] = now
        return codes

    def wait(self, ranks: list[int], deadline: float) -> bool:
        """Wait until all of ``ranks`` exited or ``time.time()`` passes ``deadline``."""
        while time.time() < deadline:
            if all(self.poll()[r] is not None for r in ranks):
                return True
            time.sleep(0.1)
        return all(self.poll()[r] is not None for r in ranks)

    def kill(self) -> None:
        """SIGKILL every rank and everything it started; reap the ranks."""
        for p in self.procs:
            try:
                os.killpg(p.pid, _signal.SIGKILL)  # pgid == pid: each rank leads its group
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.join(timeout=10)
        self.poll()

    def log(self, rank: int) -> str:
        with open(self.logs[rank], errors="replace") as f:
            return f.read()

    def logs_tail(self, chars: int = 3000) -> str:
        """Every rank's log tail, for assertion messages."""
        return "".join(f"\n--- rank {r} (exit {p.exitcode}) ---\n{self.log(r)[-chars:]}" for r, p in enumerate(self.procs))


def signal(directory: str, name: str, text: str = "") -> None:
    """Create ``directory/name`` atomically (a progress mark a test waits for)."""
    tmp = os.path.join(directory, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(directory, name))


def wait_for(path: str, group: RankGroup, deadline: float) -> bool:
    """Wait until ``path`` exists; False when ``deadline`` passes or every rank has exited first."""
    while time.time() < deadline:
        if os.path.exists(path):
            return True
        if all(code is not None for code in group.poll()):
            return os.path.exists(path)
        time.sleep(0.05)
    return os.path.exists(path)


def _entry(target, rank, world_size, init_method, log_path, args, pg_timeout_s) -> None:
    import torch
    import torch.distributed as dist

    from engine_api.dist import init_process_group

    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)  # these tests start several ranks at once on a 2-core machine
    init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout_s=pg_timeout_s)
    target(rank, world_size, *args)
    dist.destroy_process_group()
