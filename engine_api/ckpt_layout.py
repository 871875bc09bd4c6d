"""The checkpoint directory protocol shared by backends (what goes *in* a checkpoint is the
backend's business: DCP shards for FSDP, dist_checkpointing for megatron).

Layout under a checkpoint root (one training job writes a root)::

    global_step_<k>/                    one complete checkpoint: backend files, extra_rank<r>.pt,
                                        manifest.json (size + sha256 of every file), and
                                        enginekit.json (written last: the completeness proof)
    latest_checkpointed_iteration.txt   the step of the newest committed checkpoint
    .tmp_global_step_<k>/               a save in progress, or one that crashed: never loaded
    .tmp_download_*/                    a remote copy being downloaded: never loaded as such
    .del_global_step_<k>/               a checkpoint being deleted by retention: never loaded

Saving (collective): :func:`begin` removes the leftovers of crashed saves and creates an empty
``.tmp_global_step_<k>``; every rank writes its files into it; :func:`commit` waits for all
ranks and records every file in ``manifest.json`` (``engine_api.ckpt_integrity``; the ranks
share the hashing), then rank 0 (1) writes ``enginekit.json`` (which records the manifest's
sha256) into the temporary directory, (2) moves an
existing ``global_step_<k>`` aside (a re-save of the same step), (3) replaces the ``latest``
marker with ``k`` (write + fsync + rename), (4) renames the temporary directory to
``global_step_<k>`` (atomic: the checkpoint appears complete or not at all), (5) applies
retention by moving old checkpoints aside (atomic) before deleting them, never the one just
written, and (6) uploads the optional remote copy, ``enginekit.json`` last.

A failure of a backend's writer (a full disk) raises :class:`CheckpointError` naming the cause
and deletes the temporary directory (:func:`writing`). A ``global_step_<k>`` may be a symbolic
link (a checkpoint moved to another disk): it loads like a directory, and retention removes the
link, never its target. Whatever an interrupted delete leaves (a ``.del_*`` directory, file or
link, broken or not) is removed by the next :func:`begin` without following links; a retention
delete that fails after step (4) is reported on stderr, not as a failed save.

Loading resolves a root to: the checkpoint ``latest`` names, if it is complete; else the newest
complete checkpoint with a smaller step; without a readable marker, the newest complete one.
A directory is complete iff it holds ``enginekit.json``. ``latest`` is written before the
rename so that it never lags a visible checkpoint: a crash between (3) and (4) leaves it naming
a step that is not there, and the fallback finds the previous one. Trusting ``latest`` rather
than the highest step keeps a deliberate rollback (resume from an older step, save again) from
resurrecting the abandoned, higher-numbered branch.

So a crash (SIGKILL) anywhere before (4) leaves the previous checkpoint the one that loads, and
anywhere after (4) the new one; leftovers are ignored and cleaned by the next :func:`begin`
(``tests/reliability/test_checkpoint_crash.py`` kills a saving process at each step).

Loading verifies the resolved checkpoint against its manifest before any file is unpickled
(:func:`open_checkpoint`; ``engine_api.ckpt_integrity``), and reads the per-rank state with
``torch.load(weights_only=True)``: RNG states are stored as tensors and plain numbers.

Rank-0-only steps (commit, download) share their outcome with every rank: an error there
raises the same :class:`CheckpointError` on all ranks instead of leaving peers in a barrier.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
import uuid

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from engine_api.ckpt_integrity import CorruptCheckpointError, dcp_tensor_shapes, verify, write_manifest
from engine_api.dist import all_gather_objects, barrier, broadcast_object, group_rank, group_size

LATEST = "latest_checkpointed_iteration.txt"
PREFIX = "global_step_"
MARKER = "enginekit.json"
TMP = ".tmp_"
TRASH = ".del_"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (raised on every rank alike)."""


# ---------------------------------------------------------------------------------- save
def begin(root: str, step: int) -> str:
    """Clean leftovers of crashed saves under ``root`` and create an empty temporary directory
    for ``step``; returns its path. Collective."""
    tmp = os.path.join(root, f"{TMP}{PREFIX}{step}")

    def prepare() -> None:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.startswith((TMP, TRASH)):
                leftover = os.path.join(root, name)
                try:
                    _remove(leftover)
                except OSError as exc:
                    if leftover == tmp:  # in the way of this save
                        raise CheckpointError(
                            f"cannot delete {leftover}, left by an interrupted save ({type(exc).__name__}: {exc}); fix: delete it by hand"
                        ) from exc
                    # Never loaded: a leftover that will not go is no reason to refuse a save.
                    _warn(
                        f"cannot delete {leftover}, left by an interrupted save or delete ({type(exc).__name__}: {exc}); "
                        "it is never loaded; fix: delete it by hand to free its space"
                    )
        os.makedirs(tmp)

    _on_rank0(prepare, f"preparing {tmp}")
    return tmp


