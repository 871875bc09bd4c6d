"""Megatron checkpoint contents: ``megatron.core.dist_checkpointing`` of the model chunks'
and the optimizer's sharded state dicts, plus per-rank ``extra_rank<r>.pt`` (scheduler, RNG
incl. megatron's tracker, step), inside the shared directory protocol of
``engine_api.ckpt_layout`` (temp dir, atomic rename, ``latest`` marker, retention, remote)."""

from __future__ import annotations

import queue

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from engine_api import ckpt_layout

# How the distributed optimizer lays its state out in a checkpoint. megatron-core 0.16's default
# ("fully_sharded_model_space", deprecated) raises "ShardedTensor.flattened_range is not
# supported" on save; "dp_reshardable" is what megatron's own training loop uses (resumable at
# the same TP/PP, any DP). Plain (non-distributed) optimizers ignore the key.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded(model_chunks, optimizer, is_loading: bool) -> dict:
    model_sd = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}
    merged = {k: v for sd in model_sd.values() for k, v in sd.items()}
    return {**model_sd, "optimizer": optimizer.sharded_state_dict(merged, is_loading=is_loading, metadata=dict(_OPTIMIZER_METADATA))}


def _results_in_process() -> None:
    """Make megatron's checkpoint writer report its results through an in-process queue.

    megatron-core creates that queue lazily with ``multiprocessing.get_context("spawn").Manager()``,
    which starts a helper process by re-running the user's ``__main__``: a script without an
    ``if __name__ == "__main__":`` guard crashes there (EOFError), and every process that saves
    keeps a ~270 MB manager alive. The engine saves synchronously (``execute_sync``: the writer
    function runs in this process and puts its results on the queue that this process then reads),
    so a plain ``queue.Queue`` carries them; the writer's worker processes are forked and report
    through their own queue. ``tests/launch`` saves from a script without the guard.
    """
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save(model_chunks, optimizer, extra: dict, root: str, step: int, keep: int | None, remote: str | None) -> str:
    """Save the sharded model + optimizer state and ``extra``. Collective."""
    _results_in_process()
    tmp = ckpt_layout.begin(root, step)
    dist_checkpointing.save(_sharded(model_chunks, optimizer, is_loading=False), tmp)
    ckpt_layout.save_extra(tmp, extra)
    return ckpt_layout.commit(root, step, keep, remote, {"backend": "megatron"})


def load(model_chunks, optimizer, local_path: str, remote: str | None, del_local_after_load: bool) -> dict:
    """Load in place; return this rank's ``extra``. Collective.

    ``local_path`` without a complete checkpoint: ``remote`` is downloaded into it first, and
    deleted after loading when ``del_local_after_load`` (else kept as a local checkpoint)."""
    path, downloaded = ckpt_layout.resolve(local_path, remote, keep_download=not del_local_after_load)
    _ensure_optimizer_state(optimizer)
    state = dist_checkpointing.load(_sharded(model_chunks, optimizer, is_loading=True), path)
    for i, chunk in enumerate(model_chunks):
        chunk.module.load_state_dict(state[f"model{i}"])
    steps = _loaded_steps(optimizer, state["optimizer"])
    with torch.no_grad():  # the distributed optimizer copies fp32 main params in place: views of params that require grad
        optimizer.load_state_dict(state["optimizer"])
    _restore_steps(optimizer, steps)
    extra = ckpt_layout.load_extra(path)
    ckpt_layout.finish_load(downloaded)
    return extra


# ----------------------------------------------------------------------------- distributed optimizer
# megatron-core 0.16 on CPU (no TE/Apex: torch Adam keeps a per-parameter ``step`` tensor) cannot
# resume a DistributedOptimizer in a fresh process as is; the helpers below fill the gaps.


def _distributed(optimizer, loaded: dict | None = None) -> list:
    """``(DistributedOptimizer, its part of the loaded optimizer state or None)`` pairs."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [None] * len(opts) if loaded is None else [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]
    return [(opt, part) for opt, part in zip(opts, parts, strict=True) if isinstance(opt, DistributedOptimizer)]


def _ensure_optimizer_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet its state tensors before the load:
    its ``state_dict`` (called to build the sharded state dict) reads the step from them and
    asserts there is one. megatron-core initialises them the same way for its FSDP path (one
    zero-gradient step); the load overwrites every value that step touched."""
    for opt, _ in _distributed(optimizer):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _loaded_steps(optimizer, loaded: dict) -> list:
    """The Adam step each distributed optimizer had when saved (kept in its param groups)."""
    out = []
    for _, part in _distributed(optimizer, loaded):
        steps = {g["step"] for g in part["optimizer"]["param_groups"] if "step" in g}
        out.append(steps.pop() if len(steps) == 1 else None)
    return out


def _restore_steps(optimizer, steps: list) -> None:
    """Give every parameter its own Adam step tensor holding the saved step.

    ``DistributedOptimizer.load_state_dict`` assigns one *shared* step tensor to every parameter
    (torch Adam then adds 1 to it once per parameter per step) and then copies into it the step
    the optimizer had in memory before the load (its ``dp_reshardable`` parameter state carries
    the step as a plain tensor, which dist_checkpointing does not read back): without this, a
    resumed run restarts Adam's bias correction from the wrong step.
    """
    for (opt, _), step in zip(_distributed(optimizer), steps, strict=True):
        if step is None:
            continue
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
