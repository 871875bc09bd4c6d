"""``Reference``: the frozen reference policy for the KL penalty, on ``BaseEngine`` calls only."""

from __future__ import annotations

from tensordict import TensorDict

from engine_api import BaseEngine
from roles.common import infer_global


class Reference:
    """Log-probs under the reference weights: a frozen engine (``engine.frozen: true``: no
    optimizer, LR schedule or gradient memory), or the actor's own LoRA engine
    (``model.lora.rank > 0``), whose base weights with the adapters off are the reference, so an
    RL run with a KL penalty holds one model."""

    def __init__(self, engine: BaseEngine) -> None:
        self.adapters_off = engine.config.model.lora.enabled and not engine.config.frozen
        if not (engine.config.frozen or self.adapters_off):
            raise ValueError(
                "Reference needs a frozen engine or a LoRA engine (engine.frozen = False, model.lora.rank = 0); fix: build its "
                "engine with engine.frozen=true, or pass the actor's engine with engine.model.lora.rank > 0"
            )
        self.engine = engine

    def compute_log_probs(self, batch: TensorDict) -> TensorDict:
        """``log_probs`` of the global batch, on every rank (adapters off for a LoRA engine;
        ``batch`` itself is not modified)."""
        return infer_global(self.engine, batch, **({"disable_adapters": True} if self.adapters_off else {}))
