"""The backend kit: everything a backend builds on, in one declared module.

A backend (in this repository or outside it) imports from here and nowhere else in
``engine_api`` (``tests/engine_api/test_backends_use_the_kit.py``), so the pieces that make the
contract's invariances hold by construction are one documented surface; ``docs/adding-a-backend.md``
walks through them. Groups:

* the engine and its settings: ``BaseEngine`` (fill in its hooks), ``register_engine``,
  ``BackendOptions`` (with ``WorldDivisor``), ``EngineConfig``, ``LoraConfig``, ``DTYPES``,
  ``options_of``, ``format_problem`` (the house format of a config error);
* the step: ``StepSpec``; ``forward_backward_loop`` with a ``runner`` over ``CallState`` for a
  backend with its own schedule; the pieces ``validate_call``, ``make_micro_batches``,
  ``build_norm_context``, ``backward_scale``, ``DeferredNormalizer``; ``build_adamw``,
  ``build_lr_scheduler``;
* the data protocol: ``pack`` / ``unpack`` / ``pad`` / ``unpad``, ``relayout``, ``to_device``,
  ``token_log_probs``, ``token_entropy``, ``align_to_tokens``, ``lm_token_outputs`` (every LM
  output of a packed micro-batch, ``target_log_probs`` of ``TARGETS_FIELD`` too), ``HeadRequest`` (the
  same outputs from hidden states and the head's weight, chunked over tokens), ``temperature_of`` /
  ``wants_entropy``; MoE routing: ``RouterSpec``, ``RoutingRecorder``, ``ROUTING_FIELD``,
  ``NOT_ROUTED``, ``wants_routing`` (a micro-batch's replay / recording request);
* processes and placement: ``compute_device``, ``ensure_process_group``,
  ``process_group_timeout``, ``group_rank`` / ``group_size``, ``all_reduce``, ``barrier``,
  ``broadcast_tensors`` (tensor collectives only); ``relocate_module`` / ``relocate_state``;
  splitting sequences over ranks: ``gather_dim1``, ``sum_keep_grad``, ``outputs_from_columns``
  (``engine_api.seq_split``);
* checkpoints: ``ckpt_layout`` (``begin`` -> your files + ``save_extra`` -> ``commit``;
  ``open_checkpoint`` -> ``reading`` -> ``load_extra`` -> ``finish_load``), ``CorruptCheckpointError``;
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
from engine_api.logprobs import (
    TARGET_LOG_PROBS,
    TARGETS_FIELD,
    HeadRequest,
    align_to_tokens,
    lm_token_outputs,
    target_log_probs,
    token_entropy,
    token_log_probs,
)
from engine_api.losses import DeferredNormalizer, backward_scale, build_norm_context
from engine_api.lr_schedule import build_lr_scheduler
from engine_api.microbatch import make_micro_batches
from engine_api.moe import NOT_ROUTED, ROUTING_FIELD, RouterSpec, RoutingRecorder
from engine_api.offload import relocate_module, relocate_state
from engine_api.optim import build_adamw
from engine_api.registry import register_engine, unregister_engine
from engine_api.rollout import BaseRollout, RolloutEngineConfig, Sample, SamplingParams, sample_seed
from engine_api.rollout_registry import register_rollout
from engine_api.seq_split import gather_dim1, outputs_from_columns, sum_keep_grad
from engine_api.step import CallState, StepSpec, forward_backward_loop, validate_call, wants_routing


def temperature_of(micro_batch: TensorDict) -> float:
    """The batch metadata ``temperature`` (default 1.0): a backend divides the logits by it
    before log-probs and entropy (``BaseEngine`` duty; validated finite and > 0)."""
    return float(micro_batch.get_non_tensor("temperature", 1.0))


def wants_entropy(micro_batch: TensorDict) -> bool:
    """The batch metadata ``calculate_entropy`` (default False): return ``entropy`` too."""
    return bool(micro_batch.get_non_tensor("calculate_entropy", False))


# Grouped as in the module docstring (one group per line: the surface reads as a table).
# fmt: off
__all__ = [
    "BaseEngine", "register_engine", "unregister_engine", "BackendOptions", "WorldDivisor", "EngineConfig", "LoraConfig", "DTYPES",
    "options_of", "format_problem",
    "StepSpec", "CallState", "forward_backward_loop", "validate_call", "make_micro_batches", "build_norm_context", "backward_scale",
    "DeferredNormalizer", "RETURN_PREDICTIONS", "build_adamw", "build_lr_scheduler",
    "pack", "unpack", "pad", "unpad", "relayout", "to_device", "make_batch", "validate_batch", "loss_mask_of", "token_log_probs",
    "token_entropy", "align_to_tokens", "lm_token_outputs", "HeadRequest", "target_log_probs", "TARGETS_FIELD", "TARGET_LOG_PROBS", "temperature_of", "wants_entropy", "RouterSpec", "RoutingRecorder",
    "ROUTING_FIELD", "NOT_ROUTED", "wants_routing", "gather_dim1", "sum_keep_grad", "outputs_from_columns",
    "compute_device", "ensure_process_group", "process_group_timeout", "is_initialized", "group_rank", "group_size", "all_reduce",
    "barrier", "broadcast_tensors", "relocate_module", "relocate_state",
    "ckpt_layout", "CorruptCheckpointError",
    "BaseRollout", "RolloutEngineConfig", "SamplingParams", "Sample", "sample_seed", "register_rollout",
]
# fmt: on
