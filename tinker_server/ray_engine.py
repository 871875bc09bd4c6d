"""The engine of runs on Ray workers (``engine.ranks > 1``): one :class:`RayEngine` per signature,
``settings.ranks`` data-parallel ranks, each a Ray worker hosting a :class:`WorkerHost`.

The server is the single controller (``posttrain.placement``: the pool, the workers'
``torch.distributed`` world, calls fanned out to every rank, a dead worker named and the group torn
down). Each rank holds a ``shared_engine.SharedEngine`` and swaps the runs' states as the
in-process engine does; every remote call names its target by function (``WorkerHost.add_run``,
``EngineRun.forward_backward``), never by a string. The request is checked on the server before
the fan-out (the HTTP layer's checks), so a bad one fails once, not on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from tinker_server.config import RunSettings
from tinker_server.contract import AdamIn, DatumIn, ForwardBackwardOut, LoraIn, UserError
from tinker_server.shared_engine import UNLOADED, EngineRun, SharedEngine
from tinker_server.signature import Signature, run_seed, signature
from tinker_server.snapshots import RolloutPool, Snapshot, adapter_snapshot, snapshot

T = TypeVar("T")


class WorkerHost:
    """The host object of each Ray worker of a :class:`RayEngine` (``posttrain.placement``): this
    rank's part of the shared engine, built with the first run, and the runs on it by id. The
    server reaches it only through its methods (a remote call runs a function, never reads an
    attribute)."""

    def __init__(self, base_model: str, model_dir: str, settings: dict) -> None:
        self.base_model, self.model_dir, self.settings = base_model, model_dir, RunSettings(**settings)
        self.shared: SharedEngine | None = None
        self.runs: dict[int, EngineRun] = {}

    def add_run(self, run_id: int, lora: dict) -> None:
        """Open run ``run_id`` of ``lora`` (``LoraIn`` as a dict); the first one builds the engine."""
        lora_in = LoraIn(**lora)
        if self.shared is None:
            sig = signature(self.base_model, self.model_dir, lora_in)
            self.shared = SharedEngine(sig, run_seed(lora_in), self.model_dir, self.settings)
        # no memory check here: the states live on the workers' hosts, and the server bounds the runs
        self.runs[run_id] = self.shared.open_run(self.base_model, lora_in, None, check_memory=False)

    def can_reseed(self) -> bool:
        """Whether this rank's engine serves runs of other seeds than its build seed."""
        if self.shared is None:
            raise RuntimeError("WorkerHost.can_reseed: no engine is built before the first add_run; fix: add a run first")
        return self.shared.can_reseed

    def on_run(self, run_id: int, method: Callable[..., T], *args: Any) -> T:
        """``method`` (an :class:`EngineRun` method, passed as itself) on run ``run_id``."""
        return method(self.runs[run_id], *args)

    def close_run(self, run_id: int) -> None:
        """Close run ``run_id`` (gone already: nothing to do)."""
        run = self.runs.pop(run_id, None)
        if run is not None:
            run.close()

    def close(self) -> None:
        """Close every run (the worker is stopping)."""
        for run_id in list(self.runs):
            self.close_run(run_id)


