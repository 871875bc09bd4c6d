"""Checkpoint integrity: a manifest of every file a save wrote, verified before a load reads
anything, and deserialization that cannot run code.

Two independent layers (``docs/checkpoints.md``):

1. **Manifest** (``manifest.json``, written after every rank's files and before the completion
   marker, which records the manifest's own sha256): the relative path, size and sha256 of
   every file of the checkpoint. :func:`verify` refuses, before any byte is unpickled, a
   checkpoint with a missing, extra, resized or (with ``hash=True``) altered file, naming it.
   This catches truncation, zero-length files, flipped bits and NaN bytes written over a
   shard: any change made after the save.
2. **Safe deserialization**, which holds even against a forged manifest or with hashing off:
   every file a loader unpickles is first parsed without the power to run code. torch
   checkpoint files (``*.pt``) and the pickled objects inside DCP shards load with
   ``torch.load(weights_only=True)``; DCP's ``.metadata`` (which torch reads with plain
   ``pickle.load``) is parsed by an unpickler that builds only the classes DCP writes there.
   A file that needs anything else is refused.

Hashing and scanning are split over the ranks (file ``i`` goes to rank ``i % world``) and the
outcome is agreed, so every rank raises the same :class:`CorruptCheckpointError` or none does.
Assumption: every rank sees the checkpoint directory (a shared filesystem), as the directory
protocol of ``engine_api.ckpt_layout`` already requires.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import warnings

import torch

from engine_api.dist import all_gather_objects, broadcast_object, group_rank, group_size

MANIFEST = "manifest.json"
_CHUNK = 8 << 20  # bytes hashed per read
# Classes torch.distributed.checkpoint pickles into ``.metadata`` (torch 2.13, megatron-core 0.16):
# the metadata dataclasses, the storage index of the filesystem writer, save plans, and the torch
# values they hold. All are plain records: building them runs no user-chosen code.
_DCP_METADATA_CLASSES = (
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        # megatron-core's writer also keeps every rank's save plan in the metadata (plan caching).
        ("torch.distributed.checkpoint.planner", name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData", "LoadItemType")
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class CorruptCheckpointError(ValueError):
    """A checkpoint failed verification: a file is missing, extra, altered, truncated, or holds
    something that is not plain data. Raised on every rank, before any state was loaded."""


# ---------------------------------------------------------------------------------- save side
def write_manifest(directory: str, exclude: tuple[str, ...] = ()) -> str:
    """Hash every file under ``directory`` (all ranks share the work) and write ``manifest.json``
    on rank 0; returns the manifest's sha256 (for the completion marker). Collective; call it
    after every rank's files are written and before the marker.

    Args:
        exclude: file names written later (the marker), left out of the manifest.
    """
    files = [f for f in _files(directory) if f not in (MANIFEST, *exclude)]
    try:
        mine: dict | str = {rel: _describe(os.path.join(directory, rel)) for rel in files[group_rank(None) :: group_size(None)]}
    except OSError as exc:  # reported on every rank below, instead of leaving peers in the gather
        mine = f"rank {group_rank(None)}: {type(exc).__name__}: {exc}"
    entries: dict = {}
    for part in all_gather_objects(mine, None):
        if isinstance(part, str):
            raise OSError(f"hashing the files of {directory} failed: {part}")
        entries.update(part)
    text = json.dumps({"version": 1, "files": {k: entries[k] for k in sorted(entries)}}, indent=1)
    failed = None
    if group_rank(None) == 0:
        tmp = os.path.join(directory, f"{MANIFEST}.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(directory, MANIFEST))
        except OSError as exc:  # shared below (a full disk), instead of leaving peers in the next collective
            failed = (exc.errno, exc.strerror or str(exc), tmp)
    failed = broadcast_object(failed, src=0, group=None)
    if failed is not None:
        raise OSError(*failed)
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------- load side
def verify(directory: str, marker: str, hash_files: bool) -> dict:
    """Check the checkpoint in ``directory`` against its manifest and scan every file that a
    loader unpickles; return the completion marker's contents. Collective.

    Args:
        marker: the completion marker's file name (JSON, records ``manifest_sha256``).
        hash_files: compare sha256 of every file (reads every byte; ``checkpoint.verify``);
            False checks names and sizes only. The scan for code runs either way.

    Raises:
        CorruptCheckpointError: on every rank, naming each bad file, the checkpoint and the fix.
    """
    # Rank 0 reads the two small JSON files and lists the directory; every rank gets the result.
    index = broadcast_object(_read_index_safely(directory, marker, hash_files) if group_rank(None) == 0 else None, src=0, group=None)
    problems = list(index["problems"])
    files = sorted(index["files"]) if not problems else []
    for rel in files[group_rank(None) :: group_size(None)]:
        problem = _check_file(directory, rel, index["files"][rel], hash_files)
        if problem:
            problems.append(problem)
    problems = sorted({p for part in all_gather_objects(problems, None) for p in part})
    if problems:
        raise CorruptCheckpointError(
            f"checkpoint {directory} failed verification ({len(problems)} problem(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nfix: load an intact checkpoint (an earlier global_step_*, or the remote copy); nothing was loaded"
        )
    return index["marker"]


def _read_index_safely(directory: str, marker: str, hash_files: bool) -> dict:
    try:
        return _read_index(directory, marker, hash_files)
    except Exception as exc:  # noqa: BLE001 - peers wait in the broadcast: report, never leave them
        return {"marker": {}, "files": {}, "problems": [f"{directory}: cannot be read ({type(exc).__name__}: {exc})"]}


def _read_index(directory: str, marker: str, hash_files: bool) -> dict:
    """The marker, the manifest's entries (file -> size and sha256, or None where there is no
    manifest to compare with), and what is wrong with them or the listing."""
    out: dict = {"marker": {}, "files": {}, "problems": []}
    try:
        with open(os.path.join(directory, marker), "rb") as f:
            out["marker"] = json.loads(f.read())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        out["problems"].append(f"{marker}: unreadable completion marker ({type(exc).__name__})")
        return out
    if not isinstance(out["marker"], dict):
        out["problems"].append(f"{marker}: not a completion marker (a JSON object)")
        return out
    expected = out["marker"].get("manifest_sha256")
    if expected is None:
        if hash_files:
            out["problems"].append(
                f"{MANIFEST}: the marker records no manifest (a checkpoint from before manifests); to load it anyway set "
                "engine.checkpoint.verify=false (names, sizes and hashes unchecked, the scan for code still runs), then save again"
            )
        else:  # no manifest to compare with: scan every file for code, check nothing else
            out["files"] = {rel: None for rel in _files(directory) if rel != marker}
        return out
    try:
        with open(os.path.join(directory, MANIFEST), "rb") as f:
            raw = f.read()
    except OSError:
        out["problems"].append(f"{MANIFEST}: missing")
        return out
    if hashlib.sha256(raw).hexdigest() != expected:
        out["problems"].append(f"{MANIFEST}: its sha256 differs from the one {marker} recorded (the manifest was altered)")
        return out
    out["files"] = json.loads(raw)["files"]
    present = set(_files(directory)) - {MANIFEST, marker}
    for rel in sorted(set(out["files"]) - present):
        out["problems"].append(f"{rel}: listed in {MANIFEST} but missing")
    for rel in sorted(present - set(out["files"])):
        out["problems"].append(f"{rel}: not written by the save (absent from {MANIFEST})")
    return out


def _check_file(directory: str, rel: str, entry: dict | None, hash_files: bool) -> str | None:
    path = os.path.join(directory, rel)
    try:
        size = os.path.getsize(path)
    except OSError:
        return f"{rel}: missing"
    if entry is None:
        pass  # no manifest (see _read_index): only the scan below
    elif size != entry["size"]:
        kind = "empty" if size == 0 else "truncated" if size < entry["size"] else "grown"
        return f"{rel}: {kind}, {size} bytes where the save wrote {entry['size']}"
    elif hash_files and _sha256(path) != entry["sha256"]:
        return f"{rel}: its contents differ from what the save wrote (sha256 mismatch)"
    try:
        scan(path)
    except Exception as exc:  # noqa: BLE001 - any failure to parse safely refuses the file
        return f"{rel}: {exc}"
    return None


def scan(path: str) -> None:
    """Parse the pickles in ``path`` without the power to run code (see the module docstring).

    ``*.pt``: ``torch.load(weights_only=True)``; DCP ``.metadata``: the restricted unpickler, then
    every pickled object it indexes in the shards with ``weights_only=True``; other files
    (JSON, raw tensor shards read with ``weights_only=True`` by torch itself) need no scan.

    Raises:
        ValueError: the file is not plain data (naming what it asked for) or cannot be parsed.
    """
    name = os.path.basename(path)
    if name.endswith(".pt"):
        _weights_only(None, lambda: open(path, "rb"))
    elif name.endswith(".metadata"):
        metadata = _load_dcp_metadata(path)
        _scan_dcp_objects(os.path.dirname(path), metadata)


def dcp_tensor_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor of the DCP checkpoint in ``directory`` (``.metadata``,
    parsed by the restricted unpickler: no code runs), by DCP key (e.g. ``model.<fqn>``).

    Raises:
        ValueError: the metadata is missing or unreadable.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(directory, ".metadata")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing")
    metadata = _load_dcp_metadata(path)
    entries = getattr(metadata, "state_dict_metadata", {})
    return {key: tuple(meta.size) for key, meta in entries.items() if isinstance(meta, TensorStorageMetadata)}


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"asks for {module}.{name}, which DCP metadata never holds (refused: it could run code)")


def _load_dcp_metadata(path: str):
    try:
        with open(path, "rb") as f:
            return _DCPMetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise ValueError(f"DCP metadata {exc}") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise ValueError(f"unreadable DCP metadata ({type(exc).__name__}: {exc})") from None


def _scan_dcp_objects(directory: str, metadata) -> None:
    """Load every non-tensor object of a DCP checkpoint (``BytesStorageMetadata`` items, which
    torch's default planner reads with ``weights_only=False``) with ``weights_only=True``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in getattr(metadata, "storage_data", {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        shard = os.path.join(directory, str(info.relative_path))
        with open(shard, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        _weights_only(f"{info.relative_path}[{index.fqn}]", lambda data=data: io.BytesIO(data))


def _weights_only(what: str | None, open_fn) -> None:
    """``torch.load(weights_only=True)`` of what ``open_fn`` opens; ``what`` names an object
    inside a larger file in the error."""
    where = f"{what}: " if what else ""
    try:
        with open_fn() as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about the pickle protocol of foreign files
            torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{where}not plain tensor data ({_weights_only_reason(exc)}); refused: loading it could run code") from None
    except Exception as exc:  # noqa: BLE001 - truncated zips, bad headers, ...
        raise ValueError(f"{where}unreadable ({type(exc).__name__}: {_first_line(exc)})") from None


def _weights_only_reason(exc: BaseException) -> str:
    """The line of torch's weights-only error that says what was refused (not its advice)."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.strip().startswith(boilerplate)]
    return " ".join(lines) or "refused by torch's weights-only unpickler"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------------------------- helpers
def _files(directory: str) -> list[str]:
    """Every regular file under ``directory``, as sorted relative paths."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            out.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(out)


def _describe(path: str) -> dict:
    return {"size": os.path.getsize(path), "sha256": _sha256(path)}


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
