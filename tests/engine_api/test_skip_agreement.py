"""The non-finite skip is agreed by every rank (``engine_api.optim.agree_to_skip`` and
``BaseEngine.optimizer_step``), on 2 gloo ranks where only one rank sees the problem.

Why a test of its own: end to end, the FSDP engine cannot show a missing agreement, because
its loss and grad norm are already global (a NaN on one rank reaches every rank through the
loss all-reduce and the gradient reduce-scatter); there, the agreement is a third guard. It
is the only guard where a rank-local signal stays local: tensor-parallel peers (megatron
TP=2, ``tests/reliability/test_bad_input.py``), and any backend whose norm or loss a rank
computes alone. Here the grads are plain per-rank tensors, so nothing but the agreement can
make the healthy rank skip.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_api.optim import agree_to_skip
from tests.engine_api.param_engine import ParamEngine
from tests.reliability._step_common import run

# (grad norm, non-finite loss) on rank 0 and rank 1
CASES = {
    "inf norm on rank 1": ((1.0, False), (math.inf, False)),
    "nan norm on rank 0": ((math.nan, False), (1.0, False)),
    "non-finite loss on rank 1": ((1.0, False), (1.0, True)),
    "healthy": ((1.0, False), (2.0, False)),
}


def _step(rank: int, poisoned_loss: bool) -> dict:
    """One ``optimizer_step`` on a per-rank linear layer with finite grads; ``poisoned_loss``
    marks this rank's window as having seen a non-finite loss."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in layer.parameters()]
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 3) * (rank + 1)).sum().backward()
    engine = ParamEngine(dict(layer.named_parameters()), opt, clip_grad=1.0)
    if poisoned_loss:
        engine.deferred.note_loss(math.inf)
    norm = engine.optimizer_step()
    moved = any(not torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))
    return {"norm": norm, "moved": moved, "window_reset": not engine.deferred.nonfinite_loss}


def _worker(rank, world):
    decisions = {name: agree_to_skip(*pair[rank], group=None) for name, pair in CASES.items()}
    return {
        "decisions": decisions,
        "poisoned on rank 1": _step(rank, poisoned_loss=rank == 1),
        "healthy": _step(rank, poisoned_loss=False),
    }


@pytest.fixture(scope="module")
def results():
    return run(_worker, 2)


def test_one_rank_alone_sees_a_non_finite_value_and_every_rank_skips(results):
    for rank, r in enumerate(results):
        for name, skip in r["decisions"].items():
            assert skip == (name != "healthy"), f"rank {rank}, {name}: skip={skip}"


def test_the_step_skips_on_every_rank_when_one_rank_saw_a_non_finite_loss(results):
    for rank, r in enumerate(results):
        bad, good = r["poisoned on rank 1"], r["healthy"]
        assert not bad["moved"] and math.isnan(bad["norm"]), f"rank {rank} stepped: {bad}"
        assert bad["window_reset"], f"rank {rank}: the skipped window was not reset"
        assert good["moved"] and math.isfinite(good["norm"]), f"rank {rank}: the healthy window did not step: {good}"
