"""``trainer.placement``: the resource pools of a Ray run and the pool each role runs on.

A pool is a placement group of ``size`` bundles; each bundle holds one worker process (a Ray
actor) that is one rank of every role placed on that pool. Roles on the same pool share those
processes (colocated, as under torchrun, where every role lives in every rank); a role on a
pool of its own gets its own processes and its own ``torch.distributed`` world.

Layouts (``docs/launching.md``):

* everything colocated: ``pools: {main: N}`` (the default is ``{main: 1}``);
* actor + reference with the critic apart: ``pools: {train: 2, critic: 1}``,
  ``roles: {critic: critic}``;
* rollout disaggregated: ``pools: {train: 2, gen: 1}``, ``roles: {rollout: gen}``.

Roles a recipe has but ``roles`` does not list run on the actor's pool, and the actor on the
first pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAUNCHERS = ("torchrun", "ray")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEFAULT_POOL = "main"


@dataclass(frozen=True)
class PlacementConfig:
    """Where each role's processes run with ``trainer.launcher=ray``.

    Attributes:
        pools: pool name -> number of worker processes (ranks) in it; empty: ``{main: 1}``.
            Pools are listed in order; the first is the actor's unless ``roles`` says otherwise.
        roles: role -> pool (``actor``, ``reference``, ``critic``, ``teacher``, ``reward_model``, ``rollout``; SFT has only
            ``actor``); an unlisted role runs on the actor's pool, colocated with it.
        cpus_per_worker: CPUs each worker reserves in its bundle (fractions allowed: on a
            small machine ``0.5`` fits two workers per core); it also sets the worker's torch
            threads (at least 1).
        gpus_per_worker: GPUs each worker reserves; null: 1 when the Ray cluster has GPUs, else 0.
        strategy: how a pool's bundles spread over nodes: ``PACK`` (fill a node first),
            ``SPREAD``, ``STRICT_PACK`` (one node) or ``STRICT_SPREAD`` (one bundle per node).
        ready_timeout_s: how long the cluster may take to grant every pool before the run is
            refused (a pool it cannot hold is refused at once, naming what is missing).
    """

    pools: dict[str, int] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None
    strategy: str = "PACK"
    ready_timeout_s: float = 60.0

    def pool_sizes(self) -> dict[str, int]:
        """The pools, with the default ``{main: 1}`` when none are given."""
        return dict(self.pools) or {DEFAULT_POOL: 1}

    def assignment(self, roles: tuple[str, ...]) -> dict[str, str]:
        """Role -> pool for the roles a run has (``roles``, the actor first)."""
        pools = list(self.pool_sizes())
        actor_pool = self.roles.get("actor", pools[0])
        return {role: self.roles.get(role, actor_pool) for role in roles}

    def _problems(self) -> list[str]:
        out = []
        for name, size in self.pool_sizes().items():
            if not isinstance(size, int) or size < 1:
                out.append(f"placement.pools.{name} = {size!r}: a pool needs at least one worker; fix: e.g. pools.{name}=2")
        unknown = sorted(set(self.roles.values()) - set(self.pool_sizes()))
        if unknown:
            out.append(
                f"placement.roles names pool(s) {unknown} that placement.pools does not define ({sorted(self.pool_sizes())}); "
                "fix: add them to placement.pools or place the role on a defined pool"
            )
        if not self.cpus_per_worker > 0:
            out.append(f"placement.cpus_per_worker = {self.cpus_per_worker}: must be positive; fix: e.g. 1 (or 0.5 on a small machine)")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            out.append(f"placement.gpus_per_worker = {self.gpus_per_worker}: negative; fix: 0, 1, or null (1 when the cluster has GPUs)")
        if self.strategy not in STRATEGIES:
            out.append(f"placement.strategy = {self.strategy!r}: unknown; fix: use one of {', '.join(STRATEGIES)}")
        if not self.ready_timeout_s > 0:
            out.append(f"placement.ready_timeout_s = {self.ready_timeout_s}: must be positive; fix: e.g. 60")
        return out


def placement_problems(placement: PlacementConfig, roles: tuple[str, ...], shared: dict[str, str] | None = None) -> list[str]:
    """What makes ``placement`` unusable for a run with ``roles`` (the actor first).

    Args:
        placement: ``trainer.placement``.
        roles: the roles this run has (e.g. ``("actor", "rollout")`` for GRPO without KL).
        shared: role -> the role whose engine it shares and must therefore be colocated with
            (the reference of a LoRA actor is the actor's engine with the adapters off).
    """
    out = []
    extra = sorted(set(placement.roles) - set(roles))
    if extra:
        out.append(
            f"placement.roles places {extra}, which this run does not have (its roles: {', '.join(roles)}); "
            "fix: drop them from placement.roles"
        )
    where = placement.assignment(roles)
    idle = [p for p in placement.pool_sizes() if p not in where.values()]
    if idle:
        out.append(f"placement.pools {idle}: no role runs there (roles: {where}); fix: drop the pool or place a role on it")
    for role, owner in (shared or {}).items():
        if role in where and owner in where and where[role] != where[owner]:
            out.append(
                f"placement.roles.{role} = {where[role]!r}: the {role} shares the {owner}'s engine (pool {where[owner]!r}) "
                f"and must run in its processes; fix: placement.roles.{role}={where[owner]}"
            )
    return out
