"""HF <-> megatron-core conversion for the Llama / Mistral / Phi-3 / Qwen2 / Qwen3 and the MoE
Qwen3-MoE / Mixtral families: config and weights. Per family, what is exact (tested) and what is
refused: docs/megatron-families.md.

Config (:func:`config_refusals`, :func:`arch_info`): every field the families' HF config classes
declare (transformers 5.19) is in :data:`MAPPED_FIELDS` (what megatron gets from it) or
:data:`HARMLESS_FIELDS` (why it cannot change the forward or the gradients). A declared field in
neither, with a value other than its class default, is refused at ``build_engine``, as is a
mapped field with a value the converter cannot reproduce (``hidden_act`` other than the
activations in :data:`ACTIVATIONS`, RoPE types outside :data:`ROPE_TYPES`, partial RoPE,
Phi-3's ``resid_pdrop > 0``, Mixtral's ``router_jitter_noise > 0``, shared experts, per-layer
config overrides). Keys of ``config.json`` that the class does not declare are not read by these
families' HF modeling code, so they change HF's numbers no more than megatron's.

Weights: ONE mapping table per family and config (:class:`Rule`; :func:`layer_rules`,
:func:`model_rules`), used by import (:func:`to_megatron`) and export (:func:`to_hf`,
:func:`hf_experts`). A rule names the megatron parameter, the HF tensors export writes, other HF
spellings import accepts (on-disk layouts), the layout between them (:data:`LAYOUTS`) and the
config field that makes the tensor exist. Completeness both ways is checked at load
(``backends.megatron.model.load_hf_weights``): a megatron parameter without a rule, a rule whose HF
tensors are missing, a converted tensor of the wrong shape, or an HF tensor that no rule consumed
(:func:`unconsumed_problems`) fails the load naming the tensor and the likely config field. Only
HF's own ignorables are skipped: ``rotary_emb.inv_freq`` buffers (recomputed from the config,
as HF does), the LM head of a value model (HF's token-classification model drops it too) and a
tied ``lm_head.weight`` equal to the embedding.

Biases: q/k/v (``add_qkv_bias``): Qwen2 always; Llama / Qwen3 / Qwen3-MoE with
``attention_bias``. The o_proj bias (Llama / Qwen3 / Qwen3-MoE ``attention_bias``) and Llama's MLP
biases (``mlp_bias``) are independent in HF, but megatron-core 0.16 has one switch for both
(``add_bias_linear``: linear_proj, linear_fc1/fc2, and also the MoE router and experts). So
``add_bias_linear`` stays False and the layer spec gives exactly the modules HF has a bias for
one (``backends.megatron.model``: the linear class with ``bias=True``); no zero bias is ever
added (it would get gradients and drift away from HF's model, which has none).

Activation: ``hidden_act`` silu/swish (SiLU), gelu (exact erf), gelu_pytorch_tanh / gelu_new
(tanh approximation), always gated (``act(gate) * up``, megatron's ``gated_linear_unit``).
Dropout: ``attention_dropout`` -> megatron's attention dropout (on the attention probabilities,
as HF; the random draws differ from HF's); ``hidden_dropout`` is 0 (HF has none in these
families but Phi-3's ``resid_pdrop``, refused when > 0: megatron's hidden dropout also drops the
embedding output, which HF does not).

Phi-3 is Llama-shaped with fused checkpoint tensors: ``qkv_proj`` rows are [q; k; v] and
``gate_up_proj`` rows are [gate; up]; they are split on import and fused again on export.

RoPE: default, ``linear``, ``llama3`` and ``yarn`` scaling. The rotary frequencies are HF's own
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` on the model's config, so every
parameter of the config is honoured, not megatron's hard-coded llama3 defaults) and replace
megatron's after the model is built; YaRN's attention factor ``a`` (HF multiplies cos and sin
by it, i.e. q and k) becomes ``softmax_scale = a**2 / sqrt(head_dim)``, the same logits. Other
RoPE types are refused.

Sliding windows (Mistral; Qwen2/3 with ``use_sliding_window``): the local spec has no sliding
window attention, so the window becomes a sequence-length limit: a sequence that fits in the
window attends exactly as under full causal attention (HF's window admits key j for query i
when i - j < window), and a longer one is refused by the engine's batch validation.

Why not mbridge: it hard-codes the Transformer-Engine layer spec and TE weight names
(docs/design.md, megatron-core on CPU), so it cannot serve the local spec the CPU tests run. The
table uses the local spec's names; the TE spec's fused norm names
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) are read as the local
``input_layernorm`` / ``pre_mlp_layernorm``.

Layouts (fp32 exact, round trip tested):
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

Mixture of experts (Qwen3-MoE, Mixtral): softmax router, top-k, dropless (HF drops no token).
* Routing: HF takes the top-k of ``softmax(logits)`` and, with ``norm_topk_prob`` (Mixtral:
  always), renormalises them; megatron's ``moe_router_pre_softmax=False`` (softmax over the
  top-k logits) is the renormalised form, ``True`` (top-k of the full softmax) the other.
* Which layers are MoE: Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step`` (layer i
  is MoE when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``) become
  megatron's per-layer ``moe_layer_freq`` list; Mixtral's are all MoE.
* Experts are megatron's ``SequentialMLP`` (the local spec; no grouped GEMM): each expert's
  ``linear_fc1`` is ``[gate; up]`` per expert-TP rank, like the dense MLP. Under expert
  parallelism EP rank r holds the global experts ``r * E/EP ... (r + 1) * E/EP - 1`` as its
  local experts ``0 ... E/EP - 1``.
* HF layouts read: per-expert tensors (what transformers 5 writes to disk, and the Hub's
  files: Qwen3-MoE ``mlp.experts.<e>.{gate,up,down}_proj.weight``, Mixtral
  ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight``) and the fused in-memory layout
  (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` rows ``[gate; up]``, ``mlp.experts.down_proj``
  ``[E, H, I]``). Export writes the in-memory names and layout (what the HF model's
  ``state_dict`` holds and ``load_state_dict`` takes), so a rollout model syncs from it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_api.kit import format_problem

FAMILIES = ("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
# Families whose checkpoint fuses q/k/v (``self_attn.qkv_proj``) and gate/up (``mlp.gate_up_proj``).
_FUSED_HF = ("phi3",)
# Families whose ``sliding_window`` applies whenever it is set (Qwen2/3 need use_sliding_window).
_WINDOWED = ("mistral", "mixtral", "phi3")
# Families whose HF modeling reads ``attention_bias`` (q, k, v AND o_proj); Qwen2 has a q/k/v
# bias always and no o_proj bias; Mistral / Mixtral / Phi-3 have none (a stray attention_bias
# key in their config.json is not read by HF either).
_ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe")
_MLP_BIAS = ("llama",)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_FIX = "use the fsdp backend (strategy=fsdp), which runs the HF model itself"


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


@dataclass(frozen=True)
class ArchInfo:
    """What the converter needs to know about an HF architecture."""

    family: str
    num_layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    eps: float
    max_positions: int
    # HF builds embed_tokens with padding_idx = pad_token_id: lookups of it get no gradient.
    pad_token_id: int | None = None
    rope_type: str = "default"
    # HF's rotary inverse frequencies for a scaled RoPE (None: megatron's default ones are HF's).
    rope_inv_freq: tuple[float, ...] | None = None
    # Multiplier of the attention logits (YaRN's attention factor squared; 1 otherwise).
    attention_logit_scale: float = 1.0
    # Sliding attention window (None: full causal attention).
    sliding_window: int | None = None
    # o_proj bias (megatron linear_proj.bias) and MLP gate/up/down biases (linear_fc1/fc2.bias).
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"  # a key of ACTIVATIONS
    attention_dropout: float = 0.0
    # The engine's head (``model.head``) is ``value``: ``output_layer`` is HF's ``score`` (a
    # token-classification head), not ``lm_head``. Not read from the HF config: set by the engine.
    value_head: bool = False
    # Mixture of experts (num_experts = 0: a dense model).
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn: int = 0
    # Global (0-based) indices of the MoE layers; the others have a dense MLP of width ``ffn``.
    moe_layers: tuple[int, ...] = ()
    # Renormalise the top-k routing weights (HF norm_topk_prob; Mixtral always does).
    norm_topk: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def length_limit(self) -> tuple[int, str]:
        """The longest sequence the model takes, and what imposes it (for the error message)."""
        if self.sliding_window is not None and self.sliding_window < self.max_positions:
            return self.sliding_window, (
                f"the model's sliding_window: megatron's local layer spec has no sliding-window attention, so only "
                f"sequences inside the window (where it changes nothing) are exact; fix: shorten sequences to <= {self.sliding_window}"
            )
        return self.max_positions, "the model's max_position_embeddings"


# --------------------------------------------------------------------------- config
def config_refusals(hf_config) -> list[str]:
    """Every reason the megatron backend cannot reproduce the HF model of ``hf_config`` exactly
    (empty: it can). Each names the config field, its value and what to do."""
    family = hf_config.model_type
    if family not in FAMILIES:
        return [
            format_problem("model_type", family, "not supported by the megatron backend", f"use one of {', '.join(FAMILIES)}, or {_FIX}")
        ]
    out = _unaudited_fields(hf_config)
    if getattr(hf_config, "is_heterogeneous", False):
        out.append(format_problem("per_layer_config", "set", "per-layer config overrides are not converted", _FIX))
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        out.append(format_problem("hidden_act", act, f"no exact megatron MLP for it (converted: {', '.join(ACTIVATIONS)})", _FIX))
    try:
        rope_frequencies(hf_config)
    except ValueError as exc:
        out.append(str(exc))
    resid = float(getattr(hf_config, "resid_pdrop", 0.0) or 0.0)
    if resid > 0:
        why = "megatron's hidden_dropout would also drop the embedding output, which HF's Phi-3 does not (different training noise)"
        out.append(format_problem("resid_pdrop", resid, why, f"set resid_pdrop to 0 in config.json, or {_FIX}"))
    jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        why = "Mixtral's training-time jitter scales the MoE input randomly, which megatron's router does not reproduce"
        out.append(format_problem("router_jitter_noise", jitter, why, f"set router_jitter_noise to 0 in config.json, or {_FIX}"))
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        out.append(
            format_problem(
                "shared_expert_intermediate_size", hf_config.shared_expert_intermediate_size, "shared experts are not converted", _FIX
            )
        )
    moe = _moe_fields(hf_config)
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
        out.append(format_problem("layer_types", sorted(kinds), "attention kinds other than full / sliding are not converted", _FIX))
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
            out.append(format_problem(name, value, why, f"leave it at its default ({getattr(default, name, None)!r}), or {_FIX}"))
    return out


def arch_info(hf_config) -> ArchInfo:
    """Read an HF config of a supported family.

    Raises:
        ValueError: every :func:`config_refusals` reason (the converter would be silently wrong).
    """
    refusals = config_refusals(hf_config)
    if refusals:
        raise ValueError("; and ".join(refusals))
    family = hf_config.model_type
    rope_type, inv_freq, attention_factor = rope_frequencies(hf_config)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    window = getattr(hf_config, "sliding_window", None)
    if family not in _WINDOWED and not getattr(hf_config, "use_sliding_window", False):
        window = None  # Qwen2/3 record a window but apply it only with use_sliding_window
    heads = hf_config.num_attention_heads
    attention_bias = family in _ATTENTION_BIAS and bool(getattr(hf_config, "attention_bias", False))
    return ArchInfo(
        **_moe_fields(hf_config),
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        heads=heads,
        groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=family in _MLP_BIAS and bool(getattr(hf_config, "mlp_bias", False)),
        activation=getattr(hf_config, "hidden_act", "silu"),
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        rope_theta=float(theta),
        eps=hf_config.rms_norm_eps,
        max_positions=hf_config.max_position_embeddings,
        pad_token_id=getattr(hf_config, "pad_token_id", None),
        rope_type=rope_type,
        rope_inv_freq=inv_freq,
        attention_logit_scale=attention_factor**2,
        sliding_window=int(window) if window else None,
    )


def _moe_fields(hf_config) -> dict:
    """The MoE fields of :class:`ArchInfo` (empty for a dense family)."""
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
            f"rope_type = {rope_type!r}: the megatron backend converts RoPE {', '.join(ROPE_TYPES)} exactly and no other; fix: {_FIX}"
        )
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) if isinstance(rope, dict) else 1.0
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor = {partial}: partial RoPE is not converted; fix: {_FIX}")
    if rope_type == "default":
        return rope_type, None, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return rope_type, tuple(float(x) for x in inv_freq.float()), float(attention_factor)


def transformer_config_kwargs(arch: ArchInfo) -> dict:
    """``TransformerConfig`` keyword arguments of the architecture (parallelism added by the caller).

    Fusions are off: they need CUDA kernels and are not needed for parity. ``add_bias_linear``
    is off: the o_proj / MLP biases HF has are given per module by the layer spec (module
    docstring, Biases).
    """
    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden,
        num_attention_heads=arch.heads,
        num_query_groups=arch.groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=arch.eps,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS[arch.activation],
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # YaRN: HF scales q and k by the attention factor a; the same logits are a**2 / sqrt(d).
        softmax_scale=arch.attention_logit_scale / math.sqrt(arch.head_dim) if arch.attention_logit_scale != 1.0 else None,
        **(_moe_config_kwargs(arch) if arch.is_moe else {}),
    )


def _moe_config_kwargs(arch: ArchInfo) -> dict:
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_ffn,
        moe_layer_freq=[int(i in arch.moe_layers) for i in range(arch.num_layers)],
        moe_router_pre_softmax=not arch.norm_topk,
        # The engine adds HF's load-balancing loss itself (engine_api.moe), not megatron's.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        # Gives every router a RouterReplay; idle (the router's own top-k) unless the engine
        # hands it indices (backends.megatron.routing; engine_api.moe, "Routing replay").
        moe_enable_routing_replay=True,
    )


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of the TP size (megatron splits rows evenly)."""
    return math.ceil(vocab / tp) * tp


