"""Log-probs from the LM head in chunks of tokens (``backends.fsdp.lm_head``, issue 52).

The FSDP engine with the chunked head (chunks of 4 tokens here, so every micro-batch spans
several) against the same engine forced onto full logits: one optimizer step (loss, grad norm,
every updated parameter: relative 1e-6, fp32 summation order) and inference outputs with
temperature, entropy and target log-probs (1e-5), on an untied (Llama) and a tied (Qwen2)
head. Models that transform the logits after the head run the plain path.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteConfig

import engine_api.logprobs as logprobs
from engine_api.conformance.fixtures import save_model
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
