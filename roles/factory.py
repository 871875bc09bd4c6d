"""``build_roles``: the one place that chooses between the engine-based roles (the default) and
the legacy FSDP2 workers (``roles/legacy``), by ``trainer.use_legacy_worker_impl``.

Nothing else branches on the flag: a recipe builds its roles here and then calls the same role
methods (``compute_log_probs``, ``update``, ``compute_values``, ``export_weights``,
``save_checkpoint``, ``load_checkpoint``) whichever implementation it got.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from engine_api import EngineConfig, build_engine
from roles.actor import Actor, ActorConfig
from roles.critic import Critic, CriticConfig
from roles.reference import Reference

FLAG = "trainer.use_legacy_worker_impl"
FLAG_VALUES = ("auto", "enable", "disable", True, False)


class RolesRecipeConfig(Protocol):
    """What :func:`build_roles` reads from a recipe config (``recipes.ppo.PPOConfig`` has it):
    ``engine`` (the actor's ``EngineConfig``), ``actor`` / ``critic`` (role configs),
    ``algo.advantage`` (``gae`` builds a critic), ``algo.critic_lr`` and
    ``trainer.use_legacy_worker_impl``."""

    engine: EngineConfig
    actor: ActorConfig
    critic: CriticConfig
    algo: Any
    trainer: Any


@dataclass
class Roles:
    """The trained and frozen roles of an RL recipe.

    Attributes:
        actor: the policy (also the rollout's weight source).
        critic: the value model, or None (GRPO).
        reference: the frozen policy for the KL penalty, or None (``actor.kl_coef == 0``).
        legacy: whether these are the legacy workers.
    """

    actor: Any
    critic: Any | None
    reference: Any | None
    legacy: bool


def use_legacy(value: object) -> bool:
    """Interpret ``trainer.use_legacy_worker_impl``: ``enable`` / true select the legacy workers;
    ``disable`` / false / ``auto`` select the engine roles (``auto`` means "the current default",
    which is the engine roles)."""
    if value is True or value == "enable":
        return True
    if value is False or value in ("disable", "auto"):
        return False
    raise ValueError(f"{FLAG} = {value!r}: unknown; fix: use one of auto, enable, disable, true, false")


def legacy_problems(value: object, engine: EngineConfig) -> list[str]:
    """Config problems of the flag and of its combination with ``engine`` (empty when fine).

    The legacy workers are a direct FSDP2 implementation of the default feature set, kept as a
    parity baseline: FSDP only, fixed-size micro-batches, no offload, no deferred normalization.
    """
    try:
        legacy = use_legacy(value)
    except ValueError as exc:
        return [str(exc)]
    if not legacy:
        return []
    fix = f"fix: set {FLAG}=disable (the engine roles support it) or"
    out = []
    if engine.strategy != "fsdp":
        out.append(
            f"{FLAG} = {value!r} with engine.strategy = {engine.strategy!r}: the legacy workers are FSDP only; {fix} engine.strategy=fsdp"
        )
    if engine.max_token_len_per_micro_batch is not None:
        out.append(
            f"{FLAG} = {value!r} with engine.max_token_len_per_micro_batch = {engine.max_token_len_per_micro_batch}: "
            f"the legacy workers use fixed-size micro-batches; {fix} engine.max_token_len_per_micro_batch=null"
        )
    if engine.offload.param or engine.offload.optimizer:
        out.append(f"{FLAG} = {value!r} with engine.offload = {engine.offload}: the legacy workers do not offload; {fix} turn offload off")
    if engine.deferred_normalization:
        out.append(
            f"{FLAG} = {value!r} with engine.deferred_normalization = true: the legacy workers normalize per call; "
            f"{fix} engine.deferred_normalization=false"
        )
    return out


def critic_engine_config(engine: EngineConfig, critic_lr: float) -> EngineConfig:
    """The critic's engine: the actor's keys with a value head and its own learning rate."""
    model = dataclasses.replace(engine.model, head="value")
    return dataclasses.replace(engine, model=model, optim=dataclasses.replace(engine.optim, lr=critic_lr))


def build_roles(config: RolesRecipeConfig) -> Roles:
    """Build actor, critic (when ``algo.advantage == 'gae'``) and reference (when
    ``actor.kl_coef > 0``) on the implementation ``trainer.use_legacy_worker_impl`` selects.

    Raises:
        ValueError: a bad flag value, or the legacy workers with a config they do not support
            (e.g. ``engine.strategy=megatron``); raised before any model is built.
    """
    flag = config.trainer.use_legacy_worker_impl
    problems = legacy_problems(flag, config.engine)
    if problems:
        raise ValueError("; ".join(problems))
    with_critic = config.algo.advantage == "gae"
    critic_engine = critic_engine_config(config.engine, config.algo.critic_lr)
    frozen = dataclasses.replace(config.engine, frozen=True)
    if use_legacy(flag):
        # Imported here: the legacy workers import FSDP and transformers; engine roles must not.
        from roles import legacy

        legacy.warn_deprecated()
        return Roles(
            actor=legacy.LegacyActor(config.engine, config.actor),
            critic=legacy.LegacyCritic(critic_engine, config.critic) if with_critic else None,
            reference=legacy.LegacyReference(frozen) if config.actor.kl_coef else None,
            legacy=True,
        )
    return Roles(
        actor=Actor(_engine(config.engine), config.actor),
        critic=Critic(_engine(critic_engine), config.critic) if with_critic else None,
        reference=Reference(_engine(frozen)) if config.actor.kl_coef else None,
        legacy=False,
    )


def _engine(config: EngineConfig):
    engine = build_engine(config)
    engine.init_model()
    return engine
