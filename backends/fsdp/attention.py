"""Packed-row attention kernels of the FSDP backend, registered with HF's ``AttentionInterface``.

A packed micro-batch (``use_remove_padding``) runs its sequences side by side in one row (or a
few, ``backends.fsdp.forward.packed_rows``); attention must stay within each sequence. HF's own
kernels do that by detecting position restarts (sdpa / eager build a block-diagonal mask over
the whole row; flash-attn's varlen kernel takes the boundaries). Two more, whose boundaries come
from the batch itself (``cu_seqlens`` over the flattened rows, passed as forward keywords that
HF hands down to every attention call, :func:`packing_kwargs`):

* ``varlen``: torch's own ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA, half
  precision): the bundled flash kernel, cost per sequence, no flash-attn package needed.
* ``sdpa_doc_mask``: SDPA with a block-diagonal causal mask built from ``cu_seqlens`` (any
  device and dtype): the CPU stand-in with the same plumbing, equal to per-sequence attention.

Both compute plain causal softmax attention and nothing else: a model whose attention also
slides a window, soft-caps scores, adds sinks or masks otherwise is never given one
(:func:`packed_kernel_problems`), and a call that asks a kernel for any of those raises instead
of computing something else. Without the keywords (a forward that is not a packed micro-batch,
e.g. the one-sequence probe of ``packed_rows_exact``) the boundaries are read from the
``position_ids`` HF passes down (a sequence starts where they do not go on by one), else each
row is one sequence; never attention across a boundary.

``auto`` (:func:`select_attention`) picks, in order: flash-attn's kernel where installed on
CUDA (HF's ``flash_attention_2``); eager for a soft-capped model; ``varlen`` on CUDA in half
precision; ``sdpa_doc_mask`` elsewhere; HF's own default for a model neither packed kernel can
run exactly (sliding windows, sinks, ...) or under Ulysses (which wraps HF's kernels). The
choice and its reason are logged once per process (logger ``enginekit.attention``).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from backends.hf import resolve_attn_implementation, softcapping

VARLEN = "varlen"
DOC_MASK = "sdpa_doc_mask"
PACKED_KERNELS = (VARLEN, DOC_MASK)
#: forward keywords that carry the flattened rows' sequence boundaries down to the kernels
CU_KWARG = "enginekit_cu_seqlens"
MAX_KWARG = "enginekit_max_seqlen"

_log = logging.getLogger("enginekit.attention")


def varlen_missing() -> str | None:
    """Why torch's ``varlen_attn`` cannot run in this torch (None when it can)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
    return None


