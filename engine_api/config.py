"""Typed engine configuration: frozen dataclasses and their value checks.

``engine_api.loader.load_config`` builds them (``OmegaConf.structured`` + merge + ``to_object``,
see ``engine_api.typed_config``); nothing past the entry point sees a DictConfig. The YAML files
``configs/engine/fsdp.yaml`` and ``configs/engine/megatron.yaml`` document every key. This
module knows no backend and imports neither the registry nor the loader: a backend's settings
are a :class:`BackendOptions` subclass, which the loader resolves from ``strategy``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from engine_api.losses import AGG_MODES
from engine_api.typed_config import SIBLING, check

DTYPES = ("float32", "bfloat16", "float16")
HEADS = ("lm", "value")
# HF attention implementations a backend that runs the HF module may use (``auto``: the backend
# picks what is exact for the model; see ``backends.hf.resolve_attn_implementation``).
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "varlen", "sdpa_doc_mask")
LR_SCHEDULES = ("constant", "linear", "cosine")

_FP32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny; this module imports no torch


def _p(field_name: str, value: object, problem: str, fix: str) -> str:
    return f"{field_name} = {value!r}: {problem}; fix: {fix}"


@dataclass(frozen=True)
class WorldDivisor:
    """A group of ranks a backend option sets up, whose size must divide the world size; declared
    by :meth:`BackendOptions.world_divisors`, checked by :class:`EngineConfig` at load.

    Attributes:
        option: the option the problem is reported under (its value is shown).
        size: the group's size; below 1 it is not checked (the option's own check reports it).
        formula: how ``size`` is formed from the options, e.g. ``TP x PP x CP`` (shown as
            ``TP x PP x CP = 4``); None when ``size`` is the option's value.
        fix: what to do about it.
    """

    option: str
    size: int
    formula: str | None
    fix: str


@dataclass(frozen=True)
class BackendOptions:
    """Base class of a backend's settings (``BaseEngine.options_class``): a frozen dataclass
    whose keys sit under the engine-config section ``config_section`` (``engine.fsdp.*``,
    ``engine.megatron.*``, a plug-in's ``engine.mine.*``).

    A subclass declares ``config_section: ClassVar[str]`` (an identifier, not an
    :class:`EngineConfig` field), its fields with defaults, optionally ``_problems(self)`` and
    :meth:`world_divisors`. A backend reads its instance with :func:`options_of`.
    """

    config_section: ClassVar[str]

    def world_divisors(self) -> tuple[WorldDivisor, ...]:
        """The rank groups these options set up whose sizes must divide the world size
        (checked at config load when the world size is known). None by default."""
        return ()


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the model; only the adapters are trained.

    Attributes:
        rank: adapter rank r; 0 turns LoRA off.
        alpha: scaling numerator: the update is ``(alpha / rank) * B @ A``.
        dropout: dropout on the adapter input, in training only.
        target_modules: module names (suffixes) that get adapters; ``[all-linear]`` (default):
            every linear layer except the output head (for the usual decoders: all attention
            and MLP projections; on MoE models also the router).
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def to_peft(self, head: str):
        """These settings as ``peft.LoraConfig`` for a model with ``head`` (``lm`` or
        ``value``): what a backend trains with and what ``adapter_config.json`` records (the
        adapter format is peft's, whichever backend trained). peft is imported here, lazily."""
        import peft

        targets = "all-linear" if list(self.target_modules) == ["all-linear"] else list(self.target_modules)
        # A value head's new ``score`` layer is trained in full (peft's token-classification
        # task keeps a trainable copy of it), never given adapters of its own.
        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM" if head == "lm" else "TOKEN_CLS",
            exclude_modules=None if head == "lm" else ["score"],
        )

    def _problems(self) -> list[str]:
        out = []
        if self.rank < 0:
            out.append(_p("rank", self.rank, "negative", "use 0 (off) or a rank such as 8"))
        if self.alpha <= 0:
            out.append(_p("alpha", self.alpha, "must be > 0", "e.g. 16"))
        if not 0 <= self.dropout < 1:
            out.append(_p("dropout", self.dropout, "must be in [0, 1)", "e.g. 0.0"))
        if not self.target_modules or any(not isinstance(t, str) or not t for t in self.target_modules):
            out.append(_p("target_modules", self.target_modules, "needs module names", "e.g. [all-linear] or [q_proj, v_proj]"))
        elif "all-linear" in self.target_modules and len(self.target_modules) > 1:
            out.append(_p("target_modules", self.target_modules, "all-linear cannot be combined with names", "use [all-linear] alone"))
        return out


@dataclass(frozen=True)
class ModelConfig:
    """The model an engine trains.

    Attributes:
        path: local HF directory (config.json + safetensors). None only where a recipe
            builds a tiny model itself.
        head: ``lm`` (causal LM: log-probs, entropy) or ``value`` (a scalar per token).
        value_bias: with ``head: value``, whether the one-output ``score`` head has a bias: true
            is HF token classification's head (the critic: values need an offset); false is HF
            sequence classification's, bias-free (a reward model: only differences of scores
            train it, and an exported ``AutoModelForSequenceClassification`` then scores exactly
            as the engine does; the reward-model recipe and ``reward.model`` use it). A checkpoint
            without a ``score.bias`` loaded with a bias gets it at 0. Unused by an ``lm``
            engine; the RL recipe's critic, built from the actor's keys, takes it.
        dtype: parameter dtype of the compute copy.
        gradient_checkpointing: recompute activations in backward to save memory.
        lora: low-rank adapters (:class:`LoraConfig`; ``rank`` 0: off).
        attn_implementation: the attention kernel of backends that run the HF module
            (fsdp): ``auto`` picks flash_attention_2 on CUDA when flash-attn is installed,
            eager for models whose math sdpa cannot express (Gemma-2's attention logit
            soft-capping, which HF's sdpa path silently drops), else for packed rows torch's
            ``varlen`` kernel (CUDA, half precision) or ``sdpa_doc_mask`` (block-diagonal SDPA)
            where the model's attention is plain causal, else HF's default; an explicit
            choice that would change the numbers or is not installed is refused at
            ``build_engine``. Backends with their own attention (megatron) refuse a non-auto
            value.
    """

    path: str | None = None
    head: str = "lm"
    value_bias: bool = True
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    attn_implementation: str = "auto"

    def _problems(self) -> list[str]:
        out = []
        if self.path is not None and not os.path.isdir(self.path):
            out.append(_p("path", self.path, "no such directory", "point model.path at a local HF model directory"))
        if self.head not in HEADS:
            out.append(_p("head", self.head, "unknown head", f"use one of {', '.join(HEADS)}"))
        if self.dtype not in DTYPES:
            out.append(_p("dtype", self.dtype, "unknown dtype", f"use one of {', '.join(DTYPES)}"))
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            out.append(_p("attn_implementation", self.attn_implementation, "unknown", f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}"))
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
        elif self.lr_schedule != "constant" and self.total_steps is None:
            out.append(
                _p(
                    "total_steps",
                    self.total_steps,
                    f"lr_schedule={self.lr_schedule} needs the run's length",
                    f"set {SIBLING}total_steps to the run's optimizer steps (a recipe sets it from trainer.total_steps)",
                )
            )
        elif self.lr_schedule != "constant" and self.total_steps <= self.warmup_steps:
            # Usually a short run of a config sized for a long one: the warmup is what to change.
            out.append(
                _p(
                    "warmup_steps",
                    self.warmup_steps,
                    f"lr_schedule={self.lr_schedule} needs warmup_steps < total_steps = {self.total_steps} (the run's optimizer steps)",
                    f"set {SIBLING}warmup_steps below {self.total_steps} (about 10% of the run: {self.total_steps // 10}), or run "
                    "more steps (in a recipe: trainer.total_steps)",
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
class EngineConfig:
    """Everything a backend needs; ``strategy`` picks the backend from the registry.

    Attributes:
        strategy: registered engine name (``fsdp``, ``megatron``, or a custom one).
        seed: seeds model init (value heads), data order and dropout.
        model: the model to train (:class:`ModelConfig`).
        optim: the optimizer and LR schedule (:class:`OptimConfig`).
        micro_batch_size: sequences per micro-batch; exclusive with
            ``max_token_len_per_micro_batch``. Neither set: one micro-batch per call.
        max_token_len_per_micro_batch: dynamic batching: real-token budget per micro-batch.
        use_remove_padding: pack micro-batches (THD / varlen) instead of padding them (the
            outputs are the same either way; a backend may still run a micro-batch padded where
            that is cheaper: megatron's local spec without pipelining, whose attention is dense
            over a packed row).
        loss_agg_mode: one of ``engine_api.losses.AGG_MODES``.
        loss_agg_constant: C of ``seq-mean-token-sum-norm`` (required by that mode only).
        deferred_normalization: normalise at ``optimizer_step`` by the counts of every call
            since the last step, so a global batch may be split over several
            ``forward_backward_step`` calls (see ``engine_api.losses``).
        offload: what stays on the CPU between train / eval phases (:class:`OffloadConfig`).
        checkpoint: checkpoint retention and verification (:class:`CheckpointConfig`).
        frozen: inference only: no optimizer or LR schedule is built, parameters need no
            gradients, and training calls raise (a reference policy, a reward model).
        world_size: if set, checked against the model-parallel sizes at load time; None
            reads ``WORLD_SIZE`` from the environment when present.
        dist_timeout_s: seconds a collective waits for a missing peer before raising, for the
            process group an engine creates or joins (None: ``$ENGINEKIT_DIST_TIMEOUT_S``, else
            torch's default of 30 minutes). Ignored when the caller already initialised
            ``torch.distributed``.
        compile: compile each decoder layer with ``torch.compile`` before it is sharded (fsdp;
            a backend that cannot compile refuses it at ``build_engine``). Off by default: the
            first steps pay the compile time, and each new micro-batch shape may recompile.
        backend: the strategy's own settings: an instance of the backend's
            ``BaseEngine.options_class`` (a :class:`BackendOptions` subclass), written in YAML /
            overrides under the section the options class names (``config_section``, e.g.
            ``fsdp.fsdp_size=2``, ``megatron.tensor_model_parallel_size=2``). None until the
            loader or ``build_engine`` fills in the backend's defaults. A backend reads it with
            :func:`options_of`.

    Backend sections are generic: the loader (``engine_api.loader``) resolves ``strategy`` to
    its engine class, validates the keys of that class's section against its options class
    (typos get the closest key), refuses keys of another backend's section and reports a
    strategy that names no engine. Nothing here knows a backend by name.
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
    frozen: bool = False
    world_size: int | None = None
    dist_timeout_s: float | None = None
    compile: bool = False
    backend: BackendOptions | None = None

    def _problems(self) -> list[str]:
        # ``strategy`` is resolved by the loader (engine_api.loader), which knows the registry.
        out = []
        if self.seed < 0:
            out.append(_p("seed", self.seed, "negative", "use a seed >= 0"))
        if self.frozen and self.model.lora.enabled:
            out.append(
                _p(
                    "model.lora.rank",
                    self.model.lora.rank,
                    "a frozen engine trains nothing, so its adapters would stay at their initial values",
                    "use lora.rank=0 for a frozen engine (a LoRA actor's engine serves as its own reference: roles.Reference)",
                )
            )
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
        out += self._world_problems()
        return out

    def _world_problems(self) -> list[str]:
        """The backend's rank groups (:meth:`BackendOptions.world_divisors`) that do not divide
        the known world size, reported under the backend's section."""
        if self.backend is None:
            return []
        world = self.known_world_size()
        if world is None:
            return []
        out = []
        for group in self.backend.world_divisors():
            if group.size >= 1 and world % group.size:
                formed = f"{group.formula} = {group.size} " if group.formula else ""
                value = getattr(self.backend, group.option)
                problem = _p(group.option, value, f"{formed}does not divide the world size {world}", group.fix)
                out.append(f"{self.backend.config_section}.{problem}")
        return out

    def known_world_size(self) -> int | None:
        """``world_size`` if set, else ``WORLD_SIZE`` (torchrun sets it), else the initialised
        default group's size, else None (a config loaded before the ranks exist is not judged
        against a guess)."""
        return self.world_size if self.world_size is not None else _known_world_size()


OptionsT = TypeVar("OptionsT", bound=BackendOptions)


def options_of(config: EngineConfig, options_class: type[OptionsT]) -> OptionsT:
    """The backend's settings, typed: ``config.backend`` when it is an ``options_class``
    instance, else that class's defaults (a config that did not pass ``build_engine``, e.g. one
    handed to a backend's helpers)."""
    return config.backend if isinstance(config.backend, options_class) else options_class()


def problems_of(config: EngineConfig) -> list[str]:
    """Every value problem of an already-built config, nested sections and the backend's
    options included (``build_engine`` refuses one that has any). The strategy itself is
    resolved by the loader and by ``build_engine``, not here."""
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
