"""The asynchronous pipeline's state: the admitted batches whose responses are unfinished or not
yet trained, and how it is checkpointed (``posttrain.async_rl.driver``).

A batch is admitted whole (every prompt of one training step, each repeated ``n_samples``
times) and trained whole, so the data cursor is the next step to admit, and "every prompt of
the data order is trained exactly once" is: the steps trained are consecutive and each batch
carries the prompt ids it was admitted with (``prompt_ids``: positions ``step * batch_size + i``
in the data order), which the run's ledger (``prompt_ledger.jsonl``) records as it trains them.

Saved next to the roles' checkpoints as ``checkpoints/async/global_step_<N>.safetensors`` (the
tensors and, in its header, the layout; nothing pickled, nothing executed) with ``.json`` (the
layout again, for people, and the file's SHA-256, verified before anything is read; the
layout used is the hashed one), written to a temporary name and renamed, before the
roles' checkpoints of the same step: a complete role checkpoint always has its state.

Format 3: per batch its prompts, seeds and the producer's in-flight work
(``Producer.save``: ``{k}.work.*`` tensors, the layout's ``work`` entry). Format 2 (before the
producer seam) is read too: its single-turn ``samples``, multi-turn ``traj`` (a scored batch) and
``run`` (trajectories paused between turns) are the same tensors under other names.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from roles.rollout import pack_rows, unpack_rows

FORMAT = "enginekit-async-state/3"
FORMAT_2 = "enginekit-async-state/2"  # read, never written
DIR = "async"


@dataclass
class Pending:
    """One admitted batch: the prompts of training step ``step``.

    Attributes:
        step: the training step that will train it.
        prompt_ids: its prompts' positions in the data order (one per prompt, not per response).
        prompts: one entry per response (each prompt ``n_samples`` times).
        seeds: each response's seed (the synchronous loop's: ``Rollout.seeds(step, ...)``).
        work: the producer's in-flight work (``posttrain.async_rl.producer``; None: not started).
        saved: work read from a checkpoint and not yet restored: ``(tensors, meta)``.
    """

    step: int
    prompt_ids: list[int]
    prompts: list[torch.Tensor]
    seeds: list[int]
    work: Any = None
    saved: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None


def path_of(ckpt_dir: str, step: int) -> str:
    """The state file (without extension) of checkpoint step ``step``."""
    return os.path.join(ckpt_dir, DIR, f"global_step_{step}")


def save_state(ckpt_dir: str, step: int, pending: list[Pending], settings: dict, save_work: Callable[[Any], tuple[dict, dict]]) -> None:
    """Write the state of the pipeline after ``step`` updates (atomically: tensors, then the
    JSON that names their hash; a reader finds both or neither). ``save_work``: the
    producer's ``save`` of a batch's in-flight work."""
    from safetensors.torch import save_file

    base = path_of(ckpt_dir, step)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    batches = []
    for k, p in enumerate(pending):
        tensors.update({f"{k}.prompts.{name}": t for name, t in pack_rows(p.prompts).items()})
        tensors[f"{k}.seeds"] = torch.tensor(p.seeds, dtype=torch.long)
        entry: dict[str, Any] = {"step": p.step, "prompt_ids": list(p.prompt_ids)}
        if p.work is not None:
            work, meta = save_work(p.work)
            tensors.update({f"{k}.work.{name}": t for name, t in work.items()})
            entry["work"] = meta
        batches.append(entry)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    # The layout rides in the tensors file's own header, so the hash covers it too; the JSON
    # repeats it for people and holds the hash.
    layout = {"format": FORMAT, "step": step, "settings": settings, "batches": batches}
    tmp = base + ".safetensors.tmp"
    save_file(tensors, tmp, metadata={"layout": json.dumps(layout)})
    digest = _sha256(tmp)
    os.replace(tmp, base + ".safetensors")
    with open(base + ".json.tmp", "w") as f:
        json.dump({**layout, "sha256": digest}, f)
    os.replace(base + ".json.tmp", base + ".json")


def has_state(ckpt_dir: str) -> bool:
    """Whether this run ever saved an asynchronous state (a synchronous run never does)."""
    return os.path.isdir(os.path.join(ckpt_dir, DIR))


def load_state(ckpt_dir: str, step: int) -> tuple[list[Pending], dict] | None:
    """The state saved with checkpoint step ``step`` and its settings; None when neither of its
    files exists.

    Raises:
        ValueError: the files do not verify (one of the two missing, hash, format, layout):
            naming the file and the fix.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    base = path_of(ckpt_dir, step)
    where = base + ".json"
    fix = "restore the file from a copy, or resume from another checkpoint step (trainer.resume picks the newest)"
    if not os.path.exists(where):
        if not os.path.exists(base + ".safetensors"):
            return None
        # The JSON is written after the tensors and before the roles' checkpoints: a complete
        # role checkpoint without it lost it afterwards, like a lost tensors file.
        raise ValueError(
            f"async state {where} does not verify (FileNotFoundError: it is missing next to its tensors file "
            f"{base}.safetensors, so their SHA-256 cannot be checked); nothing was loaded; fix: {fix}"
        )
    try:
        with open(where) as f:
            meta = json.load(f)
        if meta.get("format") not in (FORMAT, FORMAT_2) or meta.get("step") != step:
            raise ValueError(f"format {meta.get('format')!r} / step {meta.get('step')!r}, expected {FORMAT!r} / {step}")
        if _sha256(base + ".safetensors") != meta["sha256"]:
            raise ValueError("its tensors file does not match the recorded SHA-256 (changed or truncated)")
        with safe_open(base + ".safetensors", "pt") as f:
            layout = json.loads((f.metadata() or {})["layout"])
        if layout.get("format") != meta["format"] or layout.get("step") != step:
            raise ValueError(f"the tensors file holds format {layout.get('format')!r} / step {layout.get('step')!r}")
        tensors = load_file(base + ".safetensors")
        read = _batch if layout["format"] == FORMAT else _batch_v2
        pending = [read(k, b, tensors) for k, b in enumerate(layout["batches"])]
    except (OSError, KeyError, TypeError, RuntimeError, ValueError) as exc:
        raise ValueError(f"async state {where} does not verify ({type(exc).__name__}: {exc}); nothing was loaded; fix: {fix}") from None
    return pending, layout["settings"]


