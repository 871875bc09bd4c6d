"""``Teacher``: the model an on-policy distillation run learns from, on ``BaseEngine`` calls only."""

from __future__ import annotations

import dataclasses

from tensordict import TensorDict

from engine_api import BaseEngine
from roles.common import infer_global


class Teacher:
    """Log-probs of the student's sampled tokens under another model (``distill.teacher_path``):
    a frozen engine (``engine.frozen: true``: no optimizer, no gradient memory, eval mode), so
    the teacher never receives gradients or optimizer state. Its own class (not a
    ``Reference``), so a host holding both finds each by class (``posttrain.placement``)."""

    def __init__(self, engine: BaseEngine) -> None:
        if not engine.config.frozen:
            raise ValueError("Teacher needs a frozen engine (engine.frozen = False); fix: build its engine with engine.frozen=true")
        self.engine = engine

    def compute_log_probs(self, batch: TensorDict) -> TensorDict:
        """``log_probs`` of the global batch under the teacher, on every rank (``batch`` itself
        is not modified)."""
        return infer_global(self.engine, batch)


def teacher_engine_config(engine, teacher_path: str):
    """The teacher's engine: the actor's keys (strategy, parallelism, dtypes, micro-batching),
    another model, frozen, no adapters."""
    lora = dataclasses.replace(engine.model.lora, rank=0)
    model = dataclasses.replace(engine.model, path=teacher_path, lora=lora)
    return dataclasses.replace(engine, model=model, frozen=True)
