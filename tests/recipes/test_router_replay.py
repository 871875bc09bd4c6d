"""GRPO on a tiny Qwen3-MoE with MoE routing replay (issue 32, done-when): with
``actor.router_replay=r3`` the update routes exactly as the rollout engine did
(``moe/router_disagreement`` 0) and the trainer's old log-probs, computed on the rollout's
routing, equal the rollout's at float noise, on fsdp and megatron; without replay the
disagreement is reported non-zero (the demo's 2 mini-batches x 4 epochs move the router
between the recording and the later update forwards); a run resumed from a checkpoint replays
the uninterrupted one (the routing is per-step data, re-recorded by the resumed step)."""

from __future__ import annotations

import pytest

from tests.support.recipe_runs import run_ppo as _run

MOE = ("tiny_model.family=qwen3_moe",)
FLOAT_NOISE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_r3_routes_as_the_rollout_did(tmp_path, strategy):
    rows = _run(tmp_path, "grpo_tiny.yaml", 2, *MOE, "actor.router_replay=r3", f"engine.strategy={strategy}")
    for row in rows:
        assert row["moe/router_disagreement"] == 0.0
        assert row["rollout/logprob_abs_diff_max"] <= FLOAT_NOISE
        assert "rollout/router_disagreement" in row
        assert row["moe/router_replay_override"] > 0  # the router moved during the update: replay held it


@pytest.mark.slow
def test_without_replay_the_disagreement_is_reported(tmp_path):
    rows = _run(tmp_path, "grpo_tiny.yaml", 1, *MOE, "actor.router_replay=off")
    assert rows[0]["moe/router_disagreement"] > 0.01
    assert "moe/router_replay_override" not in rows[0]


@pytest.mark.slow
def test_r3_resume_replays_the_uninterrupted_run(tmp_path):
    extra = (*MOE, "actor.router_replay=r3")
    full = _run(tmp_path / "full", "grpo_tiny.yaml", 2, *extra)
    _run(tmp_path / "cut", "grpo_tiny.yaml", 1, *extra, "trainer.checkpoint_every=1")
    resumed = _run(tmp_path / "cut", "grpo_tiny.yaml", 2, *extra, "trainer.resume=true")
    keys = ("reward", "actor_loss", "actor_grad_norm", "moe/router_disagreement", "moe/router_replay_override")
    assert [r[k] for r in resumed for k in keys] == [r[k] for r in full for k in keys]
