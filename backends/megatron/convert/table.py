"""The weights' mapping table: ONE per family and config (:class:`Rule`; :func:`layer_rules`,
:func:`model_rules`), used by import (``weights.to_megatron``) and export (``weights.to_hf``,
``weights.hf_experts``).

A rule names the megatron parameter, the HF tensors export writes, other HF spellings import
accepts (on-disk layouts), the layout between them (``layouts.LAYOUTS``) and the config field
that makes the tensor exist. :func:`rule_for` finds a megatron parameter's rule and refuses a
parameter the table has none for (one half of the load's completeness checks,
``backends.megatron.convert.checks``).

The table uses the local spec's names (mbridge hard-codes the Transformer-Engine spec's, see
``backends.megatron.convert``); the TE spec's fused norm names
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) are read as the local
``input_layernorm`` / ``pre_mlp_layernorm``.

MoE layers: the router, and each expert's ``linear_fc1`` / ``linear_fc2`` (megatron's
``SequentialMLP``, one rule for every expert: its index is ``*``), read from per-expert tensors
(what transformers 5 writes to disk, and the Hub's files: Qwen3-MoE
``mlp.experts.<e>.{gate,up,down}_proj.weight``, Mixtral ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight``)
or the fused in-memory layout (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` rows ``[gate; up]``,
``mlp.experts.down_proj`` ``[E, H, I]``), which export writes (what the HF model's ``state_dict``
holds and ``load_state_dict`` takes, so a rollout model syncs from it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from backends.megatron.convert.arch import ATTENTION_BIAS, FUSED_HF, ArchInfo
from backends.megatron.convert.checks import hint
from backends.megatron.convert.fields import FIX

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


@dataclass(frozen=True)
class Rule:
    """One row of the mapping table: a megatron parameter and the HF tensors it is made of.

    Attributes:
        megatron: the local-spec name, relative to ``decoder.layers.<i>.`` for a layer
            parameter (an expert's index is ``*``).
        hf: the HF names export writes (relative to ``model.layers.<i>.`` for a layer parameter).
        layout: how the HF tensors become the megatron tensor and back (``layouts.LAYOUTS``).
        field: the config field (or family trait) that makes the tensor exist, for error messages.
        read: the HF spellings import accepts, in order (default: ``hf``); ``{e}`` is the
            global expert index of a per-expert spelling.
    """

    megatron: str
    hf: tuple[str, ...]
    layout: str
    field: str = ""
    read: tuple[tuple[str, ...], ...] = ()

    def spellings(self) -> tuple[tuple[str, ...], ...]:
        return self.read or (self.hf,)


# The TE spec fuses the norms into the next linear; the table uses the local spec's names.
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@functools.lru_cache(maxsize=32)
def layer_rules(arch: ArchInfo, moe: bool) -> Mapping[str, Rule]:
    """The table of one decoder layer (``moe``: an MoE layer of an MoE family)."""
    fused = arch.family in FUSED_HF
    qkv = ("self_attn.qkv_proj",) if fused else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    rules = [
        Rule("input_layernorm.weight", ("input_layernorm.weight",), "copy"),
        Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy"),
        Rule("self_attention.linear_qkv.weight", tuple(n + ".weight" for n in qkv), "qkv"),
        Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "cols"),
    ]
    if arch.qkv_bias:
        field = "attention_bias" if arch.family in ATTENTION_BIAS else f"{arch.family} (q/k/v bias always)"
        rules.append(Rule("self_attention.linear_qkv.bias", tuple(n + ".bias" for n in qkv), "qkv", field))
    if arch.o_bias:
        rules.append(Rule("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), "copy", "attention_bias"))
    if arch.qk_norm:
        rules.append(Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "copy", f"{arch.family} (q/k norm)"))
        rules.append(Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "copy", f"{arch.family} (q/k norm)"))
    rules += _moe_rules() if moe else _mlp_rules(arch, fused)
    return {r.megatron: r for r in rules}


def _mlp_rules(arch: ArchInfo, fused: bool) -> list[Rule]:
    gate_up = ("mlp.gate_up_proj",) if fused else ("mlp.gate_proj", "mlp.up_proj")
    rules = [
        Rule("mlp.linear_fc1.weight", tuple(n + ".weight" for n in gate_up), "gate_up"),
        Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "cols"),
    ]
    if arch.mlp_bias:
        rules.append(Rule("mlp.linear_fc1.bias", tuple(n + ".bias" for n in gate_up), "gate_up", "mlp_bias"))
        rules.append(Rule("mlp.linear_fc2.bias", ("mlp.down_proj.bias",), "copy", "mlp_bias"))
    return rules


def _moe_rules() -> list[Rule]:
    field = "num_experts / mlp_only_layers / decoder_sparse_step"
    return [
        Rule("mlp.router.weight", ("mlp.gate.weight",), "copy", field, read=(("mlp.gate.weight",), ("block_sparse_moe.gate.weight",))),
        Rule(
            "mlp.experts.local_experts.*.linear_fc1.weight",
            ("mlp.experts.gate_up_proj",),
            "expert_fc1",
            field,
            read=(
                ("mlp.experts.gate_up_proj",),
                ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
            ),
        ),
        Rule(
            "mlp.experts.local_experts.*.linear_fc2.weight",
            ("mlp.experts.down_proj",),
            "expert_fc2",
            field,
            read=(("mlp.experts.down_proj",), ("mlp.experts.{e}.down_proj.weight",), ("block_sparse_moe.experts.{e}.w2.weight",)),
        ),
    ]


@functools.lru_cache(maxsize=32)
def model_rules(arch: ArchInfo) -> Mapping[str, Rule]:
    """The table of the parameters outside the decoder layers (a tied head reads the embedding)."""
    head_read = (("model.embed_tokens.weight",),) if arch.tied else ()
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    ]
    if arch.value_head:
        rules.append(Rule("output_layer.weight", ("score.weight",), "copy", "model.head=value"))
        if arch.value_bias:
            rules.append(Rule("output_layer.bias", ("score.bias",), "copy", "model.head=value"))
    else:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", "tie_word_embeddings", read=head_read))
    return {r.megatron: r for r in rules}


def rule_for(name: str, arch: ArchInfo, layer: int | None) -> tuple[Rule, str, int | None]:
    """``(rule, HF name prefix, local expert index or None)`` of a megatron parameter.

    Raises:
        KeyError: no rule: megatron built a parameter HF's model does not have.
    """
    match = _LAYER.match(name)
    rest = match.group(2) if match else name
    rest = _TE_NAMES.get(rest, rest)
    expert = _EXPERT.match(rest)
    key = f"mlp.experts.local_experts.*.{expert.group(2)}.weight" if expert else rest
    if match:
        rules, prefix = layer_rules(arch, layer in arch.moe_layers), f"model.layers.{layer}."
    else:
        rules, prefix = model_rules(arch), ""
    rule = rules.get(key)
    if rule is None:
        raise KeyError(
            f"megatron parameter {name!r} has no HF counterpart in the {arch.family} mapping (likely config field: {hint(rest, arch)}): "
            "megatron built a tensor the HF model does not have; fix: report it (the converter's spec and table disagree), or " + FIX
        )
    return rule, prefix, int(expert.group(1)) if expert else None
