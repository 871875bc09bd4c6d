"""``Critic``: per-token values and the clipped value update, on ``BaseEngine`` calls only
(an engine with ``model.head: value``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from engine_api import BaseEngine, agg_loss
from engine_api.losses import with_summed_metrics
from roles.algos import clipped_value_loss
from roles.common import TrainableRole, infer_global, require_fields, train_epochs


@dataclass(frozen=True)
class CriticConfig:
    """Value update.

    Attributes:
        value_clip: clip range of the value change around the old values.
        ppo_epochs: passes over the batch per update.
        mini_batch_size: global sequences per optimizer step (None: the whole batch).
    """

    value_clip: float = 0.5
    ppo_epochs: int = 1
    mini_batch_size: int | None = None

    def _problems(self) -> list[str]:
        out = []
        if self.value_clip <= 0:
            out.append(f"value_clip = {self.value_clip}: must be positive; fix: e.g. 0.5")
        if self.ppo_epochs < 1:
            out.append(f"ppo_epochs = {self.ppo_epochs}: must be >= 1; fix: use 1 or more")
        return out


class Critic(TrainableRole):
    """The value function: an engine with a value head plus the clipped value loss."""

    def __init__(self, engine: BaseEngine, config: CriticConfig) -> None:
        self.engine = engine
        self.config = config
        engine.set_loss_fn(with_summed_metrics(self.loss, "vf_loss"))  # a contribution: its global value

    def compute_values(self, batch: TensorDict) -> TensorDict:
        """Values of the global batch (``values[i]`` predicted from the prefix before token i)."""
        return infer_global(self.engine, batch)

    def update(self, batch: TensorDict) -> list[dict]:
        """Value update over ``ppo_epochs`` x mini-batches; needs jagged ``values`` (old) and ``returns``."""
        require_fields(batch, VALUE_UPDATE_FIELDS, "Critic.update")
        return train_epochs(self.engine, batch, self.config.ppo_epochs, self.config.mini_batch_size)

    def loss(self, mb: TensorDict, out: TensorDict, norm) -> tuple[torch.Tensor, dict[str, float]]:
        """The engine's loss function: :func:`value_objective`."""
        return value_objective(self.config, mb, out, norm)


VALUE_UPDATE_FIELDS = ("values", "returns")


def value_objective(c: CriticConfig, mb: TensorDict, out: TensorDict, norm) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of one micro-batch aggregated with ``norm``, and its metrics."""
    mask = mb["loss_mask"]
    per_token, clipped = clipped_value_loss(out["values"].values(), mb["values"].values(), mb["returns"].values(), c.value_clip)
    total = agg_loss(per_token, mask, norm)
    with torch.no_grad():
        tokens = mask.values().sum().clamp(min=1)
        return total, {"vf_loss": float(total.detach()), "vf_clipfrac": float((clipped * mask.values()).sum() / tokens)}
