"""The HF config side of the converter: which families and config values it reproduces exactly,
and the refusal of every other (:func:`config_refusals`, at ``build_engine``).

Every field the families' HF config classes declare (transformers 5.19) is in
:data:`MAPPED_FIELDS` (what megatron gets from it) or :data:`HARMLESS_FIELDS` (why it cannot
change the forward or the gradients). A declared field in neither, with a value other than its
class default, is refused, as is a mapped field with a value the converter cannot reproduce
(``hidden_act`` other than the activations in :data:`ACTIVATIONS`, RoPE types outside
:data:`ROPE_TYPES`, partial RoPE, Phi-3's ``resid_pdrop > 0``, Mixtral's
``router_jitter_noise > 0``, shared experts, per-layer config overrides, top-1 routing with
renormalised probabilities). Keys of ``config.json`` that the class does not declare are not
read by these families' HF modeling code, so they change HF's numbers no more than megatron's.

Activation: ``hidden_act`` silu/swish (SiLU), gelu (exact erf), gelu_pytorch_tanh / gelu_new
(tanh approximation), always gated (``act(gate) * up``, megatron's ``gated_linear_unit``).

RoPE: default, ``linear``, ``llama3`` and ``yarn`` scaling. The rotary frequencies are HF's own
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` on the model's config, so every
parameter of the config is honoured, not megatron's hard-coded llama3 defaults,
:func:`rope_frequencies`) and replace megatron's after the model is built; YaRN's attention
factor ``a`` (HF multiplies cos and sin by it, i.e. q and k) becomes
``softmax_scale = a**2 / sqrt(head_dim)``, the same logits
(``backends.megatron.convert.arch.transformer_config_kwargs``). Other RoPE types are refused.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine_api.kit import format_problem

FAMILIES = ("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The way out every refusal names (the FSDP backend takes every config the HF model does).
FIX = "use the fsdp backend (strategy=fsdp), which runs the HF model itself"


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (HF ``gelu_pytorch_tanh``; ``gelu_new`` is the same formula)."""
    return F.gelu(x, approximate="tanh")


# hidden_act -> megatron's activation_func (gated, as HF's MLPs: act(gate) * up).
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": gelu_tanh, "gelu_new": gelu_tanh}

# Every field the families' config classes declare that changes the computation, and where it goes.
MAPPED_FIELDS = {
    "vocab_size": "embedding / output rows (padded to a multiple of TP, sliced off again)",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size (Qwen3-MoE: its dense layers)",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "head_dim": "kv_channels",
    "hidden_act": f"activation_func, gated: {', '.join(ACTIVATIONS)}; others refused",
    "rms_norm_eps": "layernorm_epsilon (RMSNorm; Qwen3's q/k norms too)",
    "max_position_embeddings": "the longest sequence the engine accepts",
    "tie_word_embeddings": "share_embeddings_and_output_weights",
    "rope_parameters": f"rope_theta; {', '.join(ROPE_TYPES)} frequencies from HF's initialisers; others and partial RoPE refused",
    "pad_token_id": "HF's padding_idx: lookups of the pad row get no gradient",
    "attention_bias": "q/k/v bias (add_qkv_bias) and the o_proj bias (linear_proj built with a bias)",
    "mlp_bias": "gate/up/down biases (linear_fc1 / linear_fc2 built with biases)",
    "attention_dropout": "attention_dropout (hidden_dropout 0)",
    "sliding_window": "a sequence-length limit (exact inside the window)",
    "use_sliding_window": "whether Qwen's sliding_window applies",
    "layer_types": "which Qwen layers slide (the window limits every sequence)",
    "max_window_layers": "which Qwen layers slide (the window limits every sequence)",
    "num_experts": "num_moe_experts",
    "num_local_experts": "num_moe_experts",
    "num_experts_per_tok": "moe_router_topk",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "decoder_sparse_step": "moe_layer_freq",
    "mlp_only_layers": "moe_layer_freq",
    "norm_topk_prob": "moe_router_pre_softmax",
    "router_jitter_noise": "0 only",
    "output_router_logits": "the engine's load-balancing loss (engine_api.moe)",
    "router_aux_loss_coef": "the engine's load-balancing loss (engine_api.moe)",
    "resid_pdrop": "0 only",
}
# Declared fields that cannot change the forward or the gradients, and why.
HARMLESS_FIELDS = {
    "initializer_range": "initialisation only: the weights come from the checkpoint",
    "use_cache": "generation's KV cache",
    "bos_token_id": "a token id, not part of the forward",
    "eos_token_id": "a token id, not part of the forward",
    "pretraining_tp": "not read by transformers 5's Llama",
    "embd_pdrop": "declared by Phi3Config, applied by no HF module",
    "original_max_position_embeddings": "Phi-3: read by longrope (refused) and generation's cache reset only",
}


