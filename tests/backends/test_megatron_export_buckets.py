"""Bucketed megatron export (issue 18, item 2): ``export_weights(bucket_mb=...)`` gives the same
names, order and bit-identical tensors as the per-parameter export, and both equal the HF
checkpoint the engine was loaded from (the independent reference: HF -> megatron -> HF is exact),
at TP=2, PP=2 (tied head: the embedding lives on the first stage, the head on the last) and
PP=2 x VPP=2, on 2 ranks; with one TP all-gather / one PP broadcast per bucket instead of per
parameter, and no pickled collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.support.hf_utils import engine_for, make_model
from tests.support.launch import run_distributed
from tests.support.object_collectives import no_object_collectives

LAYOUTS = {
    "tp2": ("qwen2", ["megatron.tensor_model_parallel_size=2"]),
    "pp2": ("qwen2", ["megatron.pipeline_model_parallel_size=2"]),
    "vpp": ("llama4", ["megatron.pipeline_model_parallel_size=2", "megatron.virtual_pipeline_model_parallel_size=2"]),
}
BUCKET_MB = 0.05
COUNTED = ("all_gather_into_tensor", "all_gather", "broadcast")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"qwen2": make_model(root / "qwen2", "qwen2"), "llama4": make_model(root / "llama4", "llama", num_layers=4)}


def _export_counted(engine, bucket_mb):
    """The export (cloned) and how many of each tensor collective it made."""
    calls = dict.fromkeys(COUNTED, 0)
    saved = {name: getattr(dist, name) for name in COUNTED}

    def counted(name):
        def call(*a, **k):
            calls[name] += 1
            return saved[name](*a, **k)

        return call

    for name in COUNTED:
        setattr(dist, name, counted(name))
    try:
        with no_object_collectives():
            out = [(n, t.clone()) for n, t in engine.export_weights(bucket_mb=bucket_mb)]
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return out, sum(calls.values())


def _worker(rank, world, models):
    from megatron.core import parallel_state

    out: dict = {}
    for layout, (family, overrides) in LAYOUTS.items():
        engine = engine_for(models[family], *overrides, strategy="megatron")
        try:
            engine.export_weights(bucket_mb=0)  # no next(): the size is checked at the call
            out.setdefault("refused", []).append(False)
        except ValueError as exc:
            out.setdefault("refused", []).append("bucket_mb=0): must be a finite number > 0 of MB" in str(exc))
        per_param, per_param_calls = _export_counted(engine, None)
        bucketed, bucketed_calls = _export_counted(engine, BUCKET_MB)
        out[layout] = {"per_param": dict(per_param), "order_same": [n for n, _ in per_param] == [n for n, _ in bucketed]}
        out[layout]["bucketed"] = dict(bucketed)
        out[layout]["calls"] = (per_param_calls, bucketed_calls)
        out[layout]["mb"] = sum(t.numel() * t.element_size() for _, t in per_param) / 2**20
        del engine
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def exports(models):
    return run_distributed(_worker, 2, models, timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bucketed_export_equals_per_parameter_export_and_the_hf_checkpoint(exports, models, layout):
    original = load_file(f"{models[LAYOUTS[layout][0]]}/model.safetensors")
    for rank_out in exports:
        got = rank_out[layout]
        assert got["order_same"]
        per_param, bucketed = got["per_param"], got["bucketed"]
        assert set(original) <= set(per_param) == set(bucketed)
        for name, tensor in per_param.items():
            assert torch.equal(bucketed[name], tensor), name
        for name, tensor in original.items():
            assert torch.equal(per_param[name], tensor), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_buckets_make_far_fewer_collectives(exports, layout):
    for rank_out in exports:
        per_param_calls, bucketed_calls = rank_out[layout]["calls"]
        n_tensors = len(rank_out[layout]["per_param"])
        # per parameter: one all-gather per TP-split parameter (11 of the 2-layer model's), three
        # broadcasts per PP-moved one; per bucket: one all-gather, or three broadcasts (header
        # length, header, buffer) per bucket of BUCKET_MB
        assert per_param_calls >= 10, (per_param_calls, n_tensors)
        assert bucketed_calls <= 3 * (rank_out[layout]["mb"] / BUCKET_MB + 6), (bucketed_calls, rank_out[layout]["mb"])
        assert bucketed_calls < per_param_calls / 2, (bucketed_calls, per_param_calls)


def test_a_bad_bucket_size_is_refused_at_the_call(exports):
    from engine_api.base import bucket_bytes

    assert all(all(rank_out["refused"]) for rank_out in exports)  # MegatronEngine.export_weights(bucket_mb=0)
    for bad in (0, -1.0, float("nan"), float("inf"), "512", True):
        with pytest.raises(ValueError, match=r"export_weights\(bucket_mb=.*\): must be a finite number > 0 of MB; fix: e.g. 512"):
            bucket_bytes(bad)
    assert bucket_bytes(None) is None and bucket_bytes(1) == 2**20
