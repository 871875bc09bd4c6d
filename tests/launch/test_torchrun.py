"""Engines join the launcher's world (issue 13, item 1).

The README's API example run as a script with no process-group code of its own
(``api_script.py``): under ``torchrun --nproc-per-node 2`` every rank must see the 2-process
world, and one train step must leave the same weights on both ranks, equal to the weights of
the same step in one plain ``python`` process (the gradient of a global batch does not depend
on how it is split over ranks; fp32, relative 1e-5). On main before the fix each rank made its
own 1-rank group: ``dp_size == 1`` and each rank's weights moved by its own half of the batch.
Multi-node: two torchrun agents that rendezvous over c10d like two nodes give the SFT recipe
the same losses as one agent with two processes.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.support import launch
from tests.support.hf_utils import make_model, rel

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "api_script.py")
# name: (strategy, overrides, the data-parallel size 2 processes must give)
LAYOUTS = {
    "fsdp-dp2": ("fsdp", [], 2),
    "megatron-dp2": ("megatron", [], 2),
    "megatron-tp2": ("megatron", ["megatron.tensor_model_parallel_size=2"], 1),
    "megatron-pp2": ("megatron", ["megatron.pipeline_model_parallel_size=2"], 1),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama")


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def single_process(model_dir, tmp_path_factory):
    """Per strategy: the script's result in one plain ``python`` process (the reference)."""
    out = {}
    for strategy in ("fsdp", "megatron"):
        run_dir = tmp_path_factory.mktemp(f"single_{strategy}")
        _check(launch.python([SCRIPT, str(run_dir), model_dir, strategy]))
        out[strategy] = torch.load(run_dir / "rank0.pt")
        assert out[strategy]["world_size"] == 1 and out[strategy]["dp_size"] == 1
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchrun_ranks_train_one_model_together(layout, model_dir, single_process, tmp_path):
    strategy, overrides, dp = LAYOUTS[layout]
    _check(launch.torchrun([SCRIPT, str(tmp_path), model_dir, strategy, *overrides], nproc=2))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["dp_size"] for r in ranks] == [dp, dp]
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), f"{name} differs between the ranks"
    reference = single_process[strategy]
    assert rel(ranks[0]["weights"], reference["weights"]) < 1e-5
    assert ranks[0]["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-5)
    assert ranks[0]["metrics"]["grad_norm"] == pytest.approx(reference["metrics"]["grad_norm"], rel=1e-5)
    # The script has no __main__ guard: a checkpoint writer that spawned helpers would have crashed it.
    assert os.path.isfile(tmp_path / "ckpt" / "global_step_1" / "enginekit.json")


def _python_c(code: str, **env: str) -> subprocess.CompletedProcess:
    return launch.python(["-c", code], timeout=120, env=env)


def test_a_one_rank_group_under_a_larger_launcher_world_is_an_error(tmp_path):
    code = (
        "import torch.distributed as dist\n"
        "from engine_api.dist import ensure_process_group\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/rdzv', rank=0, world_size=1)\n"
        "try:\n"
        "    ensure_process_group('gloo')\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    proc = _python_c(code, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    assert "REFUSED" in proc.stdout and "$WORLD_SIZE = 2" in proc.stdout, proc.stdout + proc.stderr


def test_a_partial_launcher_environment_is_an_error_not_a_lone_rank():
    code = (
        "from engine_api.dist import ensure_process_group, is_initialized\n"
        "try:\n"
        "    ensure_process_group('gloo')\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc, is_initialized())\n"
    )
    proc = _python_c(code, WORLD_SIZE="2", RANK="1")
    assert "REFUSED" in proc.stdout and "$MASTER_ADDR" in proc.stdout and proc.stdout.strip().endswith("False"), proc.stdout + proc.stderr


def _sft_losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_two_torchrun_agents_as_two_nodes_match_one_agent_with_two_processes(tmp_path):
    """The multi-node command of docs/launching.md, simulated: two agents, one process each,
    c10d rendezvous on localhost. Same world size, same shards: the same per-step losses."""
    common = ["-m", "recipes.sft", "--config", "configs/sft_tiny.yaml", "trainer.total_steps=4", "trainer.progress_bar=false"]
    common += ["data.eval_batches=1"]
    one, two = tmp_path / "one_agent", tmp_path / "two_agents"
    _check(launch.torchrun([*common, f"trainer.output_dir={one}"], nproc=2))
    agents = launch.torchrun_nodes([*common, f"trainer.output_dir={two}"], nnodes=2)
    for proc in agents:
        _check(proc)
    assert "on 2 rank(s)" in agents[0].stdout + agents[1].stdout
    expected, got = _sft_losses(one), _sft_losses(two)
    assert len(got) == 4
    assert got == pytest.approx(expected, rel=1e-6)
