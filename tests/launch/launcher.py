"""Start scripts the way users do: plain ``python``, ``torchrun`` with one agent, or several
torchrun agents that rendezvous like the nodes of a multi-node job (c10d on localhost)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env(**extra: str) -> dict:
    """The environment of a launched process: the repo importable, one thread per rank, no
    launcher variables inherited from the test process."""
    out = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out.update({"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "ENGINEKIT_DIST_TIMEOUT_S": "120", **extra})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python ARGS`` (one process, no launcher)."""
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def torchrun(args: list[str], nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC ARGS`` (one agent)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def torchrun_nodes(args: list[str], nnodes: int, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """``nnodes`` torchrun agents, one process each, started as the nodes of one job:
    ``--nnodes N --node-rank i --rdzv-backend c10d --rdzv-endpoint localhost:PORT``."""
    port, job = free_port(), uuid.uuid4().hex[:8]
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{port}",
            f"--rdzv-id={job}",
            *args,
        ]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done
