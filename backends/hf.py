"""HF model loading shared by the backends (the FSDP engine trains the HF module itself; the
megatron engine converts its weights, and needs the same seeded value-head init)."""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification


def load_hf_model(path: str, head: str, seed: int, attn_implementation: str = "sdpa") -> nn.Module:
    """Load ``path`` through the normal HF path, on CPU, in fp32.

    ``head: lm`` gives ``AutoModelForCausalLM``; ``head: value`` gives
    ``AutoModelForTokenClassification`` with one label and no classifier dropout, its new
    ``score`` layer initialised by HF under ``torch.manual_seed(seed)`` (so every rank and
    every backend gets the same head).
    """
    torch.manual_seed(seed)
    if head == "value":
        hf_config = AutoConfig.from_pretrained(path, num_labels=1)
        hf_config.classifier_dropout = 0.0  # HF defaults it to 0.1: values would be noisy in train mode
        return AutoModelForTokenClassification.from_pretrained(
            path, config=hf_config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)


def value_head_state(path: str, seed: int) -> dict[str, torch.Tensor]:
    """``score.weight`` / ``score.bias`` as :func:`load_hf_model` initialises them (or as the
    directory stores them, for a trained critic)."""
    model = load_hf_model(path, "value", seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("score.")}
