"""Run the conformance checks on N fresh processes and collect one report.

Each launch starts ``nproc`` processes (on a machine with CUDA: spawned interpreters; else)
forked from multiprocessing's forkserver, which has
imported torch, transformers, the kit and the backend's module once (a new interpreter spends
5-10 s importing them; a fork from the server well under one). They are fresh processes in
everything the checks touch: no engine, process group or RNG use happened in the server, and
each rank takes the caller's environment as it is at the launch (and computes on cores // nproc
torch threads, at most the caller's ``OMP_NUM_THREADS``). With ``nproc > 1`` they get the environment torchrun
gives (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), so the
engines join that world as they would under torchrun; with ``nproc == 1`` they get none and
take the plain-python path (a 1-rank group of their own). Phase-2 checks (resume,
tampered checkpoints) run in a second launch: fresh processes, as a resumed job would be.

A rank that fails a check reports it and goes on with the next one; a launch that outlives
``timeout_s`` (e.g. one rank raised inside a collective and the others wait) is killed and
its unfinished checks fail as timed out.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import queue
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field

from engine_api.conformance import checks as C
from engine_api.conformance import fixtures as fx
from engine_api.conformance.checkpoint_checks import tamper


@dataclass
class Outcome:
    """One check's result over all ranks: ``passed``, ``failed`` or ``skipped``."""

    name: str
    status: str
    detail: str


