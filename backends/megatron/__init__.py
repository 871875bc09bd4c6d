"""Megatron-core backend: ``MegatronEngine`` (registered as ``megatron``)."""

from backends.megatron.engine import MegatronEngine

__all__ = ["MegatronEngine"]
