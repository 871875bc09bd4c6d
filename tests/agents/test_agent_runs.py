"""Multi-turn GRPO through the whole recipe (issue 54): ``python -m recipes.ppo`` on the demo's
assets (``posttrain.agents.demo``: a tiny model with a ChatML template, a tool-using task),
as a user runs it.

* FSDP with the ``hf`` rollout: the trainer's log-probs of every sampled token of every turn
  equal the rollout's at float noise (fp32: <= 1e-5 per turn index; measured ~5e-7), the
  trajectories have several turns, and the ``env/*`` metrics are there;
* megatron: the same trajectories and rewards as FSDP at step 1 (the same weights and seeds
  sample the same tokens), actor losses equal to 1e-5 relative, parity per turn;
* asynchronous (K = 2, trajectories paused between turns across weight updates): staleness
  bounded, and a SIGKILLed run resumed equals the uninterrupted one;
* FSDP with ``rollout.backend=vllm``: parity per turn at vLLM's float noise (<= 1e-4);
* Qwen3-MoE with ``actor.router_replay=r3``: the routing the update replays is, at every
  position of every turn, what the trainer's own router computes from the same weights (fp32:
  ``rollout/router_disagreement`` 0; a row shifted by one position or taken from the wrong call
  disagrees on most tokens);
* the demo config learns: the reward rises by the margin ``configs/agent_tiny.yaml`` states.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_api.rollout_registry import rollout_installed
from posttrain.agents.demo import build_assets
from tests.agents.scripted import demo_args, metric_rows
from tests.support import launch
from tests.support.launch import REPO, launch_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return Path(build_assets(tmp_path_factory.mktemp("agent_assets")))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """Another tiny model of the demo's tokenizer (another init seed): a distillation teacher."""
    return Path(build_assets(tmp_path_factory.mktemp("teacher_assets"), rows=4, seed=1)) / "model"


