"""The conformance checks of checkpoints: a save before the first step changes nothing, a
fresh process resumes bit-exactly (phase 2, with dropout: the RNG state too), and tampered
checkpoints (a flipped bit, a code-running pickle under a forged manifest) are refused
without running code. :func:`tamper` makes the tampered copies between the phases (the
runner calls it)."""

from __future__ import annotations

import os
import shutil

import torch

from engine_api.conformance.checks import CheckFailed, Env, _local, check, dropout_model, new_engine, same, weights, window


@check("save_before_first_step")
def save_before_first_step(env: Env) -> str:
    """A save before the first optimizer step changes nothing: 2 steps after it equal 2 steps without it, bit-exactly (and so do 2 steps after loading it in a fresh engine); a backend may refuse such a save with a ValueError instead."""
    plain = new_engine(env)
    want = {"steps": [window(plain, _local(plain, seed=s)) for s in (0, 1)], "w": weights(plain)}
    engine = new_engine(env)
    root = os.path.join(env.workdir, "ckpt_step0")
    try:
        engine.save_checkpoint(root, global_step=0)
    except ValueError as exc:
        saved = f"refused ({str(exc).splitlines()[0][:80]}...)"
    else:
        saved = "saved"
    same(
        f"2 steps after a save before the first step ({saved}) vs without it",
        {"steps": [window(engine, _local(engine, seed=s)) for s in (0, 1)], "w": weights(engine)},
        want,
    )
    if saved == "saved":
        loaded = new_engine(env)
        loaded.load_checkpoint(root, del_local_after_load=False)
        same(
            "2 steps after loading that checkpoint vs a fresh run",
            {"steps": [window(loaded, _local(loaded, seed=s)) for s in (0, 1)], "w": weights(loaded)},
            want,
        )
    return f"{saved}; training unchanged" + (", and after loading it" if saved == "saved" else "")


RESUME = ["optim.lr_schedule=cosine", "optim.warmup_steps=2", "optim.total_steps=10"]


def _resume_settings(env: Env) -> list[str]:
    """The resume checks' settings: a warmup + cosine schedule, on the dropout model, so the
    steps after the resume draw random numbers and match only if the RNG state was restored
    (the ``dropout`` check proves the dropout is live)."""
    return [*RESUME, f"model.path={dropout_model(env)}"]


def _ckpt_root(env: Env) -> str:
    return os.path.join(env.workdir, "ckpt")


@check("resume_save", phase=1)
def resume_save(env: Env) -> str:
    """(phase 1 of resume) 2 steps, save, 2 more steps: the record a fresh process must replay."""
    engine = new_engine(env, *_resume_settings(env))
    for s in (0, 1):
        window(engine, _local(engine, seed=s))
    engine.save_checkpoint(_ckpt_root(env), global_step=2)
    record = {"steps": [window(engine, _local(engine, seed=s)) for s in (2, 3)], "w": weights(engine)}
    if env.rank == 0:
        torch.save(record, os.path.join(env.workdir, "resume_record.pt"))
    return "saved global_step_2"


@check("resume", phase=2)
def resume(env: Env) -> str:
    """A fresh process loads the checkpoint and replays the next 2 steps bit-exactly (losses, grad norms, LR, weights), with dropout: RNG restored."""
    record_path = os.path.join(env.workdir, "resume_record.pt")
    if not os.path.exists(record_path):
        raise CheckFailed("no record from phase 1 (resume_save failed or did not run)")
    want = torch.load(record_path, weights_only=True)
    engine = new_engine(env, *_resume_settings(env))
    step = engine.load_checkpoint(_ckpt_root(env), del_local_after_load=False)
    if step != 2:
        raise CheckFailed(f"load_checkpoint returned step {step}, saved at 2")
    got = {"steps": [window(engine, _local(engine, seed=s)) for s in (2, 3)], "w": weights(engine)}
    same("resumed run vs uninterrupted run", got, want)
    return "steps 3-4 bit-exact"


SENTINEL = "code_ran.txt"


def tamper(workdir: str) -> dict[str, str]:
    """Make tampered copies of phase 1's checkpoint (in the launcher, between the phases):
    one bit flipped in the largest file; the largest file replaced by a pickle that runs code
    when unpickled, with the manifest and marker forged to vouch for it. Returns name -> path."""
    import json
    import pickle

    from engine_api import ckpt_layout
    from engine_api.ckpt_integrity import write_manifest

    src = ckpt_layout.latest_checkpoint(os.path.join(workdir, "ckpt"))
    if src is None:
        return {}
    out = {}
    for name in ("bit_flip", "code_pickle"):
        dst = os.path.join(workdir, f"tampered_{name}")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        files = [os.path.join(r, f) for r, _, fs in os.walk(dst) for f in fs if f not in (ckpt_layout.MARKER, "manifest.json")]
        target = max(files, key=os.path.getsize)
        if name == "bit_flip":
            with open(target, "r+b") as f:
                f.seek(os.path.getsize(target) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x01]))
        else:
            with open(target, "wb") as f:
                pickle.dump(_RunsCode(os.path.join(workdir, SENTINEL)), f)
            marker_path = os.path.join(dst, ckpt_layout.MARKER)
            with open(marker_path) as f:
                marker = json.load(f)
            marker["manifest_sha256"] = write_manifest(dst, exclude=(ckpt_layout.MARKER,))
            with open(marker_path, "w") as f:
                json.dump(marker, f)
        out[name] = dst
    return out


class _RunsCode:
    """Unpickling this writes a file: the payload of the code-running checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_write_sentinel, (self.path,))


def _write_sentinel(path: str) -> None:
    with open(path, "w") as f:
        f.write("a checkpoint ran code on load\n")


@check("tampered_checkpoint", phase=2)
def tampered_checkpoint(env: Env) -> str:
    """A bit-flipped or code-carrying checkpoint is refused with ValueError, runs no code, changes no state."""
    engine = new_engine(env, *_resume_settings(env))
    before = weights(engine)
    refused = []
    for name in ("bit_flip", "code_pickle"):
        path = os.path.join(env.workdir, f"tampered_{name}")
        if not os.path.isdir(path):
            raise CheckFailed(f"no tampered copy {name} (phase 1's checkpoint is missing)")
        try:
            engine.load_checkpoint(path, del_local_after_load=False)
        except ValueError:
            refused.append(name)
        else:
            raise CheckFailed(f"load_checkpoint accepted the {name} checkpoint")
        if os.path.exists(os.path.join(env.workdir, SENTINEL)):
            raise CheckFailed(f"loading the {name} checkpoint ran code from it")
    same("weights after refused loads", {"w": weights(engine)}, {"w": before})
    return f"refused: {', '.join(refused)}; no code ran; state unchanged"
