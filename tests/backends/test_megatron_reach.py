"""The megatron backend on more HF families (issue 15, items 1-2): scaled RoPE and Mistral.

Each model is built from its HF config with a fixed seed (reduced width and depth, the family's
real structural choices) and loaded back through the normal loading path:

* Llama-3.x RoPE scaling (``rope_type: llama3``: factor, low/high frequency factors and the
  original context length all from the config), YaRN (with its attention factor), linear;
* Phi-3, Llama-shaped with fused ``qkv_proj`` / ``gate_up_proj`` checkpoint tensors (split
  on import, fused on export: round trip bit-exact);
* Mistral, whose sliding window the local spec cannot apply: exact when every sequence fits in
  the window, refused (naming the window) when one does not.

Checks: megatron log-probs equal a per-sequence HF forward (packed and padded, 1 rank), within
1e-5, the project's HF parity tolerance (the issue asks 1e-4; measured ~5e-7); a RoPE-scaled Llama-3
step at TP=2 equals the FSDP step (loss, grad norm, updated weights; relative 1e-5, as for the
other families). The original context length is set to 16 so that positions 0-11 of the test
batch reach the scaled frequencies; a control asserts that scaling changes HF's log-probs there
(otherwise a converter that ignored it would pass). Other RoPE types are refused at
``build_engine``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Phi3Config

from engine_api import build_engine, load_config, make_batch
from engine_api.conformance.fixtures import TINY_DIMS, save_model
from tests.support import megatron_workers as W
from tests.support.hf_utils import VOCAB, assert_same, full_params, hf_log_probs, make_test_batch, max_abs_diff, one_step
from tests.support.launch import run_distributed

TOL = 1e-5  # as for the default-RoPE families (the issue asks <= 1e-4); measured ~5e-7
# Larger weights than HF's 0.02 so that attention, and with it RoPE, moves the log-probs well
# beyond the tolerance (at 0.02 the tiny model's outputs are nearly uniform).
BASE = {**TINY_DIMS, "initializer_range": 0.3}
ROPE = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reach")
    out = {name: save_model(LlamaConfig(**BASE, rope_parameters=rope), root / name) for name, rope in ROPE.items()}
    out["default"] = save_model(LlamaConfig(**BASE), root / "default")  # same seed: same weights, default RoPE
    out["mistral"] = save_model(MistralConfig(**BASE, sliding_window=16), root / "mistral")
    out["mistral-narrow"] = save_model(MistralConfig(**BASE, sliding_window=8), root / "mistral-narrow")
    # Phi-3: Llama-shaped with fused qkv_proj / gate_up_proj in the checkpoint.
    out["phi3"] = save_model(Phi3Config(**BASE, pad_token_id=None, bos_token_id=1, eos_token_id=2), root / "phi3")
    out["dynamic"] = save_model(
        LlamaConfig(**BASE, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), root / "dynamic"
    )
    return out


def _single(rank, world, models):
    out = {}
    for name in (*ROPE, "mistral", "phi3"):
        for packed in (True, False):
            out[(name, packed)] = W.infer(models[name], f"use_remove_padding={packed}", "micro_batch_size=2")["log_probs"]
    out["phi3_export"] = full_params(W.engine_for(models["phi3"], strategy="megatron"))
    engine = W.engine_for(models["mistral-narrow"], strategy="megatron")
    try:
        with engine.eval_mode():
            engine.infer_batch(make_test_batch())
        out["narrow"] = None
    except ValueError as exc:
        out["narrow"] = str(exc)
    with engine.eval_mode():  # sequences inside the window are fine
        short = make_batch([torch.arange(8) % VOCAB, torch.arange(5)])
        out["narrow_ok"] = engine.infer_batch(short)["log_probs"]
    return out


def _tp2_step(rank, world, model_dirs):
    out = {}
    for name, path in model_dirs.items():
        out[name] = one_step(path, "token-mean", ["megatron.tensor_model_parallel_size=2"], strategy="megatron")
        W.reset_parallel_state()
    return out


def _fsdp_step(rank, world, model_dirs):
    return {name: one_step(path, "token-mean") for name, path in model_dirs.items()}


@pytest.fixture(scope="module")
def single(models):
    return run_distributed(_single, 1, models, timeout=600)[0]


def test_the_batch_exercises_the_scaled_frequencies(models):
    batch = make_test_batch()
    default = hf_log_probs(models["default"], batch)
    for name in ROPE:
        scaled = torch.nested.as_nested_tensor(hf_log_probs(models[name], batch), layout=torch.jagged)
        assert max_abs_diff(scaled, default) > 100 * TOL, name


@pytest.mark.parametrize("name", [*ROPE, "mistral", "phi3"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_log_probs_match_hf(single, models, name, packed):
    assert max_abs_diff(single[(name, packed)], hf_log_probs(models[name], make_test_batch())) <= TOL


def test_a_sequence_longer_than_the_sliding_window_is_refused_and_shorter_ones_are_exact(single, models):
    assert single["narrow"] is not None and "sliding_window" in single["narrow"] and "<= 8" in single["narrow"], single["narrow"]
    short = make_batch([torch.arange(8) % VOCAB, torch.arange(5)])
    assert max_abs_diff(single["narrow_ok"], hf_log_probs(models["mistral-narrow"], short)) <= TOL


def test_other_rope_types_are_refused_at_build_engine(models):
    with pytest.raises(ValueError, match=r"rope_type = 'dynamic'.*fix: use the fsdp backend"):
        build_engine(load_config(None, ["strategy=megatron", f"model.path={models['dynamic']}"]))


def test_phi3_fused_tensors_round_trip_exactly(single, models):
    """HF (fused qkv_proj / gate_up_proj) -> megatron -> export_weights: the same names and
    bit-equal tensors as the checkpoint."""
    want = AutoModelForCausalLM.from_pretrained(models["phi3"], dtype=torch.float32).state_dict()
    got = single["phi3_export"]
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_rope_scaled_llama3_and_phi3_steps_at_tp2_equal_fsdp(models):
    picked = {name: models[name] for name in ("llama3", "phi3")}
    got = run_distributed(_tp2_step, 2, picked, timeout=600)[0]
    want = run_distributed(_fsdp_step, 1, picked, timeout=600)[0]
    for name in picked:
        assert_same(got[name], want[name], f"{name}, megatron TP=2 vs fsdp", rtol=1e-5)
