"""GPU-only: megatron context parallelism (issue 33) at CP=2 against CP=1, one bf16 step.

Needs 2 CUDA devices (NCCL: one rank per GPU) and transformer-engine (megatron-core's CP
attention is TE's); skipped otherwise, by name, and reported by ``make gpu-check``. Both runs
use 2 ranks: CP=1 is DP=2, CP=2 is one DP rank whose 2 CP ranks split every sequence (the
loss is DP-invariant: ``tests/conformance``). Tolerances as the other bf16 comparisons
(``test_gpu_parity``): loss and grad norm relative 2e-2, log-probs after the step mean |diff| <=
3e-2.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tests.support.hf_utils import make_model
from tests.support.launch import torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL, one rank per GPU)"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs transformer-engine (CP attention is TE's)"),
]


def _step(model_dir: str, cp: int) -> dict:
    args = ["-m", "tests.backends.gpu_step", "megatron", model_dir, "megatron.layer_spec=te", f"megatron.context_parallel_size={cp}"]
    proc = torchrun(args, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cp2_step_equals_cp1(tmp_path):
    model = make_model(tmp_path / "llama", "llama")
    one, two = _step(model, 1), _step(model, 2)
    for key in ("loss", "grad_norm"):
        assert abs(two[key] - one[key]) <= 2e-2 * abs(one[key]), (key, one[key], two[key])
    diffs = [abs(a - b) for ra, rb in zip(one["log_probs"], two["log_probs"], strict=True) for a, b in zip(ra, rb, strict=True)]
    assert sum(diffs) / len(diffs) <= 3e-2, max(diffs)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
