"""The tensor layouts between HF and megatron-core (:data:`LAYOUTS`), both ways: import
(:func:`import_layout`: HF tensors -> one TP rank's shard) and export (:func:`export_layout`: the
concatenated TP shards -> HF tensors). fp32 exact; the round trip is tested.

* ``linear_qkv`` rows are grouped per query group: ``[q heads of group g, k_g, v_g]`` (weight
  and bias alike); tensor parallelism splits whole groups, so a TP rank's shard is contiguous
  groups.
* ``linear_fc1`` is ``[gate; up]`` *per TP rank* (each rank holds its gate and up slices; its
  bias likewise). ``linear_proj`` and ``linear_fc2`` split their input columns; their biases
  are replicated (added once, after the TP reduction).
* Embedding / output rows are padded to a multiple of the TP size (zero rows); export drops
  the padding and the engine slices logits to the true vocabulary.
* Value heads: HF token classification's ``score`` (weight ``[1, hidden]``, bias ``[1]``) is a
  replicated ``output_layer`` (``weight``, ``bias``) on the last stage.
* Phi-3 is Llama-shaped with fused checkpoint tensors: ``qkv_proj`` rows are [q; k; v] and
  ``gate_up_proj`` rows are [gate; up]; they are split on import and fused again on export.
* An MoE expert's ``linear_fc1`` / ``linear_fc2`` are the dense ``gate_up`` / ``cols`` layouts
  over expert-TP (``fc1`` / ``fc2`` here; ``backends.megatron.convert.weights`` picks the expert).
"""

from __future__ import annotations

import math

import torch

from backends.megatron.convert.arch import ArchInfo

# layout -> what it does (import direction; export is the inverse).
LAYOUTS = {
    "copy": "the same tensor (replicated over TP)",
    "cols": "split along the input columns over TP (row-parallel weights)",
    "vocab": "rows padded to a multiple of TP, then split over TP; export drops the padding",
    "qkv": "q, k, v (or Phi-3's fused qkv) interleaved per query group, then split over TP",
    "gate_up": "gate, up (or Phi-3's fused gate_up) as [gate_r; up_r] per TP rank",
    "expert_fc1": "expert e's gate, up as [gate_r; up_r] per expert-TP rank (fused [E, 2I, H] or per expert)",
    "expert_fc2": "expert e's down split along its columns over expert-TP (fused [E, H, I] or per expert)",
}


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of the TP size (megatron splits rows evenly)."""
    return math.ceil(vocab / tp) * tp


def import_layout(layout: str, t: list[torch.Tensor], arch: ArchInfo, rank: int, tp: int, ffn: int) -> torch.Tensor:
    """The megatron value of HF tensors ``t`` under ``layout`` (TP rank ``rank`` of ``tp``)."""
    if layout == "copy":
        return t[0].clone()
    if layout == "cols" or layout == "fc2":
        return _cols(t[0], rank, tp)
    if layout == "vocab":
        return _rows(_pad_rows(t[0], padded_vocab(arch.vocab, tp)), rank, tp)
    if layout == "qkv":
        d = arch.head_dim
        q, k, v = t[0].split([arch.heads * d, arch.groups * d, arch.groups * d]) if len(t) == 1 else t
        return _rows(_fuse_qkv(q, k, v, arch), rank, tp)
    if layout in ("gate_up", "fc1"):
        gate, up = t[0].chunk(2) if len(t) == 1 else t
        if gate.shape[0] != ffn or up.shape[0] != ffn:
            raise ValueError(f"gate/up have {gate.shape[0]}/{up.shape[0]} rows, the config says {ffn}; fix: check config.json")
        return torch.cat([_rows(gate, rank, tp), _rows(up, rank, tp)])
    raise ValueError(f"unknown layout {layout!r}")


def export_layout(layout: str, full: torch.Tensor, arch: ArchInfo, tp: int, count: int) -> list[torch.Tensor]:
    """The inverse of :func:`import_layout` on the concatenated TP shards; ``count`` HF tensors."""
    if layout in ("copy", "cols"):
        return [full]
    if layout == "vocab":
        return [full[: arch.vocab]]
    if layout == "qkv":
        q, k, v = _split_qkv(full, arch)
        return [torch.cat([q, k, v])] if count == 1 else [q, k, v]
    if layout == "gate_up":
        gate, up = split_gate_up(full, tp, arch.ffn)
        return [torch.cat([gate, up])] if count == 1 else [gate, up]
    raise ValueError(f"unknown layout {layout!r}")


def split_gate_up(full: torch.Tensor, tp: int, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` of a ``linear_fc1`` whose TP shards were concatenated."""
    # Concatenated TP shards are [gate_0; up_0; gate_1; up_1; ...] (weights and biases alike).
    per_rank = full.reshape(tp, 2, ffn // tp, *full.shape[1:])
    return per_rank[:, 0].reshape(ffn, *full.shape[1:]), per_rank[:, 1].reshape(ffn, *full.shape[1:])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ArchInfo) -> torch.Tensor:
    per_group = arch.heads // arch.groups
    d = arch.head_dim
    q = q.reshape(arch.groups, per_group * d, *q.shape[1:])
    k = k.reshape(arch.groups, d, *k.shape[1:])
    v = v.reshape(arch.groups, d, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:]).clone()


def _split_qkv(fused: torch.Tensor, arch: ArchInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = arch.heads // arch.groups
    d = arch.head_dim
    g = fused.reshape(arch.groups, (per_group + 2) * d, *fused.shape[1:])
    q, k, v = g[:, : per_group * d], g[:, per_group * d : (per_group + 1) * d], g[:, (per_group + 1) * d :]
    return (q.reshape(-1, *fused.shape[1:]), k.reshape(-1, *fused.shape[1:]), v.reshape(-1, *fused.shape[1:]))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[rank].clone()


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[rank].clone()
