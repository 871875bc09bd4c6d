"""Less waste per FSDP step (issue 52): opt-in per-layer ``torch.compile`` (``engine.compile``),
fused AdamW on CUDA, activation checkpointing off unless asked.

``compile=true`` trains one step equal to ``compile=false`` (relative 1e-6 on every updated
parameter: inductor may reorder fp32 sums; measured ~2e-8 here). It compiles the layer's forward
and backward with inductor on this CPU (~30 s cold on 2 cores; the build-time probes are off there, as each shape compiles anew), hence ``slow``.
"""

from __future__ import annotations

import pytest
import torch

from engine_api import build_engine, load_config
from engine_api.config import OptimConfig
from engine_api.kit import build_adamw
from tests.support.hf_utils import engine_for, make_model, one_step, rel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama", num_layers=1)


@pytest.mark.slow
def test_compiled_layers_train_one_step_like_eager(model_dir, monkeypatch):
    import backends.fsdp.engine as fsdp_engine

    # No build-time probes (tested elsewhere): they run other shapes, each one more compile.
    monkeypatch.setattr(fsdp_engine, "chunked_head_problem", lambda model: "off for this test")
    want = one_step(model_dir, "token-mean", extra=["use_remove_padding=false"])
    got = one_step(model_dir, "token-mean", extra=["use_remove_padding=false", "compile=true"])
    assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-6 * want["grad_norm"]
    assert rel(got["params"], want["params"]) <= 1e-6


def test_compile_compiles_each_layer_before_sharding(model_dir, monkeypatch):
    """What ``compile=true`` does, without paying for inductor: every decoder layer's
    ``compile()`` is called, and before ``fully_shard`` wraps it."""
    import backends.fsdp.model as fsdp_model

    events = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: events.append(("compile", type(self).__name__)))
    real = fsdp_model.fully_shard
    monkeypatch.setattr(fsdp_model, "fully_shard", lambda m, **k: (events.append(("shard", type(m).__name__)), real(m, **k))[1])
    engine_for(model_dir, "compile=true")
    assert events[0] == ("compile", "LlamaDecoderLayer") and events[1][0] == "shard"
    assert sum(e[0] == "compile" for e in events) == 1  # one layer, and nothing else compiled


def test_compile_refused_with_ulysses(model_dir):
    overrides = [f"model.path={model_dir}", "compile=true", "fsdp.ulysses_sequence_parallel_size=2", "world_size=2"]
    with pytest.raises(ValueError, match=r"compile = True: Ulysses .*fix: set compile=false"):
        build_engine(load_config(None, overrides))


def test_adamw_fused_only_on_cuda():
    """CPU keeps torch's default (foreach) AdamW, today's numbers bit for bit; CUDA parameters
    get the fused kernel (the GPU test below)."""
    opt = build_adamw([torch.nn.Parameter(torch.zeros(3))], OptimConfig())
    assert not opt.defaults.get("fused")


@pytest.mark.gpu
def test_adamw_fused_on_cuda():
    opt = build_adamw([torch.nn.Parameter(torch.zeros(3, device="cuda"))], OptimConfig())
    assert opt.defaults["fused"] is True


def test_activation_checkpointing_off_unless_asked():
    assert load_config(None, []).model.gradient_checkpointing is False
    assert load_config(None, []).compile is False
