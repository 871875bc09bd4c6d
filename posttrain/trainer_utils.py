"""Pieces of a training loop that SFT and RL share: resuming from the newest checkpoint that
verifies, keeping the metrics log one line per step across a resume, stopping a run whose
optimizer steps keep being skipped, and a console without third-party noise."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Sequence

from engine_api.ckpt_integrity import CorruptCheckpointError


def load_newest_valid(candidates: Sequence, load: Callable[[object], int], rank0: bool, what: str = "trainer.resume") -> int:
    """Load the first of ``candidates`` (best first, e.g. ``ckpt_layout.candidates``) that
    passes verification; return its step.

    A candidate that fails verification (``CorruptCheckpointError``: nothing of it was loaded)
    is skipped with a loud message on rank 0 naming it and why; any other error propagates.
    Used only when a run resumes by itself: an explicit checkpoint path never falls back.

    Raises:
        CorruptCheckpointError: no candidate verifies (the run must not silently start over
            and overwrite what is left).
    """
    reasons = []
    for candidate in candidates:
        try:
            return load(candidate)
        except CorruptCheckpointError as exc:
            reasons.append(f"{candidate}: {exc}")
            if rank0:
                print(f"\n!!! {what}: SKIPPING checkpoint {candidate}: it failed verification:\n{exc}\n", file=sys.stderr, flush=True)
    raise CorruptCheckpointError(
        f"{what}: none of the {len(reasons)} checkpoint(s) verifies:\n" + "\n".join(reasons) + "\nfix: restore a checkpoint "
        "from a remote copy, or start a fresh run in another trainer.output_dir (this one is left untouched)"
    )


def truncate_metrics(path: str, last_step: int) -> None:
    """Keep the lines of the JSON-lines log ``path`` whose ``step`` is at most ``last_step``
    (rewritten atomically): a run resumed at ``last_step`` appends the replayed steps, so the
    log stays one line per step. A missing file is fine; ``last_step`` 0 empties it."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if int(json.loads(line)["step"]) <= last_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by the crash that ended the run
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


class SkipGuard:
    """Stops a run after ``limit`` consecutive trainer steps in which every optimizer step was
    skipped (a non-finite loss or gradient): such a run learns nothing and must not exit 0.

    ``limit`` 0 disables the guard.
    """

    def __init__(self, limit: int, key: str = "trainer.max_consecutive_skips") -> None:
        self.limit, self.key, self.streak = limit, key, 0

    def update(self, step: int, skipped: bool) -> None:
        """Record whether trainer step ``step`` (1-based) was skipped entirely.

        Raises:
            RuntimeError: the ``limit``-th skipped step in a row.
        """
        self.streak = self.streak + 1 if skipped else 0
        if self.limit and self.streak >= self.limit:
            raise RuntimeError(
                f"steps {step - self.streak + 1}..{step}: every optimizer step was skipped ({self.streak} in a row, "
                f"{self.key} = {self.limit}): the loss or the gradients are not finite; fix: lower the learning rate, "
                "check the data and the loss, or resume from an earlier checkpoint"
            )


def quiet_console() -> None:
    """Silence what libraries print on every run although nothing is wrong: HF's per-file
    load/save progress bars (they interleave with the training bar) and torch's one-time
    ``is_fx_tracing`` deprecation notice (raised inside transformers), and vLLM's start-up
    INFO / WARNING lines (its own "tokenizer not available" traceback for a model directory
    without a tokenizer, thread-binding notes), unless ``VLLM_LOGGING_LEVEL`` is set. Warnings
    that may matter are kept."""
    import os

    from transformers.utils import logging as hf_logging

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    hf_logging.disable_progress_bar()
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
