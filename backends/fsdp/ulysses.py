"""Ulysses sequence parallelism (SP) for the HF models of the FSDP backend.

The ranks of one SP group hold the same micro-batch; each runs the model on a contiguous
slice of every row's columns (its ``1 / sp`` of the tokens), so activations, logits and the
MLPs cost ``1 / sp`` per rank. Attention needs whole sequences: around each attention kernel
an all-to-all turns the sequence shards of q, k, v into head shards (every rank: all tokens,
``heads / sp`` heads), the kernel runs, and a second all-to-all turns its output back
(DeepSpeed-Ulysses; what verl's FSDP Ulysses does).

How it plugs into HF: :func:`apply_ulysses` registers an attention implementation named
``enginekit_ulysses_<kernel>`` that wraps the model's own kernel (``sdpa``, ``eager``, or
``flash_attention_2``) and points the model config at it. RoPE is applied by the attention
module before the kernel is called, to the local slice with the local positions, so only the
kernel sees whole sequences. A forward runs sequence-parallel when it is given the keyword
``SP_KWARG`` (a :class:`SequenceShard`); HF passes model keywords down to every attention call
(and activation checkpointing replays them), so the recomputation in backward sees it too.
Without it the wrapper is the plain kernel with HF's own mask.

The mask is built here, once per forward, from the *whole* rows' position ids: a token
attends to the earlier tokens of its own sequence (a sequence starts where the positions
restart), within the layer's ``sliding_window`` when it has one. That is the masking HF
applies to packed rows and (causally) to right-padded rows, which is all the engine's layouts
need; families whose attention masks anything else are refused (:func:`ulysses_problems`).

GQA: KV heads are split like the query heads when ``sp`` divides them; otherwise each KV
head is repeated ``r = sp / gcd(kv_heads, sp)`` times first, the fewest copies that give every
rank whole KV heads for its query heads (``r`` divides the query-per-KV group because
``sp`` divides the query heads).

Gradients: a rank's gradient covers only the tokens of its slice (the all-to-alls route the
attention's cross-slice terms back where they came from; the gather of the per-token outputs,
``engine_api.seq_split.gather_dim1``, hands each rank back the gradient of its own columns
only). Over an SP group they sum to the gradient of the micro-batch, once; FSDP then averages
over every rank of its mesh, DP x SP, which the engine compensates
(``StepSpec.grad_reduce_ranks``).
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

#: The model keyword that carries a forward's :class:`SequenceShard` down to the attention.
SP_KWARG = "enginekit_sequence_shard"
_PREFIX = "enginekit_ulysses_"
_KERNELS = ("sdpa", "eager", "flash_attention_2")


@dataclass
class SequenceShard:
    """One sequence-parallel forward: the group, and the whole rows' positions.

    Attributes:
        group: the SP process group (this rank's peers that hold the same micro-batch).
        positions: int64 ``[rows, width]``, the position ids of the whole rows (``width`` a
            multiple of the group size); rank ``i`` runs columns ``[i * width / sp, (i + 1) *
            width / sp)``.
        tail: the last ``tail`` columns only widen the rows (their positions restart at 0, so
            no position embedding overflows). No real token sees them (they come last, and
            attention is causal), so the mask may treat them as part of the row's last
            sequence: a row of one sequence keeps sdpa's mask-free causal kernel.
    """

    group: dist.ProcessGroup
    positions: torch.Tensor
    tail: int = 0
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def local_width(self) -> int:
        return self.positions.shape[1] // self.size

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's columns of ``rows`` ``[R, width, ...]``."""
        w = self.local_width
        return rows[:, self.rank * w : (self.rank + 1) * w]

    def mask(self, kernel: str, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The attention mask of the whole rows for ``kernel`` (cached per forward): None
        where the rows are plain causal sequences and the kernel is causal by itself (sdpa),
        bool ``[R, 1, W, W]`` (True: attend) for sdpa, additive ``dtype`` for eager."""
        key = (kernel, window, dtype)
        if key not in self._masks:
            positions = self.positions
            if self.tail:
                positions = positions.clone()
                positions[:, -self.tail :] = positions[:, -self.tail - 1 : -self.tail] + torch.arange(
                    1, self.tail + 1, device=positions.device
                )
            self._masks[key] = _build_mask(positions, kernel, window, dtype)
        return self._masks[key]


def _segments(positions: torch.Tensor) -> torch.Tensor:
    """Sequence ids along each row: a new sequence starts where the positions do not go on by one."""
    start = torch.ones_like(positions, dtype=torch.bool)
    start[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return start.long().cumsum(1)


def _build_mask(positions: torch.Tensor, kernel: str, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
    seg = _segments(positions)
    plain = bool((seg == 1).all()) and window is None
    if plain and kernel == "sdpa":
        return None  # sdpa's own is_causal (no mask: its fast kernels)
    cols = torch.arange(positions.shape[1], device=positions.device)
    allowed = (seg[:, :, None] == seg[:, None, :]) & (cols[None, :, None] >= cols[None, None, :])
    if window is not None:
        allowed &= (cols[:, None] - cols[None, :])[None] < window  # HF: kv_idx > q_idx - sliding_window
    allowed = allowed[:, None]
    if kernel == "sdpa":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)


# ----------------------------------------------------------------------------- collectives
class _AllToAll(torch.autograd.Function):
    """All-to-all of ``x`` ``[sp, ...]`` over ``group``: chunk ``j`` goes to rank ``j``, chunk
    ``j`` of the result came from rank ``j``. Its own inverse, so backward is the same call."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # (empty_like would copy a permuted view's strides; the collective writes flat)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """``[B, H, S / sp, D]`` (all heads of this rank's columns) to ``[B, H / sp, S, D]``
    (this rank's heads of every column)."""
    b, h, s, d = x.shape
    sp = shard.size
    chunks = x.reshape(b, sp, h // sp, s, d).permute(1, 0, 2, 3, 4)  # [to rank, B, H/sp, S/sp, D]
    got = _AllToAll.apply(chunks, shard.group)  # [from rank = column block, B, H/sp, S/sp, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def heads_to_seq(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """A kernel's output ``[B, S, H / sp, D]`` back to ``[B, S / sp, H, D]``."""
    b, s, h, d = x.shape
    sp = shard.size
    chunks = x.reshape(b, sp, s // sp, h, d).permute(1, 0, 2, 3, 4)  # [to rank = column block, ...]
    got = _AllToAll.apply(chunks, shard.group)  # [from rank = head block, B, S/sp, H/sp, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h, d)


# ----------------------------------------------------------------------------- attention
class _KernelView:
    """The attention module as the wrapped kernel must see it: after KV heads were repeated,
    fewer query heads per KV head (``groups``); and a config whose attention implementation is
    the kernel's own name (HF's flash path dispatches on ``module.config._attn_implementation``,
    which the model config holds as the wrapper's name)."""

    def __init__(self, module: nn.Module, kernel: str, groups: int | None) -> None:
        self._module = module
        if groups is not None:
            self.num_key_value_groups = groups
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) != kernel:
            config = copy.copy(config)  # shallow: only the implementation name differs
            config._attn_implementation_internal = kernel
        self.config = config

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _kernel(name: str, module: nn.Module):
    """The model's own kernel ``name``: eager is the module's family's ``eager_attention_forward``
    (families differ: soft-capping, sinks), the others HF's registered functions."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _ulysses_attention(kernel: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        shard: SequenceShard | None = kwargs.pop(SP_KWARG, None)
        inner = _kernel(kernel, module)
        if shard is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        sp, kv_heads = shard.size, key.shape[1]
        repeat = sp // math.gcd(kv_heads, sp)
        groups = None
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
            groups = getattr(module, "num_key_value_groups", query.shape[1] // kv_heads) // repeat
        view = _KernelView(module, kernel, groups) if groups is not None or kernel == "flash_attention_2" else module
        q, k, v = (seq_to_heads(t, shard) for t in (query, key, value))
        if kernel == "flash_attention_2":
            mask = None
            kwargs["position_ids"] = shard.positions  # varlen boundaries of the whole rows
        else:
            mask = shard.mask(kernel, kwargs.get("sliding_window"), q.dtype)
        out, _ = inner(view, q, k, v, mask, **kwargs)
        return heads_to_seq(out, shard), None

    return attention


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for kernel in _KERNELS:
        name = _PREFIX + kernel
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _ulysses_attention(kernel))
            # HF's own mask for forwards without a SequenceShard (the wrapper is then the kernel)
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kernel])


def apply_ulysses(model: nn.Module) -> None:
    """Point ``model``'s attention at the sequence-parallel wrapper of its current kernel.
    Forwards given ``SP_KWARG`` then run sequence-parallel; others are unchanged."""
    _register()
    config = model.config
    kernel = config._attn_implementation or "eager"
    if kernel.startswith(_PREFIX):
        return
    if kernel not in _KERNELS:
        raise ValueError(
            f"engine.fsdp.ulysses_sequence_parallel_size > 1: the model runs the {kernel!r} attention kernel, which Ulysses does not "
            f"wrap; fix: engine.model.attn_implementation = one of {', '.join(_KERNELS)}"
        )
    config._attn_implementation = _PREFIX + kernel


def ulysses_problems(hf_config, sp: int) -> list[str]:
    """Why this model cannot run at ``engine.fsdp.ulysses_sequence_parallel_size = sp`` (empty
    when it can): the query heads must split evenly; attention that masks or scores anything
    but causal packed sequences (attention sinks, chunked attention, bidirectional attention,
    non-causal layers) is not what the wrapper's mask computes."""
    field_ = "fsdp.ulysses_sequence_parallel_size"
    out = []
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(text, "num_attention_heads", None)
    if heads is not None and heads % sp:
        out.append(f"{field_} = {sp}: does not divide the model's num_attention_heads = {heads}; fix: use an SP size that divides {heads}")
    model_type = getattr(text, "model_type", "?")
    if model_type in ("gpt_oss",) or getattr(text, "attention_sink", None):
        out.append(f"{field_} = {sp}: {model_type}'s attention sinks are per head and not split by Ulysses; fix: use 1 for this model")
    if getattr(text, "attention_chunk_size", None):
        out.append(f"{field_} = {sp}: chunked attention (attention_chunk_size) is not masked by Ulysses' causal mask; fix: use 1")
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        out.append(f"{field_} = {sp}: the model attends bidirectionally; Ulysses' mask is causal; fix: use 1 for this model")
    kinds = set(getattr(text, "layer_types", None) or ())
    odd = kinds - {"full_attention", "sliding_attention"}
    if odd:
        out.append(f"{field_} = {sp}: layer types {sorted(odd)} are not causal full / sliding attention; fix: use 1 for this model")
    return out
