"""What "bit-identical resume" compares: the full training state of an engine (the snapshot of
``_step_common``: params, optimizer state, LRs, step; plus the scheduler's state and every RNG a
backend restores) and a training loop whose data depends on those RNGs.

Used inside rank processes (``_ckpt_targets``); the tests compare what comes back.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from tests.reliability._step_common import snapshot, snapshot_diff
from tests.support.hf_utils import make_test_batch

# Settings every checkpoint test adds to _step_common.COMMON: two micro-batches per rank, so
# the loop and the DP/TP reductions all take part.
OVERRIDES = ("micro_batch_size=2",)


def seed_all(seed: int) -> None:
    """Put every global RNG a checkpoint restores into a known state (all ranks alike)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def train_steps(engine, steps: int) -> list[dict]:
    """``steps`` optimizer steps on batches chosen by the global RNGs.

    The data seed of each step is drawn from torch's RNG and a numpy and a python draw are
    recorded, so what a resumed run trains on depends on the RNG state its checkpoint
    restored: the bare-engine stand-in for a data loader's position. Returns per-step metrics
    (``train_batch``'s plus the draws and the engine's step counter).
    """
    out = []
    for _ in range(steps):
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        draws = {"numpy_draw": float(np.random.random()), "python_draw": random.random()}
        with engine.train_mode():
            metrics = engine.train_batch(engine.shard_data(make_test_batch(seed=seed)))
        out.append({**metrics, **draws, "data_seed": seed, "global_step": engine.global_step})
    return out


def full_state(engine) -> dict:
    """:func:`_step_common.snapshot` plus the LR scheduler's state and this rank's RNG states
    (torch, numpy, python, and megatron's model-parallel RNG tracker). Collective."""
    state = snapshot(engine)
    state["scheduler"] = engine.scheduler.state_dict()
    state["rng"] = {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_state(),
        "python": random.getstate(),
        **_tracker_states(engine),
    }
    return state


def state_diff(a: dict, b: dict) -> list[str]:
    """What differs (bit for bit) between two :func:`full_state` results; empty when identical."""
    out = snapshot_diff(a, b)
    if a["scheduler"] != b["scheduler"]:
        out.append(f"scheduler state {a['scheduler']} vs {b['scheduler']}")
    ra, rb = a["rng"], b["rng"]
    if set(ra) != set(rb):
        out.append(f"RNG streams {sorted(ra)} vs {sorted(rb)}")
    for key in sorted(set(ra) & set(rb)):
        same = torch.equal(ra[key], rb[key]) if isinstance(ra[key], torch.Tensor) else ra[key] == rb[key]
        if not same:
            out.append(f"RNG state {key}")
    return out


def _numpy_state() -> tuple:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return (name, keys.tolist(), pos, has_gauss, cached)


def _tracker_states(engine) -> dict:
    if not type(engine).__module__.startswith("backends.megatron"):
        return {}
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {f"tracker:{name}": state.clone() for name, state in get_cuda_rng_tracker().get_states().items()}
