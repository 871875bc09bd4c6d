"""``trainer.launcher=ray`` against the torchrun runs it replaces: the same losses, rewards and
trained weights at the same data-parallel size, whatever the placement, on one Ray node or two;
a worker that dies is named and everything torn down; a cluster too small is refused.

Each run is a ``python -m recipes.*`` driver (forked from the preloaded server, see
``tests/support/forked.py``; the killed-worker and SIGTERM tests start real interpreters)
starting its own local Ray instance (or joining one started with ``ray start``), as a user
runs it. Tolerance: the same arithmetic in
the same order (one torch thread per rank under both launchers), so float noise only (rel 1e-6).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray  # noqa: F401  (an installed extra: make test installs it; a missing one must fail, not skip)
import torch
from safetensors.torch import load_file

from engine_api import ckpt_layout
from tests.support.launch import REPO, free_port, launch_env, run_script

pytestmark = pytest.mark.slow

# Two workers share each of this machine's cores in the Ray runs below.
HALF_CPU = "trainer.placement.cpus_per_worker=0.5"
COMMON = ["trainer.progress_bar=false", "trainer.loggers=[jsonl]", "trainer.save_hf=true", "engine.dist_timeout_s=120"]
PPO = ["-m", "recipes.ppo", "--config", "configs/ppo_tiny.yaml", *COMMON, "trainer.total_steps=4", "trainer.checkpoint_every=1",
       "trainer.log_samples_every=0", "actor.kl_coef=0.01", "data.batch_size=8"]  # fmt: skip
SFT = ["-m", "recipes.sft", "--config", "configs/sft_tiny.yaml", *COMMON, "trainer.total_steps=6", "trainer.val_every=3",
       "trainer.log_samples_every=3", "data.batch_size=8"]  # fmt: skip
RAY = ["trainer.launcher=ray", HALF_CPU]
PPO_KEYS = ("reward", "actor_loss", "actor_grad_norm", "critic_loss", "critic_grad_norm", "kl", "rollout/logprob_abs_diff_max")
SFT_KEYS = ("loss", "grad_norm", "val/loss")


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _run(cmd: list[str], out: Path, nproc: int = 1, env: dict | None = None) -> Path:
    """``python CMD`` (the Ray driver, or the 1-process baseline) or, with ``nproc``, the torchrun
    baseline, in processes forked from the preloaded server (``launch.run_script``)."""
    args = [*cmd, f"trainer.output_dir={out}"]
    _ok(run_script(args, nproc=nproc, timeout=600, env=env))
    return out


def _metrics(out: Path, keys: tuple[str, ...]) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: r[k] for k in keys if k in r} for r in rows]


def _same_run(got: Path, want: Path, keys: tuple[str, ...]) -> None:
    a, b = _metrics(got, keys), _metrics(want, keys)
    assert len(a) == len(b) and all(row.keys() == ref.keys() for row, ref in zip(a, b, strict=True)), (a, b)
    for row, ref in zip(a, b, strict=True):
        for k in ref:
            assert row[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), (k, a, b)
    wa, wb = load_file(str(got / "hf" / "model.safetensors")), load_file(str(want / "hf" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wb:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-6, atol=1e-7, msg=name)


def _placement(out: Path) -> list[dict]:
    return json.load(open(out / "placement.json"))


@pytest.fixture(scope="module")
def ppo_torchrun(tmp_path_factory) -> Path:
    """PPO (critic, reference) on 2 torchrun ranks: the baseline of the colocated Ray run."""
    return _run(PPO, tmp_path_factory.mktemp("ppo_torchrun"), nproc=2)


@pytest.fixture(scope="module")
def sft_torchrun(tmp_path_factory) -> Path:
    return _run(SFT, tmp_path_factory.mktemp("sft_torchrun"), nproc=2)


def test_split_placements_equal_the_colocated_run(tmp_path):
    """(b) the critic on a pool of its own and (c) the rollout on one of 2 ranks, fed by the
    transfer group, against everything colocated in one process. Both runs also distill from a
    teacher (issue 63: a tiny model of another seed, its reverse-KL advantage added to PPO's at
    weight 1) and add a reward model's scores to the task's (issue 64: a tiny sequence-classification
    model, weight 0.5), which the split run places with the critic, away from the actor."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.tiny_model import build_tiny_model

    rm_dir = str(tmp_path / "rm")
    AutoModelForSequenceClassification.from_pretrained(build_tiny_model(tmp_path / "rm_lm", seed=4), num_labels=1).save_pretrained(rm_dir)
    teacher = ["distill.teacher_path=" + build_tiny_model(tmp_path / "teacher", seed=3), "distill.reward_weight=1.0"]
    teacher += [f"reward.model={rm_dir}", "reward.model_weight=0.5"]
    colocated = _run([*PPO, *teacher], tmp_path / "colocated")
    split = [
        "trainer.placement.pools.train=1",
        "trainer.placement.pools.values=1",
        "trainer.placement.pools.gen=2",
        "trainer.placement.roles.critic=values",
        "trainer.placement.roles.teacher=values",
        "trainer.placement.roles.reward_model=values",
        "trainer.placement.roles.rollout=gen",
    ]
    out = _run([*PPO, *teacher, *RAY, *split], tmp_path / "split")
    _same_run(out, colocated, (*PPO_KEYS, "distill/reverse_kl", "distill/teacher_logprob_mean", "reward/model_mean"))
    assert "distill/reverse_kl" in _metrics(out, ("distill/reverse_kl",))[0]
    ranks = _placement(out)
    assert {(r["pool"], tuple(r["roles"])) for r in ranks} == {
        ("train", ("actor", "reference")),
        ("values", ("critic", "teacher", "reward_model")),
        ("gen", ("rollout",)),
    }
    assert len({r["pid"] for r in ranks}) == 4  # four processes, one per bundle
    sync_mb = [json.loads(line)["rollout/sync_mb"] for line in open(out / "metrics.jsonl")]
    assert all(mb > 0 for mb in sync_mb)  # the weights did travel every step