class RayEngine:
    """One :class:`Signature`'s engine spanning ``settings.ranks`` data-parallel ranks, each a Ray
    worker (module docstring), shared by its runs as a ``SharedEngine`` is in process
    (``engines.RunEngine``). Its workers stop with its last run."""

    def __init__(self, sig: Signature, model_dir: str, settings: RunSettings) -> None:
        from posttrain.placement.cluster import RayCluster
        from posttrain.placement.config import PlacementConfig

        self.signature, self.runs, self.next_id, self.closed = sig, 0, 0, False
        self.lora_alpha = settings.lora_alpha
        self.seed: int | None = None  # known once the first run has built the engine on the workers
        self.can_reseed = True
        placement = PlacementConfig(pools={"run": settings.ranks}, cpus_per_worker=settings.cpus_per_rank)
        self.cluster = RayCluster(placement, {"run": ("actor",)}, settings.ray_address, None).__enter__()
        try:
            self.group = self.cluster.spawn("run")
            self.cluster.build(self.group, WorkerHost, sig.base_model, model_dir, asdict(settings))
        except BaseException:
            self.cluster.close(graceful=False)
            raise

    def call(self, method: Callable[..., T], *args: Any) -> T:
        """``method`` (a :class:`WorkerHost` method) on every rank; rank 0's result."""
        return self.cluster.call(self.group, method, *args)

    def open_run(self, base_model: str, lora: LoraIn, pool: RolloutPool) -> RayEngineRun:
        """A new run of ``lora`` on every rank; the first one builds the workers' engine."""
        run_id = self.next_id
        self.next_id += 1
        self.call(WorkerHost.add_run, run_id, asdict(lora))
        if self.seed is None:  # the first run built the workers' engine
            self.seed, self.can_reseed = run_seed(lora), bool(self.call(WorkerHost.can_reseed))
        self.runs += 1
        return RayEngineRun(base_model, self, lora, pool, run_id)

    def close_run(self, run_id: int) -> None:
        """Run ``run_id`` closed: closed on every rank; the workers stop with the last run."""
        if self.closed:
            return
        self.call(WorkerHost.close_run, run_id)
        self.runs -= 1
        if self.runs == 0:
            self.closed = True
            self.cluster.close()


class RayEngineRun:
    """A training run on a :class:`RayEngine` (``contract.TrainingRun``): every call runs
    :class:`EngineRun`'s method on all ranks, each taking its DP shard of the datums (padded to a
    multiple of the DP size with datums that count 0) and gathering the outputs back in order;
    rank 0's result is returned. Samplers are the merged weights rank 0 exports, served by the
    server's rollout engine as for an in-process run. Opened by :meth:`RayEngine.open_run`."""

    def __init__(self, base_model: str, engine: RayEngine, lora: LoraIn, pool: RolloutPool, run_id: int) -> None:
        self.base_model, self.lora, self.pool, self.engine, self.id = base_model, lora, pool, engine, run_id
        self.closed = False

    def _call(self, method: Callable[..., T], *args: Any) -> T:
        if self.closed:
            raise UserError(UNLOADED)
        return self.engine.call(WorkerHost.on_run, self.id, method, *args)

    def forward_backward(self, datums: list[DatumIn], loss_fn: str, loss_fn_config: dict | None, forward_only: bool) -> ForwardBackwardOut:
        """``EngineRun.forward_backward`` on every rank."""
        return self._call(EngineRun.forward_backward, datums, loss_fn, loss_fn_config, forward_only)

    def optim_step(self, adam: AdamIn) -> dict[str, float]:
        """``EngineRun.optim_step`` on every rank."""
        return self._call(EngineRun.optim_step, adam)

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        """``EngineRun.save_state`` on every rank (a collective checkpoint)."""
        self._call(EngineRun.save_state, directory, with_optimizer)

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        """``EngineRun.load_state`` on every rank."""
        self._call(EngineRun.load_state, directory, with_optimizer)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The run's LoRA adapters by peft's names (rank 0's export)."""
        return self._call(EngineRun.adapter_weights)

    def sampler(self, directory: Path | None) -> Snapshot:
        """As ``EngineRun.sampler``, from the weights rank 0 exports."""
        if directory is None and self.pool.serves_adapter(self.lora.rank, self.engine.signature.modules):
            return adapter_snapshot(self.pool, self._call(EngineRun.adapter_weights), self.lora.rank, self.engine.lora_alpha)
        return snapshot(self.pool, self.base_model, self._call(EngineRun.merged_weights), directory)

    def close(self) -> None:
        """Close the run on the workers (idempotent); later calls are refused by name."""
        if not self.closed:
            self.closed = True
            self.engine.close_run(self.id)
