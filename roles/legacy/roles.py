"""The legacy actor, critic and reference: the engine roles' algorithms on :class:`FSDPWorker`."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from tensordict import TensorDict

from engine_api.config import EngineConfig
from engine_api.losses import with_summed_metrics
from roles.actor import SUMMED, ActorConfig, apply_rollout_correction, policy_objective, update_fields
from roles.common import require_fields
from roles.critic import VALUE_UPDATE_FIELDS, CriticConfig, value_objective
from roles.legacy.worker import FSDPWorker


class _LegacyRole:
    """Weight export and checkpoints, delegated to the worker (same methods as the engine roles)."""

    worker: FSDPWorker

    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` pairs (``bucket_mb``: as ``BaseEngine.export_weights``). Collective."""
        return self.worker.export_weights(bucket_mb)

    def save_checkpoint(self, path: str, global_step: int) -> None:
        """Checkpoint under ``path``. Collective."""
        self.worker.save_checkpoint(path, global_step)

    def load_checkpoint(self, path: str) -> int:
        """Restore the newest complete checkpoint under ``path``; return its step. Collective."""
        return self.worker.load_checkpoint(path)


class LegacyActor(_LegacyRole):
    """The policy, as ``roles.Actor`` but on a direct FSDP2 worker."""

    def __init__(self, engine: EngineConfig, config: ActorConfig) -> None:
        self.worker = FSDPWorker(engine)
        self.config = config

    def compute_log_probs(self, batch: TensorDict, calculate_entropy: bool = False) -> TensorDict:
        """Log-probs (and entropy) of the global batch, on every rank."""
        return self.worker.infer(batch, calculate_entropy=calculate_entropy)

    def reuses_update_log_probs(self, rows: int) -> bool:
        """Always False: the legacy workers (the parity baseline) keep the separate old-policy
        forward (``roles.Actor.reuses_update_log_probs``)."""
        return False

    def update(self, batch: TensorDict) -> list[dict]:
        """PPO update over ``ppo_epochs`` x mini-batches; one metrics dict per optimizer step
        (with the rollout correction's metrics, as ``roles.Actor.update``)."""
        require_fields(batch, update_fields(self.config), "LegacyActor.update")
        c = self.config
        batch, correction = apply_rollout_correction(c, batch)
        loss_fn = with_summed_metrics(functools.partial(policy_objective, c), *SUMMED)
        metrics = self.worker.train_epochs(batch, c.ppo_epochs, c.mini_batch_size, loss_fn, calculate_entropy=c.entropy_coef > 0)
        for m in metrics:
            m.update(correction)
        return metrics


class LegacyCritic(_LegacyRole):
    """The value model, as ``roles.Critic`` but on a direct FSDP2 worker."""

    def __init__(self, engine: EngineConfig, config: CriticConfig) -> None:
        self.worker = FSDPWorker(engine)
        self.config = config

    def compute_values(self, batch: TensorDict) -> TensorDict:
        """Values of the global batch, on every rank."""
        return self.worker.infer(batch)

    def update(self, batch: TensorDict) -> list[dict]:
        """Clipped value update over ``ppo_epochs`` x mini-batches."""
        require_fields(batch, VALUE_UPDATE_FIELDS, "LegacyCritic.update")
        loss_fn = with_summed_metrics(functools.partial(value_objective, self.config), "vf_loss")
        return self.worker.train_epochs(batch, self.config.ppo_epochs, self.config.mini_batch_size, loss_fn)


class LegacyReference:
    """Frozen log-probs, as ``roles.Reference`` (the engine config must say ``frozen: true``)."""

    def __init__(self, engine: EngineConfig) -> None:
        if not engine.frozen:
            raise ValueError("LegacyReference needs engine.frozen = true (got false); fix: build it with engine.frozen=true")
        self.worker = FSDPWorker(engine)

    def compute_log_probs(self, batch: TensorDict) -> TensorDict:
        """``log_probs`` of the global batch, on every rank."""
        return self.worker.infer(batch)
