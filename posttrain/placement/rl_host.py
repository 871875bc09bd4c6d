"""An RL run on Ray (``trainer.launcher=ray``): the roles in worker groups on the pools of
``trainer.placement``, the recipe's process driving them (a single controller).

Each pool's workers host the roles placed on it (:class:`RLHost`: the same ``build_roles`` /
``build_rollout_role`` as a torchrun rank, restricted to those roles); the driver holds
``RemoteRole`` / :class:`RemoteRollout` stand-ins with the same methods, so the recipe's loop is
unchanged. A rollout on the actor's pool syncs in process; on its own pool its weights come over
a transfer group from the actor's rank 0 (``posttrain.placement.transfer``). Every remote call
names its target as a function (``RLHost.send_weights``, ``Rollout.sync_weights``,
``Actor.update``), never as a string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from engine_api import EngineConfig
from posttrain.export import save_hf
from posttrain.placement.cluster import RayCluster, WorkerGroup
from posttrain.placement.remote import RemoteRole
from posttrain.placement.transfer import ReceivedWeights, TransferGroup, send_weights
from posttrain.placement.worker import master_store
from posttrain.rl_setup import build_rollout_role, rl_placement_problems, rl_roles
from posttrain.tasks import build_task
from roles.factory import build_roles, role_classes
from roles.rollout import Rollout, pack_rows, pack_samples, unpack_rows, unpack_samples


class RLHost:
    """The roles of one pool in one worker process (built by ``posttrain.placement.worker``).

    Args:
        cfg: the recipe config (``engine.model.path`` filled in by the driver).
        hosted: the roles placed on this pool (a rollout hosted with the actor syncs from it in
            process; without it, from the transfer group, built in ``join_transfer``).
    """

    def __init__(self, cfg, hosted: tuple[str, ...]) -> None:
        self.cfg, self.hosted = cfg, hosted
        self.source = build_task(cfg.data, cfg.engine.model.path, cfg.reward)
        roles = build_roles(cfg, include=[r for r in hosted if r != "rollout"])
        self.actor, self.critic, self.reference, self.teacher = roles.actor, roles.critic, roles.reference, roles.teacher
        self.reward_model = roles.reward_model
        self.transfer: TransferGroup | None = None
        self._store = None
        self.rollout = None
        if "rollout" in hosted and "actor" in hosted:
            self.rollout = build_rollout_role(cfg, self.actor, self.source)

    # ------------------------------------------------------------- the transfer group
    def open_transfer(self, size: int, timeout_s: float) -> tuple[str, int] | None:
        """Actor rank 0: open the transfer group's store; its address (None elsewhere)."""
        if dist.get_rank() != 0:
            return None
        self._store, addr, port = master_store(size, timeout_s)
        return addr, port

    def join_transfer(self, addr: str, port: int, size: int, timeout_s: float) -> None:
        """Join the transfer group: the actor's rank 0 as sender (rank 0), every rollout rank
        as receiver (rank 1 + its rollout rank); then build the rollout role on it."""
        if "actor" in self.hosted:
            if dist.get_rank() == 0:
                self.transfer = TransferGroup(addr, port, 0, size, timeout_s, store=self._store)
            return
        self.transfer = TransferGroup(addr, port, 1 + dist.get_rank(), size, timeout_s)
        self.rollout = build_rollout_role(self.cfg, ReceivedWeights(self.transfer), self.source)

    def adapter_sync(self) -> bool:
        """Whether the rollout syncs only LoRA adapters (its engine serves them)."""
        return bool(self.rollout.adapter_sync)

    def send_weights(self, adapter: bool, bucket_mb: float | None) -> float:
        """Export the actor's weights (collective over the actor group) and stream them to the
        rollout group; MB sent."""
        pairs = self.actor.export_adapter_weights() if adapter else self.actor.export_weights(bucket_mb=bucket_mb)
        return send_weights(pairs, self.transfer, bucket_mb)

    def last_sync(self) -> dict[str, float]:
        """The rollout's last sync's seconds and MB (``Rollout.last_sync``)."""
        return self.rollout.last_sync

    def sample_packed(
        self, prompts: dict, seeds: list[int], kept: dict | None, max_new_tokens: int | None, stop: list[str] | None = None
    ) -> dict:
        """``Rollout.sample`` with prompts and samples packed (``roles.rollout.pack_samples``):
        what ``RemoteRollout.sample`` calls."""
        out = self.rollout.sample(unpack_rows(prompts), seeds, None if kept is None else unpack_samples(kept), max_new_tokens, stop)
        return pack_samples(out)

    # ------------------------------------------------------------- the run
    def save_hf(self, out_dir: str, fmt: str) -> str:
        """``posttrain.export.save_hf`` of the actor (collective over its group)."""
        return save_hf(self.actor, self.cfg.engine, out_dir, fmt)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.engine.shutdown()


