"""Megatron checkpoint contents: ``megatron.core.dist_checkpointing`` of the model chunks'
and the optimizer's sharded state dicts, plus per-rank ``extra_rank<r>.pt`` (scheduler, RNG
incl. megatron's tracker, step), inside the shared directory protocol of
``engine_api.ckpt_layout`` (temp dir, atomic rename, ``latest`` marker, retention, remote)."""

from __future__ import annotations

from megatron.core import dist_checkpointing

from engine_api import ckpt_layout


def _sharded(model_chunks, optimizer, is_loading: bool) -> dict:
    model_sd = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}
    merged = {k: v for sd in model_sd.values() for k, v in sd.items()}
    return {**model_sd, "optimizer": optimizer.sharded_state_dict(merged, is_loading=is_loading)}


def save(model_chunks, optimizer, extra: dict, root: str, step: int, keep: int | None, remote: str | None) -> str:
    """Save the sharded model + optimizer state and ``extra``. Collective."""
    tmp = ckpt_layout.begin(root, step)
    dist_checkpointing.save(_sharded(model_chunks, optimizer, is_loading=False), tmp)
    ckpt_layout.save_extra(tmp, extra)
    return ckpt_layout.commit(root, step, keep, remote, {"backend": "megatron"})


def load(model_chunks, optimizer, local_path: str, remote: str | None, del_local_after_load: bool) -> dict:
    """Load in place; return this rank's ``extra``. Collective."""
    path, downloaded = ckpt_layout.resolve(local_path, remote)
    state = dist_checkpointing.load(_sharded(model_chunks, optimizer, is_loading=True), path)
    for i, chunk in enumerate(model_chunks):
        chunk.module.load_state_dict(state[f"model{i}"])
    optimizer.load_state_dict(state["optimizer"])
    extra = ckpt_layout.load_extra(path)
    ckpt_layout.finish_load(downloaded, del_local_after_load)
    return extra
