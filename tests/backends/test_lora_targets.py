"""LoRA target lists that name layers the model does not have are refused at build_engine on
both engines (issue 53, item 2).

peft adapts the targets that match and ignores the rest: a list written for Llama
(``q_proj`` ... ``down_proj``) on Phi-3, whose attention and MLP are the fused ``qkv_proj`` and
``gate_up_proj``, silently trained 2 of the 7 projections on FSDP while megatron refused it.
Now both refuse, naming the targets that match nothing and the model's own layers; the model's
own names (fused ones included) and ``all-linear`` build."""

from __future__ import annotations

import pytest
from transformers import Phi3Config

from engine_api import build_engine, load_config
from engine_api.conformance.fixtures import TINY_DIMS, save_model

LLAMA_TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return save_model(Phi3Config(**TINY_DIMS, pad_token_id=None, bos_token_id=1, eos_token_id=2), tmp_path_factory.mktemp("phi3"))


def _build(path: str, strategy: str, targets: str):
    return build_engine(
        load_config(None, [f"strategy={strategy}", f"model.path={path}", "model.lora.rank=4", f"model.lora.target_modules={targets}"])
    )


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_targets_naming_no_layer_are_refused(phi3, strategy):
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules.*q_proj.*fix:") as info:
        _build(phi3, strategy, LLAMA_TARGETS)
    if strategy == "fsdp":  # the refusal lists what the model has
        assert "qkv_proj" in str(info.value) and "gate_up_proj" in str(info.value)
    for ok in ("[qkv_proj,o_proj,gate_up_proj,down_proj]", "[all-linear]"):
        _build(phi3, strategy, ok)
