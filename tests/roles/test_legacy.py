"""The legacy worker implementation behind ``trainer.use_legacy_worker_impl``: the flag, the
factory, and parity with the engine roles over 5 PPO steps (the design requirement "PPO
training curves match the legacy implementation")."""

from __future__ import annotations

import ast
import dataclasses
import logging
import math
from pathlib import Path

import pytest

from engine_api.typed_config import load_typed
from posttrain.tasks import build_task
from recipes import ppo
from recipes.common import with_model_path
from roles import legacy
from roles.factory import build_roles, use_legacy
from tests.support.rl_loop import rl_step

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "ppo_tiny.yaml"
# Exercises every loop the two implementations have: 4 micro-batches per optimizer step
# (engine.micro_batch_size), 2 mini-batches x 2 epochs per update, KL to the reference, the
# entropy bonus, clipping, a warmup schedule; 16 sequences per step.
PARITY = [
    "data.batch_size=4",
    "algo.n_samples=4",
    "engine.micro_batch_size=4",
    "engine.optim.warmup_steps=12",
    "engine.optim.clip_grad=0.5",
    "actor.mini_batch_size=8",
    "critic.mini_batch_size=8",
    "actor.kl_coef=0.05",
    "actor.entropy_coef=0.01",
    "trainer.progress_bar=false",
]
TIMING = {"rollout_s", "reward_s", "prepare_s", "update_s", "tokens_per_s", "rollout/sync_s"}
NOISE_METRICS = ("rollout/logprob_abs_diff", "rollout/kl_k3")


def _config(tmp_path, *overrides) -> ppo.PPOConfig:
    return load_typed(ppo.PPOConfig, CONFIG, [f"trainer.output_dir={tmp_path}", *overrides])


@pytest.mark.parametrize(
    ("value", "legacy"), [("auto", False), ("disable", False), ("false", False), ("enable", True), ("true", True), ("True", True)]
)
def test_flag_values(tmp_path, value, legacy):
    cfg = _config(tmp_path, f"trainer.use_legacy_worker_impl={value}")
    assert use_legacy(cfg.trainer.use_legacy_worker_impl) is legacy


def test_default_is_the_engine_roles(tmp_path):
    assert use_legacy(_config(tmp_path).trainer.use_legacy_worker_impl) is False


def test_bad_flag_value_fails_at_config_load(tmp_path):
    with pytest.raises(ValueError, match=r"use_legacy_worker_impl = 'maybe': unknown; fix: use one of auto, enable, disable"):
        _config(tmp_path, "trainer.use_legacy_worker_impl=maybe")


def test_legacy_with_megatron_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match=r"use_legacy_worker_impl = 'enable' with engine.strategy = 'megatron'.*fix"):
        _config(tmp_path, "trainer.use_legacy_worker_impl=enable", "engine.strategy=megatron")
    # build_roles checks it too (for configs made in code), before building any model.
    cfg = _config(tmp_path)
    bad = dataclasses.replace(
        cfg,
        engine=dataclasses.replace(cfg.engine, strategy="megatron"),
        trainer=dataclasses.replace(cfg.trainer, use_legacy_worker_impl=True),
    )
    with pytest.raises(ValueError, match="legacy workers are FSDP only"):
        build_roles(bad)


def test_only_the_factory_imports_the_legacy_package():
    importers = []
    for path in [path for package in ("roles", "recipes", "posttrain", "engine_api") for path in (ROOT / package).rglob("*.py")]:
        if "legacy" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue  # (ast.Global / ast.Nonlocal also have .names, of plain strings)
            names = [(node.module or "")] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(n == "roles.legacy" or n.startswith("roles.legacy.") for n in names):
                importers.append(path.name)  # roles.legacy or a submodule, not e.g. roles.legacy_flag
            if isinstance(node, ast.ImportFrom) and node.module == "roles" and any(a.name == "legacy" for a in node.names):
                importers.append(path.name)
    assert importers == ["factory.py"]


def _run(cfg: ppo.PPOConfig, steps: int):
    roles = build_roles(cfg)
    rollout = ppo.build_rollout_role(cfg, roles.actor, build_task(cfg.data, cfg.engine.model.path, cfg.reward))
    metrics = [rl_step(cfg, step, roles.actor, roles.critic, roles.reference, rollout) for step in range(steps)]
    return roles, metrics


def test_legacy_roles_match_engine_roles_over_five_ppo_steps(tmp_path, caplog):
    """Same seed and config, fp32, one process: per-step reward, losses, KL, entropy, grad norms
    and LR agree within relative 1e-6, and so do the final actor and critic weights (both
    implementations run the same layers; the engine scores tokens from the hidden states in
    chunks, the legacy workers from full logits, so they agree at float noise; 1e-6 leaves room
    for nothing else). The trainer/rollout parity metrics, themselves float noise, within 1e-6
    absolute."""
    base = with_model_path(_config(tmp_path, *PARITY))
    legacy._warned = False
    with caplog.at_level(logging.WARNING, logger="enginekit.legacy"):
        old_roles, old = _run(dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, use_legacy_worker_impl="enable")), 5)
    assert old_roles.legacy and type(old_roles.actor).__name__ == "LegacyActor" and old_roles.reference is not None
    assert [r.levelno for r in caplog.records if r.name == "enginekit.legacy"] == [logging.WARNING]  # one warning, three workers
    new_roles, new = _run(base, 5)
    assert not new_roles.legacy and type(new_roles.actor).__name__ == "Actor"

    for step, (a, b) in enumerate(zip(old, new, strict=True)):
        assert set(a) == set(b)
        for key in set(a) - TIMING:
            # the trainer/rollout parity metrics are differences at float noise (~5e-8): compared
            # absolutely (the engine scores tokens from hidden states in chunks, the legacy
            # workers from full logits: the same math, summed in another order)
            abs_tol = 1e-6 if key.startswith(NOISE_METRICS) else 1e-12
            assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=abs_tol), (step, key, a[key], b[key])
    # The run actually trained: rewards, KL and LR move, so equality is not vacuous.
    assert len({m["reward"] for m in new}) > 1 and new[-1]["kl"] > 0 and new[0]["lr"] < new[-1]["lr"]
    for old_role, new_role in ((old_roles.actor, new_roles.actor), (old_roles.critic, new_roles.critic)):
        old_w, new_w = dict(old_role.export_weights()), dict(new_role.export_weights())
        assert old_w.keys() == new_w.keys()
        for name in new_w:  # per tensor, as one vector (an element near 0 would magnify float noise)
            err = float((old_w[name].double() - new_w[name].double()).norm() / new_w[name].double().norm())
            assert err <= 1e-6, (name, err)
