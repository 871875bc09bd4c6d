"""FSDP2 backend: ``FSDPEngine`` (registered as ``fsdp``) over HF transformers models."""

from backends.fsdp.engine import FSDPEngine

__all__ = ["FSDPEngine"]