# --------------------------------------------------------------------------- the mapping table
@dataclass(frozen=True)
class Rule:
    """One row of the mapping table: a megatron parameter and the HF tensors it is made of.

    Attributes:
        megatron: the local-spec name, relative to ``decoder.layers.<i>.`` for a layer
            parameter (an expert's index is ``*``).
        hf: the HF names export writes (relative to ``model.layers.<i>.`` for a layer parameter).
        layout: how the HF tensors become the megatron tensor and back (:data:`LAYOUTS`).
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
# The TE spec fuses the norms into the next linear; the table uses the local spec's names.
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@functools.lru_cache(maxsize=32)
def layer_rules(arch: ArchInfo, moe: bool) -> Mapping[str, Rule]:
    """The table of one decoder layer (``moe``: an MoE layer of an MoE family)."""
    fused = arch.family in _FUSED_HF
    qkv = ("self_attn.qkv_proj",) if fused else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    rules = [
        Rule("input_layernorm.weight", ("input_layernorm.weight",), "copy"),
        Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy"),
        Rule("self_attention.linear_qkv.weight", tuple(n + ".weight" for n in qkv), "qkv"),
        Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "cols"),
    ]
    if arch.qkv_bias:
        field = "attention_bias" if arch.family in _ATTENTION_BIAS else f"{arch.family} (q/k/v bias always)"
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
        rules += [
            Rule("output_layer.weight", ("score.weight",), "copy", "model.head=value"),
            Rule("output_layer.bias", ("score.bias",), "copy", "model.head=value"),
        ]
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
            f"megatron parameter {name!r} has no HF counterpart in the {arch.family} mapping (likely config field: {_hint(rest, arch)}): "
            "megatron built a tensor the HF model does not have; fix: report it (the converter's spec and table disagree), or " + _FIX
        )
    return rule, prefix, int(expert.group(1)) if expert else None


# --------------------------------------------------------------------------- HF -> megatron
@dataclass(frozen=True)
class ExpertShard:
    """Where this rank sits in the expert layout: EP rank/size and expert-TP rank/size."""

    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1


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


def unconsumed_problems(hf: Mapping[str, torch.Tensor], consumed: set[str], arch: ArchInfo, value_head: bool) -> list[str]:
    """One message per HF tensor that no rule read (on any rank), naming the tensor, its shape
    and the config field likely responsible; HF's own ignorables (module docstring) are skipped."""
    out = []
    for name in sorted(set(hf) - consumed):
        if _ignorable(name, hf, arch, value_head):
            continue
        out.append(
            f"HF tensor {name!r} {list(hf[name].shape)} is used by no rule of the {arch.family} mapping (likely config field: "
            f"{_hint(name, arch)}); megatron would compute something other than HF; fix: make config.json match the checkpoint, or {_FIX}"
        )
    return out