def commit(root: str, step: int, keep: int | None, remote: str | None, info: dict) -> str:
    """Publish the temporary directory of ``step`` as ``global_step_<step>`` (steps 1-6 of the
    module docstring). Collective; returns the checkpoint's path.

    Args:
        keep: keep at most this many complete checkpoints (None: all); never deletes this one.
        remote: optional fsspec URL that receives a copy of this checkpoint's contents; pass it
            to :func:`resolve` to load it back.
        info: backend facts recorded in ``enginekit.json``.
    """
    tmp = os.path.join(root, f"{TMP}{PREFIX}{step}")
    final = os.path.join(root, f"{PREFIX}{step}")
    barrier(None)  # every rank's files are written (and fsynced) before the manifest lists them
    with writing(tmp):
        manifest_sha256 = write_manifest(tmp, exclude=(MARKER,))  # collective; raises on every rank alike

    def publish() -> None:
        _write_marker(tmp, {"global_step": step, "world_size": group_size(None), "manifest_sha256": manifest_sha256, **info})
        if os.path.lexists(final):  # lexists: a broken symbolic link is in the way of the rename too
            _discard(final)
        _set_latest(root, step)
        _publish(tmp, final)
        if keep:
            try:
                _apply_retention(root, keep, final)
            except CheckpointError as exc:
                # The new checkpoint is published and loads: failing its save for an old one that
                # would not go would stop the run (and every restart) over housekeeping.
                _warn(f"checkpoint retention (keep {keep}): {exc}; {final} is saved")
        if remote:
            _upload(final, remote)

    _on_rank0(publish, f"committing {final}")
    return final


def save_extra(directory: str, extra: dict) -> None:
    """This rank's small non-sharded state (scheduler, RNG, step) as ``extra_rank<r>.pt``."""
    with open(os.path.join(directory, f"extra_rank{group_rank(None)}.pt"), "wb") as f:
        torch.save(extra, f)
        f.flush()
        os.fsync(f.fileno())  # durable before commit's marker vouches for it


# ---------------------------------------------------------------------------------- load
def resolve(local_path: str, remote: str | None, keep_download: bool = False) -> tuple[str, str | None]:
    """The checkpoint directory to load, and a downloaded directory to delete afterwards (or None).

    ``local_path`` may be one checkpoint or a root (resolved as the module docstring says).
    Without a complete local checkpoint, ``remote`` (one checkpoint's fsspec URL) is downloaded
    by rank 0 into ``local_path``: kept as a regular ``global_step_<k>`` there when
    ``keep_download``, else into a temporary directory that :func:`finish_load` deletes.
    Collective.

    Raises:
        FileNotFoundError: no complete local checkpoint and no ``remote``.
        CheckpointError: the remote copy is incomplete or cannot be read (on every rank).
    """
    found = latest_checkpoint(local_path)
    if found is not None:
        return found, None
    if remote is None:
        raise FileNotFoundError(
            f"no complete checkpoint under {local_path!r} (a complete one holds {MARKER}); "
            "fix: pass the directory given to save_checkpoint, or hdfs_path for a remote copy"
        )
    path = _on_rank0(lambda: _download_into(local_path, remote, keep_download), f"downloading {remote}")
    return path, (None if keep_download else path)


def finish_load(downloaded: str | None) -> None:
    """Delete a temporary download of :func:`resolve` once every rank has read it. Collective."""
    barrier(None)
    if downloaded and group_rank(None) == 0:
        shutil.rmtree(downloaded, ignore_errors=True)


