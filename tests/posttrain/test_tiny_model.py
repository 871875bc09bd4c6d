"""The tiny demo model builder (``posttrain.tiny_model``)."""

from __future__ import annotations

import pytest
import torch

from posttrain.tiny_model import build_tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_model_is_seeded_and_has_the_family_layout(tmp_path, family):
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", family=family, seed=1))
    b = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", family=family, seed=1))
    assert (tmp_path / "a" / "model.safetensors").is_file()
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    attn = a.model.layers[0].self_attn
    tied = a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    if family == "qwen2":
        assert tied and attn.q_proj.bias is not None
    else:
        assert not tied and attn.q_proj.bias is None
        assert a.config.num_key_value_heads < a.config.num_attention_heads  # GQA


def test_tiny_model_rejects_bad_dims(tmp_path):
    with pytest.raises(ValueError, match="num_kv_heads = 3"):
        build_tiny_model(tmp_path, num_heads=4, num_kv_heads=3)
