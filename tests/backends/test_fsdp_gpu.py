"""GPU-only FSDP paths: bf16 compute parity with the fp32 HF model, and throughput.

Skipped on CPU machines (CI has no GPU); run with ``pytest -m gpu`` on a GPU machine.
Tolerance: bf16 keeps 8 bits of mantissa (relative rounding 2^-8 ~ 4e-3 per op); through two
layers and a log-softmax over 64 logits of magnitude ~1, per-token log-prob errors of a few
1e-2 are expected. Assert mean |diff| <= 2e-2 and max |diff| <= 1.5e-1 against fp32 HF.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.hf_utils import engine_for, hf_log_probs, make_model, make_test_batch

pytestmark = pytest.mark.gpu


def test_bf16_log_probs_close_to_fp32_hf(tmp_path):
    path = make_model(tmp_path / "llama", "llama")
    batch = make_test_batch()
    engine = engine_for(path, "model.dtype=bfloat16")
    with engine.eval_mode():
        got = engine.infer_batch(batch)["log_probs"]
    diffs = torch.cat([(a - b).abs() for a, b in zip(got.unbind(), hf_log_probs(path, batch), strict=True)])
    assert float(diffs.mean()) <= 2e-2 and float(diffs.max()) <= 1.5e-1


def test_bf16_training_step_reports_tokens_per_second(tmp_path):
    path = make_model(tmp_path / "llama", "llama")
    engine = engine_for(path, "model.dtype=bfloat16", "micro_batch_size=2")
    batch = make_test_batch()
    tokens = int(batch["input_ids"].offsets()[-1])
    with engine.train_mode():
        engine.train_batch(batch)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = engine.train_batch(batch)
        torch.cuda.synchronize()
    print(f"bf16 train step: {tokens / (time.perf_counter() - start):.0f} tokens/s, loss {metrics['loss']:.4f}")
    assert metrics["step_skipped"] == 0.0
