"""A vocabulary that TP does not divide (issue 19): megatron pads the embedding and output rows
to a multiple of the TP size (63 -> 64 at TP=2); the padding rows must never reach a log-prob,
an entropy or an exported tensor. Every other test model has a vocabulary that divides every TP
size used, so without this file the slicing back to the true vocabulary runs in no test.

References: HF itself (log-probs and entropy per sequence, 1e-5), the FSDP engine's one step
(loss, grad norm, updated weights; relative 1e-5, as tests/backends/test_megatron.py), and the
HF checkpoint for the export (bit-exact, with HF's shapes). Untied (llama) and tied (qwen2)
heads: a tied head reads the padded embedding.

A real-shaped case on 4 processes: 32001 rows (Llama-2's 32000 plus one added pad token, as
many fine-tunes ship) at TP=4, padded to 32004, so each rank holds 8001 rows and the last
rank's slice ends in padding. (The issue's other example, Phi-3's 32064, divides 4: the engine
pads only to a multiple of the TP size, so at TP=4 it runs no padding at all.)
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from engine_api.conformance import fixtures
from posttrain.tiny_model import build_tiny_model
from tests.support.hf_utils import LENGTHS, RESPONSE, engine_for, hf_log_probs, max_abs_diff, one_step, rel
from tests.support.launch import run_distributed

ODD_VOCAB = 63
TOL = 1e-5
FAMILIES = ("llama", "qwen2")


def odd_batch(**meta):
    return fixtures.make_test_batch(0, LENGTHS, RESPONSE, ODD_VOCAB, **meta)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd_vocab")
    return {f: build_tiny_model(root / f, family=f, seed=0, vocab_size=ODD_VOCAB, hidden_size=32) for f in FAMILIES}


def _worker(rank, world, models):
    from megatron.core import parallel_state

    out = {}
    for family, path in models.items():
        engine = engine_for(path, "megatron.tensor_model_parallel_size=2", strategy="megatron")
        with engine.eval_mode():
            got = engine.unshard_data(engine.infer_batch(engine.shard_data(odd_batch(calculate_entropy=True))))
        out[("infer", family)] = (got["log_probs"], got["entropy"])
        out[("export", family)] = {k: v.clone() for k, v in engine.export_weights()}
        del engine
        parallel_state.destroy_model_parallel()
        out[("step", family)] = one_step(
            path, "token-mean", ["megatron.tensor_model_parallel_size=2"], strategy="megatron", batch_fn=odd_batch
        )
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def tp2(models):
    return run_distributed(_worker, 2, models, timeout=600)[0]


def _hf_entropy(model_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in batch["input_ids"].unbind():
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1], -1)
            out.append(torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)]))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_log_probs_and_entropy_match_hf_at_tp2(tp2, models, family):
    log_probs, entropy = tp2[("infer", family)]
    assert max_abs_diff(log_probs, hf_log_probs(models[family], odd_batch())) <= TOL
    assert max_abs_diff(entropy, _hf_entropy(models[family], odd_batch())) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_export_has_hf_shapes_and_values(tp2, models, family):
    original = load_file(f"{models[family]}/model.safetensors")
    exported = tp2[("export", family)]
    assert exported["model.embed_tokens.weight"].shape[0] == ODD_VOCAB
    for name, tensor in original.items():
        assert exported[name].shape == tensor.shape and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_matches_fsdp_at_tp2(tp2, models, family):
    got = tp2[("step", family)]
    want = one_step(models[family], "token-mean", batch_fn=odd_batch)
    assert math.isclose(got["loss"], want["loss"], rel_tol=TOL), (got["loss"], want["loss"])
    assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=TOL), (got["grad_norm"], want["grad_norm"])
    assert set(got["params"]) == set(want["params"]) and rel(got["params"], want["params"]) <= TOL


# ----------------------------------------------------------------------------- 32001 at TP=4
REAL_VOCAB = 32001
TP4 = ["megatron.tensor_model_parallel_size=4"]


def real_batch(**meta):
    return fixtures.make_test_batch(0, LENGTHS, RESPONSE, REAL_VOCAB, **meta)


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    # 4 KV heads: TP=4 splits the query groups too
    path = tmp_path_factory.mktemp("real_vocab") / "llama"
    return build_tiny_model(path, family="llama", seed=0, vocab_size=REAL_VOCAB, hidden_size=32, num_heads=4, num_kv_heads=4)


def _tp4_worker(rank, world, path):
    from megatron.core import parallel_state

    engine = engine_for(path, *TP4, strategy="megatron")
    with engine.eval_mode():
        got = engine.unshard_data(engine.infer_batch(engine.shard_data(real_batch(calculate_entropy=True))))
    out = {"infer": (got["log_probs"], got["entropy"]), "rows": engine.model[0].module.embedding.word_embeddings.weight.shape[0]}
    out["export"] = {k: v.clone() for k, v in engine.export_weights()}
    del engine
    parallel_state.destroy_model_parallel()
    out["step"] = one_step(path, "token-mean", TP4, strategy="megatron", batch_fn=real_batch)
    return out


@pytest.fixture(scope="module")
def tp4(real_model):
    return run_distributed(_tp4_worker, 4, real_model, timeout=600)[0]


def test_real_shaped_vocab_at_tp4_matches_hf_and_fsdp(tp4, real_model):
    assert tp4["rows"] == 8001  # 32004 / 4: the padding path runs
    log_probs, entropy = tp4["infer"]
    assert max_abs_diff(log_probs, hf_log_probs(real_model, real_batch())) <= TOL
    assert max_abs_diff(entropy, _hf_entropy(real_model, real_batch())) <= TOL
    original = load_file(f"{real_model}/model.safetensors")
    for name, tensor in original.items():
        assert tp4["export"][name].shape == tensor.shape and torch.equal(tp4["export"][name], tensor), name
    got, want = tp4["step"], one_step(real_model, "token-mean", batch_fn=real_batch)
    assert math.isclose(got["loss"], want["loss"], rel_tol=TOL), (got["loss"], want["loss"])
    assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=TOL), (got["grad_norm"], want["grad_norm"])
    assert rel(got["params"], want["params"]) <= TOL
