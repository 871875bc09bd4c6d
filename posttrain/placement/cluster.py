"""Start or join a Ray cluster, place worker groups on its pools, and drive them.

``RayCluster`` is the driver's side of ``trainer.launcher=ray``:

1. ``ray.init`` (a local instance, or ``trainer.ray_address``), then a check that the cluster
   can hold every pool (CPUs, GPUs, and a node big enough for one bundle) and one placement
   group per pool, granted within ``placement.ready_timeout_s``. Both happen before any model is
   built; what is missing is named.
2. ``spawn`` starts one ``Worker`` per bundle of a pool and joins them into the pool's own
   ``torch.distributed`` world (rank 0 picks the address).
3. ``call`` / ``call_many`` run a method on every rank of one or several groups at once and
   return rank 0's result. Tensor arguments are put into Ray's object store once (held once per
   node) and read by every worker; a worker process that dies tears every group down
   and raises ``WorkerDied`` naming the pool, its roles and the rank; an exception raised in
   the workers is re-raised on the driver as itself, after the other ranks of the call finished
   (at most ``engine.dist_timeout_s`` later: their collectives time out), with the rank in a note.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.placement.config import PlacementConfig
from posttrain.placement.worker import Method, Worker, path_of

# Passed on to every worker: a joined cluster's workers do not inherit the driver's environment.
_FORWARDED_ENV = ("ENGINEKIT_", "VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "PYTHONPATH", "OMP_", "MKL_", "CUDA_LAUNCH")
# torch's own default collective timeout, used when engine.dist_timeout_s is null.
_DEFAULT_TIMEOUT_S = 1800.0


class WorkerDied(RuntimeError):
    """A worker process of a group died (killed, out of memory, its node lost); every group was torn down."""


def ray_missing() -> str | None:
    """Why Ray cannot be used here, or None."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "trainer.launcher = 'ray': the ray package is not installed; fix: pip install -e '.[ray]' (or trainer.launcher=torchrun)"
    return None


@dataclass
class WorkerGroup:
    """The workers of one pool: one Ray actor per rank, one ``torch.distributed`` world.

    Attributes:
        pool: the pool's name.
        roles: the roles placed on it (they share these processes).
        workers: the Ray actor handles, by rank.
        nodes: each rank's ``{"node_id", "ip", "pid"}``.
    """

    pool: str
    roles: tuple[str, ...]
    workers: list[Any]
    nodes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.workers)

    def describe(self, rank: int) -> str:
        node = self.nodes[rank] if rank < len(self.nodes) else {}
        where = f" (pid {node['pid']} on {node['ip']})" if node else ""
        return f"{'+'.join(self.roles)} rank {rank} of pool {self.pool!r}{where}"


def _ray_start_failure(address: str | None, exc: BaseException) -> str:
    """What ``ray.init`` failing means for this run, and the knobs, in one message."""
    import ray

    if ray.is_initialized():
        ray.shutdown()  # what a half-started local instance left
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if address is not None:
        return (
            f"trainer.ray_address = {address!r}: could not join the Ray cluster ({type(exc).__name__}: {first}); fix: start it "
            "(`ray start --head`) or correct the address, or run without Ray (trainer.launcher=torchrun)"
        )
    slow = "timed out during startup" in str(exc)
    cause = (
        "its raylet did not register within the 30 s Ray 2.x waits (a fixed limit in ray._private.node): most often a busy or slow machine"
        if slow
        else "it failed to start"
    )
    return (
        f"trainer.launcher = 'ray': the local Ray instance did not start ({type(exc).__name__}: {first}); {cause}; fix: start "
        "the instance yourself, which waits as long as it needs (`ray start --head --num-cpus N`), and join it with "
        "trainer.ray_address=auto; or run without Ray: trainer.launcher=torchrun (the same run on one node)"
    )


