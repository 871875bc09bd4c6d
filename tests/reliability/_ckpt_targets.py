"""What the checkpoint and rank-failure tests run inside rank processes.

* :func:`resume_first` / :func:`resume_second`: the two halves of an exact-resume check, each in
  its own fresh processes (``run_distributed``).
* :func:`save_until_killed`: train, save step 1, train, start saving step 2 and stop at a named
  point of the save until the test SIGKILLs the process (``_ckpt_procs.RankGroup``);
  :func:`inspect_crashed` then loads what is left in a fresh process.
* :func:`fail_one_rank`: one rank fails inside ``forward_backward_step`` or ``save_checkpoint``.
* :func:`ppo_main`: the PPO recipe's ``main`` on ranks of an existing process group.

Stopping points are installed by wrapping ``engine_api.ckpt_layout``'s one-function-per-step
commit (and ``os.fsync`` for the backend's own writers) in this process only.
"""

from __future__ import annotations

import errno
import os
import time
from functools import partial

import torch

from engine_api import ckpt_layout
from tests.reliability._ckpt_procs import signal
from tests.reliability._ckpt_state import OVERRIDES, full_state, seed_all, train_steps
from tests.reliability._step_common import new_engine, reset_layout
from tests.support.hf_utils import full_params, pg_loss

K_STEPS, N_STEPS = 2, 2  # steps before the checkpoint, and after it

# Where save_until_killed stops: the function it stops in front of (None: os.fsync, after the
# first backend file is written), and the state of the save at that moment.
STOPS = {
    "shard_written": (None, "a backend file is written and fsynced, the checkpoint is not complete"),
    "marker_written": ("_set_latest", "every file and enginekit.json are in the temporary directory"),
    "latest_written": ("_publish", "`latest` names step 2, the rename has not happened"),
    "retention": ("_remove", "retention moved the old checkpoint aside and is about to delete it"),
    "upload": ("_upload_marker", "the remote copy has every file but enginekit.json"),
}
# The step a fresh process must load after a kill at each stop.
LOADS_AFTER_KILL = {"shard_written": 1, "marker_written": 1, "latest_written": 1, "retention": 2, "upload": 2}


# ----------------------------------------------------------------------------- exact resume
def resume_first(rank, world, strategy, model_dir, root, layouts: dict) -> dict:
    """Per layout: train K steps, snapshot, save, train N more (the uninterrupted run)."""
    torch.set_num_threads(1)  # both halves alike (bit-exact comparisons); 2 ranks share 2 cores
    out = {}
    for name, overrides in layouts.items():
        engine = new_engine(strategy, model_dir, *OVERRIDES, *overrides)
        seed_all(1234)
        before = train_steps(engine, K_STEPS)
        at_save = full_state(engine)
        engine.save_checkpoint(os.path.join(root, name), global_step=engine.global_step)
        after = train_steps(engine, N_STEPS)
        out[name] = {"before": before, "at_save": at_save, "after": after, "end": full_state(engine)}
        del engine
        reset_layout(strategy)
    return out


def resume_second(rank, world, strategy, model_dir, root, layouts: dict) -> dict:
    """Per layout, in processes that never trained: load, snapshot, train N steps."""
    torch.set_num_threads(1)
    out = {}
    for name, overrides in layouts.items():
        engine = new_engine(strategy, model_dir, *OVERRIDES, *overrides)
        seed_all(4321 + rank)  # a state the load must overwrite, different on every rank
        step = engine.load_checkpoint(os.path.join(root, name))
        after_load = full_state(engine)
        after = train_steps(engine, N_STEPS)
        out[name] = {"loaded_step": step, "after_load": after_load, "after": after, "end": full_state(engine)}
        del engine
        reset_layout(strategy)
    return out


# ----------------------------------------------------------------------------- crash
def save_until_killed(rank, world, strategy, model_dir, case_dir, stop) -> None:
    """Save step 1, then stop inside the save of step 2 at ``stop`` (see :data:`STOPS`) and
    wait there to be killed. Writes ``expect_<step>.pt`` (the params each checkpoint holds)."""
    root, remote = os.path.join(case_dir, "ckpt"), f"file://{os.path.join(case_dir, 'remote')}"
    keep = 1 if stop == "retention" else None
    engine = new_engine(strategy, model_dir, *OVERRIDES)
    seed_all(0)
    for step in (1, 2):
        train_steps(engine, 1)
        torch.save(full_params(engine), os.path.join(case_dir, f"expect_{step}.pt"))
        if step == 2:
            _stop_at(stop, os.path.join(root, f"{ckpt_layout.TMP}{ckpt_layout.PREFIX}2"), case_dir)
        engine.save_checkpoint(root, hdfs_path=remote if stop == "upload" and step == 2 else None, global_step=step, max_ckpt_to_keep=keep)
    raise AssertionError(f"the save of step 2 finished without reaching {stop!r} ({STOPS[stop][1]})")


def _stop_at(stop: str, tmp: str, signal_dir: str) -> None:
    def halt() -> None:
        signal(signal_dir, "reached", f"{stop} in pid {os.getpid()}")
        while True:  # until SIGKILL
            time.sleep(60)

    name = STOPS[stop][0]
    if name is None:
        _on_fsync(tmp, after=halt)
        return
    real = getattr(ckpt_layout, name)

    def wrapper(*args):
        if stop != "retention" or (os.path.basename(args[0]).startswith(ckpt_layout.TRASH) and os.path.exists(args[0])):
            halt()
        return real(*args)

    setattr(ckpt_layout, name, wrapper)


