"""Offload placement through the contract (issue 19), on every built-in backend.

On a CPU-only machine the compute device is the CPU, so an FSDP offload moves no bytes and a
test of tensor devices alone cannot tell whether ``train_mode`` loaded the optimizer state
back. The engine therefore keeps a record, ``engine.offloaded`` (``BaseEngine.offloaded``),
that changes exactly as on a GPU, and refuses to compute on a part the record calls
offloaded. These tests follow one engine through init, ``train_mode``, a step,
``eval_mode``, calls outside any mode, export, save and manual ``to``, and check at each
stage

* the record (and ``placement``, derived from it), against what the stage must leave;
* where each part's tensors really are: the device type, or "freed" for megatron, which
  frees offloaded storage in place (on CPU as on GPU, so its half means bytes everywhere);
* that compute on an offloaded part raises and changes nothing.

The GPU half (``gpu`` marker) checks the same stages on CUDA, where the FSDP tensors must
really be on ``cuda`` when loaded and on the CPU when offloaded, and live CUDA memory must
fall to (almost) nothing after each offload.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.reliability._step_common import local_batch, new_engine, run, snapshot, snapshot_diff, torch_optimizers, worker_setup
from tests.reliability._step_memory import cuda_bytes

CUDA = torch.cuda.is_available()
CUDA_SLACK = 1 << 20  # what may stay on the device after an offload (allocator bookkeeping)


def _where(t: torch.Tensor) -> str:
    t = t.to_local() if isinstance(t, DTensor) else t
    # megatron offloads by freeing the storage in place and keeping a host copy elsewhere
    return "freed" if t.untyped_storage().nbytes() == 0 and t.numel() > 0 else t.device.type


def _part_tensors(engine, strategy: str) -> dict[str, list[torch.Tensor]]:
    if strategy == "megatron":
        model = list(engine._model_tensors())
        # fp32 on CPU: megatron's optimizer steps the model's own parameters (no separate
        # main copy); those are the model's part, offloaded and loaded with it.
        ids = {id(t) for t in model}
        return {"model": model, "optimizer": [t for t in engine._optimizer_tensors() if id(t) not in ids]}
    model = [p for p in engine.model.parameters()] + [p.grad for p in engine.model.parameters() if p.grad is not None]
    optim = [
        v
        for opt in torch_optimizers(engine.optimizer)
        for state in opt.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step"  # AdamW keeps its step count on the CPU by design
    ]
    return {"model": model, "optimizer": optim}


def _stage(engine, strategy: str) -> dict:
    return {
        "device": str(engine.device),
        "offloaded": engine.offloaded,
        "placement": {k: str(v) for k, v in engine.placement.items()},
        "tensors": {part: sorted({_where(t) for t in ts}) for part, ts in _part_tensors(engine, strategy).items()},
        "cuda_bytes": cuda_bytes(),
    }


def _window(engine) -> tuple:
    """What a snapshot does not hold: the accumulation window and which params hold a grad
    (read without touching the grads' storage, which megatron frees while offloaded)."""
    chunks = engine.model if isinstance(engine.model, list) else [engine.model]
    grads = tuple(p.grad is not None for chunk in chunks for p in chunk.parameters())
    return engine.deferred.counts, engine.deferred.nonfinite_loss, grads


def _refusals(engine, batch) -> dict:
    """Compute calls outside any mode: each must raise RuntimeError (None: it ran)."""
    calls = {
        "train_batch": lambda: engine.train_batch(batch),
        "infer_batch": lambda: engine.infer_batch(batch),
        "optimizer_step": engine.optimizer_step,
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


def _follow(strategy: str, model_dir: str, ckpt_dir: str, offload: bool) -> dict:
    engine = new_engine(strategy, model_dir, f"offload.param={offload}", f"offload.optimizer={offload}")
    batch = local_batch(engine, seed=0)
    rec = {"init": _stage(engine, strategy)}
    with engine.train_mode():
        rec["in train_mode"] = _stage(engine, strategy)
        engine.train_batch(batch)
        rec["in train_mode, after a step"] = _stage(engine, strategy)
    rec["after train_mode"] = _stage(engine, strategy)
    with engine.eval_mode():
        engine.infer_batch(batch)
        rec["in eval_mode"] = _stage(engine, strategy)
    rec["after eval_mode"] = _stage(engine, strategy)
    if not offload:
        rec["param_bytes"] = sum(t.numel() * t.element_size() for _, t in engine.export_weights())
        return rec
    window_before = _window(engine)
    before = snapshot(engine)
    rec["refused"] = _refusals(engine, batch)
    rec["refused trace"] = snapshot_diff(before, snapshot(engine)) + (["window"] if _window(engine) != window_before else [])
    rec["after refusals"] = _stage(engine, strategy)
    # Only the model loaded: a step must still refuse, naming the optimizer.
    engine.to(engine.device, model=True, optimizer=False)
    rec["to(device, model only)"] = _stage(engine, strategy)
    rec["step with the optimizer offloaded"] = _refusals(engine, batch)["optimizer_step"]
    engine.to("cpu", model=True, optimizer=True)  # on a CPU-only machine "cpu" *is* the compute device
    rec["to('cpu')"] = _stage(engine, strategy)
    try:
        engine.to("meta")
        rec["to('meta')"] = None
    except ValueError as exc:
        rec["to('meta')"] = str(exc)
    rec["after to('meta')"] = _stage(engine, strategy)
    with engine.train_mode():
        pass
    rec["after another train_mode"] = _stage(engine, strategy)
    for _ in engine.export_weights():  # loads the model for the export, offloads it after
        pass
    rec["after export"] = _stage(engine, strategy)
    engine.save_checkpoint(ckpt_dir, global_step=1)
    rec["after save"] = _stage(engine, strategy)
    engine.load_checkpoint(ckpt_dir)
    rec["after load"] = _stage(engine, strategy)
    return rec


def record_worker(rank, world, strategy, model_dir, ckpt_dir):
    worker_setup()
    if CUDA:
        # as in test_offload_integrity: a plain single-GPU job, the engine makes its own group
        dist.destroy_process_group()
    return {offload: _follow(strategy, model_dir, f"{ckpt_dir}/{offload}", offload) for offload in (True, False)}


@pytest.fixture(scope="module")
def followed(backend, model_dir, tmp_path_factory):
    # on a GPU the worker replaces the group: new ranks there
    return run(record_worker, 1, backend, model_dir, str(tmp_path_factory.mktemp("ckpt")), fresh=CUDA)[0]


DEVICE = "cuda" if CUDA else "cpu"
LOADED = {"model": False, "optimizer": False}
OFFLOADED = {"model": True, "optimizer": True}
EVAL = {"model": False, "optimizer": True}  # eval_mode loads the params only


def _offloaded_where(backend: str) -> str:
    return "freed" if backend == "megatron" else "cpu"


def _check(stage: dict, want: dict, backend: str, label: str, tensors: bool = True) -> None:
    assert stage["offloaded"] == want, f"{label}: offloaded {stage['offloaded']}, want {want}"
    placement = {k: "cpu" if off else stage["device"] for k, off in want.items()}
    assert stage["placement"] == placement, f"{label}: placement {stage['placement']}"
    if not tensors:
        return
    for part, off in want.items():
        got = stage["tensors"][part]
        if not got:  # no optimizer state before the first step
            continue
        expect = [_offloaded_where(backend)] if off else [DEVICE]
        assert got == expect, f"{label}: {part} tensors are {got}, want {expect}"


OFFLOAD_STAGES = {
    "init": OFFLOADED,
    "in train_mode": LOADED,
    "in train_mode, after a step": LOADED,
    "after train_mode": OFFLOADED,
    "in eval_mode": EVAL,
    "after eval_mode": OFFLOADED,
    "after refusals": OFFLOADED,
    "to(device, model only)": EVAL,
    "after to('meta')": LOADED if not CUDA else OFFLOADED,
    "after another train_mode": OFFLOADED,
    "after export": OFFLOADED,
    "after save": OFFLOADED,
    "after load": OFFLOADED,
}


@pytest.mark.parametrize("stage", list(OFFLOAD_STAGES))
def test_offload_record_and_tensors_follow_every_stage(followed, backend, stage):
    _check(followed[True][stage], OFFLOAD_STAGES[stage], backend, stage)


def test_without_offload_everything_stays_loaded(followed, backend):
    for stage, got in followed[False].items():
        if stage != "param_bytes":
            _check(got, LOADED, backend, stage)


def test_compute_on_an_offloaded_part_raises_and_changes_nothing(followed):
    r = followed[True]
    for call, error in r["refused"].items():
        assert error is not None, f"{call} ran with everything offloaded"
        assert "model is offloaded" in error and "fix:" in error and "train_mode" in error, f"{call}: {error}"
    assert r["refused trace"] == [], r["refused trace"]
    error = r["step with the optimizer offloaded"]
    assert error is not None and "optimizer is offloaded" in error, error


def test_to_reads_the_compute_device_as_load_and_refuses_other_devices(followed):
    r = followed[True]
    # On a CPU-only machine "cpu" is the compute device: to("cpu") loads (as documented).
    assert r["to('cpu')"]["offloaded"] == (OFFLOADED if CUDA else LOADED)
    assert r["to('meta')"] is not None and "'meta'" in r["to('meta')"] and "fix:" in r["to('meta')"], r["to('meta')"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (GPU-only path); run on a GPU machine")
def test_offload_releases_cuda_memory_at_every_offloaded_stage(followed):
    """Live CUDA bytes: (almost) none at every offloaded stage, and at least two parameter
    copies (params + grads) fewer than the same stage without offload after a step."""
    on, off = followed[True], followed[False]
    for stage, want in OFFLOAD_STAGES.items():
        if want == OFFLOADED:
            assert on[stage]["cuda_bytes"] <= CUDA_SLACK, f"{stage}: {on[stage]['cuda_bytes']} CUDA bytes live"
    for stage in ("after train_mode", "after eval_mode"):
        freed = off[stage]["cuda_bytes"] - on[stage]["cuda_bytes"]
        assert freed >= 2 * off["param_bytes"], f"{stage}: offload freed {freed} bytes of a {off['param_bytes']}-byte model"
    assert on["in eval_mode"]["cuda_bytes"] < on["in train_mode, after a step"]["cuda_bytes"]