def packed_kernel_problems(hf_config) -> list[str]:
    """What in this model's attention the packed kernels do not compute (empty: plain causal
    softmax attention, which they compute exactly)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    out = []
    if softcapping(text) is not None:
        out.append(f"attn_logit_softcapping = {softcapping(text)} (soft-capped scores)")
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        out.append(f"layer types {sorted(kinds - {'full_attention'})} (sliding-window or other non-full attention)")
    elif not kinds and getattr(text, "sliding_window", None) is not None:
        out.append(f"sliding_window = {text.sliding_window}")
    if getattr(text, "model_type", None) == "gpt_oss" or getattr(text, "attention_sink", None):
        out.append("attention sinks")
    if getattr(text, "attention_chunk_size", None):
        out.append("chunked attention (attention_chunk_size)")
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        out.append("bidirectional attention")
    if not _backend_compatible(hf_config):
        out.append(f"{getattr(text, 'model_type', '?')} runs its own attention code (not HF's attention interface)")
    return out


def _backend_compatible(hf_config) -> bool:
    # HF refuses a registered kernel for a model class that does not call the attention interface.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return bool(MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]._supports_attention_backend)
    except (KeyError, AttributeError):
        return False


def attention_problems(hf_config, requested: str, device_type: str, compute_dtype: torch.dtype, sp: int = 1) -> list[str]:
    """Why ``model.attn_implementation = requested`` (a packed kernel) cannot run this model
    exactly here; empty for the other values (``backends.hf.attn_problems`` judges those)."""
    if requested not in PACKED_KERNELS:
        return []
    field = f"model.attn_implementation = {requested!r}"
    out = []
    odd = packed_kernel_problems(hf_config)
    if odd:
        out.append(f"{field}: the model's attention has {'; '.join(odd)}, which this kernel does not compute; fix: use auto")
    if sp > 1:
        out.append(
            f"{field}: Ulysses (fsdp.ulysses_sequence_parallel_size = {sp}) wraps HF's own kernels only; fix: use auto, sdpa or eager"
        )
    if requested == VARLEN:
        why = varlen_missing()
        if why is None and device_type != "cuda":
            why = f"it needs a CUDA device (this run's device: {device_type})"
        if why is None and compute_dtype not in (torch.bfloat16, torch.float16):
            why = f"its flash kernel runs bfloat16 / float16 only (compute dtype: {compute_dtype})"
        if why is not None:
            out.append(f"{field}: {why}; fix: use auto (or sdpa_doc_mask, which runs anywhere)")
    return out


def select_attention(hf_config, requested: str, device_type: str, compute_dtype: torch.dtype, sp: int = 1) -> str | None:
    """The ``attn_implementation`` to hand HF for the FSDP engine's ``requested`` value (see the
    module docstring for ``auto``); registers the packed kernels when it picks one. An explicit
    value is returned as given (refusals are :func:`attention_problems`' and
    ``backends.hf.attn_problems``')."""
    if requested != "auto":
        choice, why = requested, "engine.model.attn_implementation"
    else:
        choice, why = _auto(hf_config, device_type, compute_dtype, sp)
    if choice in PACKED_KERNELS:
        register_packed_kernels()
    _log_choice(choice or "HF's default for the family", why)
    return choice


def _auto(hf_config, device_type: str, compute_dtype: torch.dtype, sp: int) -> tuple[str | None, str]:
    base = resolve_attn_implementation(hf_config, "auto", device_type)
    if base == "flash_attention_2":
        return base, "flash-attn is installed and the device is CUDA"
    if base == "eager":
        return base, "the model soft-caps attention scores, which only eager computes exactly"
    if sp > 1:
        return base, "Ulysses wraps HF's own kernels"
    odd = packed_kernel_problems(hf_config)
    if odd:
        return base, f"the model's attention has {'; '.join(odd)} (HF's kernels, with their own packed-row masks)"
    if device_type == "cuda" and compute_dtype in (torch.bfloat16, torch.float16) and varlen_missing() is None:
        return VARLEN, "CUDA in half precision without flash-attn: torch's own varlen_attn, cost per sequence"
    where = "no CUDA device" if device_type != "cuda" else (varlen_missing() or f"compute dtype {compute_dtype}")
    return DOC_MASK, f"{where}: SDPA with a block-diagonal causal mask from the batch's cu_seqlens"


@functools.cache
def _log_choice(choice: str, why: str) -> None:
    _log.info("attention kernel: %s (%s)", choice, why)


def register_packed_kernels() -> None:
    """Register ``varlen`` and ``sdpa_doc_mask`` with HF's attention interface (idempotent).
    No mask function is registered for them, so HF builds no mask (the kernels need none)."""
    from transformers import AttentionInterface

    if varlen_missing() is None:
        AttentionInterface.register(VARLEN, _varlen_attention(_varlen_params()))
    AttentionInterface.register(DOC_MASK, _doc_mask_attention)


def is_packed_kernel(model: nn.Module) -> bool:
    """Whether ``model`` attends with one of this module's kernels."""
    return getattr(model.config, "_attn_implementation", None) in PACKED_KERNELS


def cu_seqlens_of(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 [N + 1], longest)`` of the sequences in ``position_ids`` ``[R, W]``
    flattened row after row: a sequence starts at each row's start and wherever the positions
    do not go on by one (so a row's padding tail, whose positions restart, is its own)."""
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    starts = start.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([starts, starts.new_tensor([position_ids.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def packing_kwargs(position_ids: torch.Tensor) -> dict:
    """The forward keywords that give the packed kernels this forward's boundaries (computed
    once per forward; one device sync for the longest sequence)."""
    cu, longest = cu_seqlens_of(position_ids)
    return {CU_KWARG: cu, MAX_KWARG: longest}


def _boundaries(batch: int, width: int, device: torch.device, kwargs: dict) -> tuple[torch.Tensor, int]:
    cu = kwargs.get(CU_KWARG)
    if cu is not None:
        return cu, kwargs[MAX_KWARG]
    pos = kwargs.get("position_ids")
    if pos is not None:
        return cu_seqlens_of(pos.expand(batch, -1))
    return torch.arange(0, batch * width + 1, width, device=device, dtype=torch.int32), width


def _refuse_extras(kernel: str, module: nn.Module, attention_mask, sliding_window, softcap, kwargs: dict) -> None:
    """Raise where the call asks for more than plain causal attention (never compute less)."""
    extra = []
    if attention_mask is not None:
        extra.append("an attention mask")
    if sliding_window is not None:
        extra.append(f"sliding_window = {sliding_window}")
    if softcap is not None:
        extra.append(f"softcap = {softcap}")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        extra.append("attention sinks")
    if getattr(module, "is_causal", True) is False:
        extra.append("non-causal attention")
    if extra:
        raise RuntimeError(
            f"attention kernel {kernel!r} computes plain causal attention, but {type(module).__name__} asks for "
            f"{', '.join(extra)}; fix: engine.model.attn_implementation = auto (or eager)"
        )


def _varlen_params() -> frozenset[str]:
    """The keywords this torch's ``varlen_attn`` takes (they changed between 2.10 and 2.11)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_attention(params: frozenset[str]):
    """The HF attention function over torch's ``varlen_attn`` (its keywords ``params`` read
    once here, not inside a compiled layer): q/k/v ``[B, H, S, D]`` -> ``[B, S, H, D]``."""
    from torch.nn.attention.varlen import varlen_attn

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs):
        _refuse_extras(VARLEN, module, attention_mask, sliding_window, softcap, kwargs)
        if dropout:
            raise RuntimeError(f"attention kernel 'varlen' has no dropout (asked: {dropout}); fix: engine.model.attn_implementation = auto")
        b, h, s, d = query.shape
        if "scale" not in params and scaling is not None and abs(scaling - d**-0.5) > 1e-12:
            raise RuntimeError(f"this torch's varlen_attn has no scale argument, and the model scales by {scaling}; fix: use auto")
        cu, longest = _boundaries(b, s, query.device, kwargs)
        q = query.transpose(1, 2).reshape(b * s, h, d)
        k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
        extra = {"scale": scaling} if "scale" in params else {}
        if k.shape[1] != h:
            if "enable_gqa" in params:
                extra["enable_gqa"] = True
            else:  # torch 2.10: whole KV heads per query head
                k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
        if "window_size" in params:  # torch >= 2.11: (-1, 0) is causal
            extra["window_size"] = (-1, 0)
        else:  # torch 2.10
            extra["is_causal"] = True
        out = varlen_attn(q, k, v, cu, cu, longest, longest, **extra)
        return out.reshape(b, s, h, d), None

    return attention


def doc_mask(cu_seqlens: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """Bool ``[B, 1, W, W]`` (True: attend): causal, and only within the sequence of
    ``cu_seqlens`` (over the flattened ``[B * W]`` rows) each token belongs to."""
    flat = torch.arange(batch * width, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens.to(torch.int64), flat, right=True).view(batch, width)
    causal = torch.ones(width, width, dtype=torch.bool, device=seg.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def _doc_mask_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs):
    """HF attention function: SDPA with :func:`doc_mask`: q/k/v ``[B, H, S, D]`` -> ``[B, S, H, D]``."""
    _refuse_extras(DOC_MASK, module, attention_mask, sliding_window, softcap, kwargs)
    b, h, s, _ = query.shape
    cu, _ = _boundaries(b, s, query.device, kwargs)
    if key.shape[1] != h:
        key, value = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=doc_mask(cu, b, s), dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None