def open_checkpoint(local_path: str, remote: str | None, keep_download: bool, hash_files: bool = True) -> tuple[str, str | None, dict]:
    """:func:`resolve` ``local_path`` (or download ``remote``), then verify the checkpoint
    against its manifest before anything in it is unpickled. Collective.

    Returns:
        ``(checkpoint directory, temporary download to delete after loading or None, the
        completion marker's contents)``.

    Raises:
        FileNotFoundError, CheckpointError: as :func:`resolve`.
        CorruptCheckpointError: verification failed (on every rank; nothing was loaded; a
            temporary download is deleted).
    """
    path, downloaded = resolve(local_path, remote, keep_download)
    try:
        info = verify(path, MARKER, hash_files)
    except CorruptCheckpointError:
        finish_load(downloaded)
        raise
    return path, downloaded, info


@contextlib.contextmanager
def reading(directory: str):
    """Turn any failure of a backend's loader inside the block into a :class:`CheckpointError`
    that names the checkpoint: torch DCP raises ``CheckpointException``, a ``BaseException``
    that ``except Exception`` does not catch, naming no file."""
    try:
        yield
    except CorruptCheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised with the checkpoint named
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"loading checkpoint {directory} failed ({type(exc).__name__}: {detail}); the engine's state may be partly "
            "loaded; fix: load an intact checkpoint (an earlier global_step_*) into this engine before training"
        ) from exc


@contextlib.contextmanager
def writing(tmp: str):
    """Turn any failure of a backend's writer inside the block (while it fills the temporary
    directory ``tmp`` of :func:`begin`) into a :class:`CheckpointError` naming the checkpoint and
    the cause, and delete the incomplete ``tmp``; the committed checkpoints are untouched (a save
    changes nothing outside ``tmp`` before :func:`commit`). torch DCP raises its
    ``CheckpointException`` (a ``BaseException`` that ``except Exception`` does not catch) with
    the real error, such as a full disk, buried in its per-rank failures."""
    try:
        yield
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised with the checkpoint named
        # Rank 0, which created ``tmp``, removes it; the other ranks leave it: a rank failing
        # alone (its disk full) must not delete the directory its peers are still writing, or
        # their errors would name a vanished file instead of the cause (they fail in commit's
        # barrier when it exits). What is left is never loaded and the next save's begin()
        # removes it. DCP fails all ranks together after their writes, rank 0 included.
        owner = group_rank(None) == 0
        if owner:
            shutil.rmtree(tmp, ignore_errors=True)
        root = os.path.dirname(tmp)
        left = "was removed" if owner else "is removed by rank 0 or the next save"
        raise CheckpointError(
            f"saving checkpoint {os.path.join(root, os.path.basename(tmp)[len(TMP) :])} failed: {_explain(exc, root)}; the "
            f"incomplete save ({tmp}) {left}, the checkpoints saved before are intact"
        ) from exc


def lora_mismatch(saved: dict, lora: dict) -> str | None:
    """Why a checkpoint written with LoRA settings ``saved`` (its ``enginekit.json`` ``lora``;
    empty: none) cannot load into an engine with ``lora`` (None: it can), naming each setting."""
    differ = [k for k in sorted(set(saved) | set(lora)) if saved.get(k) != lora.get(k)]
    if not differ:
        return None
    got = ", ".join(f"model.lora.{k} = {saved.get(k, 'off')!r} (this engine: {lora.get(k, 'off')!r})" for k in differ)
    return f"written with {got}; fix: build the engine with the checkpoint's LoRA settings"


