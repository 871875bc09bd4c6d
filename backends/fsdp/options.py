"""The FSDP backend's settings (``engine.fsdp.*``), declared as ``FSDPEngine.options_class``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine_api.kit import DTYPES, BackendOptions, WorldDivisor, format_problem

_p = format_problem


@dataclass(frozen=True)
class FSDPOptions(BackendOptions):
    """FSDP2 (``fully_shard``) settings: the ``fsdp.*`` section of the engine config.

    Attributes:
        fsdp_size: ranks per shard group; -1 shards over the whole world, a divisor of the
            world size gives HSDP (replicate over world / fsdp_size groups).
        reshard_after_forward: free gathered params after forward (ZeRO-3) or keep them (ZeRO-2).
        param_dtype: compute dtype of gathered params (None: ``model.dtype``).
        reduce_dtype: dtype of the gradient reduce-scatter.
        ulysses_sequence_parallel_size: ranks that split each sequence (Ulysses SP,
            ``backends.fsdp.ulysses``): the world is DP x SP, the ranks of an SP group hold
            the same data shard and each runs ``1 / SP`` of its tokens; 1 is off. Must divide
            the world size and the model's attention heads.
    """

    config_section: ClassVar[str] = "fsdp"

    fsdp_size: int = -1
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str = "float32"
    ulysses_sequence_parallel_size: int = 1

    def _problems(self) -> list[str]:
        out = []
        if self.fsdp_size != -1 and self.fsdp_size < 1:
            out.append(_p("fsdp_size", self.fsdp_size, "must be -1 or positive", "use -1 (whole world) or a divisor of the world size"))
        if self.ulysses_sequence_parallel_size < 1:
            out.append(
                _p(
                    "ulysses_sequence_parallel_size",
                    self.ulysses_sequence_parallel_size,
                    "must be >= 1",
                    "use 1 (off) or a divisor of the world size",
                )
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                out.append(_p(name, value, "unknown dtype", f"use one of {', '.join(DTYPES)}"))
        return out

    def world_divisors(self) -> tuple[WorldDivisor, ...]:
        """The shard group (-1, the whole world, is not checked) and the SP group."""
        return (
            WorldDivisor("fsdp_size", self.fsdp_size, None, "use -1 or a divisor of the world size"),
            WorldDivisor(
                "ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size, None, "use 1 or a divisor of the world size"
            ),
        )
