"""``engine_api.dist.broadcast_tensors`` on 2 gloo ranks: every dtype and shape arrives bit-exact,
the JSON header carries inf / nan / nested values the same on every rank (the sender included),
and a sender that cannot encode its input makes every rank raise instead of leaving the others
blocked in the next broadcast."""

from __future__ import annotations

import math

import torch

from engine_api.dist import broadcast_tensors
from tests.reliability._step_common import run


def _sent() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    return [
        ("f32", torch.randn(3, 5, generator=g)),
        ("bool", torch.rand(7, generator=g) > 0.5),
        ("bf16_scalar", torch.tensor(1.5, dtype=torch.bfloat16)),
        ("empty", torch.zeros(0, 3)),
        ("strided", base.t()),  # non-contiguous
        ("i64", torch.arange(5)),
        ("f32_again", torch.randn(2, generator=g)),  # same dtype as the first: one buffer, in order
    ]


def _worker(rank, world):
    extra = {"loss": float("inf"), "m": [1.0, float("nan")], "k": {1: (2, 3)}}
    named, got_extra = broadcast_tensors(_sent() if rank == 1 else None, extra if rank == 1 else None, src=1, group=None)
    ok = [n == m and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for (n, a), (m, b) in zip(named, _sent(), strict=True)]
    # a sender that cannot encode: it raises its own error, the receiver a RuntimeError, nobody hangs
    try:
        broadcast_tensors([("x", torch.ones(1))] if rank == 0 else None, {"bad": object()} if rank == 0 else None, src=0, group=None)
        failure = None
    except (TypeError, RuntimeError) as exc:
        failure = type(exc).__name__
    # the group still works afterwards
    after, _ = broadcast_tensors([("y", torch.full((2,), 7.0))] if rank == 0 else None, None, src=0, group=None)
    return len(named), all(ok), got_extra, failure, after[0][1].tolist()


def test_broadcast_tensors_every_dtype_and_the_header_on_every_rank():
    results = run(_worker, 2, timeout=120)
    for rank, (count, ok, extra, failure, after) in enumerate(results):
        assert count == len(_sent()) and ok, rank
        assert math.isinf(extra["loss"]) and extra["m"][0] == 1.0 and math.isnan(extra["m"][1])
        assert extra["k"] == {"1": [2, 3]}, "every rank sees the JSON round trip, the sender too"
        assert failure == ("TypeError" if rank == 0 else "RuntimeError")
        assert after == [7.0, 7.0]
