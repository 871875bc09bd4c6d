"""Checkpoints on disk: the layout under ``state_dir`` and the metadata files (the ``tinker://``
paths and ids they are named by: ``tinker_server.ids``).

Layout::

    state_dir/<model_id>/run.json                       base model, LoRA config (written at create)
    state_dir/<model_id>/weights/<name>/                training state (run.save_state)
    state_dir/<model_id>/sampler_weights/<name>/        sampler weights (run.sampler(directory))
    .../<name>/tinker_checkpoint.json                   written last: a directory without it is
                                                        an incomplete save and is never served

A save is written into a hidden staging sibling (``.<name>.saving-<hex>``) and swapped into place
(an overwritten checkpoint is moved aside to ``.<name>.replaced-<hex>`` until the new one is in
place). A server killed mid-save leaves such siblings behind: :meth:`CheckpointStore.clean_staging`
removes them when the server starts (and puts back a moved-aside checkpoint whose replacement never
arrived).

Model ids and names are checked against strict patterns before any path is built
(``tinker_server.ids``), and every directory is checked to lie under ``state_dir`` after
resolution, so no request can reach outside it. Metadata is plain JSON,
read with ``json.loads`` and checked field by field (nothing is unpickled or evaluated).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from tinker_server import tenants
from tinker_server.contract import LoraIn, UserError
from tinker_server.ids import KINDS, MODEL_ID, NAME, CheckpointRef, check_model_id

META_FILE = "tinker_checkpoint.json"
RUN_FILE = "run.json"
FORMAT = "enginekit-tinker/1"
# What CheckpointStore.begin / commit leave beside a checkpoint while a save is in flight.
_STAGING = re.compile(r"^\.(?P<name>[A-Za-z0-9_][A-Za-z0-9._-]{0,127})\.(?P<what>saving|replaced)-[0-9a-f]{8}$")

log = logging.getLogger(__name__)


def lora_to_json(lora: LoraIn) -> dict:
    """The LoRA config as a metadata file holds it (read back by :func:`lora_from_json`)."""
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
    """The checkpoints and run records under one root directory.

    ``ownerless_owner``: the owner tag that run records without an owner belong to
    (``server.ownerless_runs_owner``; "": none, so with tenants enforced they belong to no key)."""

    def __init__(self, root: Path, ownerless_owner: str = ""):
        self.root = Path(root).resolve()
        self.ownerless_owner = ownerless_owner
        self._warned: set[tuple[str, str]] = set()

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
    def write_run(self, model_id: str, base_model: str, lora: LoraIn, user_metadata: dict | None, owner: str) -> None:
        """Record a training run (so listings and weights-info answer after the run is gone);
        ``owner``: the tag of the key that created it (``tinker_server.tenants``), recorded whether
        or not tenants are enforced now."""
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

    def owner(self, record: dict) -> str:
        """The owner tag of a run record: its own, or ``ownerless_owner`` for a record without one."""
        return record.get("owner") or self.ownerless_owner

    def refuse_ownerless(self, model_id: str, field: str) -> None:
        """With tenants enforced, a run record without an owner belongs to no key: refused by name."""
        raise UserError(
            f"{field}: training run {model_id} has a run record without an owner ({self.root / model_id / RUN_FILE}: "
            "written by a server before owners were always recorded); with several API keys such a record belongs to no key "
            "until the operator assigns it; fix: the server's operator sets server.ownerless_runs_owner to the API key it "
            "belongs to"
        )

    def owned_run(self, model_id: str, field: str = "training_run_id") -> dict | None:
        """The run record of ``model_id`` if the current tenant may see it, else ``None`` (as if
        there were none). A record without an owner, with tenants enforced and no
        ``ownerless_owner``: a :class:`UserError` naming ``field`` and the setting."""
        record = self.read_run(model_id)
        if record is None:
            return None
        owner = self.owner(record)
        if not owner and tenants.is_enforced():
            self.refuse_ownerless(model_id, field)
        return record if tenants.visible(owner) else None

    def check_owned(self, ref: CheckpointRef, field: str) -> None:
        """A :class:`UserError` naming ``field``, as for a missing checkpoint, when ``ref``'s run
        belongs to another tenant (or, refused by name, to no key: :meth:`owned_run`)."""
        if self.read_run(ref.model_id) is None:
            if tenants.is_enforced() and (self.directory(ref) / META_FILE).is_file():
                self.refuse_ownerless(ref.model_id, field)  # a checkpoint whose run record is gone
            return  # nothing there: the caller's read says it does not exist
        if self.owned_run(ref.model_id, field) is None:
            raise UserError(f"{field}: checkpoint {ref.tinker_path} does not exist on this server")

    def list_runs(self) -> list[str]:
        """Model ids with a run record, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if MODEL_ID.fullmatch(p.name) and (p / RUN_FILE).is_file()]
        return [p.name for p in sorted(found, key=lambda p: (p / RUN_FILE).stat().st_mtime)]

    def visible_runs(self) -> list[tuple[str, dict]]:
        """``(model_id, record)`` of every run record the current tenant may see, oldest first.
        A damaged record (not JSON, fields missing) or, with tenants enforced, one without an
        owner is skipped and logged once, naming its file: one bad file does not deny every
        tenant's listing."""
        out = []
        for model_id in self.list_runs():
            path = self.root / model_id / RUN_FILE
            try:
                record = self.read_run(model_id)
            except (ValueError, OSError) as exc:  # (JSON and Unicode decode errors are ValueErrors)
                self._warn_once(path, "damaged", "skipping the damaged run record %s in listings (%s: %s)", path, type(exc).__name__, exc)
                continue
            if record is None:
                continue
            owner = self.owner(record)
            if not owner and tenants.is_enforced():
                self._warn_once(
                    path,
                    "ownerless",
                    "the run record %s has no owner (written by an older server): it belongs to no API key and is left out of "
                    "listings; fix: set server.ownerless_runs_owner to the API key it belongs to",
                    path,
                )
                continue
            if tenants.visible(owner):
                out.append((model_id, record))
        return out

    def _warn_once(self, path: Path, kind: str, message: str, *args) -> None:
        """Log ``message`` once per file and state (listings are polled: no warning per poll)."""
        try:
            stamp = str(path.stat().st_mtime_ns)
        except OSError:
            stamp = ""
        key = (f"{path}:{stamp}", kind)
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def clean_staging(self) -> list[Path]:
        """Remove what saves interrupted by a killed server left under the root (call at start,
        before any save runs; one server per ``state_dir``): staging directories
        (``.<name>.saving-<hex>``) are deleted; a moved-aside checkpoint (``.<name>.replaced-<hex>``)
        is put back when its replacement never arrived, and deleted when the replacement is in
        place, complete. Nothing else is touched: committed checkpoints and anything not named as
        the store names its siblings stay, and symbolic links are neither followed nor removed
        (a link named like a staging directory is logged and left). Returns the paths removed or
        put back."""
        done: list[Path] = []
        if not self.root.is_dir():
            return done
        for run_dir in self.root.iterdir():
            if run_dir.is_symlink() or not MODEL_ID.fullmatch(run_dir.name) or not run_dir.is_dir():
                continue
            for kind in KINDS:
                base = run_dir / kind
                if base.is_symlink() or not base.is_dir():
                    continue
                for entry in base.iterdir():
                    match = _STAGING.fullmatch(entry.name)
                    if match is None:
                        continue
                    if entry.is_symlink() or not entry.is_dir():
                        log.warning("left %s alone: named like a staging directory but not a directory of this server's", entry)
                        continue
                    self._inside(entry)
                    try:
                        if self._settle(entry, base / match["name"], match["what"]):
                            done.append(entry)
                    except OSError as exc:  # (a permission, a full disk: the server starts anyway)
                        log.warning("could not clean up %s (%s: %s); remove it by hand", entry, type(exc).__name__, exc)
        return done

    @staticmethod
    def _settle(entry: Path, final: Path, what: str) -> bool:
        """One leftover of :meth:`clean_staging`; whether it was removed or put back."""
        if what == "saving":
            shutil.rmtree(entry)
            log.info("removed %s: the staging directory of a save that never finished", entry)
        elif not os.path.lexists(final) and (entry / META_FILE).is_file():
            os.replace(entry, final)
            log.info("put back %s: moved aside for an overwrite that never finished", final)
        elif not final.is_symlink() and (final / META_FILE).is_file():
            shutil.rmtree(entry)
            log.info("removed %s: the checkpoint an overwrite replaced (the new one is in place)", entry)
        else:
            log.warning("left %s alone: its checkpoint %s is in a state no interrupted save leaves", entry, final)
            return False
        return True

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
        """Complete checkpoints of ``model_id``, oldest first (one with damaged metadata is
        skipped and logged once, naming its file)."""
        found = []
        for kind in KINDS:
            base = self.run_dir(model_id) / kind
            if not base.is_dir():
                continue
            for entry in base.iterdir():
                if NAME.fullmatch(entry.name) and (entry / META_FILE).is_file():
                    ref = CheckpointRef(model_id, kind, entry.name)
                    try:
                        found.append((ref, self.read(ref, "path")))
                    except (ValueError, OSError) as exc:
                        path = entry / META_FILE
                        self._warn_once(
                            path,
                            "damaged",
                            "skipping the damaged checkpoint metadata %s in listings (%s: %s)",
                            path,
                            type(exc).__name__,
                            exc,
                        )
        return sorted(found, key=lambda item: item[1].get("created", 0.0))

    def delete(self, ref: CheckpointRef) -> None:
        """Delete a complete checkpoint (a :class:`UserError` if there is none)."""
        self.read(ref, "checkpoint_id")
        shutil.rmtree(self.directory(ref))

    def size_bytes(self, ref: CheckpointRef) -> int:
        """The bytes of a checkpoint's files."""
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
