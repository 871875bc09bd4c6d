"""The checkpoint directory protocol shared by backends (what goes *in* a checkpoint is the
backend's business: DCP shards for FSDP, dist_checkpointing for megatron).

Layout under a checkpoint root::

    global_step_<k>/                    one complete checkpoint (+ enginekit.json)
    latest_checkpointed_iteration.txt   the newest complete step

:func:`begin` returns a temporary ``.tmp_global_step_<k>`` directory for every rank to write
into; :func:`commit` waits for all ranks, then rank 0 writes ``enginekit.json``, renames the
directory into place (atomic), replaces the ``latest`` marker atomically, applies retention and
uploads the optional remote copy. A crash before the rename leaves the previous checkpoint the
newest complete one. Retention never deletes the checkpoint just written.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"
PREFIX = "global_step_"
MARKER = "enginekit.json"


def begin(root: str, step: int) -> str:
    """Create a clean temporary directory for step ``step``; returns its path. Collective."""
    tmp = os.path.join(root, f".tmp_{PREFIX}{step}")
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()  # tmp exists and is empty before anyone writes into it
    return tmp


def commit(root: str, step: int, keep: int | None, remote: str | None, info: dict) -> str:
    """Publish the temporary directory of ``step`` as ``global_step_<step>``. Collective.

    ``remote`` (an fsspec URL) receives a copy of the checkpoint's contents; pass the same URL
    to :func:`resolve` to load it back.
    """
    tmp = os.path.join(root, f".tmp_{PREFIX}{step}")
    final = os.path.join(root, f"{PREFIX}{step}")
    dist.barrier()  # every rank's files are on disk
    if dist.get_rank() == 0:
        _write_atomic(os.path.join(tmp, MARKER), json.dumps({"global_step": step, "world_size": dist.get_world_size(), **info}))
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


def resolve(local_path: str, remote: str | None) -> tuple[str, str | None]:
    """The checkpoint directory to load, and a downloaded temp dir to delete afterwards (or None).

    ``local_path`` may be one checkpoint or a root (its ``latest`` marker, else its highest
    complete step). Without a local checkpoint, ``remote`` is downloaded (rank 0; others wait)
    into a temporary directory. Collective when downloading.
    """
    found = _find_local(local_path)
    if found is not None:
        return found, None
    if remote is None:
        raise FileNotFoundError(
            f"no complete checkpoint under {local_path!r}; fix: pass the directory given to save_checkpoint, or hdfs_path"
        )
    holder = [tempfile.mkdtemp(prefix="enginekit_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if dist.get_rank() == 0:
        _download(remote, holder[0])
    dist.barrier()
    return holder[0], holder[0]


def finish_load(downloaded: str | None, del_local_after_load: bool) -> None:
    """Delete a checkpoint :func:`resolve` downloaded, once every rank has read it. Collective."""
    dist.barrier()
    if downloaded and del_local_after_load and dist.get_rank() == 0:
        shutil.rmtree(downloaded, ignore_errors=True)


def make_extra(scheduler, global_step: int, **more) -> dict:
    """The per-rank resumable state every backend saves besides its sharded model/optimizer:
    LR scheduler, RNG states (torch, CUDA when present, numpy, python), the step, and ``more``."""
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return {"scheduler": scheduler.state_dict(), "rng": rng, "global_step": global_step, **more}


def apply_extra(extra: dict, scheduler) -> int:
    """Restore what :func:`make_extra` captured; returns the step."""
    scheduler.load_state_dict(extra["scheduler"])
    rng = extra["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return extra["global_step"]


def save_extra(directory: str, extra: dict) -> None:
    """This rank's small non-sharded state (scheduler, RNG, step) as ``extra_rank<r>.pt``."""
    torch.save(extra, os.path.join(directory, f"extra_rank{dist.get_rank()}.pt"))


def load_extra(directory: str) -> dict:
    """This rank's ``extra_rank<r>.pt`` of a checkpoint.

    Raises:
        ValueError: no file for this rank (the checkpoint was saved by a different world size).
    """
    path = os.path.join(directory, f"extra_rank{dist.get_rank()}.pt")
    if not os.path.exists(path):
        raise ValueError(
            f"{path} is missing: the checkpoint was saved with a different world size; fix: resume with the same number of ranks"
        )
    return torch.load(path, weights_only=False)


def step_dirs(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    names = [d for d in os.listdir(root) if d.startswith(PREFIX) and d[len(PREFIX) :].isdigit()]
    dirs = [os.path.join(root, d) for d in sorted(names, key=lambda d: int(d[len(PREFIX) :]))]
    return [d for d in dirs if os.path.exists(os.path.join(d, MARKER))]


def _find_local(path: str) -> str | None:
    if os.path.exists(os.path.join(path, MARKER)):
        return path
    marker = os.path.join(path, LATEST)
    if os.path.exists(marker):
        with open(marker) as f:
            candidate = os.path.join(path, f"{PREFIX}{f.read().strip()}")
        if os.path.exists(os.path.join(candidate, MARKER)):
            return candidate
    complete = step_dirs(path)
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
