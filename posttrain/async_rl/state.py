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
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_api.rollout import Sample
from roles.rollout import pack_rows, pack_samples, unpack_rows, unpack_samples

FORMAT = "enginekit-async-state/2"
DIR = "async"


@dataclass
class Pending:
    """One admitted batch: the prompts of training step ``step``.

    Attributes:
        step: the training step that will train it.
        prompt_ids: its prompts' positions in the data order (one per prompt, not per response).
        prompts: one entry per response (each prompt ``n_samples`` times).
        seeds: each response's seed (the synchronous loop's: ``Rollout.seeds(step, ...)``).
        samples: each response so far (None: not started).
        trajectories: multi-turn rollouts (``env.function``): the batch's trajectories once
            they have all ended and been scored (``posttrain.agents.AgentBatch``), else None.
        agent_run: multi-turn with partial rollouts: the trajectories while some are unfinished
            (``posttrain.agents.AgentRun``, paused between turns), else None.
    """

    step: int
    prompt_ids: list[int]
    prompts: list[torch.Tensor]
    seeds: list[int]
    samples: list[Sample | None] = field(default_factory=list)
    trajectories: Any = None
    agent_run: Any = None

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [None] * len(self.prompts)

    def done(self, i: int, max_new_tokens: int) -> bool:
        """Whether response ``i`` is finished (stopped, or at the length cap)."""
        s = self.samples[i]
        return s is not None and (s.finish_reason == "stop" or len(s.token_ids) >= max_new_tokens)

    def complete(self, max_new_tokens: int) -> bool:
        return all(self.done(i, max_new_tokens) for i in range(len(self.prompts)))


def path_of(ckpt_dir: str, step: int) -> str:
    """The state file (without extension) of checkpoint step ``step``."""
    return os.path.join(ckpt_dir, DIR, f"global_step_{step}")


def save_state(ckpt_dir: str, step: int, pending: list[Pending], settings: dict) -> None:
    """Write the state of the pipeline after ``step`` updates (atomically: tensors, then the
    JSON that names their hash; a reader finds both or neither)."""
    from safetensors.torch import save_file

    base = path_of(ckpt_dir, step)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    batches = []
    for k, p in enumerate(pending):
        parts = {"prompts": pack_rows(p.prompts), "samples": pack_samples(p.samples)}
        tensors.update({f"{k}.{part}.{name}": t for part, packed in parts.items() for name, t in packed.items()})
        tensors[f"{k}.seeds"] = torch.tensor(p.seeds, dtype=torch.long)
        batches.append({"step": p.step, "prompt_ids": list(p.prompt_ids)})
        if p.trajectories is not None:  # generated trajectories: kept, so a resume trains them as they are
            traj, meta = p.trajectories.to_tensors()
            tensors.update({f"{k}.traj.{name}": t for name, t in traj.items()})
            batches[-1]["trajectories"] = meta
        elif p.agent_run is not None:  # paused between turns: the kept turns, replayed on resume
            run, meta = p.agent_run.to_tensors()
            tensors.update({f"{k}.run.{name}": t for name, t in run.items()})
            batches[-1]["agent_run"] = meta
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
        if meta.get("format") != FORMAT or meta.get("step") != step:
            raise ValueError(f"format {meta.get('format')!r} / step {meta.get('step')!r}, expected {FORMAT!r} / {step}")
        if _sha256(base + ".safetensors") != meta["sha256"]:
            raise ValueError("its tensors file does not match the recorded SHA-256 (changed or truncated)")
        with safe_open(base + ".safetensors", "pt") as f:
            layout = json.loads((f.metadata() or {})["layout"])
        if layout.get("format") != FORMAT or layout.get("step") != step:
            raise ValueError(f"the tensors file holds format {layout.get('format')!r} / step {layout.get('step')!r}")
        tensors = load_file(base + ".safetensors")
        pending = [_batch(k, b, tensors, step) for k, b in enumerate(layout["batches"])]
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


def _batch(k: int, meta: dict, tensors: dict[str, torch.Tensor], step: int) -> Pending:
    """Batch ``k`` of a state saved after ``step`` updates: its samples' weight versions can be
    ``step`` at most (the round that sampled them ran with version ``step``), checked with their
    log-probs (``posttrain.agents.loop.check_sample``)."""
    from posttrain.agents.loop import check_sample

    def part(name: str) -> dict[str, torch.Tensor]:
        head = f"{k}.{name}."
        return {key[len(head) :]: t for key, t in tensors.items() if key.startswith(head)}

    prompts, samples = unpack_rows(part("prompts")), unpack_samples(part("samples"))
    seeds = tensors[f"{k}.seeds"].tolist()
    if not (len(prompts) == len(samples) == len(seeds)):
        raise ValueError(f"batch {k}: {len(prompts)} prompts, {len(seeds)} seeds, {len(samples)} response rows")
    for s in samples:
        if s is not None:
            check_sample(s, step, f"batch {k}")
    trajectories = None
    if "trajectories" in meta:
        from posttrain.agents.loop import AgentBatch

        trajectories = AgentBatch.from_tensors(part("traj"), meta["trajectories"])
    agent_run = None
    if "agent_run" in meta:
        from posttrain.agents.loop import AgentRun

        agent_run = AgentRun.from_tensors(part("run"), meta["agent_run"], max_version=step)
        if agent_run.seeds != [int(s) for s in seeds]:
            raise ValueError(f"batch {k}: its paused trajectories carry other seeds than the batch")
    return Pending(
        int(meta["step"]), [int(x) for x in meta["prompt_ids"]], prompts, [int(s) for s in seeds], samples, trajectories, agent_run
    )


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
