"""Typed engine configuration (frozen dataclasses) and :func:`load_config`.

Configs are built with ``OmegaConf.structured`` + merge + ``to_object`` (see
``engine_api.typed_config``); nothing past the entry point sees a DictConfig. The YAML files
``configs/engine/fsdp.yaml`` and ``configs/engine/megatron.yaml`` document every key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine_api.losses import AGG_MODES
from engine_api.typed_config import check, load_typed

DTYPES = ("float32", "bfloat16", "float16")
HEADS = ("lm", "value")
LR_SCHEDULES = ("constant", "linear", "cosine")
LAYER_SPECS = ("auto", "local", "te")


_FP32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny; this module imports no torch


def _p(field_name: str, value: object, problem: str, fix: str) -> str:
    return f"{field_name} = {value!r}: {problem}; fix: {fix}"


@dataclass(frozen=True)
class ModelConfig:
    """The model an engine trains.

    Attributes:
        path: local HF directory (config.json + safetensors). None only where a recipe
            builds a tiny model itself.
        head: ``lm`` (causal LM: log-probs, entropy) or ``value`` (a scalar per token).
        dtype: parameter dtype of the compute copy.
        gradient_checkpointing: recompute activations in backward to save memory.
    """

    path: str | None = None
    head: str = "lm"
    dtype: str = "float32"
    gradient_checkpointing: bool = False

    def _problems(self) -> list[str]:
        out = []
        if self.path is not None and not os.path.isdir(self.path):
            out.append(_p("path", self.path, "no such directory", "point model.path at a local HF model directory"))
        if self.head not in HEADS:
            out.append(_p("head", self.head, "unknown head", f"use one of {', '.join(HEADS)}"))
        if self.dtype not in DTYPES:
            out.append(_p("dtype", self.dtype, "unknown dtype", f"use one of {', '.join(DTYPES)}"))
        return out


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and the LR schedule.

    Attributes:
        lr: peak learning rate.
        betas, eps, weight_decay: AdamW hyper-parameters.
        clip_grad: max global grad norm (None: no clipping; the norm is still reported).
        warmup_steps: linear warmup over this many optimizer steps, reaching ``lr`` at the
            last warmup step.
        lr_schedule: ``constant``, ``linear`` or ``cosine`` decay after warmup.
        total_steps: optimizer steps of the run; needed by ``linear`` and ``cosine``.
        min_lr_ratio: decay floor as a fraction of ``lr``.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float | None = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def _problems(self) -> list[str]:
        out = []
        if self.lr < 0:
            out.append(_p("lr", self.lr, "negative learning rate", "use lr >= 0"))
        if not all(0.0 <= b < 1.0 for b in self.betas):
            out.append(_p("betas", list(self.betas), "each beta must be in [0, 1)", "e.g. [0.9, 0.999]"))
        if self.eps <= 0:
            out.append(_p("eps", self.eps, "must be positive", "e.g. 1e-8"))
        elif self.eps < _FP32_TINY:
            # It rounds to 0 (or a subnormal) in fp32/bf16 arithmetic: Adam then divides 0 by 0
            # for every parameter without gradient (e.g. embedding rows of unseen tokens).
            out.append(_p("eps", self.eps, f"below float32's smallest normal number {_FP32_TINY:.2e}", "e.g. 1e-8"))
        if self.weight_decay < 0:
            out.append(_p("weight_decay", self.weight_decay, "negative weight decay", "use weight_decay >= 0"))
        if self.clip_grad is not None and self.clip_grad <= 0:
            out.append(_p("clip_grad", self.clip_grad, "must be positive", "use a positive max norm, or null to disable clipping"))
        if self.warmup_steps < 0:
            out.append(_p("warmup_steps", self.warmup_steps, "negative", "use warmup_steps >= 0"))
        if self.lr_schedule not in LR_SCHEDULES:
            out.append(_p("lr_schedule", self.lr_schedule, "unknown schedule", f"use one of {', '.join(LR_SCHEDULES)}"))
        elif self.total_steps is not None and self.total_steps < 1:
            out.append(
                _p("total_steps", self.total_steps, "must be positive", "set optim.total_steps to the run's optimizer steps, or null")
            )
        elif self.lr_schedule != "constant" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            out.append(
                _p(
                    "total_steps",
                    self.total_steps,
                    f"lr_schedule={self.lr_schedule} needs total_steps > warmup_steps",
                    "set optim.total_steps to the run's optimizer steps",
                )
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            out.append(_p("min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]", "e.g. 0.0 or 0.1"))
        return out


@dataclass(frozen=True)
class OffloadConfig:
    """What ``train_mode``/``eval_mode`` leave on the CPU when they exit.

    Attributes:
        param: parameters and gradients.
        optimizer: optimizer state.
    """

    param: bool = False
    optimizer: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint policy.

    Attributes:
        max_ckpt_to_keep: keep at most this many ``global_step_*`` checkpoints (None: all);
            the newest complete one is never deleted.
        verify: before a load, compare the sha256 of every file with the manifest the save
            wrote (reads the checkpoint once more, split over the ranks). False checks names
            and sizes only. Either way nothing in a checkpoint can run code when loaded.
    """

    max_ckpt_to_keep: int | None = None
    verify: bool = True

    def _problems(self) -> list[str]:
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 1:
            return [_p("max_ckpt_to_keep", self.max_ckpt_to_keep, "must keep at least one", "use null (keep all) or >= 1")]
        return []


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 (``fully_shard``) settings.

    Attributes:
        fsdp_size: ranks per shard group; -1 shards over the whole world, a divisor of the
            world size gives HSDP (replicate over world / fsdp_size groups).
        reshard_after_forward: free gathered params after forward (ZeRO-3) or keep them (ZeRO-2).
        param_dtype: compute dtype of gathered params (None: ``model.dtype``).
        reduce_dtype: dtype of the gradient reduce-scatter.
    """

    fsdp_size: int = -1
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str = "float32"

    def _problems(self) -> list[str]:
        out = []
        if self.fsdp_size != -1 and self.fsdp_size < 1:
            out.append(_p("fsdp_size", self.fsdp_size, "must be -1 or positive", "use -1 (whole world) or a divisor of the world size"))
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                out.append(_p(name, value, "unknown dtype", f"use one of {', '.join(DTYPES)}"))
        return out


@dataclass(frozen=True)
class MegatronConfig:
    """megatron-core parallelism, with megatron-core's own names.

    Attributes:
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size:
            model-parallel sizes; their product must divide the world size.
        virtual_pipeline_model_parallel_size: model chunks per pipeline stage (interleaved
            1F1B), None for none; needs pipeline_model_parallel_size > 1.
        sequence_parallel: shard activations along the sequence in TP regions; needs TP > 1.
        use_distributed_optimizer: shard optimizer state over DP (ZeRO-1).
        layer_spec: ``auto`` (Transformer-Engine when importable with CUDA, else local),
            ``local`` or ``te``.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    layer_spec: str = "auto"

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: ranks that share one data-parallel replica."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def _problems(self) -> list[str]:
        out = []
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(self, name) < 1:
                out.append(_p(name, getattr(self, name), "must be >= 1", "use 1 to disable this kind of parallelism"))
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
        if self.layer_spec not in LAYER_SPECS:
            out.append(_p("layer_spec", self.layer_spec, "unknown layer spec", f"use one of {', '.join(LAYER_SPECS)}"))
        return out