class RayCluster:
    """The Ray side of a run: pools, worker groups, calls, teardown. Use as a context manager.

    Args:
        placement: ``trainer.placement``.
        pools_roles: pool -> the roles placed on it (pools without roles are not created).
        address: ``trainer.ray_address``: null starts a local instance (stopped at the end),
            ``auto`` or ``HOST:PORT`` joins a running cluster (left running).
        timeout_s: ``engine.dist_timeout_s`` (null: torch's default, 30 minutes).
    """

    def __init__(self, placement: PlacementConfig, pools_roles: dict[str, tuple[str, ...]], address: str | None, timeout_s: float | None):
        problem = ray_missing()
        if problem:
            raise ValueError(problem)
        self.placement, self.pools_roles, self.address = placement, pools_roles, address
        self.timeout_s = float(timeout_s or _DEFAULT_TIMEOUT_S)
        self.groups: list[WorkerGroup] = []
        self._pgs: dict[str, Any] = {}
        self._started_ray = False
        self._closed = False
        self._bundle: dict[str, float] = {}

    # ------------------------------------------------------------------------------ setup
    def __enter__(self) -> RayCluster:
        import ray

        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            if self.address is None:
                self._started_ray = True
            else:
                kwargs["address"] = self.address
            try:
                ray.init(**kwargs)
            except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for a slow start
                raise RuntimeError(_ray_start_failure(self.address, exc)) from exc
        try:
            self._bundle = self._worker_bundle()
            self._check_resources()
            self._reserve()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _worker_bundle(self) -> dict[str, float]:
        """What one worker reserves: ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs
        (null: 1 when the cluster has GPUs, since the driver's own node may have none)."""
        import ray

        g = self.placement.gpus_per_worker
        gpus = (1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0) if g is None else float(g)
        return {"CPU": float(self.placement.cpus_per_worker), **({"GPU": gpus} if gpus else {})}

    def _check_resources(self) -> None:
        """Refuse a placement the cluster cannot hold, naming what is missing."""
        import ray

        sizes = self.placement.pool_sizes()
        used = {p: sizes[p] for p in self.pools_roles}
        bundle = self._bundle
        available = ray.available_resources()
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        where = "the local Ray instance" if self.address is None else f"the Ray cluster at {self.address}"
        missing = []
        for resource, per_worker in bundle.items():
            need = per_worker * sum(used.values())
            have = float(available.get(resource, 0.0))
            if need > have + 1e-9:
                detail = ", ".join(f"{p}: {n} x {per_worker:g}" for p, n in used.items())
                missing.append(f"{need:g} {resource} ({detail}) but {where} has {have:g} available")
            if not any(float(n.get(resource, 0.0)) >= per_worker for n in nodes):
                missing.append(f"one worker needs {per_worker:g} {resource} on one node, and no node of {where} has that many")
        if missing:
            raise ValueError(
                "trainer.placement: the pools need " + "; ".join(missing) + "; fix: lower trainer.placement.cpus_per_worker / "
                "gpus_per_worker or the pool sizes, or add nodes to the cluster (ray start --address=HEAD:PORT on each)"
            )

    def _reserve(self) -> None:
        """One placement group per pool, all granted within ``ready_timeout_s``."""
        import ray
        from ray.util.placement_group import placement_group

        sizes = self.placement.pool_sizes()
        for pool in self.pools_roles:
            self._pgs[pool] = placement_group([self._bundle] * sizes[pool], strategy=self.placement.strategy, name="")
        waiting = {pool: pg.ready() for pool, pg in self._pgs.items()}
        ready, _ = ray.wait(list(waiting.values()), num_returns=len(waiting), timeout=self.placement.ready_timeout_s)
        late = [pool for pool, ref in waiting.items() if ref not in ready]
        if late:
            raise ValueError(
                f"trainer.placement: the Ray cluster did not grant pool(s) {late} ({self.placement.strategy}, "
                f"{self._bundle} per worker) within placement.ready_timeout_s = {self.placement.ready_timeout_s:g} s; fix: "
                "a strategy the nodes can satisfy (STRICT_SPREAD needs a node per worker, STRICT_PACK one node for the pool), "
                "fewer workers, or more nodes"
            )

    def build(self, group: WorkerGroup, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Build every rank's host object: ``factory(*args, **kwargs)`` in each worker (a class
        or a module-level function, passed as itself: it travels as its module and qualified
        name, ``worker.path_of``, so the call sites are imports a reader and the import-graph
        test see)."""
        args = tuple(_put(a) for a in args)
        self._collect(group, [w.build.remote(path_of(factory), *args, **kwargs) for w in group.workers])

    def spawn(self, pool: str) -> WorkerGroup:
        """Start the pool's workers and join them into one ``torch.distributed`` world."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        size = self.placement.pool_sizes()[pool]
        bundle = self._bundle
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}
        threads = max(1, int(self.placement.cpus_per_worker))
        actor_cls = ray.remote(Worker)
        pg = self._pgs[pool]
        # Ranks follow bundle order; the local rank is known only once each worker reports its node.
        options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0), "max_restarts": 0, "max_concurrency": 1}
        group = WorkerGroup(pool, self.pools_roles[pool], [])
        self.groups.append(group)
        placed = [
            actor_cls.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env},
            )
            for i in range(size)
        ]
        # Local rank: position among the pool's bundles on the same node (0 with a GPU each).
        bundle_nodes = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        local = []
        for i in range(size):
            node = bundle_nodes.get(i)
            local.append(0 if bundle.get("GPU") else sum(1 for j in range(i) if bundle_nodes.get(j) == node))
        group.workers = [placed[i].remote(i, size, local[i], threads, env) for i in range(size)]
        group.nodes = self._collect(group, [w.node.remote() for w in group.workers], all_ranks=True)
        addr, port = self._collect(group, [group.workers[0].open_store.remote(self.timeout_s)], all_ranks=True)[0]
        self._collect(group, [w.join_world.remote(addr, port, self.timeout_s) for w in group.workers])
        return group

    def record(self, output_dir: str) -> str:
        """Write ``<output_dir>/placement.json``: every rank's pool, roles, node and pid (for
        operators: which process to look at when one fails); its path."""
        os.makedirs(output_dir, exist_ok=True)
        rows = [{"pool": g.pool, "roles": list(g.roles), "rank": r, **g.nodes[r]} for g in self.groups for r in range(g.size)]
        path = os.path.join(output_dir, "placement.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        return path

    # ------------------------------------------------------------------------------ calls
    def call(self, group: WorkerGroup, method: Callable[..., Any] | Method, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on every rank of ``group``; rank 0's result. ``method`` is
        a function defined on a class, passed as itself (``RLHost.send_weights``,
        ``Rollout.sync_weights``), or a ``worker.Method`` (a class and the name of a method it
        has, inherited ones too): it runs on the host object when the host is of that class,
        else on the host's one attribute of that class (``worker.owner_of``)."""
        return self.call_many([(group, method, args, kwargs)])[0]

    def call_many(self, calls: Sequence[tuple[WorkerGroup, Callable[..., Any], tuple, dict]]) -> list[Any]:
        """Several group calls running at the same time (e.g. the two ends of a weight
        transfer); each one's rank-0 result, in order."""
        refs, owners = [], []
        for group, method, args, kwargs in calls:
            path = path_of(method)
            args = tuple(_put(a) for a in args)
            kwargs = {k: _put(v) for k, v in kwargs.items()}
            for rank, worker in enumerate(group.workers):
                refs.append(worker.call.remote(path, *args, **kwargs))
                owners.append((group, rank))
        results = self._wait(refs, owners)
        out, i = [], 0
        for group, *_ in calls:
            out.append(results[i])
            i += group.size
        return out

    def _collect(self, group: WorkerGroup, refs: list, all_ranks: bool = False) -> list[Any]:
        results = self._wait(refs, [(group, r) for r in range(len(refs))])
        return results if all_ranks else results[:1]

    def _wait(self, refs: list, owners: list[tuple[WorkerGroup, int]]) -> list[Any]:
        """Every ref's value. A dead worker: tear down at once and raise ``WorkerDied``. A
        raised exception: wait for the call's other ranks (each either finishes or raises when
        its collectives time out), then re-raise the first one as itself."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        first: tuple[int, BaseException] | None = None
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                stuck = ", ".join(owners[index[r]][0].describe(owners[index[r]][1]) for r in pending)
                self.close(graceful=False)
                group, rank = owners[first[0]]
                raise RuntimeError(
                    f"{group.describe(rank)} failed and {stuck} did not finish within engine.dist_timeout_s = {self.timeout_s:g} s; "
                    "every worker group was torn down"
                ) from first[1]
            ref = ready[0]
            i = index[ref]
            try:
                results[i] = ray.get(ref)
            except RayTaskError as exc:
                if first is None:
                    first, deadline = (i, exc.cause if exc.cause is not None else exc), time.monotonic() + self.timeout_s
            except RayActorError as exc:
                group, rank = owners[i]
                what = group.describe(rank)
                self.close(graceful=False)
                raise WorkerDied(
                    f"the {what} died ({type(exc).__name__}); every worker group was torn down; fix: find why in its log "
                    "(killed, out of memory, node lost), then rerun with trainer.resume=true to continue from the last checkpoint"
                ) from None
        if first is not None:
            group, rank = owners[first[0]]
            error = first[1]
            error.add_note(f"raised in the {group.describe(rank)} (trainer.launcher=ray)")
            raise error
        return results

    # ------------------------------------------------------------------------------ teardown
    def close(self, graceful: bool = True) -> None:
        """Stop every worker (``graceful``: let each close its host first, e.g. shut its
        inference engine down; after a fault the survivors may be blocked in a collective, so
        they are killed at once), free the pools, and stop Ray when this run started it.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            return
        closing = [w.close.remote() for g in self.groups for w in g.workers] if graceful else []
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=30)
        for group in self.groups:
            for worker in group.workers:
                ray.kill(worker, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        for pg in self._pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 (already gone with the cluster)
                pass
        if self._started_ray:
            ray.shutdown()


def _put(value: Any) -> Any:
    """Tensors, tensor dicts and lists of tensors go through the object store once for all ranks."""
    import ray

    tensors = isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value)
    if tensors or isinstance(value, torch.Tensor) or type(value).__name__ == "TensorDict":
        return ray.put(value)
    return value