def check_shapes(directory: str, model_shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse, before anything is loaded, a checkpoint of another model: compare the global shape
    of each of this model's tensors (``model_shapes``: checkpoint key -> shape, as this rank
    sees them) with the shape the checkpoint's DCP metadata records. Collective: the ranks'
    findings are pooled (pipeline stages hold different tensors), so all raise or none does.

    Raises:
        ValueError: naming each tensor with the checkpoint's and the model's shape (or missing
            from the checkpoint), saying the checkpoint is intact but of another model; the
            engine's state is untouched.
    """
    try:
        saved = dcp_tensor_shapes(directory)
    except ValueError:
        saved = None  # verified already; an unreadable index is left to the loader's own error
    problems = []
    for key, shape in model_shapes.items() if saved is not None else ():
        if key not in saved:
            problems.append(f"{key}: shape {list(shape)} in this model, absent from the checkpoint")
        elif tuple(saved[key]) != tuple(shape):
            problems.append(f"{key}: shape {list(saved[key])} in the checkpoint, {list(shape)} in this model")
    problems = sorted({p for part in all_gather_objects(problems, None) for p in part})
    if problems:
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        raise ValueError(
            f"checkpoint {directory} is of another model (it is intact, not corrupt): {len(problems)} tensor(s) of this "
            "engine's model do not match it:\n" + "\n".join(f"  - {p}" for p in shown) + "\nfix: build the engine from the "
            "model the checkpoint was trained from (model.path), or load a checkpoint of this model; nothing was loaded"
        )


def _explain(exc: BaseException, where: str) -> str:
    """What went wrong, in words, with the fix for the causes a user can act on (a full disk)."""
    cause = _os_error(exc)
    if cause is not None and cause.errno == errno.ENOSPC:
        return (
            f"no space left on device at {where}; fix: free space there or point the checkpoint directory elsewhere "
            "(save_checkpoint's local_path; the recipes: trainer.output_dir)"
        )
    if cause is not None and cause.errno is not None:
        at = cause.filename or where
        return f"{os.strerror(cause.errno).lower()} at {at} (OSError errno {cause.errno}: {cause})"
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {detail}"


def _os_error(exc: BaseException | None, depth: int = 0) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, one of a ``CheckpointException``'s per-rank
    failures, or a cause / context of either (bounded search)."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return exc
    nested = [pair[0] for pair in getattr(exc, "failures", {}).values()] if isinstance(exc, CheckpointException) else []
    for inner in [*nested, exc.__cause__, exc.__context__]:
        found = _os_error(inner, depth + 1)
        if found is not None:
            return found
    # megatron's writer processes report an OSError as text only ("Worker failure: [Errno 28] ...").
    text = re.search(r"\[Errno (\d+)\] ([^\n]*)", str(exc)) if not isinstance(exc, CheckpointException) else None
    return OSError(int(text.group(1)), text.group(2)) if text else None


def candidates(root: str) -> list[str]:
    """The complete checkpoints a resume from ``root`` may use, best first: the one
    :func:`latest_checkpoint` picks, then every complete one older than it, newest first
    (a recipe falls back along this list when a checkpoint fails verification)."""
    best = latest_checkpoint(root)
    if best is None:
        return []
    if os.path.normpath(best) == os.path.normpath(root):
        return [best]
    step = int(os.path.basename(best)[len(PREFIX) :])
    return [best] + [os.path.join(root, f"{PREFIX}{s}") for s in reversed(complete_steps(root)) if s < step]


def load_extra(directory: str, info: dict) -> dict:
    """This rank's per-rank state (``extra_rank<r>.pt``) of a verified checkpoint, loaded with
    ``weights_only=True``.

    Saved with the world size of this run: this rank's own file (exact resume). Saved with a
    different world size (a data-parallel resize; the backend checked that its model-parallel
    layout allows it): rank 0's file, whose scheduler state and step every rank shares, with
    ``rng`` set to None: :func:`apply_extra` then derives fresh RNG streams for this rank.

    Raises:
        CorruptCheckpointError: the file is missing or unreadable (naming it).
    """
    saved = int(info.get("world_size", group_size(None)))
    resized = saved != group_size(None)
    path = os.path.join(directory, f"extra_rank{0 if resized else group_rank(None)}.pt")
    try:
        extra = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing although the checkpoint records world size {saved}; fix: load an intact checkpoint"
        ) from None
    except Exception as exc:  # noqa: BLE001 - verified files rarely fail; name the file when one does
        raise CorruptCheckpointError(f"{path} is unreadable ({type(exc).__name__}: {exc}); fix: load an intact checkpoint") from None
    if resized:
        extra = {**extra, "rng": None, "resized_from": saved}
    return extra


# ---------------------------------------------------------------------------------- per-rank state
def make_extra(scheduler, global_step: int, **more) -> dict:
    """The per-rank resumable state every backend saves besides its sharded model/optimizer:
    LR scheduler, RNG states (torch, CUDA when present, numpy, python), the step, and ``more``.
    Everything is a tensor or plain data, so it loads with ``weights_only=True``."""
    rng = {"torch": torch.get_rng_state(), "numpy": _numpy_to_plain(np.random.get_state()), "python": _python_to_plain(random.getstate())}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return {"scheduler": scheduler.state_dict(), "rng": rng, "global_step": global_step, **more}


def apply_extra(extra: dict, scheduler, seed: int, stream: int | None = None) -> int:
    """Restore what :func:`make_extra` captured; returns the step.

    After a world-size change (``extra["rng"] is None``, see :func:`load_extra`) the torch,
    CUDA, numpy and python RNGs of this rank are seeded from ``(seed, step, stream)``
    (:func:`derived_seed`) instead: each stream is reproducible, and the run is not
    bit-identical to one at the old size (it cannot be: the data is split differently).

    Args:
        stream: which RNG stream this rank draws (default: its global rank). Ranks that must
            draw alike (tensor-parallel peers) pass the same stream.
    """
    scheduler.load_state_dict(extra["scheduler"])
    step = int(extra["global_step"])
    rng = extra["rng"]
    if rng is None:
        derived = derived_seed(seed, step, group_rank(None) if stream is None else stream)
        torch.manual_seed(derived)  # also seeds CUDA
        np.random.seed(derived % 2**32)
        random.seed(derived)
        if group_rank(None) == 0:
            print(
                f"[enginekit] resumed step {step}, saved on {extra['resized_from']} rank(s), on {group_size(None)}: model, "
                f"optimizer, scheduler and step restored; RNG streams re-derived from (seed={seed}, step={step}, rank's stream)",
                file=sys.stderr,
                flush=True,
            )
        return step
    torch.set_rng_state(rng["torch"])
    np.random.set_state(_numpy_from_plain(rng["numpy"]))
    random.setstate(_python_from_plain(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return step


def derived_seed(seed: int, step: int, stream: int) -> int:
    """The seed of RNG stream ``stream`` after a resize: a hash of ``(seed, step, stream)`` in [0, 2**31)."""
    digest = hashlib.sha256(f"{seed}/{step}/{stream}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def _numpy_to_plain(state: tuple) -> dict:
    name, keys, pos, has_gauss, cached = state
    return {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


def _numpy_from_plain(state: dict) -> tuple:
    return (state["name"], state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"], state["cached"])


def _python_to_plain(state: tuple) -> dict:
    version, internal, gauss_next = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next}


def _python_from_plain(state: dict) -> tuple:
    return (state["version"], tuple(int(x) for x in state["internal"].tolist()), state["gauss_next"])


# ---------------------------------------------------------------------------------- resolution
def step_dirs(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest (smallest step) first."""
    return [os.path.join(root, f"{PREFIX}{s}") for s in complete_steps(root)]


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending (e.g. to find the newest step
    that two roles' roots both hold)."""
    if not os.path.isdir(root):
        return []
    steps = sorted(int(d[len(PREFIX) :]) for d in os.listdir(root) if d.startswith(PREFIX) and d[len(PREFIX) :].isdigit())
    return [s for s in steps if _is_complete(os.path.join(root, f"{PREFIX}{s}"))]


def latest_checkpoint(path: str) -> str | None:
    """The complete checkpoint ``path`` means (itself, or under a root; see the module
    docstring), or None when there is none."""
    if _is_complete(path):
        return path
    steps = complete_steps(path)
    if not steps:
        return None
    latest = _read_latest(path)
    if latest is not None:
        if latest in steps:
            return os.path.join(path, f"{PREFIX}{latest}")
        older = [s for s in steps if s < latest]
        if older:  # `latest` names a checkpoint whose rename never happened (crash)
            return os.path.join(path, f"{PREFIX}{older[-1]}")
    return os.path.join(path, f"{PREFIX}{steps[-1]}")


def _is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MARKER))


