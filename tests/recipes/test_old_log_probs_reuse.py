"""Issue 42, item 23: with one update epoch over one mini-batch, the old-policy log-probs are the
update's own forward's (``Actor.reuses_update_log_probs``); the recipe then skips the separate
old-policy forward. The property: the run is the same, bit for bit (every metric but the
timings, and the final weights), as the run that recomputes them (``actor.recompute_old_log_probs
=true``), and one actor forward per step is saved; where the reuse does not hold it is not made."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from engine_api.typed_config import load_typed
from posttrain.tasks import build_task
from recipes import ppo
from recipes.common import with_model_path
from roles.factory import build_roles
from tests.support.launch import run_distributed
from tests.support.rl_loop import rl_step

ROOT = Path(__file__).resolve().parents[2]
TIMING = {"rollout_s", "reward_s", "prepare_s", "update_s", "tokens_per_s", "rollout/sync_s"}
# 4 micro-batches per optimizer step, KL to the reference and an entropy bonus (every input of
# the loss), one epoch over one mini-batch: the setting TRL's GRPOTrainer reuses its log-probs in.
ONE_STEP = [
    "data.batch_size=4",
    "algo.n_samples=4",
    "engine.micro_batch_size=4",
    "actor.ppo_epochs=1",
    "actor.mini_batch_size=null",
    "actor.kl_coef=0.05",
    "actor.entropy_coef=0.01",
    "trainer.progress_bar=false",
]


def _run(cfg: ppo.PPOConfig, steps: int):
    roles = build_roles(cfg)
    rollout = ppo.build_rollout_role(cfg, roles.actor, build_task(cfg.data, cfg.engine.model.path, cfg.reward))
    forwards = []
    infer = roles.actor.engine.infer_batch
    roles.actor.engine.infer_batch = lambda batch: forwards.append(1) or infer(batch)
    metrics = [rl_step(cfg, step, roles.actor, roles.critic, roles.reference, rollout) for step in range(steps)]
    return roles, metrics, len(forwards)


def _compare(rank: int, world: int, config: str, strategy: str, out: str) -> dict:
    """Three steps recomputing the old log-probs, three reusing the update's; what differs."""
    overrides = [f"trainer.output_dir={out}", f"engine.strategy={strategy}", *ONE_STEP]
    base = with_model_path(load_typed(ppo.PPOConfig, ROOT / "configs" / config, overrides))
    recompute = dataclasses.replace(base, actor=dataclasses.replace(base.actor, recompute_old_log_probs=True))
    steps = 3
    old_roles, old, old_forwards = _run(recompute, steps)
    new_roles, new, new_forwards = _run(base, steps)
    weights = {}
    for role in ("actor", "critic"):
        a, b = getattr(old_roles, role), getattr(new_roles, role)
        if a is not None:
            old_w, new_w = dict(a.export_weights()), dict(b.export_weights())
            weights[role] = old_w.keys() == new_w.keys() and all(torch.equal(old_w[k], new_w[k]) for k in new_w)
    return {
        "reuses": (old_roles.actor.reuses_update_log_probs(16), new_roles.actor.reuses_update_log_probs(16)),
        "saved_forwards": old_forwards - new_forwards,
        "steps": steps,
        "differ": [
            (i, k, a[k], b[k])
            for i, (a, b) in enumerate(zip(old, new, strict=True))
            for k in set(a) | set(b)
            if k not in TIMING and a.get(k) != b.get(k)
        ],
        "moved": len({m["reward"] for m in new}) > 1 and new[-1]["kl"] > 0,
        "weights_equal": weights,
    }


def _check(result: dict) -> None:
    assert result["reuses"] == (False, True)
    assert result["saved_forwards"] == result["steps"]  # one actor forward-only pass saved per step
    assert result["differ"] == []  # every metric bit for bit (timings aside)
    assert result["moved"]  # not vacuous: rewards and the KL moved
    assert result["weights_equal"] and all(result["weights_equal"].values()), result["weights_equal"]


@pytest.mark.parametrize("config", ["grpo_tiny.yaml", "ppo_tiny.yaml"])
def test_reusing_the_update_forward_changes_nothing_but_saves_a_forward(tmp_path, config, own_process_group):
    _check(_compare(0, 1, config, "fsdp", str(tmp_path)))


def test_the_same_on_megatron_over_two_data_parallel_ranks(tmp_path):
    """The other backend, and outputs gathered over DP ranks (each rank's shard of the update's
    forward comes back in the global batch's order)."""
    for result in run_distributed(_compare, 2, "grpo_tiny.yaml", "megatron", str(tmp_path)):
        _check(result)


@pytest.mark.parametrize(
    ("override", "rows"),
    [
        ("actor.ppo_epochs=2", 16),  # the second epoch's forward runs on updated weights
        ("actor.mini_batch_size=8", 16),  # the second mini-batch's forward too
        ("actor.rollout_correction.mode=tis", 16),  # needs the old log-probs before the update
        ("actor.recompute_old_log_probs=true", 16),
        ("actor.mini_batch_size=16", 16),  # one mini-batch: holds
    ],
)
def test_the_reuse_is_made_only_where_it_holds(tmp_path, override, rows, own_process_group):
    cfg = with_model_path(
        load_typed(ppo.PPOConfig, ROOT / "configs" / "grpo_tiny.yaml", [f"trainer.output_dir={tmp_path}", *ONE_STEP, override])
    )
    actor = build_roles(cfg).actor
    assert actor.reuses_update_log_probs(rows) == (override == "actor.mini_batch_size=16")
    if override != "actor.mini_batch_size=16":
        return
    assert not actor.reuses_update_log_probs(rows + 1)  # a larger batch no longer fits one mini-batch
    # A model that drops activations in training: its update forward is not the eval-mode one.
    attention = next(m for m in actor.engine.model.modules() if hasattr(m, "attention_dropout"))
    attention.attention_dropout = 0.1
    assert actor.engine.trains_with_dropout and not actor.reuses_update_log_probs(rows)
    with pytest.raises(ValueError, match="update_on_policy.*not the update's own"):
        actor.update_on_policy(TensorDict({}, batch_size=[rows]))
