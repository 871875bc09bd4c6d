"""The backend kit: everything a backend builds on, in one declared module.

A backend (in this repository or outside it) imports from here and nowhere else in
``engine_api`` (``tests/test_import_graph.py`` enforces it for ``backends/`` and the reference
engine), so the pieces that make the contract's invariances hold by construction are one
documented surface. See ``docs/adding-a-backend.md`` for the walk-through and
``engine_api/base.py`` for the hooks a backend fills in.

Groups:

* the engine and its settings: ``BaseEngine`` (subclass it and fill in its hooks),
  ``register_engine``, ``BackendOptions`` (subclass it for your ``options_class``; declare
  ``WorldDivisor``s for groups whose size must divide the world), ``EngineConfig`` and its
  sections (``LoraConfig``, ``DTYPES``), ``options_of`` (a backend's typed options from the
  config), ``format_problem`` (the house format of a config error for ``check_config`` and an
  options class's ``_problems``);
* the step: ``StepSpec`` (what ``BaseEngine._step_spec`` returns) and, for a backend that
  drives its own schedule, ``forward_backward_loop`` with a ``runner`` over ``CallState``; the
  pieces (``validate_call``, ``make_micro_batches``, ``build_norm_context``,
  ``backward_scale``, ``DeferredNormalizer``);
* the optimizer: ``build_adamw``, ``build_lr_scheduler`` (the step itself is
  ``BaseEngine.optimizer_step``; a backend overrides its small hooks);
* the data protocol: ``pack`` / ``unpack`` / ``pad`` / ``unpad``, ``relayout``,
  ``to_device``, ``token_log_probs``, ``token_entropy``, ``align_to_tokens``,
  ``temperature_of`` / ``wants_entropy`` (batch metadata);
* MoE routing: ``RouterSpec`` (an HF config's router settings) and ``RoutingRecorder`` (the
  load-balancing loss and expert-load metrics the loop reports);
* processes and placement: ``compute_device`` (``cuda:$LOCAL_RANK`` or the CPU),
  ``ensure_process_group`` (join torchrun's world, or a 1-rank group for plain python),
  ``process_group_timeout``, ``group_rank`` / ``group_size``, ``all_reduce``, ``barrier``,
  ``broadcast_tensors`` (named tensors plus a JSON header from one rank, tensor collectives
  only); offload moves that copy, ``relocate_module`` / ``relocate_state``;
* checkpoints: ``ckpt_layout`` (``begin`` -> write your files + ``save_extra`` -> ``commit``;
  ``open_checkpoint`` -> ``reading`` -> ``load_extra`` -> ``finish_load``),
  ``CorruptCheckpointError``;
* rollout backends: ``BaseRollout``, ``RolloutEngineConfig``, ``SamplingParams``, ``Sample``,
  ``sample_seed``, ``register_rollout``.
"""

from __future__ import annotations

from tensordict import TensorDict

from engine_api import ckpt_layout
from engine_api.base import RETURN_PREDICTIONS, BaseEngine
from engine_api.batch import loss_mask_of, make_batch, pack, pad, relayout, to_device, unpack, unpad, validate_batch
from engine_api.ckpt_integrity import CorruptCheckpointError
from engine_api.config import DTYPES, BackendOptions, EngineConfig, LoraConfig, WorldDivisor, format_problem, options_of
from engine_api.dist import (
    all_reduce,
    barrier,
    broadcast_tensors,
    compute_device,
    ensure_process_group,
    group_rank,
    group_size,
    is_initialized,
    process_group_timeout,
)
from engine_api.logprobs import align_to_tokens, token_entropy, token_log_probs
from engine_api.losses import DeferredNormalizer, backward_scale, build_norm_context
from engine_api.lr_schedule import build_lr_scheduler
from engine_api.microbatch import make_micro_batches
from engine_api.moe import RouterSpec, RoutingRecorder
from engine_api.offload import relocate_module, relocate_state
from engine_api.optim import build_adamw
from engine_api.registry import register_engine, unregister_engine
from engine_api.rollout import BaseRollout, RolloutEngineConfig, Sample, SamplingParams, sample_seed
from engine_api.rollout_registry import register_rollout
from engine_api.step import CallState, StepSpec, forward_backward_loop, validate_call


def temperature_of(micro_batch: TensorDict) -> float:
    """The batch metadata ``temperature`` (default 1.0): a backend divides the logits by it
    before log-probs and entropy (``BaseEngine`` duty; validated finite and > 0)."""
    return float(micro_batch.get_non_tensor("temperature", 1.0))


def wants_entropy(micro_batch: TensorDict) -> bool:
    """The batch metadata ``calculate_entropy`` (default False): return ``entropy`` too."""
    return bool(micro_batch.get_non_tensor("calculate_entropy", False))


__all__ = [
    "DTYPES",
    "RETURN_PREDICTIONS",
    "BackendOptions",
    "BaseEngine",
    "BaseRollout",
    "CallState",
    "CorruptCheckpointError",
    "DeferredNormalizer",
    "EngineConfig",
    "LoraConfig",
    "RolloutEngineConfig",
    "RouterSpec",
    "RoutingRecorder",
    "Sample",
    "SamplingParams",
    "StepSpec",
    "WorldDivisor",
    "align_to_tokens",
    "all_reduce",
    "backward_scale",
    "barrier",
    "broadcast_tensors",
    "build_adamw",
    "build_lr_scheduler",
    "build_norm_context",
    "ckpt_layout",
    "compute_device",
    "ensure_process_group",
    "format_problem",
    "forward_backward_loop",
    "group_rank",
    "group_size",
    "is_initialized",
    "loss_mask_of",
    "make_batch",
    "make_micro_batches",
    "options_of",
    "pack",
    "pad",
    "process_group_timeout",
    "register_engine",
    "register_rollout",
    "relayout",
    "relocate_module",
    "relocate_state",
    "sample_seed",
    "temperature_of",
    "to_device",
    "token_entropy",
    "token_log_probs",
    "unpack",
    "unpad",
    "unregister_engine",
    "validate_batch",
    "validate_call",
    "wants_entropy",
]
