"""Driver-side stand-ins for roles that live in Ray worker groups (``trainer.launcher=ray``).

A ``RemoteRole`` has the methods of the role it stands for; calling one runs it on every rank of
the role's group at once (``RayCluster.call``) and returns rank 0's result, which is what a
colocated recipe's rank 0 sees. So a recipe's loop (``recipes.ppo.rl_step``) is the same code
under both launchers.

``RemoteRollout`` adds the weight sync of a rollout on a pool of its own: the actor group sends
(``send_weights``) while the rollout group receives (``rollout.sync_weights``), both started
together; with the rollout colocated with the actor the sync is the in-process one.
"""

from __future__ import annotations

import functools
from typing import Any

from posttrain.placement.cluster import RayCluster, WorkerGroup
from roles.rollout import pack_rows, pack_samples, unpack_samples


class RemoteRole:
    """``name`` on ``group``: ``handle.method(*args)`` = ``host.<name>.method(*args)`` on every rank.

    Args:
        cluster: the run's cluster.
        group: the worker group hosting the role.
        name: the role's attribute on the host (``actor``, ``critic``, ...); empty: the host itself.
        methods: the methods exposed (others raise ``AttributeError``, as on the role).
    """

    def __init__(self, cluster: RayCluster, group: WorkerGroup, name: str, methods: tuple[str, ...]) -> None:
        self._cluster, self._group, self._name, self._methods = cluster, group, name, methods

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_") or method not in self._methods:
            raise AttributeError(f"{self._name} (on Ray pool {self._group.pool!r}) has no method {method!r}")
        path = f"{self._name}.{method}" if self._name else method
        return functools.partial(self._cluster.call, self._group, path)

    def __repr__(self) -> str:
        return f"RemoteRole({self._name!r} on pool {self._group.pool!r}, {self._group.size} rank(s))"


class RemoteRollout:
    """The ``roles.rollout.Rollout`` of a worker group, with the methods a recipe calls.

    Args:
        cluster: the run's cluster.
        group: the rollout's worker group.
        actor_group: the actor's group, when it is another one (then weights travel over the
            transfer group); None: colocated.
        adapter: sync only the LoRA adapters (the rollout's ``adapter_sync``).
        bucket_mb: ``rollout.sync_bucket_mb``.
        alone: the rollout's group hosts no other role.
    """

    def __init__(
        self,
        cluster: RayCluster,
        group: WorkerGroup,
        actor_group: WorkerGroup | None,
        adapter: bool,
        bucket_mb: float | None,
        alone: bool = False,
    ) -> None:
        self._cluster, self._group, self._actor_group = cluster, group, actor_group
        self._adapter, self._bucket_mb = adapter, bucket_mb
        #: whether generation can run while the other roles train: the rollout's group hosts
        #: no other role (calls from two driver threads never queue on the same workers)
        self.overlaps = bool(alone and actor_group is not None)
        #: the last sync's seconds and MB (``rollout/sync_s``, ``rollout/sync_mb``)
        self.last_sync: dict[str, float] = {}

    def sync_weights(self, version: int | None = None) -> None:
        """The actor's weights into the rollout engines as ``version`` (see ``Rollout.sync_weights``)."""
        receive = (self._group, "rollout.sync_weights", (version,), {})
        if self._actor_group is None:
            self._cluster.call_many([receive])
        else:
            send = (self._actor_group, "send_weights", (self._adapter, self._bucket_mb), {})
            self._cluster.call_many([send, receive])
        self.last_sync = self._cluster.call(self._group, "rollout.last_sync")

    def generate(self, prompts, seed_offset: int | None = None):
        """One response per prompt, sampled across the rollout group (see ``Rollout.generate``)."""
        return self._cluster.call(self._group, "rollout.generate", prompts, seed_offset=seed_offset)

    def sample(self, prompts, seeds, kept=None, max_new_tokens: int | None = None):
        """One ``Sample`` per prompt across the rollout group (see ``Rollout.sample``); prompts
        and samples travel packed in a few flat tensors (``roles.rollout.pack_samples``)."""
        packed = self._cluster.call(
            self._group, "sample_packed", pack_rows(prompts), list(seeds), None if kept is None else pack_samples(kept), max_new_tokens
        )
        return unpack_samples(packed)

    def release(self) -> None:
        """Free the engines' memory for training (see ``Rollout.release``)."""
        self._cluster.call(self._group, "rollout.release")
