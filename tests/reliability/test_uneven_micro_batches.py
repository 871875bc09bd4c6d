"""Dynamic batching where the DP shards need different micro-batch counts (issue 19): rank 0's
shard (3 short sequences, 12 tokens) fits one micro-batch of 16 tokens, rank 1's (3 long ones,
42 tokens) needs three. Every rank must run the same number of forward/backward passes (FSDP's
reduce-scatters and megatron's schedule are collective per micro-batch), so the engine agrees on
the max over DP; the step must then equal the 1-process step on the same global batch (DP
invariance: loss, pre-clip grad norm, updated weights; relative 1e-5, as the other cross-layout
tests). Without the agreement the ranks disagree on the collectives of a step: wrong gradients or
a hang (the harness's timeout then fails the test).

The other 2-rank dynamic-batching tests use the shared test batch, whose shards happen to need
the same count; this one is built so that they do not (asserted below, from the partition alone).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_api.batch import make_batch
from engine_api.partition import partition_balanced
from tests.reliability._step_common import BACKENDS, run
from tests.support.hf_utils import VOCAB, make_model, one_step, rel

LENGTHS = (3, 4, 5, 15, 14, 13)  # rank 0: 3 + 4 + 5 = 12 tokens; rank 1: 15 + 14 + 13 = 42
BUDGET = 16
TOL = 1e-5


def uneven_batch():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    masks = [torch.cat([torch.zeros(1), torch.ones(n - 1)]) for n in LENGTHS]
    return make_batch(seqs, loss_mask=masks, advantages=[torch.randn(n, generator=g) for n in LENGTHS])


def test_the_shards_need_different_counts():
    """The premise, from the partition alone: 1 part for rank 0's shard, 3 for rank 1's."""
    assert len(partition_balanced(LENGTHS[:3], BUDGET)) == 1
    assert len(partition_balanced(LENGTHS[3:], BUDGET)) == 3


def _step(rank, world, model_dir, strategy):
    torch.set_num_threads(1)
    return one_step(model_dir, "token-mean", [f"max_token_len_per_micro_batch={BUDGET}"], strategy=strategy, batch_fn=uneven_batch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("uneven") / "llama", "llama")


@pytest.mark.parametrize("strategy", BACKENDS)
def test_two_ranks_with_uneven_counts_equal_one_process(model_dir, strategy):
    single = run(_step, 1, model_dir, strategy, timeout=180)[0]
    two = run(_step, 2, model_dir, strategy, timeout=180)
    for got in two:
        assert math.isclose(got["loss"], single["loss"], rel_tol=TOL), (got["loss"], single["loss"])
        assert math.isclose(got["grad_norm"], single["grad_norm"], rel_tol=TOL), (got["grad_norm"], single["grad_norm"])
        assert rel(got["params"], single["params"]) <= TOL
