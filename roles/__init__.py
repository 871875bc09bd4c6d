"""RL roles (actor, critic, reference, rollout) written on BaseEngine calls only.

``build_roles(config)`` builds a recipe's roles (engine-based by default, the legacy FSDP
workers with ``trainer.use_legacy_worker_impl``); the role classes can also be built directly
around an engine.
"""

from roles.actor import Actor, ActorConfig
from roles.critic import Critic, CriticConfig
from roles.factory import Roles, build_roles
from roles.reference import Reference
from roles.rollout import Rollout, RolloutConfig

__all__ = ["Actor", "ActorConfig", "Critic", "CriticConfig", "Reference", "Roles", "Rollout", "RolloutConfig", "build_roles"]
