"""The adapter export (``posttrain.export``) writes the peft adapter directory the FSDP backend's
own LoRA settings give, without importing ``backends`` itself.

``posttrain.export.peft_lora_config`` rebuilds peft's ``LoraConfig`` from the engine config; the
reference here is what the backend trains with (``backends.fsdp.lora.peft_config``): the tests
may import a backend, the library may not (``tests/test_import_graph.py``).
"""

from __future__ import annotations

import json

import peft
import pytest
import torch

from backends.fsdp.lora import peft_config
from engine_api.config import EngineConfig, LoraConfig, ModelConfig
from posttrain.export import peft_lora_config, save_hf
from posttrain.tiny_model import build_tiny_model

LORAS = [
    LoraConfig(rank=8, alpha=16.0),  # the default targets: all-linear
    LoraConfig(rank=4, alpha=32.0, dropout=0.1, target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"]),
]


@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize("lora", LORAS, ids=["all-linear", "named"])
def test_the_peft_config_is_the_fsdp_backends(lora, head):
    assert peft_lora_config(lora, head).to_dict() == peft_config(lora, head).to_dict()


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
    wrapped = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), peft_config(lora, "lm"))
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
