"""HF <-> megatron-core conversion for the Llama / Mistral / Phi-3 / Qwen2 / Qwen3 and the MoE
Qwen3-MoE / Mixtral families: config and weights. Per family, what is exact (tested) and what is
refused: docs/megatron-families.md.

One concern per module (each module's docstring holds its rules):

* ``fields``: the config audit. Every field the families' HF config classes declare is mapped
  (:data:`MAPPED_FIELDS`) or harmless (:data:`HARMLESS_FIELDS`); a value the converter cannot
  reproduce is refused at ``build_engine`` (:func:`config_refusals`); scaled RoPE frequencies
  are HF's own (:func:`rope_frequencies`).
* ``arch``: what the converter reads from a config (:class:`ArchInfo`, :func:`arch_info`:
  biases, dropout, sliding windows, MoE routing) and megatron's ``TransformerConfig`` for it
  (:func:`transformer_config_kwargs`).
* ``table``: ONE two-way mapping table per family and config (:class:`Rule`,
  :func:`layer_rules`, :func:`model_rules`, :func:`rule_for`), used by import and export.
* ``layouts``: the tensor layouts between the two (:data:`LAYOUTS`: q/k/v per query group,
  gate/up per TP rank, vocabulary padding, TP shards; :func:`import_layout`).
* ``weights``: one parameter through the table: import (:func:`to_megatron`, experts placed by
  :class:`ExpertShard`) and export (:func:`to_hf`, :func:`hf_experts`).
* ``checks``: the load's completeness checks on the HF side (:func:`unconsumed_problems`).

Why not mbridge: it hard-codes the Transformer-Engine layer spec and TE weight names
(docs/design.md, megatron-core on CPU), so it cannot serve the local spec the CPU tests run. The
table uses the local spec's names and reads the TE spec's fused norm names as the local ones.

Every public name is re-exported here, and callers import them from here
(``backends.megatron.convert``: one path for the converter); the modules' own names are the same
objects.
"""

from __future__ import annotations

from backends.megatron.convert.arch import ArchInfo, arch_info, transformer_config_kwargs
from backends.megatron.convert.checks import unconsumed_problems
from backends.megatron.convert.fields import (
    ACTIVATIONS,
    FAMILIES,
    HARMLESS_FIELDS,
    MAPPED_FIELDS,
    MOE_FAMILIES,
    ROPE_TYPES,
    config_refusals,
    gelu_tanh,
    rope_frequencies,
)
from backends.megatron.convert.layouts import LAYOUTS, import_layout, padded_vocab
from backends.megatron.convert.table import Rule, layer_rules, model_rules, rule_for
from backends.megatron.convert.weights import ExpertShard, hf_experts, to_hf, to_megatron

__all__ = [
    "ACTIVATIONS",
    "FAMILIES",
    "HARMLESS_FIELDS",
    "LAYOUTS",
    "MAPPED_FIELDS",
    "MOE_FAMILIES",
    "ROPE_TYPES",
    "ArchInfo",
    "ExpertShard",
    "Rule",
    "arch_info",
    "config_refusals",
    "gelu_tanh",
    "hf_experts",
    "import_layout",
    "layer_rules",
    "model_rules",
    "padded_vocab",
    "rope_frequencies",
    "rule_for",
    "to_hf",
    "to_megatron",
    "transformer_config_kwargs",
    "unconsumed_problems",
]
