"""``ctx[RETURN_PREDICTIONS] = False`` (what ``train_batch`` passes, issue 7) changes nothing but
the returned predictions: on every built-in backend, one step through ``train_batch`` and one
step through ``forward_backward_step`` with predictions kept, from the same init on the same
batch, give the same loss and grad norm and bit-identical parameters, optimizer state and step.
"""

from __future__ import annotations

from engine_api import RETURN_PREDICTIONS
from tests.reliability._step_common import local_batch, new_engine, run, snapshot, snapshot_diff, worker_setup


def _worker(rank, world, strategy, model_dir):
    worker_setup()
    dropped = new_engine(strategy, model_dir)
    batch = local_batch(dropped)
    with dropped.train_mode():
        metrics = dropped.train_batch(batch)
    kept = new_engine(strategy, model_dir)
    with kept.train_mode():
        kept.optimizer_zero_grad()
        predictions, loss, _ = kept.forward_backward_step(batch)
        grad_norm = kept.optimizer_step()
        kept.lr_scheduler_step()  # train_batch steps the schedule after a taken step
        # The flag alone, on the stepped weights: no predictions come back, the same loss.
        kept.optimizer_zero_grad()
        none, loss_dropped, _ = kept.forward_backward_step(batch, ctx={RETURN_PREDICTIONS: False})
        kept.optimizer_zero_grad()
        _, loss_kept, _ = kept.forward_backward_step(batch)
        kept.optimizer_zero_grad()
    return {
        "train_batch": (metrics["loss"], metrics["grad_norm"]),
        "kept": (loss, grad_norm),
        "kept_has_predictions": predictions is not None and "log_probs" in predictions.keys(),
        "dropped_predictions": none,
        "losses_after_step": (loss_dropped, loss_kept),
        "diff": snapshot_diff(snapshot(dropped), snapshot(kept)),
    }


def test_dropping_predictions_changes_only_the_predictions(backend, model_dir):
    (out,) = run(_worker, 1, backend, model_dir)
    assert out["train_batch"] == out["kept"]
    assert out["kept_has_predictions"] and out["dropped_predictions"] is None
    dropped, kept = out["losses_after_step"]
    assert dropped == kept and dropped != out["kept"][0]  # the step changed the weights
    assert out["diff"] == [], out["diff"]
