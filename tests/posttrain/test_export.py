"""The adapter export (``posttrain.export``) writes the directory peft itself saves for the
engine's LoRA settings, without importing ``backends`` (``tests/test_import_graph.py``).

Both the FSDP backend and the export build peft's config from one place,
``engine_api.config.LoraConfig.to_peft``; its fields are checked here against the settings.
"""

from __future__ import annotations

import json

import peft
import pytest
import torch

from engine_api.config import EngineConfig, LoraConfig, ModelConfig
from posttrain.export import save_hf
from posttrain.tiny_model import build_tiny_model

LORAS = [
    LoraConfig(rank=8, alpha=16.0),  # the default targets: all-linear
    LoraConfig(rank=4, alpha=32.0, dropout=0.1, target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"]),
]


@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize("lora", LORAS, ids=["all-linear", "named"])
def test_the_peft_config_carries_every_lora_setting(lora, head):
    got = lora.to_peft(head)
    targets = {"all-linear"} if lora.target_modules == ["all-linear"] else set(lora.target_modules)
    assert (got.r, got.lora_alpha, got.lora_dropout, got.bias) == (lora.rank, lora.alpha, lora.dropout, "none")
    assert (got.target_modules if isinstance(got.target_modules, set) else {got.target_modules}) == targets
    assert got.task_type == ("CAUSAL_LM" if head == "lm" else "TOKEN_CLS")
    assert got.exclude_modules == (None if head == "lm" else {"score"})


class _Trained:
    """A source whose ``export_adapter_weights`` yields the adapters of a peft model, as an
    engine does (peft's saved names)."""

    def __init__(self, wrapped) -> None:
        self.wrapped = wrapped

    def export_adapter_weights(self):
        yield from peft.get_peft_model_state_dict(self.wrapped).items()


def test_an_adapter_export_equals_the_directory_peft_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    lora = LORAS[1]
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora.to_peft("lm"))
    with torch.no_grad():  # lora_B starts at zero; give the adapters values to compare
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param))
    wrapped.save_pretrained(tmp_path / "peft")

    config = EngineConfig(model=ModelConfig(path=str(model_dir), lora=lora))
    out = save_hf(_Trained(wrapped), config, str(tmp_path / "hf"), fmt="adapter")

    assert json.loads((tmp_path / "hf" / "adapter_config.json").read_text()) == json.loads(
        (tmp_path / "peft" / "adapter_config.json").read_text()
    )
    from safetensors.torch import load_file

    got, want = load_file(f"{out}/adapter_model.safetensors"), load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
