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

The model's family, dimensions and seed are declared once, in :class:`TinyModelConfig`: the
recipes' ``tiny_model`` section is that dataclass, :func:`build_tiny_model` takes its fields as
keywords, and the benchmarks' model shapes extend it. What the data fixes (the vocabulary, the
positions, the special token ids) is given to the build next to it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Written into every model directory built here: a freshly initialised model, which the demo
# settings (a high learning rate, an entropy bonus) suit; the recipes' warnings about settings
# that wreck a pretrained model stay quiet for it (:func:`is_built_model`).
BUILT_MARKER = "enginekit_built_model.json"
# The tiny MoE: every layer routes each token to the top 2 of 4 experts, renormalised (Qwen3-MoE's
# norm_topk_prob), each expert half the dense MLP's width.
MOE_EXPERTS, MOE_TOP_K = 4, 2
# The vocabulary and positions of a model built without them: the sorting task's vocabulary
# (posttrain.sort_task.VOCAB_SIZE) and room for its sequences; the recipes raise the positions to
# their data's longest sequence.
VOCAB_SIZE, MAX_POSITIONS = 32, 64


@dataclass(frozen=True)
class TinyModelConfig:
    """The tiny model: its family, dimensions and weight-init seed. The recipes' ``tiny_model``
    section (the model built when ``engine.model.path`` is null) and the fields of
    :func:`build_tiny_model`.

    Attributes:
        family: ``llama`` (GQA, untied), ``qwen2`` (qkv bias, tied embeddings), ``qwen3``
            or ``qwen3_moe`` (top-2 of 4 experts in every layer; ``posttrain.tiny_model``).
            qwen3's heads are twice ``hidden_size / num_heads`` wide (q/k norm, untied); each
            qwen3_moe expert is ``intermediate_size / 2`` wide.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: dimensions.
            ``num_heads`` must divide ``hidden_size`` and be a multiple of ``num_kv_heads``.
        head_dim: per-head width; null: hidden_size / num_heads (the RL recipe raises it to
            32 for rollout.backend=vllm, whose CPU attention kernel needs >= 32).
        seed: weight-init seed.
    """

    family: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    head_dim: int | None = None
    seed: int = 0

    def _problems(self) -> list[str]:
        out = []
        if self.family not in FAMILIES:
            out.append(f"family = {self.family!r}: unknown model family; fix: use one of {', '.join(FAMILIES)}")
        if self.num_heads < 1 or self.hidden_size % self.num_heads:
            out.append(f"num_heads = {self.num_heads}: must divide hidden_size = {self.hidden_size}; fix: e.g. num_heads=4")
        if self.num_kv_heads < 1 or self.num_heads % max(self.num_kv_heads, 1):
            out.append(f"num_kv_heads = {self.num_kv_heads}: must divide num_heads = {self.num_heads}; fix: e.g. num_kv_heads=2")
        for name in ("num_layers", "intermediate_size"):
            if getattr(self, name) < 1:
                out.append(f"{name} = {getattr(self, name)}: must be positive; fix: use a value >= 1")
        return out


def build_tiny_model(
    path: str | os.PathLike,
    family: str = TinyModelConfig.family,
    *,
    vocab_size: int = VOCAB_SIZE,
    max_position_embeddings: int = MAX_POSITIONS,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    **fields: Any,
) -> str:
    """Create a randomly initialised HF causal LM and save it to ``path``.

    Args:
        path: output directory (created if missing; existing files are overwritten).
        family, **fields: the fields of :class:`TinyModelConfig` (``family`` also positionally; a
            field not given takes its default). ``seed`` is set with ``torch.manual_seed``
            before the weights are initialised, so the same arguments always give the same
            weights. A config object builds as ``build_tiny_model(path, **asdict(config), ...)``.
        vocab_size, max_position_embeddings: the vocabulary and positions (what the data needs).
        bos_token_id, eos_token_id, pad_token_id: recorded in the config (generation only).

    Returns:
        ``path`` as a string: a directory with ``config.json`` and ``model.safetensors``.

    Raises:
        ValueError: unknown family or inconsistent dimensions (``TinyModelConfig``'s checks).
        TypeError: a keyword that is not a field of ``TinyModelConfig``.
    """
    model = TinyModelConfig(family=family, **fields)
    config = tiny_config(
        model,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(model.seed)
    # fp32 weights whatever torch's default dtype is: the engines cast per model.dtype.
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    hf_model.save_pretrained(str(path))  # safetensors is transformers' default format
    with open(os.path.join(path, BUILT_MARKER), "w") as f:
        json.dump({"built_by": "posttrain.tiny_model", "family": model.family, "seed": model.seed}, f)
        f.write("\n")
    return str(path)


def is_built_model(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a model directory :func:`build_tiny_model` wrote (randomly
    initialised, not pretrained); an export of a model trained from one is not."""
    return path is not None and os.path.isfile(os.path.join(path, BUILT_MARKER))


def tiny_config(
    model: TinyModelConfig,
    *,
    vocab_size: int,
    max_position_embeddings: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
):
    """The HF ``PretrainedConfig`` that :func:`build_tiny_model` instantiates (see its args).

    Raises:
        ValueError: ``model``'s problems (unknown family, inconsistent dimensions).
    """
    problems = model._problems()
    if problems:
        raise ValueError("; ".join(problems))
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    family, hidden_size, num_heads, head_dim = model.family, model.hidden_size, model.num_heads, model.head_dim
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=model.num_kv_heads,
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
            moe_intermediate_size=max(1, model.intermediate_size // 2),
            norm_topk_prob=True,
        )
    # Qwen2 always has q/k/v biases (no flag); the tied head exercises weight sharing.
    return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
