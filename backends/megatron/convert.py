"""HF <-> megatron-core conversion for the Llama / Mistral / Phi-3 / Qwen2 / Qwen3 and the MoE
Qwen3-MoE / Mixtral families: config and weights.

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
(docs/design.md, megatron-core on CPU), so it cannot serve the local spec the CPU tests run. This converter maps
each megatron parameter name explicitly (one branch per name, in both directions) and handles
both namings (local spec: separate
``input_layernorm`` / ``pre_mlp_layernorm``; TE spec: ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``).

Layouts (fp32 exact, round trip tested):
* ``linear_qkv`` rows are grouped per query group: ``[q heads of group g, k_g, v_g]``; tensor
  parallelism splits whole groups, so a TP rank's shard is contiguous groups.
* ``linear_fc1`` is ``[gate; up]`` *per TP rank* (each rank holds its gate and up slices).
* Embedding / output rows are padded to a multiple of the TP size (zero rows); export drops
  the padding and the engine slices logits to the true vocabulary.
* Value heads: HF token classification's ``score`` (weight ``[1, hidden]``, bias ``[1]``) is a
  replicated ``output_layer`` on the last stage.

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
* Refused: Mixtral's ``router_jitter_noise > 0`` (random input scaling in training, which
  megatron's router jitter does not reproduce), shared experts (other families).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
# Families whose checkpoint fuses q/k/v (``self_attn.qkv_proj``) and gate/up (``mlp.gate_up_proj``).
_FUSED_HF = ("phi3",)
# Families whose ``sliding_window`` applies whenever it is set (Qwen2/3 need use_sliding_window).
_WINDOWED = ("mistral", "mixtral", "phi3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


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
        ValueError: an unsupported family or RoPE scaling (the converter would be silently wrong).
    """
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(f"model_type = {family!r} is not supported by the megatron backend; fix: use one of {', '.join(FAMILIES)}")
    rope_type, inv_freq, attention_factor = rope_frequencies(hf_config)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    window = getattr(hf_config, "sliding_window", None)
    if family not in _WINDOWED and not getattr(hf_config, "use_sliding_window", False):
        window = None  # Qwen2/3 record a window but apply it only with use_sliding_window
    heads = hf_config.num_attention_heads
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
        qkv_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
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
        jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
        if jitter > 0:
            raise ValueError(
                f"router_jitter_noise = {jitter}: Mixtral's training-time jitter scales the MoE input randomly, which megatron's "
                "router does not reproduce; fix: set router_jitter_noise to 0 in config.json, or use the fsdp backend"
            )
        experts, moe, norm = hf_config.num_local_experts, tuple(range(layers)), True
    else:
        experts, norm = hf_config.num_experts, bool(hf_config.norm_topk_prob)
        step, dense = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
        moe = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise ValueError("shared experts are not converted; fix: use the fsdp backend for this model")
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
            f"rope_type = {rope_type!r}: the megatron backend converts RoPE {', '.join(ROPE_TYPES)} exactly and no other; "
            "fix: use the fsdp backend for this model"
        )
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) if isinstance(rope, dict) else 1.0
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor = {partial}: partial RoPE is not converted; fix: use the fsdp backend for this model")
    if rope_type == "default":
        return rope_type, None, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return rope_type, tuple(float(x) for x in inv_freq.float()), float(attention_factor)


