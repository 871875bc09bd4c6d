"""The converter's part of the load's completeness checks (``backends.megatron.model.load_hf_weights``
runs them; the table's side is :func:`~backends.megatron.convert.table.rule_for` and the import's
``weights.to_megatron``).

Completeness is checked both ways: a megatron parameter without a rule, a rule whose HF tensors
are missing, a converted tensor of the wrong shape, or an HF tensor that no rule consumed
(:func:`unconsumed_problems`) fails the load naming the tensor and the likely config field
(:func:`hint`). Only HF's own ignorables are skipped: ``rotary_emb.inv_freq`` buffers (recomputed
from the config, as HF does), the LM head of a value model (HF's token-classification model drops
it too) and a tied ``lm_head.weight`` equal to the embedding.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from backends.megatron.convert.arch import ArchInfo
from backends.megatron.convert.fields import FIX

# Name fragment -> the config field (or family trait) that decides whether the tensor exists.
_HINTS = (
    ("o_proj.bias", "attention_bias"),
    ("linear_proj.bias", "attention_bias"),
    ("q_proj.bias", "attention_bias"),
    ("k_proj.bias", "attention_bias"),
    ("v_proj.bias", "attention_bias"),
    ("qkv_proj.bias", "attention_bias"),
    ("linear_qkv.bias", "attention_bias"),
    ("mlp.gate_proj.bias", "mlp_bias"),
    ("mlp.up_proj.bias", "mlp_bias"),
    ("mlp.down_proj.bias", "mlp_bias"),
    ("mlp.gate_up_proj.bias", "mlp_bias"),
    ("linear_fc1.bias", "mlp_bias"),
    ("linear_fc2.bias", "mlp_bias"),
    ("_norm.", "model_type (only Qwen3 / Qwen3-MoE have q/k norms)"),
    ("_layernorm.", "model_type (only Qwen3 / Qwen3-MoE have q/k norms)"),
    ("lm_head", "tie_word_embeddings"),
    ("score.", "model.head"),
    ("experts", "num_experts / num_local_experts / mlp_only_layers / decoder_sparse_step"),
    ("router", "num_experts / mlp_only_layers / decoder_sparse_step"),
    (".gate.", "num_experts / mlp_only_layers / decoder_sparse_step"),
)
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def unconsumed_problems(hf: Mapping[str, torch.Tensor], consumed: set[str], arch: ArchInfo, value_head: bool) -> list[str]:
    """One message per HF tensor that no rule read (on any rank), naming the tensor, its shape
    and the config field likely responsible; HF's own ignorables (module docstring) are skipped."""
    out = []
    for name in sorted(set(hf) - consumed):
        if _ignorable(name, hf, arch, value_head):
            continue
        out.append(
            f"HF tensor {name!r} {list(hf[name].shape)} is used by no rule of the {arch.family} mapping (likely config field: "
            f"{hint(name, arch)}); megatron would compute something other than HF; fix: make config.json match the checkpoint, or {FIX}"
        )
    return out


def _ignorable(name: str, hf: Mapping[str, torch.Tensor], arch: ArchInfo, value_head: bool) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True  # a buffer HF recomputes from the config (and ignores on load too)
    if name == "lm_head.weight" and value_head:
        return True  # the token-classification model has no LM head (HF drops it as well)
    embed = hf.get("model.embed_tokens.weight")
    return name == "lm_head.weight" and arch.tied and embed is not None and torch.equal(hf[name], embed)


def hint(name: str, arch: ArchInfo) -> str:
    """The config field (or family trait) most likely behind a tensor one side has and the other
    lacks (``name``: an HF name, or a megatron name relative to its layer)."""
    layer = _HF_LAYER.match(name)
    if layer and int(layer.group(1)) >= arch.num_layers:
        return f"num_hidden_layers = {arch.num_layers}"
    return next((field for fragment, field in _HINTS if fragment in name), f"model_type = {arch.family!r}")
