"""Exact resume in a fresh process (issue 6, item 1), for every registered HF backend at 1 and 2
ranks (megatron: data parallel, distributed optimizer, tensor and pipeline parallel).

A run trains K steps on data drawn from the global RNGs, saves, and trains N more; processes
that never trained load the checkpoint and train the same N steps. Bit for bit (``==`` /
``torch.equal``, no tolerance): right after the load, the full training state equals the saving
run's at the save (params, every optimizer-state tensor, LRs, scheduler state, step counter,
torch / numpy / python RNGs and megatron's RNG tracker); then every per-step metric (loss, grad
norm, lr, the data drawn) and the final state equal the uninterrupted run's.

tests/backends/test_fsdp_state.py and test_megatron.py resume inside the *same* process, where a
state the checkpoint forgot can survive in memory; here it cannot. The PPO recipe's resume at 2
ranks is at the end (1 rank: tests/recipes/test_ppo.py).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.reliability import _ckpt_targets as T
from tests.reliability._ckpt_state import state_diff
from tests.reliability._step_common import BACKENDS, two_rank_layouts
from tests.support.hf_utils import make_model
from tests.support.launch import RankError, run_distributed
from tests.support.megatron_workers import LAYOUTS as MEGATRON_LAYOUTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resume_layouts(strategy: str, world: int) -> dict[str, list[str]]:
    """Layouts a backend resumes at: 1 rank, or the suite's 2-rank layouts (megatron adds the
    distributed optimizer, whose checkpoint shards the optimizer state, and pipeline stages)."""
    if world == 1:
        return {"single": []}
    extra = {k: MEGATRON_LAYOUTS[k] for k in ("dp2-distopt", "pp2")} if strategy == "megatron" else {}
    return {**two_rank_layouts(strategy), **extra}


CASES = [(s, w, layout) for s in BACKENDS for w in (1, 2) for layout in resume_layouts(s, w)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per (backend, world size), computed on first use: the saving run's and the resumed
    run's results by layout, each a list by rank."""
    model_dir = make_model(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2")  # tied embeddings + qkv bias
    cache: dict = {}

    def get(strategy: str, world: int) -> tuple[list, list]:
        if (strategy, world) not in cache:
            root, layouts = str(tmp_path_factory.mktemp(f"resume_{strategy}_{world}")), resume_layouts(strategy, world)
            args = (strategy, model_dir, root, layouts)
            # New ranks for each half, as a resumed job has: nothing in memory carries over.
            first = run_distributed(T.resume_first, world, *args, timeout=400, fresh=True)
            second = run_distributed(T.resume_second, world, *args, timeout=400, fresh=True)
            cache[strategy, world] = (first, second)
        return cache[strategy, world]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy,world,layout", CASES, ids=[f"{s}-{w}rank-{layout}" for s, w, layout in CASES])
def test_fresh_process_resume_is_bit_identical(runs, strategy, world, layout):
    first, second = runs(strategy, world)
    for rank in range(world):
        a, b = first[rank][layout], second[rank][layout]
        assert b["loaded_step"] == a["at_save"]["step"] == T.K_STEPS
        diff = state_diff(a["at_save"], b["after_load"])
        assert not diff, f"rank {rank}: state after load differs from the state saved: {diff}"
        assert b["after"] == a["after"], f"rank {rank}: per-step metrics after resume differ:\n{b['after']}\nvs\n{a['after']}"
        diff = state_diff(a["end"], b["end"])
        assert not diff, f"rank {rank}: state {T.N_STEPS} steps after resume differs: {diff}"
    # The comparison has teeth: the LR moves every step after the save, and every step drew other data.
    steps = first[0][layout]["before"] + first[0][layout]["after"]
    assert len({m["lr"] for m in first[0][layout]["after"]}) == T.N_STEPS, steps
    assert len({m["data_seed"] for m in steps}) == T.K_STEPS + T.N_STEPS, steps


# ----------------------------------------------------------------------------- PPO recipe, 2 ranks
PPO_ARGS = [
    "--config",
    os.path.join(ROOT, "configs", "ppo_tiny.yaml"),
    "data.batch_size=8",
    "algo.n_samples=4",
    "trainer.progress_bar=false",
]
PPO_KEYS = ("step", "reward", "entropy", "actor_loss", "actor_grad_norm", "critic_loss", "critic_grad_norm", "lr")


def _ppo(out, steps: int, *extra: str) -> list[dict]:
    argv = [*PPO_ARGS, f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.checkpoint_every=2", *extra]
    run_distributed(T.ppo_main, 2, argv, timeout=400, fresh=True)  # a job per call, as resumed jobs are
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def ppo_full(tmp_path_factory):
    """The uninterrupted run: 4 PPO steps on 2 ranks, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("ppo_full")
    return out, _ppo(out, 4)


def _crashed_copy(full, dst, published: dict[str, list[int]]) -> None:
    """``dst``'s checkpoints: per role, the steps of ``full`` that are published, and step 4 as a
    save SIGKILLed between its ``latest`` update and its rename leaves it (``.tmp_global_step_4``,
    ``latest`` = 4) unless 4 is published."""
    for role, steps in published.items():
        src, to = full / "checkpoints" / role, dst / "checkpoints" / role
        for step in steps:
            shutil.copytree(src / f"global_step_{step}", to / f"global_step_{step}")
        if 4 not in steps:
            shutil.copytree(src / "global_step_4", to / ".tmp_global_step_4")
        (to / "latest_checkpointed_iteration.txt").write_text("4")


def _rows(rows: list[dict]) -> list[list]:
    return [[r[k] for k in PPO_KEYS] for r in rows]


@pytest.mark.slow
def test_ppo_recipe_resumes_exactly_on_two_ranks_from_the_newest_complete_checkpoint(ppo_full, tmp_path):
    """Both roles' step-4 saves were cut short: ``trainer.resume`` must pick step 2 and replay
    steps 3-4 identically (actor and critic, 2 ranks each)."""
    full_dir, full = ppo_full
    _crashed_copy(full_dir, tmp_path, {"actor": [2], "critic": [2]})
    resumed = _ppo(tmp_path, 4, "trainer.resume=true")
    assert [r["step"] for r in resumed] == [3, 4]
    assert _rows(resumed) == _rows(full[2:])


@pytest.mark.slow
def test_ppo_recipe_resumes_actor_and_critic_from_the_same_step(ppo_full, tmp_path):
    """The save of step 4 was killed after the actor's checkpoint and inside the critic's: the
    roles must resume together from step 2, not the actor from 4 and the critic from 2."""
    full_dir, full = ppo_full
    _crashed_copy(full_dir, tmp_path, {"actor": [2, 4], "critic": [2]})
    resumed = _ppo(tmp_path, 4, "trainer.resume=true")
    assert _rows(resumed) == _rows(full[2:])


def _flip_middle(path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_ppo_recipe_skips_a_checkpoint_that_fails_verification_and_logs_each_step_once(ppo_full, tmp_path):
    """Step 4 is complete for both roles but the critic's weights were damaged after the save:
    ``trainer.resume`` must skip step 4 (it fails verification) and replay from step 2. The
    killed run's log already holds steps 1-4 (marked here): the resumed log must hold each step
    once, with steps 3-4 recomputed (equal to the uninterrupted run, not the marked lines)."""
    full_dir, full = ppo_full
    _crashed_copy(full_dir, tmp_path, {"actor": [2, 4], "critic": [2, 4]})
    _flip_middle(tmp_path / "checkpoints" / "critic" / "global_step_4" / "__0_0.distcp")
    stale = [{**r, "reward": -1.0} if r["step"] > 2 else r for r in full]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    resumed = _ppo(tmp_path, 4, "trainer.resume=true")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert _rows(resumed) == _rows(full)


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["incomplete", "absent"])
def test_ppo_resume_that_cannot_load_every_role_stops_before_writing(ppo_full, tmp_path, critic):
    """The actor's checkpoints are there, the critic's are not: its save never completed
    (``incomplete``), or the directory is absent, as when GRPO checkpoints (no critic) are
    resumed with ``algo.advantage=gae``. Starting over at step 1 would overwrite the actor's
    checkpoints and the metrics: the run stops first, naming the role and the fix."""
    full_dir, full = ppo_full
    _crashed_copy(full_dir, tmp_path, {"actor": [2, 4], "critic": []})
    if critic == "absent":
        shutil.rmtree(tmp_path / "checkpoints" / "critic")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv = [*PPO_ARGS, f"trainer.output_dir={tmp_path}", "trainer.total_steps=4", "trainer.checkpoint_every=2", "trainer.resume=true"]
    with pytest.raises(RankError) as err:
        run_distributed(T.ppo_main, 1, argv, timeout=400)
    message = str(err.value)
    assert "trainer.resume=true: the actor has checkpoints up to step 4" in message and "the critic has no complete checkpoint" in message
    assert ("written by a GRPO run" in message) == (critic == "absent")
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert {p: after.get(p) for p in before} == before  # nothing overwritten or removed
    assert all("tiny_model" in p.parts for p in set(after) - set(before))  # only the run's model was built