def saved_batches(ckpt_dir: str, step: int) -> int | None:
    """How many admitted batches the state of checkpoint step ``step`` holds, read without
    verifying it (for a message about a state that is not used); None: no state, or unreadable."""
    from safetensors import safe_open

    base = path_of(ckpt_dir, step)
    try:
        if os.path.exists(base + ".safetensors"):
            with safe_open(base + ".safetensors", "pt") as f:
                return len(json.loads((f.metadata() or {})["layout"])["batches"])
        if os.path.exists(base + ".json"):
            with open(base + ".json") as f:
                return len(json.load(f)["batches"])
    except (OSError, KeyError, TypeError, ValueError, RuntimeError):
        return None
    return None


def prune_states(ckpt_dir: str, keep_steps: set[int], newest: int) -> None:
    """Delete saved states of steps below ``newest`` whose role checkpoints are gone (retention)."""
    root = os.path.join(ckpt_dir, DIR)
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        stem = name.split(".", 1)[0]
        if not stem.startswith("global_step_"):
            continue
        try:
            step = int(stem[len("global_step_") :])
        except ValueError:
            continue
        if step < newest and step not in keep_steps:
            os.remove(os.path.join(root, name))


def _part(tensors: dict[str, torch.Tensor], head: str) -> dict[str, torch.Tensor]:
    return {key[len(head) :]: t for key, t in tensors.items() if key.startswith(head)}


def _batch(k: int, meta: dict, tensors: dict[str, torch.Tensor]) -> Pending:
    """Batch ``k`` of a format-3 state; its work is restored by the producer (``Pipeline.resume``)."""
    prompts, seeds = unpack_rows(_part(tensors, f"{k}.prompts.")), tensors[f"{k}.seeds"].tolist()
    if len(prompts) != len(seeds):
        raise ValueError(f"batch {k}: {len(prompts)} prompts, {len(seeds)} seeds")
    saved = (_part(tensors, f"{k}.work."), dict(meta["work"])) if "work" in meta else None
    return Pending(int(meta["step"]), [int(x) for x in meta["prompt_ids"]], prompts, [int(s) for s in seeds], saved=saved)


def _batch_v2(k: int, meta: dict, tensors: dict[str, torch.Tensor]) -> Pending:
    """Batch ``k`` of a format-2 state, its work renamed to what the producers save today:
    single-turn ``samples`` as they are (none started: no work), a multi-turn scored batch
    (``traj``) or paused run (``run``) under ``traj.`` / ``run.`` with their meta."""
    prompts, seeds = unpack_rows(_part(tensors, f"{k}.prompts.")), tensors[f"{k}.seeds"].tolist()
    if len(prompts) != len(seeds):
        raise ValueError(f"batch {k}: {len(prompts)} prompts, {len(seeds)} seeds")
    samples = _part(tensors, f"{k}.samples.")
    if "trajectories" in meta:
        saved = ({f"traj.{n}": t for n, t in _part(tensors, f"{k}.traj.").items()}, {"trajectories": meta["trajectories"]})
    elif "agent_run" in meta:
        saved = ({f"run.{n}": t for n, t in _part(tensors, f"{k}.run.").items()}, {"agent_run": meta["agent_run"]})
    elif any(samples["started"].tolist()):
        saved = (samples, {})
    else:
        saved = None
    return Pending(int(meta["step"]), [int(x) for x in meta["prompt_ids"]], prompts, [int(s) for s in seeds], saved=saved)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