def _read_latest(root: str) -> int | None:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------- commit steps
# One function per step, so a test can stop a saving process between any two of them.
def _write_marker(tmp: str, info: dict) -> None:
    _write_atomic(os.path.join(tmp, MARKER), json.dumps(info))


def _set_latest(root: str, step: int) -> None:
    _write_atomic(os.path.join(root, LATEST), str(step))


def _publish(tmp: str, final: str) -> None:
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final))  # the rename itself survives a power loss


def _apply_retention(root: str, keep: int, final: str) -> None:
    """Delete the oldest complete checkpoints beyond ``keep``; ``final`` (just written) is never
    one of them, whatever its step; incomplete directories are neither counted nor touched. A
    ``global_step_<k>`` that is a symbolic link (a checkpoint moved to another disk and linked
    back) counts like any other, and retention removes the link only, never what it points to."""
    others = [d for d in step_dirs(root) if d != final]
    for old in others[: max(0, len(others) - (keep - 1))]:
        _discard(old)


def _discard(directory: str) -> None:
    """Remove a checkpoint so that it is never seen half-deleted: an atomic rename out of the
    ``global_step_*`` namespace first, then the slow delete (a symbolic link is renamed and
    unlinked as a link: the data it points to is kept).

    Raises:
        CheckpointError: naming ``directory`` (and where it was moved), not only the ``.del_*``
            name the user never created.
    """
    trash = os.path.join(os.path.dirname(directory), f"{TRASH}{os.path.basename(directory)}")
    try:
        _remove(trash)
        os.replace(directory, trash)  # renames a symbolic link itself, never its target
    except OSError as exc:
        raise CheckpointError(
            f"cannot delete checkpoint {directory} ({type(exc).__name__}: {exc}); fix: check the permissions of "
            f"{os.path.dirname(directory)}, or delete {directory} by hand"
        ) from exc
    try:
        _remove(trash)
    except OSError as exc:
        raise CheckpointError(
            f"cannot delete checkpoint {directory}, moved aside to {trash} ({type(exc).__name__}: {exc}); it is no longer "
            f"loaded, and the next save retries the delete; fix: check the permissions of {trash}"
        ) from exc


