"""The asynchronous driver run step by step with the recipe's own pieces (``recipes.ppo``), so a
test sees each batch, the rollout's weights of each version and the trainer at each version.
Shared by the in-process (fsdp) and the world (megatron) tests."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine_api.typed_config import load_typed
from posttrain.async_rl import Pipeline, Schedule, SingleTurn
from posttrain.tasks import build_task
from recipes import ppo
from recipes.common import with_model_path
from roles.factory import build_roles
from tests.support.rl_loop import rl_step

ROOT = Path(__file__).resolve().parents[2]
TIMING = {"rollout_s", "reward_s", "prepare_s", "update_s", "tokens_per_s", "rollout/sync_s"}
SMALL = ["data.batch_size=4", "algo.n_samples=4", "trainer.progress_bar=false", "engine.optim.eps=1e-3"]


def config(out: str, strategy: str, *extra: str) -> ppo.PPOConfig:
    overrides = [f"trainer.output_dir={out}", f"engine.strategy={strategy}", *SMALL, *extra]
    return with_model_path(load_typed(ppo.PPOConfig, ROOT / "configs" / "grpo_tiny.yaml", overrides))


def _roles(cfg):
    roles = build_roles(cfg)
    source = build_task(cfg.data, cfg.engine.model.path, cfg.reward)
    return roles, source, ppo.build_rollout_role(cfg, roles.actor, source)


def _weights(role) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in role.export_weights()}


def sync_loop(cfg, steps: int) -> tuple[list[dict], dict]:
    """``tests.support.rl_loop.rl_step`` (the synchronous loop, unchanged) for ``steps`` steps."""
    roles, source, rollout = _roles(cfg)
    metrics = [rl_step(cfg, s, roles.actor, roles.critic, roles.reference, rollout, source) for s in range(steps)]
    return metrics, _weights(roles.actor)


def pipelined(cfg, steps: int, rank: int = 0) -> dict:
    """``steps`` steps of the asynchronous driver with the recipe's training half."""
    roles, source, rollout = _roles(cfg)
    actor = roles.actor
    pipe = pipeline_of(cfg, rollout, source, rank == 0, score=lambda batch: actor.compute_log_probs(batch)["log_probs"])
    train = functools.partial(ppo.train_on_batch, actor=actor, critic=roles.critic, reference=roles.reference, rollout=rollout)
    metrics = [pipe.step(step, functools.partial(train, cfg, step)) for step in range(steps)]
    return {"metrics": metrics, "weights": _weights(actor)}


def pipeline_of(cfg, rollout, source, rank0: bool = True, score=None, producer=None) -> Pipeline:
    """The recipe's pipeline of an RL config (single-turn unless ``producer`` is given)."""
    schedule = Schedule(cfg.data.batch_size, cfg.algo.n_samples, cfg.rollout.seed, cfg.trainer.total_steps, cfg.trainer.output_dir)
    producer = producer or SingleTurn(source, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    return Pipeline(cfg.async_, schedule, producer, rollout, source, rank0, score=score)


def differences(a: list[dict], b: list[dict]) -> list:
    """Every (step, key, a, b) where two runs' metrics differ, timings and ``async/`` aside."""
    return [
        (i, k, x.get(k), y.get(k))
        for i, (x, y) in enumerate(zip(a, b, strict=True))
        for k in set(x) & set(y)
        if k not in TIMING and not k.startswith("async/") and x.get(k) != y.get(k)
    ]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def checks(rank: int, world: int, strategy: str, out: str, whole: bool = True) -> dict:
    """K = 0 against the synchronous loop, and K = 2 with partial rollouts and the per-version
    parity probe (``whole``: also K = 2 without partial rollouts). Runs in process or as the
    target of a world (every rank the same calls)."""
    steps = 3
    sync_m, sync_w = sync_loop(config(f"{out}/sync", strategy), steps)
    k0 = pipelined(config(f"{out}/k0", strategy, "async.max_staleness=0"), steps, rank)
    k2 = pipelined(config(f"{out}/k2", strategy, "async.max_staleness=2", "async.check_version_parity=true"), 5, rank)
    result = {
        "k0_differs": differences(sync_m, k0["metrics"]),
        "k0_same_weights": same_weights(sync_w, k0["weights"]),
        "k0_moved": len({m["actor_loss"] for m in sync_m}) > 1,
        "k2": [{k: v for k, v in m.items() if k.startswith(("async/", "rollout/"))} for m in k2["metrics"]],
    }
    if whole:
        cfg = config(f"{out}/whole", strategy, "async.max_staleness=2", "async.partial_rollouts=false")
        result["whole"] = [{k: v for k, v in m.items() if k.startswith("async/")} for m in pipelined(cfg, 4, rank)["metrics"]]
    return result


def assert_checks(r: dict) -> None:
    assert r["k0_moved"]
    assert r["k0_differs"] == [] and r["k0_same_weights"], r["k0_differs"][:5]
    stale = [m["async/staleness_max"] for m in r["k2"]]
    # batch b's first tokens come from version max(1, b - 1): staleness 0, 1, then 2 from step 3 on
    assert stale == [0.0, 1.0, 2.0, 2.0, 2.0], stale
    assert max(m["async/version_span_max"] for m in r["k2"]) == 2.0  # responses continued across an update
    assert_parity_per_version(r["k2"])
    if "whole" in r:
        assert [m["async/staleness_max"] for m in r["whole"]] == [0.0, 1.0, 2.0, 2.0]
        assert all(m["async/version_span_max"] == 1.0 for m in r["whole"])


def assert_parity_per_version(rows: list[dict]) -> None:
    """Each step's trainer against the tokens its own version sampled: float noise (fp32),
    over a real number of tokens; the batch it trains (sampled by older versions) is far off:
    the probe can tell the versions apart."""
    assert all(m["async/version_parity_tokens"] > 0 for m in rows), rows
    assert max(m["async/version_logprob_abs_diff_max"] for m in rows) < 1e-4, rows
    assert max(m["rollout/logprob_abs_diff_max"] for m in rows[2:]) > 1e-2, rows
