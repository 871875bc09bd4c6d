"""What the checkpoint-integrity tests run inside a rank process: tampered copies of one
checkpoint, each loaded into an engine that must refuse it without running code or changing
state, then the untouched original, which must load bit-exactly.

Tampering kinds (``apply``):

* ``evil``: the file is replaced by a pickle whose ``__reduce__`` runs ``touch <marker>``;
  ``evil_zip``: the same object inside a ``torch.save`` archive (what a forged ``.pt`` holds);
* ``forged``: ``evil`` plus a manifest and completion marker rewritten to vouch for the new file
  (an attacker with write access to the checkpoint): only the scan for code can refuse it;
* ``truncate`` (half the bytes), ``empty`` (zero bytes), ``flip`` (16 bytes inverted in the
  middle), ``nan`` (float NaN bytes written over 64 bytes in the middle), ``delete``;
* ``legacy``: no manifest, and a marker that records none (a checkpoint from before manifests).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil

import torch

from engine_api import ckpt_layout
from engine_api.ckpt_integrity import MANIFEST
from tests.reliability._ckpt_state import OVERRIDES, full_state, seed_all, state_diff, train_steps
from tests.reliability._step_common import new_engine, snapshot_diff


class _Touch:
    """Unpickling this runs ``os.system("touch <path>")``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def apply(directory: str, rel: str, kind: str, marker: str) -> None:
    """Tamper with ``directory/rel`` (see the module docstring)."""
    path = os.path.join(directory, rel)
    data = open(path, "rb").read() if os.path.exists(path) else b""
    if kind in ("evil", "forged"):
        new = pickle.dumps(_Touch(marker))
    elif kind == "evil_zip":
        buf = io.BytesIO()
        torch.save({"state": _Touch(marker)}, buf)
        new = buf.getvalue()
    elif kind == "truncate":
        new = data[: len(data) // 2]
    elif kind == "empty":
        new = b""
    elif kind == "flip":
        mid = len(data) // 2
        new = data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 16]) + data[mid + 16 :]
    elif kind == "nan":
        mid = (len(data) // 2) & ~3
        new = data[:mid] + bytes.fromhex("0000c07f") * 16 + data[mid + 64 :]
    elif kind == "delete":
        os.remove(path)
        return
    elif kind == "legacy":
        os.remove(os.path.join(directory, MANIFEST))
        marker_path = os.path.join(directory, ckpt_layout.MARKER)
        with open(marker_path) as f:
            info = json.load(f)
        del info["manifest_sha256"]
        with open(marker_path, "w") as f:
            json.dump(info, f)
        return
    else:
        raise ValueError(kind)
    with open(path, "wb") as f:
        f.write(new)
    if kind == "forged":
        _vouch_for(directory, rel)


def _vouch_for(directory: str, rel: str) -> None:
    """Rewrite the manifest and the marker so that they describe the tampered file."""
    path = os.path.join(directory, rel)
    with open(os.path.join(directory, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["files"][rel] = {"size": os.path.getsize(path), "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    text = json.dumps(manifest, indent=1)
    with open(os.path.join(directory, MANIFEST), "w") as f:
        f.write(text)
    with open(os.path.join(directory, ckpt_layout.MARKER)) as f:
        info = json.load(f)
    info["manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    with open(os.path.join(directory, ckpt_layout.MARKER), "w") as f:
        json.dump(info, f)


def tamper_and_load(rank, world, strategy, model_dir, root, cases, extra_overrides=()) -> dict:
    """Save a checkpoint at step 2, train one more step, then for each ``(rel, kind)`` of
    ``cases`` (``rel`` None: every file of the checkpoint) load a tampered copy and record what
    happened; finally load the original. Returns per case: the error type and message (or
    None when it loaded), whether the marker file appeared, and what of the engine's state
    changed; plus the files of the checkpoint and whether the original loaded bit-exactly."""
    torch.set_num_threads(1)
    engine = new_engine(strategy, model_dir, *OVERRIDES, *extra_overrides)
    seed_all(0)
    train_steps(engine, 2)
    saved = full_state(engine)
    engine.save_checkpoint(os.path.join(root, "intact"), global_step=2)
    original = os.path.join(root, "intact", f"{ckpt_layout.PREFIX}2")
    files = sorted(os.path.relpath(os.path.join(d, n), original) for d, _, names in os.walk(original) for n in names)
    train_steps(engine, 1)
    before = full_state(engine)
    out = {"files": files, "cases": {}}
    expanded = [(rel, kind) for pattern, kind in cases for rel in (files if pattern is None else [pattern])]
    for i, (rel, kind) in enumerate(expanded):
        case_dir = os.path.join(root, f"case{i}", f"{ckpt_layout.PREFIX}2")
        shutil.copytree(original, case_dir)
        marker = os.path.join(root, f"case{i}.ran_code")
        apply(case_dir, rel, kind, marker)
        error = None
        try:
            engine.load_checkpoint(case_dir)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
            error = (type(exc).__name__, str(exc), isinstance(exc, ValueError))
        out["cases"][(rel, kind)] = {
            "error": error,
            "ran_code": os.path.exists(marker),
            "changed": snapshot_diff(before, full_state(engine)),
            "dir": case_dir,
        }
    # A checkpoint from before manifests: refused with verify on (the test's cases), loadable
    # with verify off (the scan for code still runs).
    legacy = os.path.join(root, "legacy", f"{ckpt_layout.PREFIX}2")
    shutil.copytree(original, legacy)
    apply(legacy, MANIFEST, "legacy", os.path.join(root, "legacy.ran_code"))
    try:
        engine.load_checkpoint(legacy)
        out["legacy"] = state_diff(saved, full_state(engine))
    except ValueError as exc:
        out["legacy"] = str(exc)
    engine.load_checkpoint(os.path.join(root, "intact"))
    out["intact_diff"] = state_diff(saved, full_state(engine))
    return out
