"""Checkpoints on disk: ``tinker://`` paths, the layout under ``state_dir`` and the metadata files.

Layout::

    state_dir/<model_id>/run.json                       base model, LoRA config (written at create)
    state_dir/<model_id>/weights/<name>/                training state (run.save_state)
    state_dir/<model_id>/sampler_weights/<name>/        sampler weights (run.sampler(directory))
    .../<name>/tinker_checkpoint.json                   written last: a directory without it is
                                                        an incomplete save and is never served

A path names ``tinker://<model_id>/<weights|sampler_weights>/<name>``. Model ids and names are
checked against strict patterns before any path is built, and every directory is checked to lie
under ``state_dir`` after resolution, so no request can reach outside it. Metadata is plain JSON,
read with ``json.loads`` and checked field by field (nothing is unpickled or evaluated).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tinker_server import tenants
from tinker_server.contract import LoraIn, UserError

META_FILE = "tinker_checkpoint.json"
RUN_FILE = "run.json"
FORMAT = "enginekit-tinker/1"
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> SDK checkpoint_type

# Matched with fullmatch: "$" would also match before a trailing newline ("name\n").
_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}:train:[0-9]{1,9}$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def check_session_id(session_id: object, field: str) -> str:
    """``session_id`` if well formed, else a :class:`UserError` naming ``field``."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise UserError(f"{field}: {session_id!r} is not a session id (letters, digits, '_' and '-')")
    return session_id


def check_model_id(model_id: object, field: str) -> str:
    """``model_id`` if well formed (``<session_id>:train:<n>``), else a :class:`UserError`."""
    if not isinstance(model_id, str) or not _MODEL_ID.fullmatch(model_id):
        raise UserError(f"{field}: {model_id!r} is not a model id of this server (expected '<session_id>:train:<n>')")
    return model_id


def check_name(name: object, field: str) -> str:
    """A checkpoint name: letters, digits, ``.``, ``_``, ``-`` (no ``/``, no ``..``), at most 128 chars."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise UserError(
            f"{field}: {name!r} is not a valid checkpoint name; use 1-128 letters, digits, '.', '_' or '-' "
            "(no '/', no '..', not starting with '.')"
        )
    return name


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint: the model that wrote it, its kind (path segment) and its name."""

    model_id: str
    kind: str  # "weights" or "sampler_weights"
    name: str

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return KINDS[self.kind]


