"""``build_roles``: the one place that chooses between the engine-based roles (the default) and
the legacy FSDP2 workers (``roles/legacy``), by ``trainer.use_legacy_worker_impl``.

Nothing else branches on the flag: a recipe builds its roles here and then calls the same role
methods (``compute_log_probs``, ``update``, ``compute_values``, ``export_weights``,
``save_checkpoint``, ``load_checkpoint``) whichever implementation it got.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from engine_api import EngineConfig, build_engine
from roles.actor import Actor, ActorConfig
from roles.advantages import needs_critic
from roles.critic import Critic, CriticConfig
from roles.legacy_flag import FLAG, FLAG_VALUES, legacy_problems, use_legacy
from roles.reference import Reference
from roles.reward_model import RewardModel, reward_engine_config
from roles.teacher import Teacher, teacher_engine_config

# FLAG, FLAG_VALUES, use_legacy and legacy_problems live in roles.legacy_flag (which roles.legacy
# imports too, so that it never imports this module); re-exported here.
__all__ = [
    "FLAG",
    "FLAG_VALUES",
    "Roles",
    "RolesRecipeConfig",
    "build_roles",
    "role_classes",
    "critic_engine_config",
    "legacy_problems",
    "use_legacy",
]


class RolesRecipeConfig(Protocol):
    """What :func:`build_roles` reads from a recipe config (``recipes.ppo.PPOConfig`` has it):
    ``engine`` (the actor's ``EngineConfig``), ``actor`` / ``critic`` (role configs),
    ``algo.advantage`` (an estimator that needs one, ``gae``, builds a critic), ``algo.critic_lr`` and
    ``trainer.use_legacy_worker_impl``; a ``distill`` section with a ``teacher_path``, when present,
    builds the teacher."""

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
        reference: the frozen policy for the KL penalty, or None (``actor.kl_coef == 0``); with
            LoRA it shares the actor's engine (the base weights, adapters off).
        legacy: whether these are the legacy workers.
        teacher: the frozen teacher of on-policy distillation (``distill.teacher_path``), or None.
        reward_model: the frozen reward model scoring responses (``reward.model``), or None.
    """

    actor: Any
    critic: Any | None
    reference: Any | None
    legacy: bool
    teacher: Any | None = None
    reward_model: Any | None = None


def critic_engine_config(engine: EngineConfig, critic_lr: float) -> EngineConfig:
    """The critic's engine: the actor's keys with a value head and its own learning rate."""
    model = dataclasses.replace(engine.model, head="value")
    return dataclasses.replace(engine, model=model, optim=dataclasses.replace(engine.optim, lr=critic_lr))


def role_classes(config: RolesRecipeConfig) -> dict[str, type]:
    """The class of the ``actor``, ``critic`` and ``reference`` :func:`build_roles` builds for
    ``config`` (the engine roles, or the legacy workers): what a driver needs to name their
    methods when the roles live in other processes (``posttrain.placement.rl_host``)."""
    if use_legacy(config.trainer.use_legacy_worker_impl):
        legacy = _legacy()
        return {
            "actor": legacy.LegacyActor,
            "critic": legacy.LegacyCritic,
            "reference": legacy.LegacyReference,
            "teacher": Teacher,
            "reward_model": RewardModel,
        }
    return {"actor": Actor, "critic": Critic, "reference": Reference, "teacher": Teacher, "reward_model": RewardModel}


def _legacy():
    """The legacy workers' package, imported here only: it imports FSDP and transformers, which
    the engine roles must not."""
    from roles import legacy

    return legacy


def build_roles(config: RolesRecipeConfig, include: Collection[str] | None = None) -> Roles:
    """Build actor, critic (when the ``algo.advantage`` estimator needs one) and reference (when
    ``actor.kl_coef > 0``) on the implementation ``trainer.use_legacy_worker_impl`` selects.

    ``include``: only these of ``actor`` / ``critic`` / ``reference`` (the others are None), for
    a process that hosts some of a run's roles (``trainer.launcher=ray`` with roles on separate
    pools); None: all. A LoRA reference is the actor's engine, so it needs the actor.

    Raises:
        ValueError: a bad flag value, or the legacy workers with a config they do not support
            (e.g. ``engine.strategy=megatron``); raised before any model is built.
    """
    flag = config.trainer.use_legacy_worker_impl
    problems = legacy_problems(flag, config.engine)
    if problems:
        raise ValueError("; ".join(problems))
    wanted = {"actor", "critic", "reference", "teacher", "reward_model"} if include is None else set(include)
    with_critic = needs_critic(config.algo.advantage) and "critic" in wanted
    with_reference = bool(config.actor.kl_coef) and "reference" in wanted
    with_actor = "actor" in wanted
    distill = getattr(config, "distill", None)  # on-policy distillation: a recipe with a ``distill`` section
    teacher = None
    if distill is not None and distill.teacher_path is not None and "teacher" in wanted:
        teacher = Teacher(_engine(teacher_engine_config(config.engine, distill.teacher_path)))
    reward = getattr(config, "reward", None)  # a learned reward: a recipe whose reward section names a model
    reward_model = None
    if getattr(reward, "model", None) is not None and "reward_model" in wanted:
        reward_model = RewardModel(_engine(reward_engine_config(config.engine, reward.model)))
    if with_reference and config.engine.model.lora.enabled and not with_actor:
        raise ValueError("build_roles(include=...): a LoRA reference is the actor's engine with the adapters off; include the actor too")
    critic_engine = critic_engine_config(config.engine, config.algo.critic_lr)
    frozen = dataclasses.replace(config.engine, frozen=True)
    if use_legacy(flag):
        legacy = _legacy()
        legacy.warn_deprecated()
        return Roles(
            actor=legacy.LegacyActor(config.engine, config.actor) if with_actor else None,
            critic=legacy.LegacyCritic(critic_engine, config.critic) if with_critic else None,
            reference=legacy.LegacyReference(frozen) if with_reference else None,
            legacy=True,
            teacher=teacher,
            reward_model=reward_model,
        )
    actor = Actor(_engine(config.engine), config.actor) if with_actor else None
    reference = None
    if with_reference:
        # LoRA: the reference is the actor's own engine with the adapters off (one model).
        reference = Reference(actor.engine if config.engine.model.lora.enabled else _engine(frozen))
    return Roles(
        actor=actor,
        critic=Critic(_engine(critic_engine), config.critic) if with_critic else None,
        reference=reference,
        legacy=False,
        teacher=teacher,
        reward_model=reward_model,
    )


def _engine(config: EngineConfig):
    engine = build_engine(config)
    engine.init_model()
    return engine