@dataclass
class Report:
    """Every outcome of one conformance run."""

    strategy: str
    nproc: int
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped checks are listed, not counted as passed)."""
        return all(o.status != "failed" for o in self.outcomes)

    def status(self, name: str) -> str:
        return next(o.status for o in self.outcomes if o.name == name)

    def summary(self) -> str:
        lines = [f"conformance of strategy {self.strategy!r} on {self.nproc} process(es):"]
        for o in self.outcomes:
            lines.append(f"  {o.status.upper():7s} {o.name}: {o.detail}")
        counts = {s: sum(o.status == s for o in self.outcomes) for s in ("passed", "failed", "skipped")}
        lines.append(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
        return "\n".join(lines)


def run_conformance(
    strategy: str,
    nproc: int = 1,
    overrides: tuple[str, ...] | list[str] = (),
    only: tuple[str, ...] | list[str] | None = None,
    workdir: str | None = None,
    timeout_s: float = 1200.0,
    exclude: tuple[str, ...] | list[str] | set[str] = (),
) -> Report:
    """Run the checks (all, or ``only`` these names, less ``exclude``) against ``strategy``.

    Raises:
        ValueError: ``strategy`` names no engine, or an unknown check is asked for.

    Args:
        strategy: a registered name, an entry-point name, or ``package.module:ClassName``.
            A name registered only in this process (by the decorator) is passed to the fresh
            processes as its class's import path.
        nproc: processes per launch.
        overrides: engine settings for every check, e.g. a layout
            (``megatron.tensor_model_parallel_size=2``).
        workdir: where the model and checkpoints go (default: a temporary directory).
        exclude: checks not to run (e.g. ones a layout cannot change, run on another layout);
            they are left out of the report. ``resume_save`` still runs when ``resume`` or
            ``tampered_checkpoint`` does (they read its checkpoint).
    """
    target = _resolvable(strategy)
    names = list(C.CHECKS) if only is None else list(only)
    unknown = [n for n in [*names, *exclude] if n not in C.CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; fix: use some of {', '.join(C.CHECKS)}")
    names = [n for n in names if n not in exclude]
    if "resume" in names and "resume_save" not in names:
        names.insert(0, "resume_save")
    if "tampered_checkpoint" in names and "resume_save" not in names:
        names.insert(0, "resume_save")
    with tempfile.TemporaryDirectory(prefix="enginekit-conformance-") as tmp:
        workdir = workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        model_dir = fx.build_model(os.path.join(workdir, "model"))
        # the same weights with attention dropout on: the dropout and resume checks (RNG)
        fx.build_model(os.path.join(workdir, fx.DROPOUT_MODEL), attention_dropout=fx.DROPOUT)
        report = Report(strategy, nproc)
        for phase in (1, 2):
            todo = [n for n in names if C.CHECKS[n].phase == phase]
            if not todo:
                continue
            if phase == 2:
                tamper(workdir)
            env = dict(strategy=target, overrides=tuple(overrides), model_dir=model_dir, workdir=workdir)
            report.outcomes += _launch(env, todo, nproc, timeout_s)
    return report


def _resolvable(strategy: str) -> str:
    """What the fresh processes can resolve: ``strategy`` itself when it is a built-in, an
    entry point or an import path; else (a name registered by a decorator in this process)
    its class's import path. Raises ``ValueError`` (the registry's message) for an unknown name,
    before anything is launched."""
    from engine_api import registry

    if registry.is_import_path(strategy):
        registry.get_engine_class(strategy)  # fails here, once, if it does not import
        return strategy
    if strategy in registry.available_engines() and strategy not in registry._REGISTRY:
        return strategy
    cls = registry.get_engine_class(strategy)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(
            f"strategy = {strategy!r} is a class defined in __main__ or inside a function, which the kit's fresh processes cannot import; "
            "fix: move the class into an importable module and pass 'package.module:ClassName'"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


# What the forkserver imports before it forks ranks, besides the backend's own module.
_PRELOAD = ["torch", "transformers", "tensordict", "engine_api.conformance.checks"]


def _context(strategy: str):
    """The forkserver context, with the backend's module added to what the server preloads when
    it has not started yet (one server per process, shared with anything else that uses it;
    a module the server lacks is imported by each rank instead, which is only slower)."""
    import torch

    from engine_api import registry

    if torch.cuda.is_available():
        # A GPU machine: new interpreters, as CUDA cannot be used in a process forked after
        # anything touched it (the server's preloaded imports included); slower, but safe.
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    server = getattr(mp_forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is None:
        wanted = [*_PRELOAD, registry.get_engine_class(strategy).__module__]
        have = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
        ctx.set_forkserver_preload(have + [m for m in wanted if m not in have])
    return ctx


def _launch(env: dict, names: list[str], nproc: int, timeout_s: float) -> list[Outcome]:
    ctx = _context(env["strategy"])
    results = ctx.Queue()
    port = _free_port()
    caller_env = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_main, args=(rank, nproc, port, env, names, results, caller_env), daemon=False) for rank in range(nproc)
    ]
    for p in procs:
        p.start()
    per_check: dict[str, list[tuple[str, str]]] = {n: [] for n in names}
    done, deadline = 0, time.monotonic() + timeout_s
    while done < nproc and time.monotonic() < deadline:
        try:
            rank, name, status, detail = results.get(timeout=1.0)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        if name is None:
            done += 1
        else:
            per_check[name].append((status, f"rank {rank}: {detail}"))
    for p in procs:
        p.join(timeout=30 if done == nproc else 0)
        if p.is_alive():
            p.kill()
            p.join()
    outcomes = []
    for name in names:
        reports = per_check[name]
        failed = [d for s, d in reports if s == "failed"]
        if len(reports) < nproc:
            missing = "timed out" if time.monotonic() >= deadline else "a rank died"
            outcomes.append(Outcome(name, "failed", f"{missing} before every rank reported ({'; '.join(failed) or 'no failure reported'})"))
        elif failed:
            outcomes.append(Outcome(name, "failed", "; ".join(failed)))
        elif any(s == "skipped" for s, _ in reports):
            outcomes.append(Outcome(name, "skipped", next(d for s, d in reports if s == "skipped")))
        else:
            outcomes.append(Outcome(name, "passed", reports[0][1].split(": ", 1)[1]))
    return outcomes


def _rank_main(rank: int, world: int, port: int, env: dict, names: list[str], results, caller_env: dict) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    os.environ.clear()  # the caller's environment at the launch, not the older one of the server
    os.environ.update(caller_env)
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per engine would bury the report
    hf_logging.set_verbosity_error()  # and the value-head load report (new `score` head: expected)
    # The kit's ranks form their own world: nothing inherited from a launcher the caller ran
    # under (torchrun) may leak in, or a 1-process run would try to join that world.
    for key in _LAUNCHER_KEYS:
        os.environ.pop(key, None)
    if world > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
        )
    # Tiny models: more threads than cores per process only contend (on a busy machine OpenMP
    # threads waiting for each other made a check 10x slower); the caller's OMP_NUM_THREADS,
    # when set, caps them (a rank forked from the server has its torch threads already).
    threads = max(1, (os.cpu_count() or 1) // world)
    cap = caller_env.get("OMP_NUM_THREADS", "").strip()
    if cap.isdigit() and int(cap) > 0:
        threads = min(threads, int(cap))
    torch.set_num_threads(threads)
    e = C.Env(rank=rank, world=world, **env)
    for name in names:
        try:
            detail = C.CHECKS[name].fn(e)
            results.put((rank, name, "passed", detail or "ok"))
        except C.Skipped as exc:
            results.put((rank, name, "skipped", str(exc)))
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
            where = traceback.extract_tb(exc.__traceback__)[-1]
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            kind = "" if isinstance(exc, C.CheckFailed) else f"{type(exc).__name__} at {os.path.basename(where.filename)}:{where.lineno}: "
            results.put((rank, name, "failed", kind + detail))
    results.put((rank, None, None, None))


_LAUNCHER_KEYS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
