"""FSDPEngine state: offload, exact resume, retention, remote copy, export, non-finite skip."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tests.backends.hf_utils import engine_for, full_params, hf_log_probs_of, make_model, make_test_batch, max_abs_diff
from tests.dist_harness import run_distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_model(root / family, family) for family in ("llama", "qwen2")}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _state_devices(engine) -> set[str]:
    devices = set()
    for p in engine.model.parameters():
        devices.add(str(_local(p).device))
        if p.grad is not None:
            devices.add(str(_local(p.grad).device))
    for state in engine.optimizer.state.values():
        devices |= {str(_local(v).device) for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"}
    return devices


def test_offload_places_everything_where_it_claims_and_keeps_the_result(models):
    """On CPU the compute device is the CPU too, so placement is checked against what the
    engine records; on GPU the same test checks that CUDA memory is released."""
    batch = make_test_batch()
    plain, offloaded = engine_for(models["llama"]), engine_for(models["llama"], "offload.param=true", "offload.optimizer=true")
    results = []
    for engine in (plain, offloaded):
        for _ in range(2):
            with engine.train_mode():
                m = engine.train_batch(batch)
            with engine.eval_mode():
                engine.infer_batch(batch)
        results.append((m["loss"], full_params(engine)))
    assert offloaded.placement == {"model": torch.device("cpu"), "optimizer": torch.device("cpu")}
    assert _state_devices(offloaded) == {"cpu"}
    if torch.cuda.is_available():
        assert torch.cuda.memory_allocated() < 1 << 20
    assert results[0][0] == results[1][0]
    assert all(torch.equal(results[0][1][k], v) for k, v in results[1][1].items())


def _train(engine, steps, seed0):
    losses = []
    for s in range(steps):
        with engine.train_mode():
            losses.append(engine.train_batch(engine.shard_data(make_test_batch(seed=seed0 + s)))["loss"])
    return losses


def _resume_run(rank, world, model_dir, ckpt_dir):
    """Train 1 step, save, train 2 more; a fresh engine loads and does the same 2 steps."""
    overrides = ["micro_batch_size=1", "optim.lr_schedule=cosine", "optim.total_steps=5", "optim.warmup_steps=1"]
    first = engine_for(model_dir, *overrides)
    _train(first, 1, seed0=0)
    first.save_checkpoint(ckpt_dir, global_step=1)
    continued = _train(first, 2, seed0=1)
    second = engine_for(model_dir, *overrides)
    step = second.load_checkpoint(ckpt_dir)
    resumed = _train(second, 2, seed0=1)
    return step, continued, resumed, full_params(first), full_params(second), first.scheduler.get_last_lr(), second.scheduler.get_last_lr()


def _check_resume(result):
    step, continued, resumed, p1, p2, lr1, lr2 = result
    assert step == 1
    assert continued == resumed  # bit-identical losses
    assert lr1 == lr2
    assert all(torch.equal(p1[k], p2[k]) for k in p1), "params differ after resume"


def test_exact_resume_single_process(models, tmp_path):
    _check_resume(_resume_run(0, 1, models["llama"], str(tmp_path / "ckpt")))


def test_exact_resume_two_processes(models, tmp_path):
    for result in run_distributed(_resume_run, 2, models["qwen2"], str(tmp_path / "ckpt"), timeout=300):
        _check_resume(result)


def test_retention_and_remote_copy(models, tmp_path):
    engine = engine_for(models["llama"])
    root, remote = tmp_path / "ckpt", f"file://{tmp_path / 'remote' / 'step3'}"
    for step in (1, 2, 3):
        _train(engine, 1, seed0=step)
        engine.save_checkpoint(str(root), hdfs_path=remote if step == 3 else None, global_step=step, max_ckpt_to_keep=2)
    assert sorted(os.listdir(root)) == ["global_step_2", "global_step_3", "latest_checkpointed_iteration.txt"]
    want = full_params(engine)
    fresh = engine_for(models["llama"])
    assert fresh.load_checkpoint(str(tmp_path / "nothing_here"), hdfs_path=remote) == 3
    got = full_params(fresh)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert os.path.isdir(tmp_path / "remote" / "step3")  # the remote copy itself is never deleted


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_exported_weights_reproduce_engine_log_probs_in_plain_hf(models, family):
    engine = engine_for(models[family])
    _train(engine, 1, seed0=0)  # exported weights must be the trained ones, not the checkpoint's
    batch = make_test_batch(seed=5)
    with engine.eval_mode():
        ours = engine.infer_batch(batch)["log_probs"]
    hf = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(dict(engine.export_weights()), strict=False)
    assert not unexpected and not [k for k in missing if k != "lm_head.weight"]  # tied head may be implicit
    assert max_abs_diff(ours, hf_log_probs_of(hf.eval(), batch)) <= 1e-5


def test_non_finite_grad_norm_skips_the_step(models):
    engine = engine_for(models["llama"])
    _train(engine, 1, seed0=0)
    before = full_params(engine)
    steps_before = {k: float(v["step"]) for k, v in engine.optimizer.state.items()}
    engine.set_loss_fn(lambda mb, out, norm: (out["log_probs"].values().sum() * math.inf, {}))
    with engine.train_mode():
        metrics = engine.train_batch(make_test_batch())
    assert not math.isfinite(metrics["grad_norm"]) and metrics["step_skipped"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in full_params(engine).items())
    assert {k: float(v["step"]) for k, v in engine.optimizer.state.items()} == steps_before
    assert engine.global_step == 1
