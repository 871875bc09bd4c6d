"""The backend kit: everything a backend builds on, in one declared module.

A backend (in this repository or outside it) imports from here, not from the private
submodules, so the pieces that make the contract's invariances hold by construction are one
documented surface. See ``docs/adding-a-backend.md`` for the walk-through and
``engine_api/base.py`` for the duties each piece serves.

Groups:

* registration and settings: ``BaseEngine``, ``register_engine``, ``EngineConfig``,
  ``options_of`` (a backend's options from the config), ``format_problem`` (the house format
  of a config error for ``check_config``);
* the step: ``StepSpec`` + ``forward_backward_loop`` (validation agreed over DP, micro-batch
  planning, the normalization context, backward scaling, deferred counts, output restore) and
  ``DeferredNormalizer``; backends that drive their own schedule use the pieces
  (``validate_call``, ``make_micro_batches``, ``build_norm_context``, ``backward_scale``);
* the optimizer: ``build_adamw``, ``clip_and_step`` (deferred scaling, global norm, agreed
  skip, clip, step), ``build_lr_scheduler``; the post-step finite check is
  ``BaseEngine._check_update``;
* the data protocol: ``pack`` / ``unpack`` / ``pad`` / ``unpad``, ``token_log_probs``,
  ``token_entropy``, ``align_to_tokens``, ``temperature_of`` / ``wants_entropy`` (batch
  metadata);
* processes and placement: ``compute_device`` (``cuda:$LOCAL_RANK`` or the CPU),
  ``ensure_process_group`` (join torchrun's world, or a 1-rank group for plain python), ``group_rank`` / ``group_size``, ``all_reduce``, ``barrier``,
  ``broadcast_tensors`` (named tensors plus a JSON header from one rank, tensor collectives only);
* weight export: ``bucket_bytes`` (validate ``export_weights``'s ``bucket_mb`` at the call);
* checkpoints: ``ckpt_layout`` (``begin`` -> write your files + ``save_extra`` -> ``commit``;
  ``open_checkpoint`` -> ``reading`` -> ``load_extra`` -> ``apply_extra`` -> ``finish_load``),
  ``make_extra``, ``CorruptCheckpointError``.
"""

from __future__ import annotations

from tensordict import TensorDict

from engine_api import ckpt_layout
from engine_api.base import RETURN_PREDICTIONS, BaseEngine, bucket_bytes, relocate_module, relocate_state
from engine_api.batch import loss_mask_of, make_batch, pack, pad, relayout, to_device, unpack, unpad, validate_batch
from engine_api.ckpt_integrity import CorruptCheckpointError
from engine_api.ckpt_layout import make_extra
from engine_api.config import EngineConfig, format_problem, options_of
from engine_api.dist import (
    all_reduce,
    barrier,
    broadcast_tensors,
    compute_device,
    ensure_process_group,
    group_rank,
    group_size,
    is_initialized,
)
from engine_api.logprobs import align_to_tokens, token_entropy, token_log_probs
from engine_api.losses import DeferredNormalizer, backward_scale, build_norm_context
from engine_api.lr_schedule import build_lr_scheduler
from engine_api.microbatch import make_micro_batches
from engine_api.optim import build_adamw, clip_and_step
from engine_api.registry import register_engine, unregister_engine
from engine_api.step import StepSpec, forward_backward_loop, validate_call


def temperature_of(micro_batch: TensorDict) -> float:
    """The batch metadata ``temperature`` (default 1.0): a backend divides the logits by it
    before log-probs and entropy (``BaseEngine`` duty; validated finite and > 0)."""
    return float(micro_batch.get_non_tensor("temperature", 1.0))


def wants_entropy(micro_batch: TensorDict) -> bool:
    """The batch metadata ``calculate_entropy`` (default False): return ``entropy`` too."""
    return bool(micro_batch.get_non_tensor("calculate_entropy", False))


__all__ = [
    "RETURN_PREDICTIONS",
    "BaseEngine",
    "CorruptCheckpointError",
    "DeferredNormalizer",
    "EngineConfig",
    "StepSpec",
    "align_to_tokens",
    "all_reduce",
    "backward_scale",
    "barrier",
    "broadcast_tensors",
    "bucket_bytes",
    "build_adamw",
    "build_lr_scheduler",
    "build_norm_context",
    "ckpt_layout",
    "clip_and_step",
    "compute_device",
    "ensure_process_group",
    "format_problem",
    "forward_backward_loop",
    "group_rank",
    "group_size",
    "is_initialized",
    "loss_mask_of",
    "make_batch",
    "make_extra",
    "make_micro_batches",
    "options_of",
    "pack",
    "pad",
    "register_engine",
    "relayout",
    "relocate_module",
    "relocate_state",
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