def parse_tinker_path(path: object, field: str) -> CheckpointRef:
    """``tinker://<model_id>/<weights|sampler_weights>/<name>`` -> :class:`CheckpointRef`."""
    prefix = "tinker://"
    if not isinstance(path, str) or not path.startswith(prefix):
        raise UserError(f"{field}: {path!r} is not a checkpoint path; expected 'tinker://<model_id>/weights/<name>'")
    parts = path[len(prefix) :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise UserError(
            f"{field}: {path!r} is not a checkpoint path; expected 'tinker://<model_id>/weights/<name>' "
            "or 'tinker://<model_id>/sampler_weights/<name>'"
        )
    return CheckpointRef(check_model_id(parts[0], field), parts[1], check_name(parts[2], field))


def lora_to_json(lora: LoraIn) -> dict:
    return asdict(lora)


def lora_from_json(data: object, where: str) -> LoraIn:
    """The LoRA config of a metadata file; a file that does not hold one is a server-side error."""
    if not isinstance(data, dict) or not isinstance(data.get("rank"), int):
        raise ValueError(f"{where}: no valid 'lora' entry")
    seed = data.get("seed")
    flags = {k: data.get(k, True) for k in ("train_mlp", "train_attn", "train_unembed")}
    if (seed is not None and not isinstance(seed, int)) or not all(isinstance(v, bool) for v in flags.values()):
        raise ValueError(f"{where}: invalid 'lora' entry {data!r}")
    return LoraIn(rank=data["rank"], seed=seed, **flags)


class CheckpointStore:
    """The checkpoints and run records under one root directory."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()

    def _inside(self, path: Path) -> Path:
        resolved = path.resolve()
        if resolved != self.root and self.root not in resolved.parents:
            # Unreachable with checked ids and names; kept as the last line of defence.
            raise UserError(f"path {path} is outside the server's state directory")
        return resolved

    def run_dir(self, model_id: str) -> Path:
        return self._inside(self.root / check_model_id(model_id, "model_id"))

    def directory(self, ref: CheckpointRef) -> Path:
        return self._inside(self.root / ref.model_id / ref.kind / ref.name)

    # ------------------------------------------------------------------ runs
    def write_run(self, model_id: str, base_model: str, lora: LoraIn, user_metadata: dict | None, owner: str = "") -> None:
        """Record a training run (so listings and weights-info answer after the run is gone);
        ``owner``: its tenant's tag (``tinker_server.tenants``; "" when keys are not separated)."""
        directory = self.run_dir(model_id)
        directory.mkdir(parents=True, exist_ok=True)
        record = {"format": FORMAT, "model_id": model_id, "base_model": base_model, "lora": lora_to_json(lora), "owner": owner}
        record.update(created=time.time(), user_metadata=_str_dict(user_metadata))
        _write_json(directory / RUN_FILE, record)

    def read_run(self, model_id: str) -> dict | None:
        """The run record of ``model_id`` (``None`` if there is none)."""
        path = self.run_dir(model_id) / RUN_FILE
        if not path.is_file():
            return None
        record = _read_json(path)
        if not isinstance(record.get("base_model"), str):
            raise ValueError(f"{path}: no 'base_model'")
        record["lora"] = lora_from_json(record.get("lora"), str(path))
        if not isinstance(record.get("owner", ""), str):
            raise ValueError(f"{path}: 'owner' is not a string")
        return record

    def owned_run(self, model_id: str) -> dict | None:
        """The run record of ``model_id`` if the current tenant may see it, else ``None`` (as if
        there were none)."""
        record = self.read_run(model_id)
        return record if record is not None and tenants.visible(record.get("owner")) else None

    def check_owned(self, ref: CheckpointRef, field: str) -> None:
        """A :class:`UserError` naming ``field``, as for a missing checkpoint, when ``ref``'s run
        belongs to another tenant."""
        if not tenants.visible((self.read_run(ref.model_id) or {}).get("owner")):
            raise UserError(f"{field}: checkpoint {ref.tinker_path} does not exist on this server")

    def list_runs(self) -> list[str]:
        """Model ids with a run record, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _MODEL_ID.fullmatch(p.name) and (p / RUN_FILE).is_file()]
        return [p.name for p in sorted(found, key=lambda p: (p / RUN_FILE).stat().st_mtime)]

    # ------------------------------------------------------------------ checkpoints
    def begin(self, ref: CheckpointRef, overwrite: bool) -> Path:
        """An empty directory to save ``ref`` into: a hidden sibling of its final place (an
        existing complete checkpoint is replaced only with ``overwrite``, and only by
        :meth:`commit`: a save that fails leaves the old one as it was)."""
        final = self.directory(ref)
        if (final / META_FILE).is_file() and not overwrite:
            raise UserError(f"path: checkpoint {ref.tinker_path} already exists; choose another name (or save_state(..., overwrite=True))")
        # Names never start with '.', so the sibling is neither listed nor reachable by a path.
        staging = self._inside(final.parent / f".{ref.name}.saving-{uuid.uuid4().hex[:8]}")
        staging.mkdir(parents=True)
        return staging

    def commit(
        self,
        ref: CheckpointRef,
        staging: Path,
        base_model: str,
        lora: LoraIn,
        *,
        with_optimizer: bool,
        user_metadata: dict | None,
        ttl_seconds: int | None,
    ) -> dict:
        """Write the metadata file (which marks the save complete) into ``staging``, then swap it
        into place: the old checkpoint of that name (if any) is moved aside first and deleted only
        once the new one is in place. Returns the metadata."""
        created = time.time()
        meta = {"format": FORMAT, "tinker_path": ref.tinker_path, "model_id": ref.model_id, "kind": ref.kind, "name": ref.name}
        meta.update(base_model=base_model, lora=lora_to_json(lora), with_optimizer=with_optimizer, created=created)
        meta.update(user_metadata=_str_dict(user_metadata), expires_at=created + ttl_seconds if ttl_seconds else None)
        _write_json(staging / META_FILE, meta)
        final = self.directory(ref)
        old = None
        if final.exists():
            old = final.parent / f".{ref.name}.replaced-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        try:
            os.replace(staging, final)
        except BaseException:
            if old is not None:
                os.replace(old, final)  # put the old one back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return meta

    def abort(self, staging: Path) -> None:
        """Remove a save that failed half way (the checkpoint it would have replaced is untouched)."""
        shutil.rmtree(staging, ignore_errors=True)

    def read(self, ref: CheckpointRef, field: str) -> dict:
        """The metadata of a complete checkpoint (a :class:`UserError` naming ``field`` if there is none)."""
        path = self.directory(ref) / META_FILE
        if not path.is_file():
            raise UserError(f"{field}: checkpoint {ref.tinker_path} does not exist on this server")
        meta = _read_json(path)
        if not isinstance(meta.get("base_model"), str):
            raise ValueError(f"{path}: no 'base_model'")
        meta["lora"] = lora_from_json(meta.get("lora"), str(path))
        return meta

    def stamp(self, ref: CheckpointRef, field: str) -> tuple[int, int, int]:
        """What identifies the complete checkpoint on disk now (its metadata file's inode, size and
        modification time: a new save of the name is a new file); a :class:`UserError` naming
        ``field`` if there is none (deleted)."""
        try:
            st = (self.directory(ref) / META_FILE).stat()
        except FileNotFoundError:
            raise UserError(f"{field}: checkpoint {ref.tinker_path} does not exist on this server (was it deleted?)") from None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def list(self, model_id: str) -> list[tuple[CheckpointRef, dict]]:
        """Complete checkpoints of ``model_id``, oldest first."""
        found = []
        for kind in KINDS:
            base = self.run_dir(model_id) / kind
            if not base.is_dir():
                continue
            for entry in base.iterdir():
                if _NAME.fullmatch(entry.name) and (entry / META_FILE).is_file():
                    ref = CheckpointRef(model_id, kind, entry.name)
                    found.append((ref, self.read(ref, "path")))
        return sorted(found, key=lambda item: item[1].get("created", 0.0))

    def delete(self, ref: CheckpointRef) -> None:
        """Delete a complete checkpoint (a :class:`UserError` if there is none)."""
        self.read(ref, "checkpoint_id")
        shutil.rmtree(self.directory(ref))

    def size_bytes(self, ref: CheckpointRef) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.directory(ref)):
            total += sum((Path(dirpath) / f).stat().st_size for f in files)
        return total


def _str_dict(data: dict | None) -> dict[str, str] | None:
    return None if data is None else {str(k): str(v) for k, v in data.items()}


def _write_json(path: Path, data: dict) -> None:
    # Write then rename: a reader never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data
