"""One parameter through the table, both ways: HF -> this rank's megatron value
(:func:`to_megatron`) and a megatron parameter's gathered TP shards -> HF tensors (:func:`to_hf`;
a layer's experts at once: :func:`hf_experts`).

Experts are megatron's ``SequentialMLP`` (the local spec; no grouped GEMM): each expert's
``linear_fc1`` is ``[gate; up]`` per expert-TP rank, like the dense MLP. Under expert
parallelism EP rank r holds the global experts ``r * E/EP ... (r + 1) * E/EP - 1`` as its local
experts ``0 ... E/EP - 1`` (:class:`ExpertShard`). Import reads whichever HF spelling the
checkpoint has (per expert, or the fused ``[E, ...]`` tensors: ``table``'s MoE rules); export
writes the fused in-memory layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from backends.megatron.convert.arch import ArchInfo
from backends.megatron.convert.layouts import export_layout, import_layout, split_gate_up
from backends.megatron.convert.table import Rule, layer_rules, rule_for


@dataclass(frozen=True)
class ExpertShard:
    """Where this rank sits in the expert layout: EP rank/size and expert-TP rank/size."""

    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1


# --------------------------------------------------------------------------- HF -> megatron
def to_megatron(
    name: str,
    hf: Mapping[str, torch.Tensor],
    arch: ArchInfo,
    layer: int | None,
    tp_rank: int,
    tp: int,
    experts: ExpertShard = ExpertShard(),
    used: set[str] | None = None,
) -> torch.Tensor:
    """This rank's value of megatron parameter ``name`` from HF tensors ``hf`` (the table's rule).

    Args:
        name: local megatron name (``decoder.layers.<local>.<rest>`` or a non-layer name).
        hf: HF state dict (full tensors).
        layer: the global layer index of a ``decoder.layers`` name (None otherwise).
        tp_rank, tp: tensor-parallel rank and size (dense parameters).
        experts: the expert-parallel position (expert parameters).
        used: HF names read are added to it (the load's completeness check).

    Raises:
        KeyError: no rule for ``name``, or none of the rule's HF spellings is in ``hf``.
    """
    rule, prefix, local_expert = rule_for(name, arch, layer)
    e = None if local_expert is None else experts.ep_rank * (arch.num_experts // experts.ep) + local_expert
    template = _present_spelling(rule, prefix, e, hf, arch)
    names = _fmt(template, prefix, e)
    if used is not None:
        used.update(names)
    tensors = [hf[n] for n in names]
    if rule.layout.startswith("expert_"):
        if not any("{e}" in n for n in template):  # the fused [E, ...] layout: expert e's slice
            tensors = [t[e] for t in tensors]
        return import_layout(rule.layout.removeprefix("expert_"), tensors, arch, experts.etp_rank, experts.etp, arch.moe_ffn)
    return import_layout(rule.layout, tensors, arch, tp_rank, tp, arch.ffn)


def _fmt(spelling: tuple[str, ...], prefix: str, e: int | None) -> tuple[str, ...]:
    return tuple(prefix + n.replace("{e}", str(e)) for n in spelling)


def _present_spelling(rule: Rule, prefix: str, e: int | None, hf: Mapping[str, torch.Tensor], arch: ArchInfo) -> tuple[str, ...]:
    """The first of the rule's HF spellings (templates) whose tensors are all in ``hf``."""
    for spelling in rule.spellings():
        if all(n in hf for n in _fmt(spelling, prefix, e)):
            return spelling
    looked = " or ".join("+".join(_fmt(s, prefix, e)) for s in rule.spellings())
    field = f" (made by config field {rule.field})" if rule.field else ""
    raise KeyError(
        f"the checkpoint has no HF tensor for megatron parameter {rule.megatron!r}{field}: looked for {looked}; "
        f"fix: check that config.json matches the checkpoint ({arch.family})"
    )


# --------------------------------------------------------------------------- megatron -> HF
def to_hf(name: str, full: torch.Tensor, arch: ArchInfo, layer: int | None, tp: int) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of a megatron parameter whose TP shards were concatenated
    along their partition dim (``full``): the table's rule, inverted (experts: :func:`hf_experts`)."""
    rule, prefix, local_expert = rule_for(name, arch, layer)
    if local_expert is not None:
        raise KeyError(f"expert weight {name!r}: experts export a layer at a time (hf_experts)")
    tensors = export_layout(rule.layout, full, arch, tp, len(rule.hf))
    return [(prefix + n, t) for n, t in zip(rule.hf, tensors, strict=True)]


def hf_experts(fc1: torch.Tensor, fc2: torch.Tensor, arch: ArchInfo, layer: int, etp: int) -> list[tuple[str, torch.Tensor]]:
    """HF's fused expert tensors of a layer (the names of the table's expert rules) from every
    expert's megatron weights: ``fc1`` ``[E, 2I, H]`` (each expert's expert-TP shards
    concatenated: ``[gate_0; up_0; gate_1; ...]``) and ``fc2`` ``[E, H, I]``."""
    rules = layer_rules(arch, True)
    split = [split_gate_up(w, etp, arch.moe_ffn) for w in fc1.unbind()]
    gate_up = torch.stack([torch.cat(pair) for pair in split])
    p = f"model.layers.{layer}."
    (fc1_name,) = rules["mlp.experts.local_experts.*.linear_fc1.weight"].hf
    (fc2_name,) = rules["mlp.experts.local_experts.*.linear_fc2.weight"].hf
    return [(p + fc1_name, gate_up), (p + fc2_name, fc2)]