def _ignorable(name: str, hf: Mapping[str, torch.Tensor], arch: ArchInfo, value_head: bool) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True  # a buffer HF recomputes from the config (and ignores on load too)
    if name == "lm_head.weight" and value_head:
        return True  # the token-classification model has no LM head (HF drops it as well)
    embed = hf.get("model.embed_tokens.weight")
    return name == "lm_head.weight" and arch.tied and embed is not None and torch.equal(hf[name], embed)


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


def _hint(name: str, arch: ArchInfo) -> str:
    layer = _HF_LAYER.match(name)
    if layer and int(layer.group(1)) >= arch.num_layers:
        return f"num_hidden_layers = {arch.num_layers}"
    return next((field for fragment, field in _HINTS if fragment in name), f"model_type = {arch.family!r}")


# --------------------------------------------------------------------------- megatron -> HF
def to_hf(name: str, full: torch.Tensor, arch: ArchInfo, layer: int | None, tp: int) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of a megatron parameter whose TP shards were concatenated
    along their partition dim (``full``): the table's rule, inverted (experts: :func:`hf_experts`)."""
    rule, prefix, local_expert = rule_for(name, arch, layer)
    if local_expert is not None:
        raise KeyError(f"expert weight {name!r}: experts export a layer at a time (hf_experts)")
    tensors = _export_layout(rule.layout, full, arch, tp, len(rule.hf))
    return [(prefix + n, t) for n, t in zip(rule.hf, tensors, strict=True)]