@dataclass(frozen=True)
class EngineConfig:
    """Everything a backend needs; ``strategy`` picks the backend from the registry.

    Attributes:
        strategy: registered engine name (``fsdp``, ``megatron``, or a custom one).
        seed: seeds model init (value heads), data order and dropout.
        micro_batch_size: sequences per micro-batch; exclusive with
            ``max_token_len_per_micro_batch``. Neither set: one micro-batch per call.
        max_token_len_per_micro_batch: dynamic batching: real-token budget per micro-batch.
        use_remove_padding: pack micro-batches (THD / varlen) instead of padding them.
        loss_agg_mode: one of ``engine_api.losses.AGG_MODES``.
        loss_agg_constant: C of ``seq-mean-token-sum-norm`` (required by that mode only).
        deferred_normalization: normalise at ``optimizer_step`` by the counts of every call
            since the last step, so a global batch may be split over several
            ``forward_backward_step`` calls (see ``engine_api.losses``).
        frozen: inference only: no optimizer or LR schedule is built, parameters need no
            gradients, and training calls raise (a reference policy, a reward model).
        world_size: if set, checked against the model-parallel sizes at load time; None
            reads ``WORLD_SIZE`` from the environment when present.
        dist_timeout_s: seconds a collective waits for a missing peer before raising, for the
            process group an engine creates or joins (None: ``$ENGINEKIT_DIST_TIMEOUT_S``, else
            torch's default of 30 minutes). Ignored when the caller already initialised
            ``torch.distributed``.
    """

    strategy: str = "fsdp"
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int | None = None
    max_token_len_per_micro_batch: int | None = None
    use_remove_padding: bool = True
    loss_agg_mode: str = "token-mean"
    loss_agg_constant: float | None = None
    deferred_normalization: bool = False
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    frozen: bool = False
    world_size: int | None = None
    dist_timeout_s: float | None = None

    def _problems(self) -> list[str]:
        out = []
        if not self.strategy:
            out.append(_p("strategy", self.strategy, "empty", "name a registered engine, e.g. fsdp or megatron"))
        if self.seed < 0:
            out.append(_p("seed", self.seed, "negative", "use a seed >= 0"))
        if self.world_size is not None and self.world_size < 1:
            out.append(_p("world_size", self.world_size, "must be positive", "use the number of processes, or null to read $WORLD_SIZE"))
        if self.dist_timeout_s is not None and not self.dist_timeout_s > 0:
            out.append(_p("dist_timeout_s", self.dist_timeout_s, "must be positive", "seconds > 0, e.g. 600, or null for the default"))
        if self.micro_batch_size is not None and self.max_token_len_per_micro_batch is not None:
            out.append(
                _p(
                    "micro_batch_size",
                    self.micro_batch_size,
                    f"set together with max_token_len_per_micro_batch = {self.max_token_len_per_micro_batch}",
                    "set only one micro-batching mode (the other to null)",
                )
            )
        for name in ("micro_batch_size", "max_token_len_per_micro_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                out.append(_p(name, value, "must be positive", "use a positive value or null"))
        if self.loss_agg_mode not in AGG_MODES:
            out.append(_p("loss_agg_mode", self.loss_agg_mode, "unknown mode", f"use one of {', '.join(AGG_MODES)}"))
        needs_constant = self.loss_agg_mode == "seq-mean-token-sum-norm"
        if needs_constant and (self.loss_agg_constant is None or self.loss_agg_constant <= 0):
            out.append(
                _p(
                    "loss_agg_constant",
                    self.loss_agg_constant,
                    "seq-mean-token-sum-norm needs a positive constant C",
                    "set it, e.g. to the max response length",
                )
            )
        world = self.world_size if self.world_size is not None else _known_world_size()
        mp = self.megatron.model_parallel_size
        if self.strategy == "megatron" and world is not None and mp >= 1 and world % mp:
            out.append(
                _p(
                    "megatron.tensor_model_parallel_size",
                    self.megatron.tensor_model_parallel_size,
                    f"TP x PP x CP = {mp} does not divide the world size {world}",
                    "choose sizes whose product divides the number of processes",
                )
            )
        if self.strategy == "fsdp" and world is not None and self.fsdp.fsdp_size > 0 and world % self.fsdp.fsdp_size:
            out.append(
                _p(
                    "fsdp.fsdp_size",
                    self.fsdp.fsdp_size,
                    f"does not divide the world size {world}",
                    "use -1 or a divisor of the world size",
                )
            )
        return out


def load_config(source: str | os.PathLike | Mapping | None = None, overrides: Sequence[str] = ()) -> EngineConfig:
    """Load an :class:`EngineConfig` from a YAML path or a mapping, plus dot-list overrides.

    Example: ``load_config("configs/engine/fsdp.yaml", ["micro_batch_size=2", "optim.lr=1e-4"])``.

    Raises:
        ValueError: one error listing every misspelt key (with the closest valid key), every
            wrong type and every invalid value, each with the field, the value and the fix.
    """
    return load_typed(EngineConfig, source, overrides)


def config_problems(config: EngineConfig) -> list[str]:
    """Every problem of an already-built config (``build_engine`` refuses one that has any)."""
    return check(config)


def format_problem(field_name: str, value: object, problem: str, fix: str) -> str:
    """One config problem in the house format (backends' ``check_config`` use it too)."""
    return _p(field_name, value, problem, fix)


def _known_world_size() -> int | None:
    """``WORLD_SIZE`` (torchrun sets it), else the initialised default group's size, else None
    (unknown: a config loaded before the ranks exist is not judged against a guess)."""
    value = os.environ.get("WORLD_SIZE")
    if value and value.isdigit():
        return int(value)
    import torch.distributed as dist  # imported here: this module itself stays free of torch

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
