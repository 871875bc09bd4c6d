"""Checkpoints made through the real ``engine_api.ckpt_layout`` protocol (begin, extra state,
commit with retention and remote copy) with a stand-in file for a backend's shards: the
protocol's tests need no engine (``tests/reliability/test_checkpoint_crash.py``,
``test_checkpoint_edges.py``)."""

from __future__ import annotations

import os

from engine_api import ckpt_layout


def save_stand_in(root: str, step: int, keep: int | None = None, remote: str | None = None) -> str:
    """A checkpoint through the real protocol, with a stand-in for the backend's files."""
    tmp = ckpt_layout.begin(root, step)
    with open(os.path.join(tmp, "__0_0.distcp"), "w") as f:
        f.write(f"shard of step {step}")
    ckpt_layout.save_extra(tmp, {"global_step": step})
    return ckpt_layout.commit(root, step, keep, remote, {"backend": "test"})


def latest_name(root) -> str | None:
    """The directory name ``root`` resolves to (``latest_checkpoint``), or None."""
    found = ckpt_layout.latest_checkpoint(str(root))
    return os.path.basename(found) if found else None