def config_refusals(hf_config) -> list[str]:
    """Every reason the megatron backend cannot reproduce the HF model of ``hf_config`` exactly
    (empty: it can). Each names the config field, its value and what to do."""
    family = hf_config.model_type
    if family not in FAMILIES:
        return [
            format_problem("model_type", family, "not supported by the megatron backend", f"use one of {', '.join(FAMILIES)}, or {FIX}")
        ]
    out = _unaudited_fields(hf_config)
    if getattr(hf_config, "is_heterogeneous", False):
        out.append(format_problem("per_layer_config", "set", "per-layer config overrides are not converted", FIX))
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        out.append(format_problem("hidden_act", act, f"no exact megatron MLP for it (converted: {', '.join(ACTIVATIONS)})", FIX))
    try:
        rope_frequencies(hf_config)
    except ValueError as exc:
        out.append(str(exc))
    resid = float(getattr(hf_config, "resid_pdrop", 0.0) or 0.0)
    if resid > 0:
        why = "megatron's hidden_dropout would also drop the embedding output, which HF's Phi-3 does not (different training noise)"
        out.append(format_problem("resid_pdrop", resid, why, f"set resid_pdrop to 0 in config.json, or {FIX}"))
    jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        why = "Mixtral's training-time jitter scales the MoE input randomly, which megatron's router does not reproduce"
        out.append(format_problem("router_jitter_noise", jitter, why, f"set router_jitter_noise to 0 in config.json, or {FIX}"))
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        out.append(
            format_problem(
                "shared_expert_intermediate_size", hf_config.shared_expert_intermediate_size, "shared experts are not converted", FIX
            )
        )
    moe = moe_fields(hf_config)
    if moe and moe["moe_topk"] == 1 and moe["norm_topk"]:
        # HF renormalises the one selected probability: every routing weight is exactly 1.0 and
        # the router learns only from the load-balancing loss. megatron-core refuses top-1 with
        # the softmax after the selection ("--moe-router-pre-softmax") and before it the weight
        # is the probability itself, so neither layout is HF's.
        field = "num_experts_per_tok"
        why = (
            "top-1 routing with the selected probability renormalised (Mixtral always; Qwen3-MoE norm_topk_prob=true) gives every "
            "token a routing weight of exactly 1.0, which megatron-core's router cannot express"
        )
        out.append(format_problem(field, 1, why, "use strategy=fsdp for this model (or norm_topk_prob=false on Qwen3-MoE)"))
    kinds = set(getattr(hf_config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        out.append(format_problem("layer_types", sorted(kinds), "attention kinds other than full / sliding are not converted", FIX))
    return out


def _unaudited_fields(hf_config) -> list[str]:
    """Declared fields of the config class that are neither mapped nor known harmless and are not
    at their class default: refused (a field added by a newer transformers must be looked at)."""
    cls = type(hf_config)
    if not dataclasses.is_dataclass(cls):
        return []
    from transformers import PretrainedConfig

    base = {f.name for f in dataclasses.fields(PretrainedConfig)} if dataclasses.is_dataclass(PretrainedConfig) else set()
    default = cls()
    out = []
    for f in dataclasses.fields(cls):
        name = f.name
        if name in base or name in MAPPED_FIELDS or name in HARMLESS_FIELDS or name.startswith("_"):
            continue
        value = getattr(hf_config, name, None)
        if value != getattr(default, name, None):
            why = f"{cls.__name__} field the megatron converter has not audited (it may change the computation)"
            out.append(format_problem(name, value, why, f"leave it at its default ({getattr(default, name, None)!r}), or {FIX}"))
    return out


def moe_fields(hf_config) -> dict:
    """The MoE fields of ``ArchInfo`` (empty for a dense family).

    Which layers are MoE: Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step`` (layer i
    is MoE when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``); Mixtral's
    are all MoE. Mixtral always renormalises the top-k routing weights."""
    family = hf_config.model_type
    if family not in MOE_FAMILIES:
        return {}
    layers = hf_config.num_hidden_layers
    if family == "mixtral":
        experts, moe, norm = hf_config.num_local_experts, tuple(range(layers)), True
    else:
        experts, norm = hf_config.num_experts, bool(hf_config.norm_topk_prob)
        step, dense = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
        moe = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(
        num_experts=experts,
        moe_topk=hf_config.num_experts_per_tok,
        moe_ffn=getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
        moe_layers=moe,
        norm_topk=norm,
    )


def rope_frequencies(hf_config) -> tuple[str, tuple[float, ...] | None, float]:
    """``(rope_type, inverse frequencies or None for default RoPE, attention factor)`` of an HF
    config, computed by HF's own RoPE initialisers.

    Raises:
        ValueError: a RoPE type the converter does not reproduce exactly.
    """
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type = {rope_type!r}: the megatron backend converts RoPE {', '.join(ROPE_TYPES)} exactly and no other; fix: {FIX}"
        )
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) if isinstance(rope, dict) else 1.0
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor = {partial}: partial RoPE is not converted; fix: {FIX}")
    if rope_type == "default":
        return rope_type, None, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return rope_type, tuple(float(x) for x in inv_freq.float()), float(attention_factor)
