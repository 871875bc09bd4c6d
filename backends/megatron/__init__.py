"""Megatron-core backend: ``MegatronEngine`` (registered as ``megatron``)."""

import warnings

# megatron-core warns at import, once per module, that Transformer-Engine / Apex are missing and
# that it falls back to torch implementations. Without CUDA that is the only configuration there
# is, and with CUDA the engine says which layer spec it uses (backends.megatron.model); the
# warnings read like errors to a newcomer and say nothing the user must act on.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed", category=UserWarning)

from backends.megatron.engine import MegatronEngine  # noqa: E402 - after the filter on purpose

__all__ = ["MegatronEngine"]
