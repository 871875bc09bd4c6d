"""Log-probs from the LM head in chunks of tokens (``backends.fsdp.lm_head``, issue 52).

The FSDP engine with the chunked head (chunks of 4 tokens here, so every micro-batch spans
several) against the same engine forced onto full logits: one optimizer step (loss, grad norm,
every updated parameter: relative 1e-6, fp32 summation order) and inference outputs with
temperature, entropy and target log-probs (1e-5), on an untied (Llama) and a tied (Qwen2)
head, and on a head with a bias (Phi's: the chunks add it). Models that transform the logits
after the head run the plain path; a head the chunks cannot serve is named for what it is (LoRA
adapters, another class, none).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, GraniteConfig

import engine_api.logprobs as logprobs
from backends.fsdp.lm_head import chunked_head_problem
from engine_api.conformance.fixtures import TINY_DIMS, save_model
from tests.support.hf_utils import engine_for, make_model, make_test_batch, one_step, rel

TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp(request.param) / request.param, request.param)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 4 * 64)  # vocabulary 64: 4 tokens per chunk


def _plain(monkeypatch):
    """Engines built from here on compute log-probs from full logits."""
    import backends.fsdp.engine as fsdp_engine

    monkeypatch.setattr(fsdp_engine, "chunked_head_problem", lambda model: "forced off by the test")


def test_one_step_equals_full_logits(model_dir, small_chunks, monkeypatch):
    got = one_step(model_dir, "token-mean", extra=["micro_batch_size=3"])
    _plain(monkeypatch)
    want = one_step(model_dir, "token-mean", extra=["micro_batch_size=3"])
    assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-6 * abs(float(want["loss"]))
    assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-6 * want["grad_norm"]
    assert rel(got["params"], want["params"]) <= 1e-6


def test_inference_outputs_equal_full_logits(model_dir, small_chunks, monkeypatch):
    batch = make_test_batch(temperature=0.7, calculate_entropy=True)
    ids = batch["input_ids"]
    batch["target_ids"] = torch.nested.nested_tensor_from_jagged((ids.values() * 7 + 3) % 64, ids.offsets())
    outs = []
    for chunked in (True, False):
        if not chunked:
            _plain(monkeypatch)
        engine = engine_for(model_dir, "use_remove_padding=false", "micro_batch_size=4")  # padded rows: index gathers
        assert engine.chunked_head is chunked
        with engine.eval_mode():
            outs.append(engine.infer_batch(batch))
    for key in ("log_probs", "entropy", "target_log_probs"):
        for a, b in zip(outs[0][key].unbind(), outs[1][key].unbind(), strict=True):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=key)


def test_logits_scaled_after_the_head_run_the_plain_path(tmp_path):
    """Granite divides the head's output by ``logits_scaling``: the probe sees the chunked
    columns come back changed and the engine keeps full logits (its log-probs stay HF's)."""
    cfg = GraniteConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        logits_scaling=4.0,
    )  # fmt: skip
    engine = engine_for(save_model(cfg, tmp_path / "granite"))
    assert engine.chunked_head is False
    value = engine_for(make_model(tmp_path / "llama", "llama", num_layers=1), "model.head=value")
    assert value.chunked_head is False  # the value head is unchanged


def test_a_head_with_a_bias_is_served_by_the_chunks(tmp_path, capsys, monkeypatch):
    """Phi's ``lm_head`` has a bias, which the chunks add: the engine serves it chunked, says
    nothing about full logits at start-up, and its log-probs (with entropy) equal the full-logits
    path's (1e-5). Before, a refusal or a dropped bias would print a fallback line (a dropped bias
    fails the start-up probe) and keep full logits."""
    path = save_model(AutoConfig.for_model("phi", **TINY_DIMS), tmp_path / "phi")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.get_output_embeddings().bias is not None and chunked_head_problem(model) is None
    batch = make_test_batch(calculate_entropy=True)
    outs = []
    for chunked in (True, False):
        if not chunked:
            assert "log-probs from full logits" not in capsys.readouterr().err
            _plain(monkeypatch)
        engine = engine_for(path)
        assert engine.chunked_head is chunked
        with engine.eval_mode():
            outs.append(engine.infer_batch(batch))
    for key in ("log_probs", "entropy"):
        for a, b in zip(outs[0][key].unbind(), outs[1][key].unbind(), strict=True):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=key)


def test_a_head_the_chunks_cannot_serve_is_named_for_what_it_is():
    """The start-up line's reason names what the head is: LoRA adapters on it, another class
    (a Linear subclass or not a Linear at all), or no head, never a contradiction such as "Linear,
    not a plain Linear" (what a peft-wrapped head, whose class is also called Linear, printed)."""
    import peft

    def llama():
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_DIMS))

    lora = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    why = chunked_head_problem(lora)
    assert why.startswith("the output head carries LoRA adapters (peft.tuners.lora.layer.Linear)") and "plain Linear" not in why

    class ScaledHead(nn.Linear):
        pass

    model = llama()
    model.lm_head = ScaledHead(TINY_DIMS["hidden_size"], TINY_DIMS["vocab_size"], bias=False)
    assert "ScaledHead, a subclass of torch.nn.Linear" in chunked_head_problem(model)
    model.lm_head = nn.Sequential(nn.Linear(TINY_DIMS["hidden_size"], TINY_DIMS["vocab_size"]))
    assert "torch.nn.modules.container.Sequential, not a torch.nn.Linear" in chunked_head_problem(model)
    model.get_output_embeddings = lambda: None
    assert chunked_head_problem(model) == "the model has no output head (get_output_embeddings() is None)"
