"""The RL recipe's data order, recorded with its checkpoints and checked on resume.

The data position of a run is its step: step ``s`` trains the prompts at positions
``s * data.batch_size .. (s + 1) * data.batch_size - 1`` of the data order, which is a pure
function of the task's settings (``posttrain.tasks``: ``data.batch_size``, ``data.seed``,
``data.shuffle`` and the rows of ``data.train_files``, or the sorting task's keys). A checkpoint
of step ``s`` is therefore only a position in the order it was trained with: resumed under
another batch size, seed, shuffle or other rows, the run would skip some prompts and train others
twice. So the order's description (``task.data_order()``) is written next to the checkpoints
(``checkpoints/data_order.json``, rank 0, before the roles' checkpoints of each save) and a resume
whose order differs is refused, naming each key and both values, before any engine is built.

Checkpoints written before this record existed resume with a warning that the order could not
be checked.
"""

from __future__ import annotations

import json
import os
from typing import Any

from posttrain.trainer_utils import warn

FILE = "data_order.json"
FORMAT = "enginekit-data-order/1"
# Recorded for people (the message), not compared: the same rows under another path resume.
_SHOWN_ONLY = ("data.train_files",)


def sort_task_order(cfg) -> dict[str, Any]:
    """The sorting task's data order: its keys (every batch is drawn from them)."""
    return {
        "task": "sort",
        "data.batch_size": cfg.batch_size,
        "data.seed": cfg.seed,
        "data.min_digits": cfg.min_digits,
        "data.max_digits": cfg.max_digits,
    }


def files_order(cfg, rows: int, digest: str) -> dict[str, Any]:
    """A data-file run's data order: the order's keys and the training rows as loaded (their
    number and ``digest``, a SHA-256 of them as the recipe renders them); the files are shown in
    messages, not compared."""
    return {
        "task": "files",
        "data.batch_size": cfg.batch_size,
        "data.seed": cfg.seed,
        "data.shuffle": cfg.shuffle,
        "data.train_files": list(cfg.train_files),
        "train_rows": rows,
        "train_rows_sha256": digest,
    }


def save_order(ckpt_dir: str, order: dict[str, Any]) -> None:
    """Write the run's data order next to its checkpoints (atomically; rank 0)."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": FORMAT, "order": order}, f, indent=1)
    os.replace(path + ".tmp", path)


def check_order(ckpt_dir: str, order: dict[str, Any], rank0: bool) -> None:
    """Refuse to resume the checkpoints in ``ckpt_dir`` under another data order than ``order``.

    Raises:
        ValueError: the saved order differs (every differing key with its saved and current
            values, and the fix), or its file is unreadable.
    """
    path = os.path.join(ckpt_dir, FILE)
    if not os.path.exists(path):
        warn(
            [
                f"trainer.resume: {path} is missing (checkpoints written before the data order was recorded): the data order "
                "(data.batch_size, data.seed, data.shuffle, the rows of data.train_files) cannot be checked; a change skips "
                "prompts and repeats others"
            ],
            rank0,
        )
        return
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("format") != FORMAT or not isinstance(saved.get("order"), dict):
            raise ValueError(f"format {saved.get('format')!r}, expected {FORMAT!r}")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"trainer.resume=true: the data order {path} does not verify ({type(exc).__name__}: {exc}); nothing was loaded; "
            "fix: restore the file from a copy, or start a fresh run in another trainer.output_dir"
        ) from None
    saved = saved["order"]
    differ = [k for k in sorted(set(saved) | set(order)) if k not in _SHOWN_ONLY and saved.get(k) != order.get(k)]
    if not differ:
        return
    shown = "; ".join(f"{k} = {order.get(k)!r} now, {saved.get(k)!r} when they were saved" for k in differ)
    if any(k.startswith("train_rows") for k in differ):
        shown += f" (data.train_files now {order.get('data.train_files')}, then {saved.get('data.train_files')})"
    keys = [k for k in differ if k.startswith("data.")]
    fix = "resume with the run's own data settings (" + " ".join(f"{k}={saved.get(k)}" for k in keys) + ")" if keys else ""
    fix = (fix + ", " if fix else "resume with the rows the run was trained on, ") + "or start a fresh run in another trainer.output_dir"
    raise ValueError(
        f"trainer.resume=true: the checkpoints in {ckpt_dir} were trained in another data order: {shown}; a step's checkpoint is "
        f"a position in that order, so resuming would skip some prompts and train others twice; nothing was loaded; fix: {fix}"
    )