def _on_fsync(tmp: str, after=None, instead=None, backend_only: bool = True) -> None:
    """Call ``after`` once a file in ``tmp`` is fsynced, or ``instead`` of fsyncing it.

    Patches ``os.fsync`` of this process, which the writer processes megatron forks inherit.
    ``backend_only``: only the backend's files, not the protocol's own (``extra_rank*.pt``,
    enginekit.json).
    """
    real = os.fsync
    tmp = os.path.realpath(tmp)
    protocol = ("extra_rank", ckpt_layout.MARKER) if backend_only else (ckpt_layout.MARKER,)

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else ""
        mine = os.path.dirname(path) == tmp and not os.path.basename(path).startswith(protocol)
        if mine and instead is not None:
            return instead()
        real(fd)
        if mine and after is not None:
            after()

    os.fsync = fsync


def inspect_crashed(rank, world, strategy, model_dir, cases: dict, memory_url: str) -> dict:
    """In a fresh process: what each killed save left loads as; a next save cleans up; and the
    remote round trip through ``memory_url`` with ``del_local_after_load`` both ways."""
    torch.set_num_threads(1)
    engine = new_engine(strategy, model_dir, *OVERRIDES)
    out = {}
    for stop, case_dir in cases.items():
        root = os.path.join(case_dir, "ckpt")
        r = {"step": engine.load_checkpoint(root), "params": full_params(engine), "lr": engine.scheduler.get_last_lr()}
        if stop == "upload":
            r["remote_error"] = _error_of(
                lambda d=case_dir: engine.load_checkpoint(os.path.join(d, "empty"), hdfs_path=f"file://{os.path.join(d, 'remote')}")
            )
        engine.save_checkpoint(root, global_step=3)
        r["listing_after_next_save"] = sorted(os.listdir(root))
        r["reloaded_step"] = engine.load_checkpoint(root)
        out[stop] = r
    # Remote copy with an in-memory fsspec filesystem, loaded back both ways.
    first = next(iter(cases.values()))
    engine.save_checkpoint(os.path.join(first, "mem_src"), hdfs_path=memory_url, global_step=7)
    saved = full_params(engine)
    engine.load_checkpoint(os.path.join(first, "ckpt", f"{ckpt_layout.PREFIX}1"))  # different params in between
    for keep_local in (False, True):
        local = os.path.join(first, f"mem_dl_keep{keep_local}")
        step = engine.load_checkpoint(local, hdfs_path=memory_url, del_local_after_load=not keep_local)
        params = full_params(engine)
        out[f"memory_keep{keep_local}"] = {
            "step": step,
            "same_params": all(torch.equal(params[k], v) for k, v in saved.items()),
            "listing": sorted(os.listdir(local)),
            "local_reload": engine.load_checkpoint(local) if keep_local else None,
        }
    return out


def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the message
        return f"{type(exc).__name__}: {exc}"
    return None


# ----------------------------------------------------------------------------- rank failure
class InjectedFailure(RuntimeError):
    """The failure a test injects on rank 1."""


def fail_one_rank(rank, world, strategy, model_dir, where, signal_dir) -> None:
    """Train one step on every rank, then make one rank fail ``where``:

    * ``forward``: rank 1's loss function raises inside ``forward_backward_step`` (uncaught);
    * ``forward_alive``: the same, but rank 1 catches it and stays alive without joining any
      collective again (a swallowed error, or a rank stuck in I/O);
    * ``save``: the first file rank 1 writes in ``save_checkpoint`` hits a full disk (ENOSPC);
    * ``upload``: rank 0's remote copy (a rank-0-only step of ``save_checkpoint``) fails.

    Every rank is expected to raise; reaching the end is an error.
    """
    engine = new_engine(strategy, model_dir, *OVERRIDES)
    seed_all(0)
    train_steps(engine, 1)
    root = os.path.join(signal_dir, "ckpt")
    if where in ("forward", "forward_alive"):
        engine.set_loss_fn(partial(_loss_failing_on_rank1, rank=rank, signal_dir=signal_dir))
        try:
            train_steps(engine, 1)
        except InjectedFailure:
            if where == "forward_alive":
                while True:
                    time.sleep(60)
            raise
    elif where == "save":
        if rank == 1:
            # The first file rank 1 writes: a shard of its own (FSDP), or its extra_rank1.pt where
            # the backend lets one DP replica write the replicated model (megatron).
            tmp = os.path.join(root, f"{ckpt_layout.TMP}{ckpt_layout.PREFIX}1")
            _on_fsync(tmp, instead=partial(_disk_full, signal_dir), backend_only=False)
        engine.save_checkpoint(root, global_step=1)
    else:
        blocker = os.path.join(signal_dir, "not_a_directory")
        if rank == 0:
            with open(blocker, "w") as f:
                f.write("a file where the remote copy's directory should go")
            signal(signal_dir, "injected", repr(time.time()))
        engine.save_checkpoint(root, hdfs_path=f"file://{blocker}/copy", global_step=1)
    raise AssertionError(f"rank {rank} finished although a rank failed in {where}")


def _loss_failing_on_rank1(mb, out, norm, rank, signal_dir):
    if rank == 1:
        signal(signal_dir, "injected", repr(time.time()))
        raise InjectedFailure("injected failure in forward_backward_step on rank 1")
    return pg_loss(mb, out, norm)


def _disk_full(signal_dir):
    signal(signal_dir, "injected", repr(time.time()))
    raise OSError(errno.ENOSPC, "No space left on device (injected on rank 1)")


# ----------------------------------------------------------------------------- recipe
def ppo_main(rank, world, argv: list[str]) -> None:
    """``python -m recipes.ppo`` on this rank; the recipe joins the existing process group."""
    from recipes.ppo import main

    torch.set_num_threads(1)  # the runs compared are both on 1 thread per rank
    main(argv)
