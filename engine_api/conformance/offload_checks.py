"""The conformance check of offload: training and inference with ``offload.param`` and
``offload.optimizer`` bit-identical to without, the storage the state used while loaded
released by an offload (on a CPU-only machine too), and ``engine.offloaded`` right at each
stage."""

from __future__ import annotations

import torch

from engine_api.conformance.checks import CheckFailed, Env, _local, check, new_engine, same, weights, window


def _offload_stages(engine) -> list[tuple[str, dict, dict]]:
    """``(stage, engine.offloaded, expected)`` after init, in ``train_mode``, in ``eval_mode``
    and after it, for an engine built with ``offload.param`` and ``offload.optimizer``."""
    off, on = {"model": True, "optimizer": True}, {"model": False, "optimizer": False}
    stages = [("after init", engine.offloaded, off)]
    with engine.train_mode():
        stages.append(("in train_mode", engine.offloaded, on))
    with engine.eval_mode():
        stages.append(("in eval_mode", engine.offloaded, {"model": False, "optimizer": True}))
    stages.append(("after eval_mode", engine.offloaded, off))
    return stages


def _storages(engine) -> dict[str, list]:
    """Weak references to the distinct non-empty storages of ``engine.state_tensors`` per
    part (weak: holding them must not keep the memory alive), with their devices."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = {}
    for kind in ("model", "optimizer"):
        seen = {}
        for t in engine.state_tensors(kind):
            storage = t.untyped_storage()
            if storage.nbytes():
                seen.setdefault(storage.data_ptr(), (StorageWeakRef(storage), t.device))
        out[kind] = list(seen.values())
    return out


def _still_allocated(refs: list) -> int:
    """How many of ``refs`` still hold bytes (neither freed nor resized to 0 in place)."""
    alive = 0
    for ref, _ in refs:
        storage = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        alive += storage is not None and storage.nbytes() > 0
        del storage
    return alive


def _check_released(engine, loaded: dict[str, list]) -> str:
    """After an offload of both parts: every storage seen while loaded is released, and no
    tensor of the engine's state holds bytes on the compute device (on a GPU)."""
    for kind, refs in loaded.items():
        if not refs:
            raise CheckFailed(
                f"engine.state_tensors({kind!r}) gave nothing after an optimizer step: the kit cannot see where the {kind} lives; "
                "fix: override BaseEngine.state_tensors to yield it"
            )
        alive = _still_allocated(refs)
        if alive:
            raise CheckFailed(
                f"after the offload, {alive} of the {len(refs)} {kind} storages used in train_mode are still allocated "
                f"(engine.offloaded says {engine.offloaded}): the offload freed nothing; fix: copy into host memory and release "
                "the loaded storage (kit.relocate_module / relocate_state, BaseEngine._move's default), on a CPU-only machine too"
            )
    for kind in ("model", "optimizer"):
        resident = [t.device for t in engine.state_tensors(kind) if t.device.type != "cpu" and t.untyped_storage().nbytes()]
        if resident:
            raise CheckFailed(f"after the offload, {len(resident)} {kind} tensors still hold bytes on {resident[0]}")
    return f"{len(loaded['model'])} model and {len(loaded['optimizer'])} optimizer storages released"


@check("offload")
def offload(env: Env) -> str:
    """offload.param/optimizer round trips through train/eval modes train bit-identically to
    no offload, an offload releases the storage the state used while loaded (on a CPU-only
    machine too), and ``engine.offloaded`` (the base's record) is right at each stage."""
    results, stages, released = [], [], ""
    for extra in (["offload.param=true", "offload.optimizer=true"], []):
        engine = new_engine(env, *extra)
        if extra:
            stages = _offload_stages(engine)
            loaded: dict[str, list] = {}
            steps = [window(engine, _local(engine, seed=0), inside=lambda e=engine, out=loaded: out.update(_storages(e)))]
            released = _check_released(engine, loaded)
            steps.append(window(engine, _local(engine, seed=1)))
        else:
            steps = [window(engine, _local(engine, seed=s)) for s in (0, 1)]
        with engine.eval_mode():
            out = engine.infer_batch(_local(engine))
        lp = None if out is None else out["log_probs"].values().detach().cpu().clone()
        with engine.train_mode():
            pass  # one more load / offload cycle
        results.append({"steps": steps, "w": weights(engine), "lp": lp})
    same(
        "training with offload vs without",
        {"steps": results[0]["steps"], "w": results[0]["w"]},
        {"steps": results[1]["steps"], "w": results[1]["w"]},
    )
    if results[1]["lp"] is not None and not torch.equal(results[0]["lp"], results[1]["lp"]):
        raise CheckFailed("inference after offload differs from inference without it")
    for stage, got, want in stages:
        if got != want:
            raise CheckFailed(f"engine.offloaded {stage} is {got}, want {want}")
    return f"2 steps + inference bit-exact; {released}; offload record right at every stage"