@dataclass
class RayRoles:
    """The placed roles of a Ray run, as ``recipes.ppo.run`` uses them."""

    actor: Any
    critic: Any
    reference: Any
    rollout: Any
    cluster: RayCluster
    actor_group: Any
    teacher: Any = None
    reward_model: Any = None

    def save_hf(self, out_dir: str, fmt: str) -> str:
        return self.cluster.call(self.actor_group, RLHost.save_hf, out_dir, fmt)

    def close(self) -> None:
        self.cluster.close()


def place_on_ray(cfg) -> RayRoles:
    """Start (or join) Ray, reserve the pools, build every pool's roles and wire the rollout's
    weight sync; the cluster is torn down if any of it fails.

    Raises:
        ValueError: a placement this run cannot use, or a cluster that cannot hold it (before
            any model is built).
    """
    problems = rl_placement_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))
    t = cfg.trainer
    roles = rl_roles(cfg)
    where = t.placement.assignment(roles)
    pools = {p: tuple(r for r in roles if where[r] == p) for p in t.placement.pool_sizes() if p in where.values()}
    cluster = RayCluster(t.placement, pools, t.ray_address, cfg.engine.dist_timeout_s).__enter__()
    try:
        groups = {p: cluster.spawn(p) for p in pools}
        for pool, hosted in pools.items():
            cluster.build(groups[pool], RLHost, cfg, hosted)
        actor_group, rollout_group = groups[where["actor"]], groups[where["rollout"]]
        split = actor_group is not rollout_group
        if split:
            size = 1 + rollout_group.size
            addr, port = cluster.call(actor_group, RLHost.open_transfer, size, cluster.timeout_s)
            join = (addr, port, size, cluster.timeout_s)
            cluster.call_many([(g, RLHost.join_transfer, join, {}) for g in (actor_group, rollout_group)])
        adapter = cluster.call(rollout_group, RLHost.adapter_sync)
        classes = role_classes(cfg)
        handles = {
            role: RemoteRole(cluster, groups[where[role]], classes[role]) if role in where else None
            for role in ("actor", "critic", "reference", "teacher", "reward_model")
        }
        alone = pools[where["rollout"]] == ("rollout",)
        rollout = RemoteRollout(cluster, rollout_group, actor_group if split else None, adapter, cfg.rollout.sync_bucket_mb, alone)
        cluster.record(t.output_dir)
        return RayRoles(
            handles["actor"],
            handles["critic"],
            handles["reference"],
            rollout,
            cluster,
            actor_group,
            handles["teacher"],
            handles["reward_model"],
        )
    except BaseException:
        cluster.close(graceful=False)
        raise


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
        receive = (self._group, Rollout.sync_weights, (version,), {})
        if self._actor_group is None:
            self._cluster.call_many([receive])
        else:
            send = (self._actor_group, RLHost.send_weights, (self._adapter, self._bucket_mb), {})
            self._cluster.call_many([send, receive])
        self.last_sync = self._cluster.call(self._group, RLHost.last_sync)

    def generate(self, prompts, seed_offset: int | None = None):
        """One response per prompt, sampled across the rollout group (see ``Rollout.generate``)."""
        return self._cluster.call(self._group, Rollout.generate, prompts, seed_offset=seed_offset)

    def sample(self, prompts, seeds, kept=None, max_new_tokens: int | None = None, stop=None):
        """One ``Sample`` per prompt across the rollout group (see ``Rollout.sample``); prompts
        and samples travel packed in a few flat tensors (``roles.rollout.pack_samples``)."""
        kept = None if kept is None else pack_samples(kept)
        stop = list(stop) if stop else None
        packed = self._cluster.call(self._group, RLHost.sample_packed, pack_rows(prompts), list(seeds), kept, max_new_tokens, stop)
        return unpack_samples(packed)

    def release(self) -> None:
        """Free the engines' memory for training (see ``Rollout.release``)."""
        self._cluster.call(self._group, Rollout.release)


@dataclass
class LocalRoles:
    """The roles in this process (``trainer.launcher=torchrun``: every role on every rank)."""

    actor: Any
    critic: Any
    reference: Any
    rollout: Rollout
    engine_config: EngineConfig
    teacher: Any = None
    reward_model: Any = None

    def save_hf(self, out_dir: str, fmt: str) -> str:
        return save_hf(self.actor, self.engine_config, out_dir, fmt)

    def close(self) -> None:
        self.rollout.engine.shutdown()


def place_roles(cfg, source):
    """The run's roles: built in this process (``trainer.launcher=torchrun``), or in worker
    groups on a Ray cluster driven from here (``ray``: :func:`place_on_ray`). Both
    have ``actor``, ``critic``, ``reference``, ``teacher``, ``reward_model``, ``rollout``, ``save_hf`` and ``close``."""
    if cfg.trainer.launcher == "ray":
        return place_on_ray(cfg)
    roles = build_roles(cfg)
    rollout = build_rollout_role(cfg, roles.actor, source)
    return LocalRoles(roles.actor, roles.critic, roles.reference, rollout, cfg.engine, roles.teacher, roles.reward_model)
