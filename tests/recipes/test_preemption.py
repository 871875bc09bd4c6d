"""A job told to stop (SIGTERM from a scheduler or torchrun, SIGINT from Ctrl-C) saves at the
next step boundary, exits with 128 + the signal, and ``trainer.resume`` continues exactly: the
resumed steps equal an uninterrupted run's (``posttrain.preemption``).

The signal arrives at a random point of a step (whenever the test sees a few steps logged), so
the stop step differs run to run; every assertion is about that step, read from the log.

The signalled runs are real interpreters (and a real torchrun agent): how the process takes a
signal is the subject. The resumed and the reference runs are forked from the preloaded server
(``launch.run_script``): what they prove is the resume itself.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_api import ckpt_layout
from tests.support.launch import REPO, launch_env, run_script

# The demo's cosine schedule spans trainer.total_steps: pinned, so the stopped, the resumed and
# the reference run (each with its own total_steps) share one schedule.
SFT = ["-m", "recipes.sft", "--config", "configs/sft_tiny.yaml", "trainer.progress_bar=false", "data.eval_batches=0"]
SFT += ["engine.optim.total_steps=2000"]
GRPO = ["-m", "recipes.ppo", "--config", "configs/grpo_tiny.yaml", "trainer.progress_bar=false", "data.batch_size=4", "algo.n_samples=4"]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _interrupt(cmd: list[str], out: Path, sig: int, after_steps: int, torchrun: int = 0) -> tuple[subprocess.CompletedProcess, int]:
    """Start ``cmd``, send ``sig`` once ``after_steps`` steps are logged; return the finished
    process and the last step it logged."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"] if torchrun else [sys.executable]
    )
    proc = subprocess.Popen([*launcher, *cmd], cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(_rows(out)) < after_steps:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run logged too few steps"
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), _rows(out)[-1]["step"]


