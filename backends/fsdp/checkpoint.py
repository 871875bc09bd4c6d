"""Resumable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout under a checkpoint root::

    global_step_<k>/            DCP shards of {"model", "optimizer"} + .metadata
        extra_rank<r>.pt        per-rank scheduler state, RNG states, step
    latest_checkpointed_iteration.txt   the newest complete step

A checkpoint is written to ``.tmp_global_step_<k>`` and renamed into place by rank 0 only
after every rank finished writing, and the ``latest`` marker is replaced atomically after
that, so a crash mid-save leaves the previous checkpoint as the newest complete one.
Retention never deletes the checkpoint just written.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

LATEST = "latest_checkpointed_iteration.txt"
PREFIX = "global_step_"


def save(model, optimizer, extra: dict, root: str, step: int, keep: int | None, remote: str | None) -> str:
    """Save model + optimizer (sharded, DCP) and ``extra`` (per rank). Collective.

    ``remote`` (an fsspec URL) receives a copy of this checkpoint's directory contents; pass
    the same URL to :func:`resolve` to load it back.
    """
    rank = dist.get_rank()
    final = os.path.join(root, f"{PREFIX}{step}")
    tmp = os.path.join(root, f".tmp_{PREFIX}{step}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()  # tmp is clean before anyone writes into it
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
    torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    dist.barrier()  # every rank's shards and extra state are on disk
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(os.path.join(root, LATEST), str(step))
        if keep:
            for old in step_dirs(root)[:-keep]:
                shutil.rmtree(old)
        if remote:
            _upload(final, remote)
    dist.barrier()  # nobody returns before the checkpoint is visible
    return final


def load(model, optimizer, path: str) -> dict:
    """Load into ``model``/``optimizer`` in place and return this rank's ``extra``. Collective."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    extra_path = os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
    if not os.path.exists(extra_path):
        raise ValueError(
            f"{extra_path} is missing: the checkpoint was saved with a different world size; fix: resume with the same number of ranks"
        )
    return torch.load(extra_path, weights_only=False)


def resolve(local_path: str, remote: str | None) -> tuple[str, str | None]:
    """The checkpoint directory to load, and a downloaded temp dir to delete afterwards (or None).

    ``local_path`` may be one checkpoint or a root (its ``latest`` marker, else its highest
    complete step). Without a local checkpoint, ``remote`` (an fsspec URL of one checkpoint)
    is downloaded (rank 0; others wait) into a temporary directory.
    """
    found = _find_local(local_path)
    if found is not None:
        return found, None
    if remote is None:
        raise FileNotFoundError(f"no checkpoint under {local_path!r}; fix: pass the directory given to save_checkpoint, or hdfs_path")
    holder = [tempfile.mkdtemp(prefix="enginekit_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if dist.get_rank() == 0:
        _download(remote, holder[0])
    dist.barrier()
    return holder[0], holder[0]


def step_dirs(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    names = [d for d in os.listdir(root) if d.startswith(PREFIX) and d[len(PREFIX) :].isdigit()]
    return [os.path.join(root, d) for d in sorted(names, key=lambda d: int(d[len(PREFIX) :]))]


def _find_local(path: str) -> str | None:
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    marker = os.path.join(path, LATEST)
    if os.path.exists(marker):
        with open(marker) as f:
            candidate = os.path.join(path, f"{PREFIX}{f.read().strip()}")
        if os.path.exists(os.path.join(candidate, ".metadata")):
            return candidate
    complete = [d for d in step_dirs(path) if os.path.exists(os.path.join(d, ".metadata"))]
    return complete[-1] if complete else None


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _upload(local_dir: str, remote: str) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(remote)
    fs.makedirs(root, exist_ok=True)
    fs.put(f"{local_dir}/", f"{root.rstrip('/')}/", recursive=True)


def _download(remote: str, local_dir: str) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(remote)
    fs.get(f"{root.rstrip('/')}/", f"{local_dir}/", recursive=True)
