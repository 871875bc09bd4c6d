"""``make gpu-check``'s CPU smoke mode (issue 18, item 4): the same steps and report as on a GPU
machine, the GPU tests skipped and the throughput run on a tiny fp32 model; the report must
name every step, the environment and the optional GPU packages, and every step must pass."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_check_smoke_writes_the_report(tmp_path):
    proc = subprocess.run(
        ["bash", "ci/gpu_check.sh", "--smoke", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["smoke"] is True
    assert [s["step"] for s in report["steps"]] == ["pytest -m gpu", "benchmarks.gpu_throughput", "tensor gathers on NCCL"]
    assert all(s["ok"] for s in report["steps"])
    assert report["steps"][0].get("skipped", 0) >= 4  # the gpu tests were collected (and skipped without CUDA)
    assert {r["case"] for r in report["steps"][1]["rows"]} == {"fsdp", "megatron"}
    text = (tmp_path / "gpu_check.md").read_text()
    assert "transformer_engine NOT installed" in text and "flash_attn NOT installed" in text
