"""Rank-side halves of the resize tests: save on one number of ranks, resume on another.

The data of step ``s`` is the global test batch of seed ``s`` (sharded over the ranks of the
run), never drawn from an RNG: after a data-parallel resize the RNG streams are re-derived
(``engine_api.ckpt_layout.apply_extra``), and the global batch of a step is what must not change.
"""

from __future__ import annotations

import os

import torch

from tests.reliability._ckpt_state import OVERRIDES
from tests.reliability._step_common import new_engine
from tests.support.hf_utils import full_params, make_test_batch

K_STEPS, N_STEPS = 2, 2


def _train(engine, steps) -> list[dict]:
    out = []
    for s in steps:
        with engine.train_mode():
            m = engine.train_batch(engine.shard_data(make_test_batch(seed=s)))
        out.append({"loss": m["loss"], "grad_norm": m["grad_norm"], "lr": m["lr"]})
    return out


def save_then_continue(rank, world, strategy, model_dir, root, overrides) -> dict:
    """K steps, a checkpoint, N more steps (the uninterrupted run at this world size)."""
    torch.set_num_threads(1)
    engine = new_engine(strategy, model_dir, *OVERRIDES, *overrides)
    _train(engine, range(K_STEPS))
    engine.save_checkpoint(root, global_step=K_STEPS)
    after = _train(engine, range(K_STEPS, K_STEPS + N_STEPS))
    return {"after": after, "end": full_params(engine)}


def resume_and_continue(rank, world, strategy, model_dir, root, overrides) -> dict:
    """Load the checkpoint of :func:`save_then_continue` (saved on another number of ranks)
    and train the same N steps; or record the error the load raised."""
    torch.set_num_threads(1)
    engine = new_engine(strategy, model_dir, *OVERRIDES, *overrides)
    try:
        step = engine.load_checkpoint(root)
    except ValueError as exc:
        return {"error": str(exc)}
    after = _train(engine, range(K_STEPS, K_STEPS + N_STEPS))
    return {"step": step, "after": after, "end": full_params(engine), "files": sorted(os.listdir(root))}
