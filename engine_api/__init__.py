"""Enginekit's engine contract: ``BaseEngine``, the registry, typed configs, the batch
protocol, micro-batching and loss normalization. Imports no backend, no megatron and no
transformers; backends are found lazily through the registry."""

from engine_api.base import RETURN_PREDICTIONS, BaseEngine
from engine_api.batch import make_batch, validate_batch
from engine_api.config import BackendOptions, EngineConfig
from engine_api.loader import load_config
from engine_api.losses import AGG_MODES, NormContext, agg_loss
from engine_api.registry import available_engines, build_engine, register_engine, unregister_engine

__all__ = [
    "AGG_MODES",
    "BackendOptions",
    "BaseEngine",
    "EngineConfig",
    "NormContext",
    "RETURN_PREDICTIONS",
    "agg_loss",
    "available_engines",
    "build_engine",
    "load_config",
    "make_batch",
    "register_engine",
    "unregister_engine",
    "validate_batch",
]
