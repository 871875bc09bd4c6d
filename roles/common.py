"""Pieces every role uses, on ``BaseEngine`` calls only."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from tensordict import TensorDict

from engine_api import BaseEngine


def infer_global(engine: BaseEngine, batch: TensorDict, **meta) -> TensorDict:
    """Forward-only outputs for a *global* batch, gathered back on every rank: shard by DP rank,
    ``eval_mode`` + ``infer_batch``, ``unshard_data``. ``meta`` becomes batch metadata (e.g.
    ``calculate_entropy=True``, ``temperature=0.7``). Collective."""
    local = engine.shard_data(batch)
    for key, value in meta.items():
        local.set_non_tensor(key, value)
    with engine.eval_mode():
        predictions = engine.infer_batch(local)
    return engine.unshard_data(predictions)


def train_epochs(
    engine: BaseEngine,
    batch: TensorDict,
    epochs: int,
    mini_batch_size: int | None,
    prepare: Callable[[TensorDict], None] | None = None,
) -> list[dict]:
    """``epochs`` passes over a global batch in mini-batches of ``mini_batch_size`` sequences
    (None: the whole batch), one ``train_batch`` (optimizer step) each, inside one
    ``train_mode``. ``prepare(local)`` may set metadata on each rank's shard. Collective."""
    size = mini_batch_size or batch.batch_size[0]
    metrics = []
    with engine.train_mode():
        for _ in range(epochs):
            for start in range(0, batch.batch_size[0], size):
                local = engine.shard_data(batch[start : start + size])
                if prepare is not None:
                    prepare(local)
                metrics.append(engine.train_batch(local))
    return metrics


def require_fields(batch: TensorDict, needed: Iterable[str], who: str) -> None:
    """Raise a ValueError naming the per-token fields ``who`` needs that ``batch`` lacks."""
    missing = [k for k in needed if k not in batch.keys()]
    if missing:
        raise ValueError(f"{who} batch lacks {missing}; fix: add them as jagged per-token fields")


class TrainableRole:
    """What a recipe needs from a trained role besides its algorithm: weight export (for the
    rollout) and checkpoints. Engine roles delegate to their engine; the legacy workers
    implement the same methods directly."""

    engine: BaseEngine

    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` pairs, gathered one tensor or one ``bucket_mb`` bucket per
        collective (``BaseEngine.export_weights``). Collective."""
        return self.engine.export_weights(bucket_mb=bucket_mb)

    def export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapters by peft's names (``BaseEngine.export_adapter_weights``). Collective."""
        return self.engine.export_adapter_weights()

    def save_checkpoint(self, path: str, global_step: int) -> None:
        """Model, optimizer, LR schedule, RNG and step under ``path``. Collective."""
        self.engine.save_checkpoint(path, global_step=global_step)

    def load_checkpoint(self, path: str) -> int:
        """Restore the newest complete checkpoint under ``path``; return its step. Collective."""
        return self.engine.load_checkpoint(path)
