"""Driver-side stand-ins for roles that live in Ray worker groups (``trainer.launcher=ray``).

A ``RemoteRole`` has the methods of the role class it stands for; calling one runs it on every
rank of the role's group at once (``RayCluster.call`` with the class's own function, so the
worker finds the role object of that class on its host) and returns rank 0's result, which is
what a colocated recipe's rank 0 sees. So a recipe's loop is the same code under both launchers.
The RL rollout's stand-in, which also moves weights between groups, is
``posttrain.placement.rl_host.RemoteRollout``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from posttrain.placement.cluster import RayCluster, WorkerGroup
from posttrain.placement.worker import Method


class RemoteRole:
    """The ``cls`` object of ``group``'s hosts: ``handle.method(*args)`` runs ``cls.method`` on
    every rank.

    Args:
        cluster: the run's cluster.
        group: the worker group hosting the role.
        cls: the role's class (the host's own class when the host is the role).
    """

    def __init__(self, cluster: RayCluster, group: WorkerGroup, cls: type) -> None:
        self._cluster, self._group, self._cls = cluster, group, cls

    def __getattr__(self, method: str) -> Any:
        fn = getattr(self._cls, method, None) if not method.startswith("_") else None
        if not inspect.isfunction(fn):
            raise AttributeError(f"{self._cls.__name__} (on Ray pool {self._group.pool!r}) has no method {method!r}")
        return functools.partial(self._cluster.call, self._group, Method(self._cls, method))

    def __repr__(self) -> str:
        return f"RemoteRole({self._cls.__name__} on pool {self._group.pool!r}, {self._group.size} rank(s))"
