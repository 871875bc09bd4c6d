"""The engine the role tests drive (a tiny FSDP model in this process) and the old-policy
log-probs an actor update needs (``tests/roles/test_roles.py``, ``test_rollout.py``)."""

from __future__ import annotations

from engine_api import build_engine, load_config
from engine_api.batch import unpack


def fsdp_engine(model_dir, *overrides):
    """An initialised single-process FSDP engine on ``model_dir``: lr 0.01, micro-batches of 2."""
    engine = build_engine(
        load_config(None, ["strategy=fsdp", f"model.path={model_dir}", "optim.lr=0.01", "micro_batch_size=2", *overrides])
    )
    engine.init_model()
    return engine


def with_old_log_probs(actor, batch, name="old_log_probs"):
    """``batch`` with the actor's current log-probs set as ``name`` (the first epoch's ratio is 1)."""
    lp = actor.compute_log_probs(batch)["log_probs"]
    batch.set(name, unpack(lp.values(), batch["input_ids"]))
    return batch
