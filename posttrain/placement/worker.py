"""The Ray actor one rank of a worker group runs in (``posttrain.placement.cluster`` spawns it).

A worker joins its group's own ``torch.distributed`` world (gloo on CPU, NCCL when Ray gave
it a GPU), builds the objects of the roles placed on its pool with the host class the driver
passes (``RayCluster.build(group, RLHost, ...)``: the class itself travels as its module and
qualified name), and then runs the driver's calls on them: a method named by the driver as a
function (``RayCluster.call(group, RLHost.send_weights, ...)``, or a role's method such as
``Actor.update``, run on the host's one attribute of that class). Only rank 0 of a group returns
a call's result: every rank computes the same global outputs (the roles gather them), so one
copy travels back.

The world's rendezvous is a ``TCPStore`` that rank 0 opens on port 0 of its node (the OS picks
a free port; never a fixed one) and the others join; the usual launcher variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) are set as torchrun would, for
code that reads them.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def resolve(path: str) -> Any:
    """The object at ``module:qualified.name`` (a class, a function, or a class's method)."""
    module, _, name = path.partition(":")
    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


@dataclass(frozen=True)
class Method:
    """Method ``name`` as class ``cls`` has it (defined there or inherited): a remote call's
    target when the class that defines the function is not the one to find on the host (both an
    ``Actor`` and a ``Critic`` inherit ``compute_log_probs``)."""

    cls: type
    name: str


def path_of(obj: Any) -> str:
    """``module:qualified.name`` of a class, a function defined at module level or on a class,
    or a :class:`Method` (what :func:`resolve` finds again in another process). A class of the
    script run as ``python -m pkg.mod`` is named by its module, not ``__main__``.

    Raises:
        ValueError: a lambda or a function defined inside another (not reachable by name).
    """
    if isinstance(obj, Method):
        return f"{path_of(obj.cls)}.{obj.name}"
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None and spec.name else module
    if not qualname or not module or "<" in qualname or module == "__main__":
        raise ValueError(f"{obj!r}: a remote call names a class or a method defined at module level of a module; fix: define it there")
    return f"{module}:{qualname}"


def owner_of(host: Any, cls: type) -> Any:
    """The object on ``host`` a method of class ``cls`` is called on: the host itself when it is
    of that class, else the one public attribute of the host that is.

    Raises:
        ValueError: none or several of the host's attributes are of that class.
    """
    if isinstance(host, cls):
        return host
    found = [v for k, v in vars(host).items() if not k.startswith("_") and isinstance(v, cls)]
    if len(found) != 1:
        raise ValueError(f"{type(host).__name__} holds {len(found)} objects of class {cls.__qualname__}; a remote call needs exactly one")
    return found[0]


def master_store(size: int, timeout_s: float) -> tuple[dist.TCPStore, str, int]:
    """A ``TCPStore`` master for ``size`` processes on a free port of this node (the OS picks
    it: never a fixed port), with the node's address and that port."""
    import ray

    ip = ray.util.get_node_ip_address()
    store = dist.TCPStore(ip, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, ip, store.port


class Worker:
    """One rank of a worker group. Created by the cluster as a Ray actor (this module does not
    import Ray; ``node`` asks it at call time).

    Args:
        rank, world_size: this process's place in its group.
        local_rank: its index among the group's processes on the same node (0 when Ray gives
            it its own GPU: that GPU is then its only visible device).
        threads: torch's intra-op threads (the bundle's CPUs, at least 1).
        env: variables set before anything else runs (``ENGINEKIT_*``, ``VLLM_*`` and the like
            of the driver's environment: a joined cluster's workers do not inherit it).
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, threads: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        torch.set_num_threads(threads)
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.host: Any = None
        self._store = None

    def node(self) -> dict[str, Any]:
        """Where this worker runs: Ray node id, node IP and process id."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def open_store(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: open the group's rendezvous store on a free port of this node; its address."""
        self._store, ip, port = master_store(self.world_size, timeout_s)
        return ip, port

    def join_world(self, addr: str, port: int, timeout_s: float) -> None:
        """Join the group's process group through rank 0's store (collective over the group)."""
        store = self._store or dist.TCPStore(addr, port, self.world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            backend = "nccl"
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            ENGINEKIT_DIST_TIMEOUT_S=str(timeout_s),
        )
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout_s))

    def build(self, factory: str, *args: Any, **kwargs: Any) -> None:
        """Build this rank's objects: ``factory(*args, **kwargs)`` (``module:qualified.name`` of a
        class or function: ``path_of``)."""
        self.host = resolve(factory)(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` (``module:Class.method``: ``path_of``) on the host's object of that class
        (``owner_of``) with ``*args, **kwargs``; the result on rank 0, None on the others."""
        owner, _, name = method.rpartition(".")
        out = getattr(owner_of(self.host, resolve(owner)), name)(*args, **kwargs)
        return out if self.rank == 0 else None

    def close(self) -> None:
        """Release the host's resources (``host.close()``) and leave the process group."""
        try:
            if self.host is not None and hasattr(self.host, "close"):
                self.host.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
