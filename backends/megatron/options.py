"""The Megatron backend's settings (``engine.megatron.*``), declared as ``MegatronEngine.options_class``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from engine_api.kit import BackendOptions, WorldDivisor, format_problem

_p = format_problem
LAYER_SPECS = ("auto", "local", "te")


def _size(short: str, default: int | None, kept_on_resume: bool = False):
    """An option that is one of megatron-core's model-parallel sizes (the one list of them:
    :func:`parallel_size_fields`; ``backends.megatron.parallel`` derives every use). ``short``
    names it in messages; ``kept_on_resume``: recorded with a checkpoint, and a resume must keep
    it (the ``dp_reshardable`` optimizer layout lets only the data-parallel size change)."""
    return field(default=default, metadata={"parallel_size": short, "kept_on_resume": kept_on_resume})


@dataclass(frozen=True)
class MegatronOptions(BackendOptions):
    """megatron-core parallelism, with megatron-core's own names: the ``megatron.*`` section
    of the engine config.

    Attributes:
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size:
            model-parallel sizes; their product must divide the world size.
        virtual_pipeline_model_parallel_size: model chunks per pipeline stage (interleaved
            1F1B), None for none; needs pipeline_model_parallel_size > 1.
        sequence_parallel: shard activations along the sequence in TP regions; needs TP > 1.
        expert_model_parallel_size: EP, ranks the experts of an MoE layer are split over
            (carved out of the data-parallel ranks: EP x expert-TP x PP must divide the world).
        expert_tensor_parallel_size: tensor parallelism inside each expert; None means the
            TP size (megatron's default).
        use_distributed_optimizer: shard optimizer state over DP (ZeRO-1).
        layer_spec: ``auto`` (Transformer-Engine when importable with CUDA, else local),
            ``local`` or ``te``.
    """

    config_section: ClassVar[str] = "megatron"

    # The model-parallel sizes carry megatron-core's own keyword names (_size).
    tensor_model_parallel_size: int = _size("tp", 1, kept_on_resume=True)
    pipeline_model_parallel_size: int = _size("pp", 1, kept_on_resume=True)
    virtual_pipeline_model_parallel_size: int | None = _size("vpp", None, kept_on_resume=True)
    context_parallel_size: int = _size("cp", 1)
    sequence_parallel: bool = False
    expert_model_parallel_size: int = _size("ep", 1)
    expert_tensor_parallel_size: int | None = _size("etp", None)
    use_distributed_optimizer: bool = False
    layer_spec: str = "auto"

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: ranks that share one data-parallel replica."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def expert_tensor_size(self) -> int:
        """The expert-TP size in effect (``expert_tensor_parallel_size``, defaulting to TP)."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def expert_parallel_size(self) -> int:
        """EP x expert-TP x PP: ranks that share one expert-data-parallel replica."""
        return self.expert_model_parallel_size * self.expert_tensor_size * self.pipeline_model_parallel_size

    def _problems(self) -> list[str]:
        out = []
        for f in parallel_size_fields():
            value = getattr(self, f.name)
            # the sizes that may be null (vpp, expert-TP) have their own checks below
            if f.default is not None and value < 1:
                out.append(_p(f.name, value, "must be >= 1", "use 1 to disable this kind of parallelism"))
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 1 or self.pipeline_model_parallel_size < 2):
            out.append(
                _p(
                    "virtual_pipeline_model_parallel_size",
                    vpp,
                    "needs a value >= 1 and pipeline_model_parallel_size > 1",
                    "set it to null or raise pipeline_model_parallel_size",
                )
            )
        if self.sequence_parallel and self.tensor_model_parallel_size < 2:
            out.append(
                _p(
                    "sequence_parallel",
                    True,
                    "needs tensor_model_parallel_size > 1",
                    "set sequence_parallel=false or raise tensor_model_parallel_size",
                )
            )
        if self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size < 1:
            out.append(
                _p("expert_tensor_parallel_size", self.expert_tensor_parallel_size, "must be >= 1", "use null (= TP) or a size >= 1")
            )
        if self.layer_spec not in LAYER_SPECS:
            out.append(_p("layer_spec", self.layer_spec, "unknown layer spec", f"use one of {', '.join(LAYER_SPECS)}"))
        return out

    def world_divisors(self) -> tuple[WorldDivisor, ...]:
        """TP x PP x CP (one data-parallel replica) and EP x expert-TP x PP (one
        expert-data-parallel replica)."""
        model = WorldDivisor(
            "tensor_model_parallel_size",
            self.model_parallel_size,
            "TP x PP x CP",
            "choose sizes whose product divides the number of processes",
        )
        # With EP = 1 and expert-TP = TP this is the TP x PP group above; report it once.
        if not (self.expert_model_parallel_size > 1 or self.expert_tensor_parallel_size is not None):
            return (model,)
        expert = WorldDivisor(
            "expert_model_parallel_size",
            self.expert_parallel_size,
            "EP x expert-TP x PP",
            "choose expert sizes whose product with the pipeline size divides the number of processes",
        )
        return (model, expert)


def parallel_size_fields() -> tuple[dataclasses.Field, ...]:
    """The options that are megatron-core's model-parallel sizes (declared with ``_size``), in
    their declared order."""
    return tuple(f for f in dataclasses.fields(MegatronOptions) if "parallel_size" in f.metadata)
