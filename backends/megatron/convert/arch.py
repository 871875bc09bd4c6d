"""What the converter knows about an HF architecture (:class:`ArchInfo`, read by
:func:`arch_info` from a config :func:`~backends.megatron.convert.fields.config_refusals`
accepts) and the megatron ``TransformerConfig`` that computes the same model
(:func:`transformer_config_kwargs`).

Biases: q/k/v (``add_qkv_bias``): Qwen2 always; Llama / Qwen3 / Qwen3-MoE with
``attention_bias``. The o_proj bias (Llama / Qwen3 / Qwen3-MoE ``attention_bias``) and Llama's MLP
biases (``mlp_bias``) are independent in HF, but megatron-core 0.16 has one switch for both
(``add_bias_linear``: linear_proj, linear_fc1/fc2, and also the MoE router and experts). So
``add_bias_linear`` stays False and the layer spec gives exactly the modules HF has a bias for
one (``backends.megatron.model``: the linear class with ``bias=True``); no zero bias is ever
added (it would get gradients and drift away from HF's model, which has none).

Dropout: ``attention_dropout`` -> megatron's attention dropout (on the attention probabilities,
as HF; the random draws differ from HF's); ``hidden_dropout`` is 0 (HF has none in these
families but Phi-3's ``resid_pdrop``, refused when > 0: megatron's hidden dropout also drops the
embedding output, which HF does not).

Sliding windows (Mistral; Qwen2/3 with ``use_sliding_window``): the local spec has no sliding
window attention, so the window becomes a sequence-length limit: a sequence that fits in the
window attends exactly as under full causal attention (HF's window admits key j for query i
when i - j < window), and a longer one is refused by the engine's batch validation
(:meth:`ArchInfo.length_limit`).

Mixture of experts (Qwen3-MoE, Mixtral): softmax router, top-k, dropless (HF drops no token).
HF takes the top-k of ``softmax(logits)`` and, with ``norm_topk_prob`` (Mixtral: always),
renormalises them; megatron's ``moe_router_pre_softmax=False`` (softmax over the top-k logits) is
the renormalised form, ``True`` (top-k of the full softmax) the other. The MoE layers
(``fields.moe_fields``) become megatron's per-layer ``moe_layer_freq`` list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backends.megatron.convert.fields import ACTIVATIONS, config_refusals, moe_fields, rope_frequencies

# Families whose checkpoint fuses q/k/v (``self_attn.qkv_proj``) and gate/up (``mlp.gate_up_proj``).
FUSED_HF = ("phi3",)
# Families whose HF modeling reads ``attention_bias`` (q, k, v AND o_proj); Qwen2 has a q/k/v
# bias always and no o_proj bias; Mistral / Mixtral / Phi-3 have none (a stray attention_bias
# key in their config.json is not read by HF either).
ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe")
# Families whose ``sliding_window`` applies whenever it is set (Qwen2/3 need use_sliding_window).
_WINDOWED = ("mistral", "mixtral", "phi3")
_MLP_BIAS = ("llama",)


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
    # The value head has a bias (HF token classification's ``score``); False: bias-free, HF
    # sequence classification's (``model.value_bias``). Set by the engine.
    value_bias: bool = True
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


def arch_info(hf_config) -> ArchInfo:
    """Read an HF config of a supported family.

    Raises:
        ValueError: every :func:`~backends.megatron.convert.fields.config_refusals` reason (the
            converter would be silently wrong).
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
    attention_bias = family in ATTENTION_BIAS and bool(getattr(hf_config, "attention_bias", False))
    return ArchInfo(
        **moe_fields(hf_config),
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
