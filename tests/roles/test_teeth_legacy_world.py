"""The legacy worker's step on two ranks equals the single-process step (issue 28, item 9).

``roles.legacy.worker.FSDPWorker`` divides each micro-batch's loss by the GLOBAL token count
and multiplies it by the world size before backward, because FSDP2 averages gradients over
the ranks: the product is the gradient of the global token-mean loss. Dropping (or doubling)
that factor changes nothing on one rank, and on two ranks halves (or doubles) every gradient:
the reported grad norm, the clipping and, through AdamW's eps, the update. Reference: the
same worker, config, batch and loss in one process. Two spawned gloo ranks, one step.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_utils import make_model, make_test_batch, pg_loss
from tests.support.launch import run_distributed

# AdamW's eps comparable to the gradients, so a gradient scale error also moves the weights
# (Adam alone is nearly scale-invariant); a clip below the grad norm, so clipping acts.
OVERRIDES = ["optim.lr=0.01", "optim.eps=1e-2", "optim.clip_grad=0.5", "micro_batch_size=1"]


def _legacy_step(rank: int, world: int, model_dir: str, mode: str) -> dict:
    from engine_api import load_config
    from roles.legacy.worker import FSDPWorker

    torch.set_num_threads(1)
    config = load_config(None, ["strategy=fsdp", f"model.path={model_dir}", f"loss_agg_mode={mode}", *OVERRIDES])
    worker = FSDPWorker(config)
    (metrics,) = worker.train_epochs(make_test_batch(seed=3), 1, None, pg_loss)
    weights = {name: t.clone() for name, t in worker.export_weights()}
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "skipped": metrics["step_skipped"], "weights": weights}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("legacy_world") / "model", "llama")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_a_two_rank_legacy_step_equals_the_one_process_step(model_dir, mode):
    (one,) = run_distributed(_legacy_step, 1, model_dir, mode)
    two = run_distributed(_legacy_step, 2, model_dir, mode)
    assert one["skipped"] == 0.0 and one["grad_norm"] > 0.5  # the step ran and the clip acted
    for rank, r in enumerate(two):
        assert r["skipped"] == 0.0
        assert r["loss"] == pytest.approx(one["loss"], rel=1e-5), f"rank {rank}: loss"
        assert r["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), f"rank {rank}: grad norm"
        assert r["weights"].keys() == one["weights"].keys()
        for name, w in one["weights"].items():
            torch.testing.assert_close(r["weights"][name], w, rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {name}")