def _losses(out: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in _rows(out)}


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_resume_is_exact(tmp_path):
    out = tmp_path / "run"
    args = [*SFT, f"trainer.output_dir={out}", "trainer.total_steps=2000", "trainer.checkpoint_every=0"]
    proc, stopped = _interrupt(args, out, signal.SIGTERM, after_steps=3)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    # checkpoint_every=0 saves nothing on its own: this checkpoint is the preemption's, of the last logged step.
    assert ckpt_layout.complete_steps(str(out / "checkpoints")) == [stopped]
    assert f"SIGTERM received: stopped after step {stopped}" in proc.stdout

    total = stopped + 4
    # A step is a position in the data order: resumed in another order, prompts would be skipped
    # and others repeated; refused before anything is loaded, naming the key (issue 53, item 11, SFT).
    other = run_script([*SFT, f"trainer.output_dir={out}", f"trainer.total_steps={total}", "trainer.resume=true", "data.batch_size=16"])
    assert other.returncode == 2 and "data.batch_size" in other.stderr and "Traceback" not in other.stderr, other.stderr[-3000:]
    resumed = run_script([*SFT, f"trainer.output_dir={out}", f"trainer.total_steps={total}", "trainer.resume=true"], timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    checkpoint = out / "checkpoints" / f"{ckpt_layout.PREFIX}{stopped}"
    assert f"trainer.resume: loaded checkpoint {checkpoint} (step {stopped})" in resumed.stdout

    ref = tmp_path / "ref"
    full = run_script([*SFT, f"trainer.output_dir={ref}", f"trainer.total_steps={total}"], timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    split, whole = _losses(out, "loss"), _losses(ref, "loss")
    assert sorted(split) == list(range(1, total + 1))  # one line per step across the stop
    assert split == whole  # bit-exact: same process count, same kernels, state restored


@pytest.mark.slow
def test_sigint_stops_rl_at_a_step_boundary_with_its_own_exit_code_and_resumes(tmp_path):
    out = tmp_path / "run"
    args = [*GRPO, f"trainer.output_dir={out}", "trainer.total_steps=400"]
    proc, stopped = _interrupt(args, out, signal.SIGINT, after_steps=2)
    assert proc.returncode == 128 + signal.SIGINT, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "KeyboardInterrupt" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert ckpt_layout.complete_steps(str(out / "checkpoints" / "actor")) == [stopped]
    # GRPO has no critic: the message names the actor's checkpoint only (issue 53, item 24)
    assert f"checkpoints/actor/global_step_{stopped}" in proc.stdout and "critic" not in proc.stdout, proc.stdout[-2000:]
    # With the progress bar off, a console line per step all the same (trainer.log_every = 1).
    assert all(f"step {s}/400 | actor_loss " in proc.stdout for s in range(1, stopped + 1)), proc.stdout[-2000:]

    total = stopped + 2
    resumed = run_script([*GRPO, f"trainer.output_dir={out}", f"trainer.total_steps={total}", "trainer.resume=true"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {stopped}); continuing at step {stopped + 1}" in resumed.stdout
    ref = tmp_path / "ref"
    assert run_script([*GRPO, f"trainer.output_dir={ref}", f"trainer.total_steps={total}"], timeout=300).returncode == 0
    assert _losses(out, "actor_loss") == _losses(ref, "actor_loss")
    assert _losses(out, "reward") == _losses(ref, "reward")


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_at_the_same_step(tmp_path):
    """The realistic preemption: the scheduler signals the torchrun agent, which forwards SIGTERM
    to each worker at its own moment; the ranks agree on one stop step and save one complete
    checkpoint of it, which a new run resumes."""
    out = tmp_path / "run"
    args = [*SFT, f"trainer.output_dir={out}", "trainer.total_steps=2000"]
    proc, stopped = _interrupt(args, out, signal.SIGTERM, after_steps=3, torchrun=2)
    assert proc.returncode != 0  # torchrun reports the stop; the workers' own code is 143
    assert f"SIGTERM received: stopped after step {stopped}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ckpt_layout.complete_steps(str(out / "checkpoints")) == [stopped]
    resumed = run_script([*SFT, f"trainer.output_dir={out}", f"trainer.total_steps={stopped + 2}", "trainer.resume=true"], nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"(step {stopped}); continuing at step {stopped + 1}" in resumed.stdout
    assert sorted(_losses(out, "loss")) == list(range(1, stopped + 3))


# The signal at a chosen moment after training: the stage's method signals its own process once
# (as a scheduler's SIGTERM would land there), then does its work.
_SIGNAL_IN = """
import os, signal, sys
import recipes.sft as sft

stage = sys.argv.pop(1)
original = getattr(sft.SFTWorker, stage)

def signalled(self, *args, **kwargs):
    print("STAGE CALLED", *args, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    return original(self, *args, **kwargs)

setattr(sft.SFTWorker, stage, signalled)
sft.main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["eval_counts", "save_hf"])
def test_sigterm_after_the_last_step_keeps_the_trained_state(stage, tmp_path):
    """SIGTERM during the final evaluation or the HF export, with no checkpoint saved so far
    (``checkpoint_every: 0``): the trained state is saved, the run exits 128 + SIGTERM, no
    ``hf.tmp`` is left; a resume completes the run (evaluation and export). An export in progress
    completes; the evaluation (4 batches, checked for a signal between them) stops after the
    part in progress, so the save is not held up by a long evaluation (issue 53, item 19: an
    evaluation of ~70 s went past a 30 s grace period)."""
    out = tmp_path / "run"
    args = [
        *SFT[2:],
        "trainer.total_steps=3",
        "trainer.checkpoint_every=0",
        "trainer.save_hf=true",
        "trainer.val_every=0",
        "data.eval_batches=4",
    ]
    args.append(f"trainer.output_dir={out}")
    stopped = run_script(["-c", _SIGNAL_IN, stage, *args], timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    assert "SIGTERM received: stopped after step 3" in stopped.stdout
    if stage == "eval_counts":  # one part of one batch evaluated, not the 4 of the whole evaluation
        assert [line.split()[2:] for line in stopped.stdout.splitlines() if line.startswith("STAGE CALLED")] == [["0", "1"]], stopped.stdout
    assert ckpt_layout.complete_steps(str(out / "checkpoints")) == [3]
    assert not (out / "hf.tmp").exists()
    assert (out / "hf" / "model.safetensors").exists() == (stage == "save_hf")  # an export in progress completes
    resumed = run_script([*SFT[:2], *args, "trainer.resume=true"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "hf" / "model.safetensors").exists() and [r["step"] for r in _rows(out)] == [1, 2, 3]


_SIGNAL_WHILE_BUILDING = """
import os, signal, sys
import recipes.ppo as ppo

original = ppo.place_roles

def building(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's SIGTERM lands during minutes of engine start-up
    return original(*args, **kwargs)

ppo.place_roles = building
ppo.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_sigterm_while_the_engines_start_ends_the_run_in_one_line(tmp_path):
    """Before the first step there is nothing to save: a signal while the engines are built (vLLM
    start-up and its kernel compile, on CPU minutes) ends the run with 128 + SIGTERM and one line
    saying so, not the library's crash dump."""
    out = tmp_path / "run"
    stopped = run_script(["-c", _SIGNAL_WHILE_BUILDING, *GRPO[2:], "trainer.total_steps=2", f"trainer.output_dir={out}"], timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    assert "SIGTERM received while building the engines (before the first step): nothing trained" in stopped.stderr
    assert "Traceback" not in stopped.stderr and len(stopped.stderr) < 2000, stopped.stderr
    assert not (out / "metrics.jsonl").exists()