def _export_layout(layout: str, full: torch.Tensor, arch: ArchInfo, tp: int, count: int) -> list[torch.Tensor]:
    """The inverse of :func:`import_layout` on the concatenated TP shards; ``count`` HF tensors."""
    if layout in ("copy", "cols"):
        return [full]
    if layout == "vocab":
        return [full[: arch.vocab]]
    if layout == "qkv":
        q, k, v = _split_qkv(full, arch)
        return [torch.cat([q, k, v])] if count == 1 else [q, k, v]
    if layout == "gate_up":
        gate, up = _split_gate_up(full, tp, arch.ffn)
        return [torch.cat([gate, up])] if count == 1 else [gate, up]
    raise ValueError(f"unknown layout {layout!r}")


def _split_gate_up(full: torch.Tensor, tp: int, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Concatenated TP shards are [gate_0; up_0; gate_1; up_1; ...] (weights and biases alike).
    per_rank = full.reshape(tp, 2, ffn // tp, *full.shape[1:])
    return per_rank[:, 0].reshape(ffn, *full.shape[1:]), per_rank[:, 1].reshape(ffn, *full.shape[1:])


def hf_experts(fc1: torch.Tensor, fc2: torch.Tensor, arch: ArchInfo, layer: int, etp: int) -> list[tuple[str, torch.Tensor]]:
    """HF's fused expert tensors of a layer (the names of the table's expert rules) from every
    expert's megatron weights: ``fc1`` ``[E, 2I, H]`` (each expert's expert-TP shards
    concatenated: ``[gate_0; up_0; gate_1; ...]``) and ``fc2`` ``[E, H, I]``."""
    rules = layer_rules(arch, True)
    split = [_split_gate_up(w, etp, arch.moe_ffn) for w in fc1.unbind()]
    gate_up = torch.stack([torch.cat(pair) for pair in split])
    p = f"model.layers.{layer}."
    (fc1_name,) = rules["mlp.experts.local_experts.*.linear_fc1.weight"].hf
    (fc2_name,) = rules["mlp.experts.local_experts.*.linear_fc2.weight"].hf
    return [(p + fc1_name, gate_up), (p + fc2_name, fc2)]


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
