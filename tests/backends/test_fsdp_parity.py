"""FSDPEngine forward parity with the HF model it loaded (issue 3).

fp32, CPU, gloo. Tolerance max |diff| <= 1e-5 on log-probs: the engine's packed/padded
batched forward differs from the per-sequence HF forward only in float summation order
(measured ~5e-7).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_api import make_batch
from tests.backends.hf_utils import engine_for, hf_log_probs, hf_values, make_model, make_test_batch, max_abs_diff
from tests.dist_harness import run_distributed

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_model(root / family, family) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_log_probs_match_hf_single_process(models, family, packed):
    batch = make_test_batch(calculate_entropy=True)
    engine = engine_for(models[family], f"use_remove_padding={packed}", "micro_batch_size=4")
    with engine.eval_mode():
        preds = engine.infer_batch(batch)
    assert max_abs_diff(preds["log_probs"], hf_log_probs(models[family], batch)) <= TOL
    # Outputs come back on the caller's jagged layout: they combine with its fields directly.
    assert (preds["log_probs"] * batch["loss_mask"]).values().shape == batch["loss_mask"].values().shape
    assert preds["entropy"].values().min() >= 0


def test_temperature_divides_logits(models):
    hot = make_test_batch(temperature=2.0)
    engine = engine_for(models["llama"])
    with engine.eval_mode():
        got = engine.infer_batch(hot)["log_probs"]
    model = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for ids in hot["input_ids"].unbind():
            logits = model(ids[None]).logits[0, :-1] / 2.0
            want.append(torch.cat([torch.zeros(1), torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)]))
    assert max_abs_diff(got, want) <= TOL
    assert max_abs_diff(got, hf_log_probs(models["llama"], hot)) > 1e-3  # and it is not the T=1 result


def test_value_head_matches_hf_token_classification(models):
    batch = make_test_batch()
    engine = engine_for(models["llama"], "model.head=value", "seed=7")
    with engine.eval_mode():
        values = engine.infer_batch(batch)["values"]
    assert max_abs_diff(values, hf_values(models["llama"], batch, seed=7)) <= TOL
    assert all(float(v[0]) == 0.0 for v in values.unbind())  # nothing predicts position 0


def test_bad_batch_raises_before_state_changes(models):
    engine = engine_for(models["llama"])
    before = {k: v.clone() for k, v in engine.export_weights()}
    bad = make_batch([torch.tensor([1, 2, 64])])  # 64 is outside the 64-token vocabulary
    with engine.train_mode(), pytest.raises(ValueError, match="token id 64"):
        engine.train_batch(bad)
    assert all(p.grad is None for p in engine.model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in engine.export_weights())
    assert engine.global_step == 0


def _parity_worker(rank, world, models):
    out = {}
    batch = make_test_batch()
    for family, path in models.items():
        for packed in (True, False):
            engine = engine_for(path, f"use_remove_padding={packed}", "micro_batch_size=2")
            with engine.eval_mode():
                local = engine.infer_batch(engine.shard_data(batch))
            out[(family, packed)] = engine.unshard_data(local)["log_probs"]
    return out


def test_log_probs_match_hf_two_processes(models):
    per_rank = run_distributed(_parity_worker, 2, models, timeout=300)
    batch = make_test_batch()
    for family, path in models.items():
        want = hf_log_probs(path, batch)
        for results in per_rank:
            for packed in (True, False):
                assert max_abs_diff(results[(family, packed)], want) <= TOL, (family, packed)