GRPO_ASYNC = ["-m", "recipes.ppo", "--config", "configs/grpo_tiny.yaml", *COMMON, "trainer.total_steps=5", "data.batch_size=4",
              "algo.n_samples=4", "trainer.log_samples_every=0", "async.max_staleness=2", "trainer.checkpoint_every=1"]  # fmt: skip
ASYNC_KEYS = ("reward", "actor_loss", "actor_grad_norm", "rollout/logprob_abs_diff_max", "async/staleness_max", "async/version_span_max")
ASYNC_SPLIT = ["trainer.placement.pools.train=1", "trainer.placement.pools.gen=1", "trainer.placement.roles.rollout=gen"]


def test_async_rollout_pool_killed_mid_generation_then_resumed_runs_the_in_process_schedule(tmp_path):
    """Issue 43: K = 2 with the rollout on a pool of its own (each round of generation runs in a
    driver thread while the actor updates). Its worker SIGKILLed mid-run: the driver stops
    non-zero naming it, every worker gone; resumed, the run is the one-process run (the rounds
    before the updates) step for step and weight for weight: the schedule depends on the step
    and the data order, not on the layout, the timing or the interruption."""
    local = _run(GRPO_ASYNC, tmp_path / "local")
    out = tmp_path / "split"
    cmd = [sys.executable, *GRPO_ASYNC, *RAY, *ASYNC_SPLIT, f"trainer.output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(ckpt_layout.complete_steps(str(out / "checkpoints" / "actor"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    victim = next(r for r in _placement(out) if r["pool"] == "gen")
    os.kill(victim["pid"], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert f"rollout rank 0 of pool 'gen' (pid {victim['pid']}" in stderr, stderr[-3000:]
    for rank in _placement(out):
        with pytest.raises(ProcessLookupError):
            os.kill(rank["pid"], 0)
    _run([*GRPO_ASYNC, *RAY, *ASYNC_SPLIT, "trainer.resume=true"], out)
    _same_run(out, local, ASYNC_KEYS)
    rows = _metrics(out, ASYNC_KEYS)
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert max(r["async/version_span_max"] for r in rows) == 2.0
    assert open(out / "prompt_ledger.jsonl").read() == open(local / "prompt_ledger.jsonl").read()


def test_sft_on_two_ray_nodes_equals_torchrun(sft_torchrun, tmp_path):
    """SFT on Ray, on a cluster of two nodes started with ``ray start`` (each with 1 CPU, so the 2
    ranks must land on different nodes), joined with ``trainer.ray_address``: the torchrun run,
    samples too. (A local Ray instance, one node: the PPO tests here.)"""
    env = launch_env(RAY_AUTH_MODE="disabled")
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    port = free_port()
    head = ["start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats"]
    try:
        for args in (head, ["start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--disable-usage-stats"]):
            _ok(subprocess.run([*ray_cli, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120))
        extra = [
            "trainer.launcher=ray",
            f"trainer.ray_address=127.0.0.1:{port}",
            "trainer.placement.pools.main=2",
            "trainer.placement.strategy=STRICT_SPREAD",
        ]
        out = _run([*SFT, *extra], tmp_path / "two_nodes", env={"RAY_AUTH_MODE": "disabled"})
    finally:
        subprocess.run([*ray_cli, "stop", "--force"], cwd=REPO, env=env, capture_output=True, timeout=120)
    assert len({r["node_id"] for r in _placement(out)}) == 2
    _same_run(out, sft_torchrun, SFT_KEYS)
    assert open(out / "samples.jsonl").read() == open(sft_torchrun / "samples.jsonl").read()


def test_a_killed_worker_is_named_everything_stops_and_resume_continues(ppo_torchrun, tmp_path):
    """PPO on Ray with every role colocated on 2 ranks: a worker SIGKILLed mid-run is named and
    everything stops; resumed, the run equals the torchrun run at every step and in its weights
    (the steps before the kill and after the resume: one uninterrupted Ray run adds nothing)."""
    out = tmp_path / "run"
    cmd = [sys.executable, *PPO, *RAY, "trainer.placement.pools.main=2", f"trainer.output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300

    def saved() -> bool:  # a step both roles checkpointed completely: what a resume needs
        return all(ckpt_layout.complete_steps(str(out / "checkpoints" / role)) for role in ("actor", "critic"))

    while not saved():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    victim = _placement(out)[1]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    stdout, stderr = proc.communicate(timeout=300)
    # Found by the driver at once, not after a collective timeout (engine.dist_timeout_s = 120 here).
    assert time.monotonic() - killed < 60
    assert proc.returncode != 0
    assert f"actor+reference+critic+rollout rank 1 of pool 'main' (pid {victim['pid']}" in stderr, stderr[-3000:]
    assert "trainer.resume=true" in stderr
    for rank in _placement(out):  # every worker of every group is gone
        with pytest.raises(ProcessLookupError):
            os.kill(rank["pid"], 0)
    resumed = subprocess.run([*cmd, "trainer.resume=true"], cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    _ok(resumed)
    assert "trainer.resume: loaded checkpoint" in resumed.stdout
    _same_run(out, ppo_torchrun, PPO_KEYS)  # the resumed run ends where the uninterrupted one did
    ranks = _placement(out)
    assert [(r["pool"], r["rank"], r["roles"]) for r in ranks] == [("main", i, ["actor", "reference", "critic", "rollout"]) for i in (0, 1)]


def test_sigterm_to_the_driver_saves_at_a_step_boundary_and_stops_every_worker(tmp_path):
    """A scheduler preempting a Ray job signals the driver: the step in flight finishes, every
    rank saves, the workers are stopped and the exit code says preempted (128 + SIGTERM)."""
    out = tmp_path / "run"
    cmd = [sys.executable, *SFT, *RAY, "trainer.placement.pools.main=2", "trainer.total_steps=2000", f"trainer.output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-2000:] + stderr[-3000:]
    stopped = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert f"SIGTERM received: stopped after step {stopped}" in stdout
    assert ckpt_layout.complete_steps(str(out / "checkpoints")) == [stopped]
    for rank in _placement(out):
        with pytest.raises(ProcessLookupError):
            os.kill(rank["pid"], 0)


def test_a_cluster_too_small_is_refused_before_any_model(tmp_path):
    from recipes.sft import main

    out = tmp_path / "big"
    with pytest.raises(ValueError) as err:
        main(
            [
                "--config",
                "configs/sft_tiny.yaml",
                "trainer.launcher=ray",
                "trainer.placement.cpus_per_worker=64",
                f"trainer.output_dir={out}",
            ]
        )
    message = str(err.value)
    assert "64 CPU (main: 1 x 64)" in message and "cpus_per_worker" in message
    assert not (out / "placement.json").exists() and not (out / "checkpoints").exists()
    # A strategy one node cannot satisfy: two bundles that must be on different nodes.
    with pytest.raises(ValueError) as err:
        main([
            "--config", "configs/sft_tiny.yaml", "trainer.launcher=ray", HALF_CPU, "trainer.placement.pools.main=2",
            "trainer.placement.strategy=STRICT_SPREAD", "trainer.placement.ready_timeout_s=5", f"trainer.output_dir={out}",
        ])  # fmt: skip
    assert "did not grant pool(s) ['main']" in str(err.value)


# The rollout on a pool of its own, served by vLLM: every step's LoRA adapters, gathered from a
# TP-sharded megatron actor, arrive over the transfer group and vLLM serves them with its own LoRA.
# Trainer and rollout log-probs equal at float noise at every step is the proof that what arrived
# is the actor's current adapters (a stale or garbled sync shows as a gap). (Full weights over the
# transfer group: test_split_placements_equal_the_colocated_run; from megatron TP=2 to vLLM, and
# FSDP's adapters to vLLM: tests/recipes/test_vllm_rollout.py.)
VLLM_SPLIT = {
    "megatron-tp2-lora": [
        "engine.strategy=megatron", "engine.megatron.tensor_model_parallel_size=2", "trainer.placement.pools.train=2",
        "engine.model.lora.rank=8", "engine.optim.lr=1e-2",
    ],
}  # fmt: skip


@pytest.mark.parametrize("layout", list(VLLM_SPLIT))
def test_vllm_rollout_on_its_own_pool_samples_from_the_current_weights(layout, tmp_path):
    pytest.importorskip("vllm", reason="vllm not installed (make test installs it)")
    args = ["-m", "recipes.ppo", "--config", "configs/grpo_tiny.yaml", f"trainer.output_dir={tmp_path}", "trainer.total_steps=3",
            "trainer.progress_bar=false", "trainer.loggers=[jsonl]", "trainer.log_samples_every=0", "data.batch_size=8",
            "algo.n_samples=4", "rollout.backend=vllm", *RAY, *VLLM_SPLIT[layout],
            "trainer.placement.pools.gen=1", "trainer.placement.roles.rollout=gen"]  # fmt: skip
    _ok(run_script(args, timeout=600))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 3
    model_mb = sum(f.stat().st_size for f in (tmp_path / "tiny_model").glob("*.safetensors")) / 2**20
    for row in rows:
        assert row["rollout/logprob_abs_diff_max"] <= 1e-4 and row["rollout/weight_version_lag"] == 0, row
        assert 0 < row["rollout/sync_mb"] < model_mb / 4 and row["actor_grad_norm"] > 0, (model_mb, row)  # the adapters alone
    assert {r["pool"] for r in _placement(tmp_path)} == {"train", "gen"}


def test_an_error_raised_in_the_workers_reaches_the_driver_as_itself(tmp_path):
    """Bad input found on the ranks (here a batch that does not split over 2 data-parallel
    ranks) is the same ValueError, with the same fix, as under torchrun, plus where it was raised."""
    from recipes.sft import main

    args = ["--config", "configs/sft_tiny.yaml", "trainer.launcher=ray", HALF_CPU, "trainer.placement.pools.main=2", "data.batch_size=3"]
    with pytest.raises(ValueError) as err:
        main([*args, f"trainer.output_dir={tmp_path}"])
    assert "data.batch_size = 3: not a multiple of the 2 data-parallel ranks; fix: use a multiple of 2" in str(err.value)
    assert any("raised in the actor rank" in note and "of pool 'main'" in note for note in err.value.__notes__)
