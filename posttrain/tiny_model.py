"""Build a tiny, seeded HF causal LM from a config alone (nothing is downloaded).

The demo and the tests need a real HF model directory (``config.json`` + safetensors) that
the backends load through ``config.model.path``. Two families cover the layouts the
backends must handle:

* ``llama``: grouped-query attention (4 query heads over 2 KV heads), no linear biases,
  untied input embedding and LM head.
* ``qwen2``: biases on the q/k/v projections, tied embeddings (the LM head is the
  embedding matrix).

``qwen3`` (q/k norm, decoupled head width) and ``qwen3_moe`` (Qwen3 attention, a mixture of
experts in every layer: for MoE routing and its replay) round them out.
"""

from __future__ import annotations

import json
import os

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Written into every model directory built here: a freshly initialised model, which the demo
# settings (a high learning rate, an entropy bonus) suit; the recipes' warnings about settings
# that wreck a pretrained model stay quiet for it (:func:`is_built_model`).
BUILT_MARKER = "enginekit_built_model.json"
# The tiny MoE: every layer routes each token to the top 2 of 4 experts, renormalised (Qwen3-MoE's
# norm_topk_prob), each expert half the dense MLP's width.
MOE_EXPERTS, MOE_TOP_K = 4, 2


def build_tiny_model(
    path: str | os.PathLike,
    family: str = "llama",
    seed: int = 0,
    vocab_size: int = 32,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 64,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    head_dim: int | None = None,
) -> str:
    """Create a randomly initialised HF causal LM and save it to ``path``.

    Args:
        path: output directory (created if missing; existing files are overwritten).
        family: ``llama`` (GQA, untied), ``qwen2`` (qkv bias, tied embeddings), ``qwen3``
            (q/k norm, head_dim = 2 * hidden / heads, untied) or ``qwen3_moe`` (qwen3's
            attention; every MLP a top-2-of-4 mixture of experts of width
            ``intermediate_size / 2``).
        seed: ``torch.manual_seed`` before the weights are initialised, so the same
            arguments always give the same weights.
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
            max_position_embeddings: model dimensions (``num_heads`` must be a multiple of
            ``num_kv_heads`` and divide ``hidden_size``).
        bos_token_id, eos_token_id, pad_token_id: recorded in the config (generation only).
        head_dim: per-head width; None: ``hidden_size / num_heads`` (qwen3: twice that). vLLM's
            CPU attention needs >= 32.

    Returns:
        ``path`` as a string: a directory with ``config.json`` and ``model.safetensors``.

    Raises:
        ValueError: unknown family or inconsistent dimensions.
    """
    config = tiny_config(
        family,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        head_dim=head_dim,
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # fp32 weights whatever torch's default dtype is: the engines cast per model.dtype.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))  # safetensors is transformers' default format
    with open(os.path.join(path, BUILT_MARKER), "w") as f:
        json.dump({"built_by": "posttrain.tiny_model", "family": family, "seed": seed}, f)
        f.write("\n")
    return str(path)


def is_built_model(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a model directory :func:`build_tiny_model` wrote (randomly
    initialised, not pretrained); an export of a model trained from one is not."""
    return path is not None and os.path.isfile(os.path.join(path, BUILT_MARKER))


def tiny_config(
    family: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    head_dim: int | None = None,
):
    """The HF ``PretrainedConfig`` that :func:`build_tiny_model` instantiates (see its args)."""
    _check_dims(family, hidden_size, num_heads, num_kv_heads)
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    if head_dim is not None and family not in ("qwen3", "qwen3_moe"):
        common["head_dim"] = head_dim
    if family == "llama":
        # attention_bias=False, mlp_bias=False are Llama's defaults; spelled out because the
        # megatron conversion relies on "no linear bias" for this family.
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
    if family in ("qwen3", "qwen3_moe"):
        # q/k RMSNorm per head, and a head_dim twice hidden/heads, as real Qwen3 models decouple them.
        qwen3 = dict(
            **common,
            head_dim=head_dim or 2 * hidden_size // num_heads,
            attention_bias=False,
            tie_word_embeddings=False,
            use_sliding_window=False,
        )
        if family == "qwen3":
            return Qwen3Config(**qwen3)
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **qwen3,
            num_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
            moe_intermediate_size=max(1, intermediate_size // 2),
            norm_topk_prob=True,
        )
    # Qwen2 always has q/k/v biases (no flag); the tied head exercises weight sharing.
    return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)


def _check_dims(family: str, hidden_size: int, num_heads: int, num_kv_heads: int) -> None:
    problems = []
    if family not in FAMILIES:
        problems.append(f"family = {family!r}: unknown model family; fix: use one of {', '.join(FAMILIES)}")
    if num_heads < 1 or hidden_size % num_heads:
        problems.append(f"num_heads = {num_heads}: must divide hidden_size = {hidden_size}; fix: pick a divisor, e.g. 4")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        problems.append(f"num_kv_heads = {num_kv_heads}: must divide num_heads = {num_heads}; fix: pick a divisor, e.g. 2")
    if problems:
        raise ValueError("; ".join(problems))
