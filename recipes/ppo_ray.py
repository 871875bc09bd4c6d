"""``recipes.ppo`` on Ray (``trainer.launcher=ray``): the roles in worker groups on the pools of
``trainer.placement``, the recipe's process driving them (a single controller).

Each pool's workers host the roles placed on it (``RLHost``: the same ``build_roles`` /
``build_rollout_role`` as a torchrun rank, restricted to those roles); the driver holds
``RemoteRole`` / ``RemoteRollout`` stand-ins with the same methods, so ``recipes.ppo.run`` and
``rl_step`` are unchanged. A rollout on the actor's pool syncs in process; on its own pool its
weights come over a transfer group from the actor's rank 0 (``posttrain.placement.transfer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from posttrain.export import save_hf
from posttrain.placement.cluster import RayCluster
from posttrain.placement.remote import RemoteRole, RemoteRollout
from posttrain.placement.transfer import ReceivedWeights, TransferGroup, send_weights
from posttrain.placement.worker import master_store
from posttrain.tasks import build_task
from recipes.rl_roles import build_rollout_role, rl_placement_problems, rl_roles
from roles.factory import build_roles
from roles.rollout import pack_samples, unpack_rows, unpack_samples

# What the driver may call on each role (the methods recipes.ppo uses).
_METHODS = {
    "actor": ("compute_log_probs", "update", "reuses_update_log_probs", "update_on_policy", "save_checkpoint", "load_checkpoint"),
    "critic": ("compute_values", "update", "save_checkpoint", "load_checkpoint"),
    "reference": ("compute_log_probs",),
}


class RLHost:
    """The roles of one pool in one worker process (built by ``posttrain.placement.worker``).

    Args:
        cfg: the recipe config (``engine.model.path`` filled in by the driver).
        hosted: the roles placed on this pool (a rollout hosted with the actor syncs from it in
            process; without it, from the transfer group, built in ``join_transfer``).
    """

    def __init__(self, cfg, hosted: tuple[str, ...]) -> None:
        self.cfg, self.hosted = cfg, hosted
        self.source = build_task(cfg)
        roles = build_roles(cfg, include=[r for r in hosted if r != "rollout"])
        self.actor, self.critic, self.reference = roles.actor, roles.critic, roles.reference
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

    def sample_packed(self, prompts: dict, seeds: list[int], kept: dict | None, max_new_tokens: int | None) -> dict:
        """``Rollout.sample`` with prompts and samples packed (``roles.rollout.pack_samples``):
        what ``RemoteRollout.sample`` calls."""
        out = self.rollout.sample(unpack_rows(prompts), seeds, None if kept is None else unpack_samples(kept), max_new_tokens)
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

    def save_hf(self, out_dir: str, fmt: str) -> str:
        return self.cluster.call(self.actor_group, "save_hf", out_dir, fmt)

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
            cluster.build(groups[pool], "recipes.ppo_ray:RLHost", cfg, hosted)
        actor_group, rollout_group = groups[where["actor"]], groups[where["rollout"]]
        split = actor_group is not rollout_group
        if split:
            size = 1 + rollout_group.size
            addr, port = cluster.call(actor_group, "open_transfer", size, cluster.timeout_s)
            cluster.call_many([(g, "join_transfer", (addr, port, size, cluster.timeout_s), {}) for g in (actor_group, rollout_group)])
        adapter = cluster.call(rollout_group, "adapter_sync")
        handles = {
            role: RemoteRole(cluster, groups[where[role]], role, _METHODS[role]) if role in where else None
            for role in ("actor", "critic", "reference")
        }
        alone = pools[where["rollout"]] == ("rollout",)
        rollout = RemoteRollout(cluster, rollout_group, actor_group if split else None, adapter, cfg.rollout.sync_bucket_mb, alone)
        cluster.record(t.output_dir)
        return RayRoles(handles["actor"], handles["critic"], handles["reference"], rollout, cluster, actor_group)
    except BaseException:
        cluster.close(graceful=False)
        raise
