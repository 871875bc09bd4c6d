"""Bucketed FSDP export (issue 18, item 2): the same tensors, names and order as the per-tensor
export, bit-exact, with one all-gather per bucket instead of one collective per tensor; on 1, 2
and 3 ranks (3: dims that do not divide, so some ranks hold smaller or empty chunks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.support.hf_utils import engine_for, make_model
from tests.support.launch import run_distributed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("export") / "qwen2", "qwen2")  # tied head, qkv biases (1-D tensors)


def _worker(rank, world, model_dir, bucket_mb):
    engine = engine_for(model_dir)
    per_tensor = [(n, t.clone()) for n, t in engine.export_weights()]
    calls = {"all_gather_into_tensor": 0, "full_tensor": 0}
    gather, full = dist.all_gather_into_tensor, DTensor.full_tensor

    def counted_gather(*a, **k):
        calls["all_gather_into_tensor"] += 1
        return gather(*a, **k)

    def counted_full(self, *a, **k):
        calls["full_tensor"] += 1
        return full(self, *a, **k)

    dist.all_gather_into_tensor, DTensor.full_tensor = counted_gather, counted_full
    try:
        bucketed = [(n, t.clone()) for n, t in engine.export_weights(bucket_mb=bucket_mb)]
    finally:
        dist.all_gather_into_tensor, DTensor.full_tensor = gather, full
    same = [a[0] == b[0] and a[1].shape == b[1].shape and torch.equal(a[1], b[1]) for a, b in zip(per_tensor, bucketed, strict=True)]
    total_mb = sum(t.numel() * t.element_size() for _, t in per_tensor) / 2**20
    return all(same) and len(per_tensor) == len(bucketed), calls, len(per_tensor), total_mb


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bucketed_export_equals_the_per_tensor_export(model_dir, world):
    for ok, calls, n_tensors, total_mb in run_distributed(_worker, world, model_dir, 0.05, timeout=300):
        assert ok
        if world > 1:
            assert calls["full_tensor"] == 0
            # one gather per bucket: about total / bucket size, far fewer than one per tensor
            assert 0 < calls["all_gather_into_tensor"] <= total_mb / 0.05 + n_tensors // 10 + 2 < n_tensors, (calls, n_tensors, total_mb)


def test_a_bad_bucket_size_is_refused(model_dir, tmp_path):
    engine = engine_for(model_dir)
    with pytest.raises(ValueError, match=r"bucket_mb=0\): must be a finite number > 0 of MB"):
        engine.export_weights(bucket_mb=0)  # at the call, before any collective
