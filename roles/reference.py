"""``Reference``: the frozen reference policy for the KL penalty, on ``BaseEngine`` calls only."""

from __future__ import annotations

from tensordict import TensorDict

from engine_api import BaseEngine
from roles.common import infer_global


class Reference:
    """Log-probs under frozen weights. The engine must be built with ``engine.frozen: true``,
    so no optimizer, LR schedule or gradient memory exists for it."""

    def __init__(self, engine: BaseEngine) -> None:
        if not engine.config.frozen:
            raise ValueError("Reference needs a frozen engine (engine.frozen = False); fix: build its engine with engine.frozen=true")
        self.engine = engine

    def compute_log_probs(self, batch: TensorDict) -> TensorDict:
        """``log_probs`` of the global batch, on every rank."""
        return infer_global(self.engine, batch)