def _remove(path: str) -> None:
    """Delete ``path`` whatever it is: a directory tree, a file, or a symbolic link (broken or
    not), which is unlinked without following it: a leftover of an interrupted delete must
    never block the next save, and data outside the checkpoint root is never touched."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _warn(message: str) -> None:
    print(f"!!! [enginekit] {message}", file=sys.stderr, flush=True)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_rank0(fn, what: str):
    """Run ``fn`` on rank 0 and give its result to every rank; an exception on rank 0 raises
    :class:`CheckpointError` everywhere (peers would otherwise wait in the next collective)."""
    outcome: tuple[bool, object] = (True, None)
    if group_rank(None) == 0:
        try:
            outcome = (True, fn())
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            cause = _os_error(exc)
            # A full disk gets its fix spelled out; ``what`` ends with the path being written.
            hint = f"; {_explain(cause, what.split(' ', 1)[-1])}" if cause is not None and cause.errno == errno.ENOSPC else ""
            outcome = (False, f"{type(exc).__name__}: {exc}{hint}")
    ok, value = broadcast_object(outcome, src=0, group=None)
    if not ok:
        raise CheckpointError(f"rank 0 failed {what}: {value}")
    return value


# ---------------------------------------------------------------------------------- remote copy
def _upload(local_dir: str, remote: str) -> None:
    """Copy a checkpoint's files to ``remote``, ``enginekit.json`` last, so a copy cut short is
    recognisably incomplete (a stale marker from an earlier upload is removed first)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(remote)
    root = root.rstrip("/")
    if fs.exists(f"{root}/{MARKER}"):
        fs.rm(f"{root}/{MARKER}")
    fs.makedirs(root, exist_ok=True)
    for name in sorted(os.listdir(local_dir)):
        src = os.path.join(local_dir, name)
        if name == MARKER:
            continue
        if os.path.isdir(src):
            fs.put(f"{src}/", f"{root}/{name}/", recursive=True)
        else:
            fs.put_file(src, f"{root}/{name}")
    _upload_marker(fs, local_dir, root)


def _upload_marker(fs, local_dir: str, root: str) -> None:
    fs.put_file(os.path.join(local_dir, MARKER), f"{root}/{MARKER}")


def _download_into(local_root: str, remote: str, keep: bool) -> str:
    """Rank 0: download ``remote`` under ``local_root``; a kept copy is published like a save."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(remote)
    root = root.rstrip("/")
    if not fs.exists(f"{root}/{MARKER}"):
        raise CheckpointError(
            f"remote checkpoint {remote!r} has no {MARKER}: it is missing or its upload did not finish; "
            "fix: point hdfs_path at a complete copy (save_checkpoint uploads the marker last)"
        )
    os.makedirs(local_root, exist_ok=True)
    tmp = os.path.join(local_root, f"{TMP}download_{uuid.uuid4().hex[:8]}")
    fs.get(f"{root}/", f"{tmp}/", recursive=True)
    if not keep:
        return tmp
    with open(os.path.join(tmp, MARKER)) as f:
        step = int(json.load(f)["global_step"])
    final = os.path.join(local_root, f"{PREFIX}{step}")
    if os.path.lexists(final):
        _discard(final)
    _set_latest(local_root, step)
    _publish(tmp, final)
    return final
