"""Pieces every role uses, on ``BaseEngine`` calls only."""

from __future__ import annotations

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
