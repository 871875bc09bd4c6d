"""``engine.model.attn_implementation`` (issue 28): the FSDP engine runs HF's own attention, so
the kernel decides the numbers.

Gemma-2 soft-caps its attention logits (``tanh(s / c) * c``); HF's sdpa kernel silently drops
the cap, eager applies it. The tiny Gemma-2 here has a small cap (1.0) and scaled-up q/k
projections so the cap bites (sdpa vs eager differ by more than 1e-2 on it, asserted as a
premise), and a final-logit cap that bites too. Reference: HF eager, one sequence at a time.
Tolerance 1e-5 as the other FSDP parity tests (float summation order only).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from engine_api import build_engine, load_config
from engine_api.conformance.fixtures import save_model
from tests.support.hf_utils import engine_for, hf_log_probs_of, make_model, make_test_batch, max_abs_diff

TOL = 1e-5


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    cfg = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=8,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
    )
    path = save_model(cfg, tmp_path_factory.mktemp("gemma2"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name or "embed_tokens" in name:
                p.mul_(30.0)  # attention scores and logits well past the caps
    model.save_pretrained(path)
    return path


def _hf(path: str, impl: str, batch) -> list[torch.Tensor]:
    return hf_log_probs_of(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).eval(), batch)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_gemma2_matches_hf_eager_by_default(gemma2, packed):
    batch = make_test_batch()
    eager = _hf(gemma2, "eager", batch)
    # The premise: on this model the kernels disagree, so matching eager means eager ran.
    assert max(float((a - b).abs().max()) for a, b in zip(eager, _hf(gemma2, "sdpa", batch), strict=True)) > 1e-2
    engine = engine_for(gemma2, f"use_remove_padding={packed}", "micro_batch_size=3")
    with engine.eval_mode():
        got = engine.infer_batch(batch)["log_probs"]
    assert max_abs_diff(got, eager) <= TOL


def test_gemma2_sdpa_refused_naming_the_cap(gemma2):
    with pytest.raises(ValueError, match=r"model\.attn_implementation = 'sdpa'.*attn_logit_softcapping"):
        build_engine(load_config(None, [f"model.path={gemma2}", "model.attn_implementation=sdpa"]))


def test_eager_honours_packed_rows(tmp_path):
    """An explicit choice runs: eager on a packed Llama batch equals HF per sequence."""
    path = make_model(tmp_path / "llama", "llama")
    batch = make_test_batch()
    engine = engine_for(path, "model.attn_implementation=eager", "micro_batch_size=6")
    assert engine.model.config._attn_implementation == "eager"
    with engine.eval_mode():
        got = engine.infer_batch(batch)["log_probs"]
    assert max_abs_diff(got, _hf(path, "eager", batch)) <= TOL


def test_bad_values_refused(tmp_path):
    with pytest.raises(ValueError, match=r"model\.attn_implementation = 'flash'.*auto, sdpa, eager"):
        load_config(None, ["model.attn_implementation=flash"])
    if not torch.cuda.is_available():
        path = make_model(tmp_path / "llama", "llama")
        with pytest.raises(ValueError, match=r"flash_attention_2.*needs a CUDA device"):
            build_engine(load_config(None, [f"model.path={path}", "model.attn_implementation=flash_attention_2"]))


def test_megatron_refuses_an_hf_attention_kernel(tmp_path):
    """megatron-core runs its own attention: an HF kernel choice would be ignored silently."""
    path = make_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match=r"model\.attn_implementation = 'eager'.*megatron-core's own attention"):
        build_engine(load_config(None, ["strategy=megatron", f"model.path={path}", "model.attn_implementation=eager"]))
