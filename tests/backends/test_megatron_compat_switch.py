"""The CPU compatibility layer is switched on by the megatron engine alone, explicitly, and says so once.

It rewrites CUDA device arguments of every torch call in the process, so it must never be a
side effect: importing ``backends.megatron`` or running the FSDP engine leaves it off; the
first megatron engine on a CPU machine switches it on and prints one line; a second engine
prints nothing more.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_api.conformance.fixtures import build_model

ROOT = Path(__file__).resolve().parents[2]
LINE = "[enginekit] megatron on CPU: compatibility layer on"

CODE = """
import sys
from backends.megatron import cpu_compat
from engine_api import build_engine, load_config
assert not cpu_compat.is_active(), "importing backends.megatron switched the compat layer on"
def engine(strategy):
    e = build_engine(load_config(None, [f"strategy={strategy}", "model.path=" + sys.argv[1]]))
    e.init_model()
    return e
engine("fsdp")
assert not cpu_compat.is_active(), "the FSDP engine switched the compat layer on"
engine("megatron")
assert cpu_compat.is_active(), "the megatron engine on CPU did not switch the compat layer on"
engine("megatron")
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compat layer is for CPU-only machines")
def test_only_the_megatron_engine_switches_the_compat_layer_on_and_says_so_once(tmp_path):
    model = build_model(str(tmp_path / "model"))
    result = subprocess.run([sys.executable, "-c", CODE, model], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr[-3000:]
    assert result.stderr.count(LINE) == 1, result.stderr[-3000:]
