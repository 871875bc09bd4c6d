"""Pieces of a training loop that SFT and RL share: resuming from the newest checkpoint that
verifies, keeping the metrics log one line per step across a resume, stopping a run whose
optimizer steps keep being skipped, and a console without third-party noise."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence

from engine_api.ckpt_integrity import CorruptCheckpointError


def load_newest_valid(
    candidates: Sequence, load: Callable[[object], int], rank0: bool, what: str = "trainer.resume", describe: Callable[[object], str] = str
) -> int:
    """Load the first of ``candidates`` (best first, e.g. ``ckpt_layout.candidates``) that
    passes verification; return its step. Rank 0 prints which checkpoint it loaded
    (``describe(candidate)``: its path or paths) and the step it continues at.

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
            step = load(candidate)
        except CorruptCheckpointError as exc:
            reasons.append(f"{candidate}: {exc}")
            if rank0:
                print(f"\n!!! {what}: SKIPPING checkpoint {candidate}: it failed verification:\n{exc}\n", file=sys.stderr, flush=True)
            continue
        if rank0:
            print(f"{what}: loaded checkpoint {describe(candidate)} (step {step}); continuing at step {step + 1}", flush=True)
        return step
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


def run_cli(main: Callable[[], object]) -> None:
    """Run a recipe's ``main()`` as a command. A ``ValueError`` (a refused config key, a bad data
    file, a checkpoint of another run: every user error here is one, with the field, the value
    and the fix in its message) ends the command with that message alone on stderr and exit
    code 2, not a traceback whose last line is the one that matters. The user's own code failing
    (``posttrain.fencing.UserCodeError``: an environment that raised, say) ends it with exit code
    1, its summary and the frame of the user's file where it was raised, not the library's
    frames around it. ``ENGINEKIT_TRACEBACK=1`` shows the whole traceback as well. Called from
    ``__main__`` only: in-process callers get the exception."""
    from posttrain.fencing import UserCodeError

    whole = os.environ.get("ENGINEKIT_TRACEBACK", "") not in ("", "0")
    try:
        main()
    except ValueError as exc:
        if whole:
            raise
        print(f"error: {exc}\n(ENGINEKIT_TRACEBACK=1 shows where it was raised)", file=sys.stderr)
        raise SystemExit(2) from None
    except UserCodeError as exc:
        if whole:
            raise
        where = f"\n{exc.user_frame}" if exc.user_frame else ""
        print(f"error: {exc}{where}\n(ENGINEKIT_TRACEBACK=1 shows the whole traceback)", file=sys.stderr)
        raise SystemExit(1) from None


def guard_fresh_run(output_dir: str, resume: bool, overwrite: bool, rank0: bool) -> None:
    """A fresh run (``trainer.resume=false``) never writes over another run: an ``output_dir``
    whose ``checkpoints/`` holds a checkpoint (a ``global_step_*`` directory or a ``latest``
    pointer, of any role) is refused before anything is written, naming the ways out. With
    ``trainer.overwrite=true`` the old run's checkpoints are deleted first (rank 0; the others
    wait), so the new run never mixes with them.

    Raises:
        ValueError: the directory holds checkpoints and ``overwrite`` is false.
    """
    ckpt = os.path.join(output_dir, "checkpoints")
    if resume or not _holds_checkpoints(ckpt):
        return
    if not overwrite:
        raise ValueError(
            f"trainer.resume = false, but trainer.output_dir = {output_dir!r} holds another run's checkpoints ({ckpt}): a fresh run "
            "there would overwrite its checkpoints, metrics and data order, and it could no longer resume; nothing was written; fix: "
            "trainer.resume=true to continue it, another trainer.output_dir for a new run, or trainer.overwrite=true to delete "
            "the old run's checkpoints and start over"
        )
    if rank0:
        shutil.rmtree(ckpt)
        print(f"trainer.overwrite: deleted the earlier run's checkpoints in {ckpt}", file=sys.stderr, flush=True)
    from engine_api.dist import is_initialized

    if is_initialized():
        import torch.distributed as dist

        dist.barrier()  # nobody writes into checkpoints/ before rank 0 has emptied it


def _holds_checkpoints(ckpt: str) -> bool:
    """Whether ``ckpt`` (or a role's directory in it) holds a checkpoint or a ``latest`` pointer."""
    if not os.path.isdir(ckpt):
        return False
    for root in [ckpt, *(os.path.join(ckpt, d) for d in sorted(os.listdir(ckpt)))]:
        if os.path.isdir(root) and any(n == "latest" or n.startswith("global_step_") for n in os.listdir(root)):
            return True
    return False


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


# Above these learning rates a pretrained model is usually damaged rather than tuned: the
# anchors' published GSM8K recipes use ~1e-6 (RL, full weights), ~1e-5 (RL, LoRA) and 1e-5..2e-5
# (SFT, full weights); LoRA tolerates about ten times more (configs/examples/ and
# docs/example-configs.md list the sources).
_LR_LIMITS = {("sft", False): 1e-4, ("sft", True): 1e-3, ("rl", False): 2e-5, ("rl", True): 2e-4}
_ENTROPY_LIMIT = 0.01


def demo_setting_warnings(kind: str, model_path_given: bool, lr: float, lora: bool, entropy_coef: float = 0.0) -> list[str]:
    """Warnings for settings made for the tiny demo model that wreck a pretrained one.

    Only when the user brings a model (``engine.model.path`` set): the demo configs train a
    freshly initialised 60k-parameter model, where lr 3e-3 (SFT) / 7e-4 (RL) and an entropy
    bonus are right; on a pretrained model the same values destroy it within steps (an entropy
    bonus of 0.03 made a policy uniform in two steps). ``kind``: ``sft`` or ``rl``.
    """
    if not model_path_given:
        return []
    out = []
    limit = _LR_LIMITS[(kind, lora)]
    if lr > limit:
        out.append(
            f"engine.optim.lr = {lr:g} is far above what pretrained models take ({'LoRA ' if lora else ''}{kind.upper()}: "
            f"<= {limit:g}; the demo configs configs/*_tiny.yaml are tuned for the built-in tiny model); "
            "start from configs/examples/ instead (docs/example-configs.md)"
        )
    if entropy_coef > _ENTROPY_LIMIT:
        out.append(
            f"actor.entropy_coef = {entropy_coef:g}: an entropy bonus this large pushes a pretrained policy towards uniform "
            "sampling within a few steps (the anchors' GSM8K recipes use 0); fix: actor.entropy_coef=0"
        )
    return out


def warn(lines: Sequence[str], rank0: bool) -> None:
    """Print each warning loudly on rank 0 (stderr)."""
    if rank0:
        for line in lines:
            print(f"WARNING: {line}", file=sys.stderr, flush=True)