def transformer_config_kwargs(arch: ArchInfo) -> dict:
    """``TransformerConfig`` keyword arguments of the architecture (parallelism added by the caller).

    Fusions are off: they need CUDA kernels and are not needed for parity; dropout is 0 as in
    the HF configs of these families.
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
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
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
    )


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of the TP size (megatron splits rows evenly)."""
    return math.ceil(vocab / tp) * tp


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
    hf: dict[str, torch.Tensor],
    arch: ArchInfo,
    layer: int | None,
    tp_rank: int,
    tp: int,
    experts: ExpertShard = ExpertShard(),
) -> torch.Tensor:
    """This rank's value of megatron parameter ``name`` from HF tensors ``hf``.

    Args:
        name: local megatron name (``decoder.layers.<local>.<rest>`` or a non-layer name).
        hf: HF state dict (full tensors).
        layer: the global layer index of a ``decoder.layers`` name (None otherwise).
        tp_rank, tp: tensor-parallel rank and size (dense parameters).
        experts: the expert-parallel position (expert parameters).
    """
    match = _LAYER.match(name)
    rest = match.group(2) if match else name
    p = f"model.layers.{layer}." if match else ""
    if rest == "mlp.router.weight":
        return _hf_router(hf, p).clone()
    expert = _EXPERT.match(rest)
    if expert:
        e = experts.ep_rank * (arch.num_experts // experts.ep) + int(expert.group(1))
        gate, up, down = _hf_expert(hf, p, e)
        if expert.group(2) == "linear_fc2":
            return _cols(down, experts.etp_rank, experts.etp)
        return torch.cat([_rows(gate, experts.etp_rank, experts.etp), _rows(up, experts.etp_rank, experts.etp)])
    if rest == "embedding.word_embeddings.weight":
        return _rows(_pad_rows(hf["model.embed_tokens.weight"], padded_vocab(arch.vocab, tp)), tp_rank, tp)
    if rest == "output_layer.weight":
        if "score.weight" in hf:
            return hf["score.weight"].clone()
        head = hf["model.embed_tokens.weight"] if arch.tied else hf["lm_head.weight"]
        return _rows(_pad_rows(head, padded_vocab(arch.vocab, tp)), tp_rank, tp)
    if rest == "output_layer.bias":
        return hf["score.bias"].clone()
    if rest == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"].clone()
    if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return hf[p + "input_layernorm.weight"].clone()
    if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return hf[p + "post_attention_layernorm.weight"].clone()
    if rest == "self_attention.q_layernorm.weight":
        return hf[p + "self_attn.q_norm.weight"].clone()
    if rest == "self_attention.k_layernorm.weight":
        return hf[p + "self_attn.k_norm.weight"].clone()
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        if arch.family in _FUSED_HF:
            d = arch.head_dim
            q, k, v = hf[f"{p}self_attn.qkv_proj.{kind}"].split([arch.heads * d, arch.groups * d, arch.groups * d])
        else:
            q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
        return _rows(_fuse_qkv(q, k, v, arch), tp_rank, tp)
    if rest == "self_attention.linear_proj.weight":
        return _cols(hf[p + "self_attn.o_proj.weight"], tp_rank, tp)
    if rest == "mlp.linear_fc1.weight":
        if arch.family in _FUSED_HF:
            gate, up = hf[p + "mlp.gate_up_proj.weight"].chunk(2)
        else:
            gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
        return torch.cat([_rows(gate, tp_rank, tp), _rows(up, tp_rank, tp)])
    if rest == "mlp.linear_fc2.weight":
        return _cols(hf[p + "mlp.down_proj.weight"], tp_rank, tp)
    raise KeyError(f"no HF source for megatron parameter {name!r}")


def _hf_router(hf: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    for name in (p + "mlp.gate.weight", p + "block_sparse_moe.gate.weight"):
        if name in hf:
            return hf[name]
    raise KeyError(f"no router weight for layer {p!r} (looked for mlp.gate.weight, block_sparse_moe.gate.weight)")


def _hf_expert(hf: dict[str, torch.Tensor], p: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e``'s ``(gate [I, H], up [I, H], down [H, I])`` from any HF layout (module docstring)."""
    fused = p + "mlp.experts.gate_up_proj"
    if fused in hf:
        gate, up = hf[fused][e].chunk(2)
        return gate, up, hf[p + "mlp.experts.down_proj"][e]
    for prefix, names in (
        (f"{p}mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
        (f"{p}block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
    ):
        if prefix + names[0] + ".weight" in hf:
            return tuple(hf[f"{prefix}{n}.weight"] for n in names)
    raise KeyError(f"no weights for expert {e} of layer {p!r} in any known layout (per-expert or fused gate_up_proj)")


def hf_experts(fc1: torch.Tensor, fc2: torch.Tensor, arch: ArchInfo, layer: int, etp: int) -> list[tuple[str, torch.Tensor]]:
    """HF's fused expert tensors of a layer from every expert's megatron weights: ``fc1``
    ``[E, 2I, H]`` (each expert's expert-TP shards concatenated: ``[gate_0; up_0; gate_1; ...]``)
    and ``fc2`` ``[E, H, I]``. The inverse of the expert branch of :func:`to_megatron`."""
    per_rank = fc1.reshape(arch.num_experts, etp, 2, arch.moe_ffn // etp, -1)
    gate = per_rank[:, :, 0].reshape(arch.num_experts, arch.moe_ffn, -1)
    up = per_rank[:, :, 1].reshape(arch.num_experts, arch.moe_ffn, -1)
    p = f"model.layers.{layer}.mlp.experts."
    return [(p + "gate_up_proj", torch.cat([gate, up], dim=1)), (p + "down_proj", fc2)]


# --------------------------------------------------------------------------- megatron -> HF
def to_hf(name: str, full: torch.Tensor, arch: ArchInfo, layer: int | None, tp: int) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of a megatron parameter whose TP shards were concatenated
    along their partition dim (``full``). The inverse of :func:`to_megatron`."""
    match = _LAYER.match(name)
    rest = match.group(2) if match else name
    p = f"model.layers.{layer}." if match else ""
    if rest == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", full[: arch.vocab])]
    if rest == "output_layer.weight":
        if full.shape[0] == 1:
            return [("score.weight", full)]
        return [("lm_head.weight", full[: arch.vocab])]
    if rest == "output_layer.bias":
        return [("score.bias", full)]
    if rest == "decoder.final_layernorm.weight":
        return [("model.norm.weight", full)]
    if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return [(p + "input_layernorm.weight", full)]
    if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return [(p + "post_attention_layernorm.weight", full)]
    if rest == "self_attention.q_layernorm.weight":
        return [(p + "self_attn.q_norm.weight", full)]
    if rest == "self_attention.k_layernorm.weight":
        return [(p + "self_attn.k_norm.weight", full)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = _split_qkv(full, arch)
        if arch.family in _FUSED_HF:
            return [(f"{p}self_attn.qkv_proj.{kind}", torch.cat([q, k, v]))]
        return [(f"{p}self_attn.q_proj.{kind}", q), (f"{p}self_attn.k_proj.{kind}", k), (f"{p}self_attn.v_proj.{kind}", v)]
    if rest == "self_attention.linear_proj.weight":
        return [(p + "self_attn.o_proj.weight", full)]
    if rest == "mlp.linear_fc1.weight":
        # Concatenated TP shards are [gate_0; up_0; gate_1; up_1; ...].
        per_rank = full.reshape(tp, 2, arch.ffn // tp, -1)
        if arch.family in _FUSED_HF:
            return [
                (p + "mlp.gate_up_proj.weight", torch.cat([per_rank[:, 0].reshape(arch.ffn, -1), per_rank[:, 1].reshape(arch.ffn, -1)]))
            ]
        return [
            (p + "mlp.gate_proj.weight", per_rank[:, 0].reshape(arch.ffn, -1)),
            (p + "mlp.up_proj.weight", per_rank[:, 1].reshape(arch.ffn, -1)),
        ]
    if rest == "mlp.linear_fc2.weight":
        return [(p + "mlp.down_proj.weight", full)]
    if rest == "mlp.router.weight":
        return [(p + "mlp.gate.weight", full)]
    raise KeyError(f"no HF name for megatron parameter {name!r} (expert weights: hf_experts)")


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