@pytest.fixture(scope="module")
def reward_model(teacher, tmp_path_factory) -> Path:
    """A sequence-classification model of the demo's tokenizer (the teacher's body, a seeded
    one-output head): a reward model that scores whole conversations."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("reward_model") / "rm"
    AutoModelForSequenceClassification.from_pretrained(teacher, num_labels=1).save_pretrained(path)
    return path


def _args(assets: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return demo_args("agent_tiny.yaml", assets, out, steps, *extra)


_rows = metric_rows


def _run(assets: Path, out: Path, steps: int, *extra: str, nproc: int = 1) -> list[dict]:
    proc = launch.run_script(_args(assets, out, steps, *extra), nproc=nproc, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return _rows(out)


def _per_turn_parity(rows: list[dict], noise: float) -> None:
    for row in rows:
        turns = [k for k in row if k.startswith("rollout/logprob_abs_diff_max/turn_")]
        assert len(turns) >= 2, row  # several turns sampled, each checked
        assert all(row[k] <= noise for k in turns), {k: row[k] for k in turns}
        assert row["rollout/logprob_abs_diff_max"] <= noise
        for key in ("env/turns_mean", "env/turns_max", "env/tool_calls_mean", "env/tool_errors_sum", "env/truncated_frac"):
            assert key in row, key
        assert row["env/turns_max"] >= 2


SMALL = ["data.batch_size=4", "algo.n_samples=4"]


def test_fsdp_megatron_and_two_ranks_train_the_same_trajectories_at_parity(assets, teacher, reward_model, tmp_path):
    """Step 1 from the same weights and seeds: the same trajectories (rewards, turns) and losses
    on megatron and on 2 ranks (the environment runs on rank 0, its tokens broadcast; the
    rollout shards the prompts) as on one FSDP rank. The update is GSPO over RLOO advantages
    mixed with on-policy distillation from a teacher (its reverse KL in the advantage and its
    top-3 forward KL as a loss term, over every assistant turn): the distillation metrics agree
    too. The reward adds a reward model's score of each whole conversation (``reward.model``,
    weight 0.5): its scores agree over the backends and rank layouts, and the trained reward is
    the function's plus half the model's."""
    algos = [
        "actor.policy_loss=gspo",
        "algo.advantage=rloo",
        f"distill.teacher_path={teacher}",
        "distill.reward_weight=1",
        "distill.topk=3",
        f"reward.model={reward_model}",
        "reward.model_weight=0.5",
    ]
    got = {}
    # The 2-rank run is asynchronous (K = 2, trajectories paused between turns, 3 steps): its first
    # batch is still generated whole by version 1 (step 1 compares as it is); the third takes its
    # first two turns under version 1 and the rest under version 2, every collective on both ranks.
    runs = {"fsdp": ([], 1, 2), "megatron": (["engine.strategy=megatron"], 1, 2), "fsdp_2ranks": (["async.max_staleness=2"], 2, 3)}
    for name, (extra, nproc, steps) in runs.items():
        got[name] = _run(assets, tmp_path / name, steps, *SMALL, "trainer.val_every=0", *algos, *extra, nproc=nproc)
        _per_turn_parity(got[name][:1] if nproc == 2 else got[name], 1e-5)  # later async rows: stale tokens, not noise
    assert [r["async/staleness_max"] for r in got["fsdp_2ranks"]] == [0, 1, 2]
    f = got["fsdp"][0]
    for row in (r for rows in got.values() for r in rows):
        assert row["reward"] == pytest.approx(row["reward/function_mean"] + 0.5 * row["reward/model_mean"], rel=1e-6, abs=1e-6)
        assert row["reward/model_std"] > 0, row
    for name in ("megatron", "fsdp_2ranks"):
        m = got[name][0]
        keys = ("reward/function_mean", "env/turns_mean", "env/tool_calls_mean")
        assert [m[k] for k in keys] == [f[k] for k in keys], name
        for key in ("reward/model_mean", "reward/model_std"):  # the reward model on either backend, 1 or 2 ranks
            assert m[key] == pytest.approx(f[key], rel=1e-5, abs=1e-6), (name, key)
        # The loss sums terms of opposite signs (GSPO's, the top-k KL's) to about 1e-3: float noise
        # of its O(0.1) parts is 1e-7 absolute (megatron: 7e-8 measured); a term missing is 1e-2.
        assert m["actor_loss"] == pytest.approx(f["actor_loss"], rel=1e-5, abs=1e-6), name
        for key in ("distill/reverse_kl", "distill/topk_forward_kl"):
            assert m[key] == pytest.approx(f[key], rel=1e-5, abs=1e-7), (name, key)
    # another model: a real KL (top-k forward 0.0039 measured; the reverse KL's k1 estimate 0.047, of either sign in general)
    assert f["distill/topk_forward_kl"] > 1e-3 and abs(f["distill/reverse_kl"]) > 1e-4, f


def test_async_trajectories_stay_within_the_bound_and_resume_after_sigkill_exactly(assets, tmp_path):
    """``async.max_staleness=2`` with partial rollouts and ``env.max_turns=2``: each batch's
    trajectories take their first turn in the batch's first round and their second one round
    (one weight update) later, so a trajectory of two turns spans two weight versions
    (``async/version_span_max`` 2) and staleness, counted from its oldest token, is 2 from step 3
    on, never more. A run SIGKILLed at a random moment after its step-2 checkpoint (which holds
    one batch paused between turns and one scored batch), resumed, equals the uninterrupted run
    in every metric but the timings: the paused trajectories are replayed through fresh
    environments from their kept turns, none regenerated or trained twice. On Ray with the
    rollout on a pool of its own (the rounds run in a driver thread while the actor trains), the
    same run step for step: the schedule depends on the step, not the layout."""
    # env.schedule=lockstep: reruns and resumes bit-identical (per trajectory, which calls share a
    # rollout call depends on timing, and with it the rollout's log-probs at float rounding).
    over = [
        *SMALL,
        "async.max_staleness=2",
        "env.max_turns=2",
        "trainer.val_every=0",
        "trainer.checkpoint_every=1",
        "env.schedule=lockstep",
    ]
    full = _run(assets, tmp_path / "full", 5, *over)
    assert [r["async/staleness_max"] for r in full] == [0, 1, 2, 2, 2]
    assert max(r["async/version_span_max"] for r in full[2:]) == 2 and max(r["env/turns_max"] for r in full[2:]) == 2
    split = ["trainer.placement.pools.train=1", "trainer.placement.pools.gen=1", "trainer.placement.roles.rollout=gen"]
    ray = _run(assets, tmp_path / "ray", 5, *over, "trainer.launcher=ray", "trainer.placement.cpus_per_worker=0.5", *split)
    for key in ("reward", "actor_loss", "env/turns_mean", "env/tool_calls_mean", "async/staleness_max"):
        assert [r[key] for r in ray] == pytest.approx([r[key] for r in full], rel=1e-6), key
    out = tmp_path / "cut"
    cmd = [sys.executable, *_args(assets, out, 5, *over)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(_rows(out)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 0.3))  # anywhere in step 2's save or in step 3
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    resumed = _run(assets, out, 5, *over, "trainer.resume=true")
    timing = ("_s", "tokens_per_s", "_frac")
    untimed = [{k: v for k, v in r.items() if not k.endswith(timing)} for r in resumed]
    assert untimed == [{k: v for k, v in r.items() if not k.endswith(timing)} for r in full]


def test_moe_routing_replay_over_every_turn(tmp_path):
    assets = Path(build_assets(tmp_path / "moe_assets", rows=32, family="qwen3_moe"))
    rows = _run(assets, tmp_path / "r3", 2, *SMALL, "actor.router_replay=r3", "trainer.val_every=0")
    _per_turn_parity(rows, 1e-5)
    assert all(r["rollout/router_disagreement"] == 0.0 for r in rows), [r["rollout/router_disagreement"] for r in rows]


@pytest.mark.skipif(not rollout_installed("vllm"), reason="vllm not installed (make test installs it)")
def test_vllm_rollout_keeps_parity_on_every_turn(assets, tmp_path):
    """Under CISPO over REINFORCE++ advantages with a group baseline and DAPO's dynamic sampling
    (refills are sampled by vLLM like the rest): parity on every turn, full batches."""
    algos = ["actor.policy_loss=cispo", "algo.advantage=reinforce_pp_baseline", "algo.dynamic_sampling=true"]
    rows = _run(assets, tmp_path / "vllm", 2, *SMALL, "rollout.backend=vllm", *algos)
    _per_turn_parity(rows, 1e-4)
    kept = [r["dynamic_sampling/prompts_drawn"] - r["dynamic_sampling/groups_dropped"] - r["dynamic_sampling/groups_surplus"] for r in rows]
    assert kept == [4, 4], rows  # data.batch_size groups with a reward spread, every step


def test_the_demo_config_learns_to_call_the_tool(assets, tmp_path):
    """The first 60 of the default ``configs/agent_tiny.yaml``'s 120 steps (only its paths moved):
    the tool is called in (nearly) every trajectory, where an untrained model calls it in about one
    in eight, and the reward, which only the tool's value can earn beyond 0.2, is well above the
    start. Measured: first 5 steps 0.07-0.1 mean reward and 0.1-0.4 calls per trajectory; steps
    51-60 about 0.26 and 1.0 (the copy is learned after that: about 0.5 by step 120,
    docs/agents.md)."""
    out = tmp_path / "demo"
    rows = _run(assets, out, 60)
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-10:]) / 10
    calls = sum(r["env/tool_calls_mean"] for r in rows[-10:]) / 10
    assert rows[0]["env/tool_calls_mean"] < 0.5 and calls >= 0.9, (rows[0]["env/tool_calls_mean"], calls)
    assert last >= 0.2 and last >= first + 0.1, (first, last)
    # Issue 60 item 11: the demo keeps its checkpoints and an export, and recipes.evaluate scores
    # the multi-turn run through its environment (it blamed a reward.function never written):
    # from the last checkpoint it repeats the run's final validation exactly.
    assert (out / "hf" / "config.json").is_file() and (out / "checkpoints" / "actor" / "global_step_60").is_dir()
    args = ["-m", "recipes.evaluate", *_args(assets, tmp_path / "eval", 60)[2:], f"eval.checkpoint={out}/checkpoints/actor"]
    evaluated = launch.run_script(args, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "eval_summary.json").read_text())
    assert summary["checkpoint_step"] == 60 and summary["val/reward"] == rows[-1]["val/reward"], (summary, rows[-1]["val/reward"])
