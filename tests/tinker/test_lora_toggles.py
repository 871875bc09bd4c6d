"""The Tinker LoRA toggles select the attention and MLP projections a model has, fused or not
(issue 53, item 2): on Phi-3 (``qkv_proj``, ``gate_up_proj``) they selected Llama's names, and the
FSDP engine then adapted 2 of the 7 projections without a word. Built from configs on the meta
device (no weights read)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Phi3Config

from engine_api.conformance.fixtures import TINY_DIMS, save_model
from tinker_server.contract import LoraIn, UserError
from tinker_server.signature import lora_modules


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("toggles")
    return {
        "llama": save_model(LlamaConfig(**TINY_DIMS), root / "llama"),
        "phi3": save_model(Phi3Config(**TINY_DIMS, pad_token_id=None, bos_token_id=1, eos_token_id=2), root / "phi3"),
    }


def test_toggles_select_the_models_own_projections(dirs):
    assert lora_modules(LoraIn(rank=4), dirs["llama"]) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    ]
    assert lora_modules(LoraIn(rank=4), dirs["phi3"]) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    assert lora_modules(LoraIn(rank=4, train_unembed=False, train_mlp=False), dirs["phi3"]) == ["qkv_proj", "o_proj"]
    with pytest.raises(UserError, match="all false"):
        lora_modules(LoraIn(rank=4, train_attn=False, train_mlp=False, train_unembed=False), dirs["llama"])
