"""FSDPEngine forward parity with the HF model it loaded (issue 3).

fp32, CPU, gloo. Tolerance max |diff| <= 1e-5 on log-probs: the engine's packed/padded
batched forward differs from the per-sequence HF forward only in float summation order
(measured ~5e-7).
"""

from __future__ import annotations

import pytest

from tests.support.hf_utils import engine_for, hf_log_probs, make_model, make_test_batch, max_abs_diff
from tests.support.launch import run_distributed

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
