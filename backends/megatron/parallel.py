"""megatron-core's model-parallel sizes of one layout, read from the one place they are listed:
the ``megatron.*`` options marked as sizes (``backends.megatron.options``). Initialising
``parallel_state``, the ``TransformerConfig``, the one-layout-per-process check and the layout a
checkpoint records all go through :class:`ParallelSizes`, so a new size is one marked option."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core import parallel_state as mpu

from backends.megatron.options import MegatronOptions, parallel_size_fields


@dataclass(frozen=True)
class ParallelSizes:
    """The model-parallel sizes of one layout: ``(name, size)`` pairs in the options' order, each
    named as megatron-core names the keyword (``initialize_model_parallel``,
    ``TransformerConfig``) and as its ``parallel_state`` getter reports it
    (``get_<name without _size>_world_size``)."""

    sizes: tuple[tuple[str, int | None], ...]

    @classmethod
    def of(cls, options: MegatronOptions) -> ParallelSizes:
        """The sizes ``options`` configure."""
        # expert-TP None means the TP size (megatron's default): resolved, so a layout compares
        # equal to what parallel_state reports once initialised with it.
        resolved = {"expert_tensor_parallel_size": options.expert_tensor_size}
        return cls(tuple((f.name, resolved.get(f.name, getattr(options, f.name))) for f in parallel_size_fields()))

    @classmethod
    def current(cls) -> ParallelSizes:
        """The sizes megatron's ``parallel_state`` was initialised with in this process."""
        return cls(tuple((f.name, getattr(mpu, f"get_{f.name.removesuffix('_size')}_world_size")()) for f in parallel_size_fields()))

    def kwargs(self) -> dict[str, int | None]:
        """The sizes as megatron-core's keyword arguments."""
        return dict(self.sizes)

    def kept_on_resume(self) -> dict[str, int | None]:
        """The sizes a checkpoint records and a resume must keep (the options marked so: the
        ``dp_reshardable`` optimizer layout lets only the data-parallel size change)."""
        kept = {f.name for f in parallel_size_fields() if f.metadata["kept_on_resume"]}
        return {name: size for name, size in self.sizes if name in kept}

    def describe(self) -> str:
        """``tp=2, pp=1, vpp=None, ...``: the sizes by their short names, for messages."""
        short = {f.name: f.metadata["parallel_size"] for f in parallel_size_fields()}
        return ", ".join(f"{short[name]}={size}" for name, size in self.sizes)
