"""The synchronous RL step written out call by call, for tests that compare role implementations
(legacy workers against the engine roles, the old-log-prob reuse) or hold the asynchronous
pipeline at K = 0 to it: sample with ``Rollout.generate`` (seed offset = the step), score with
the single-turn producer, train with the recipe's own ``train_on_batch``. The recipe itself runs
steps through ``posttrain.async_rl.Pipeline``."""

from __future__ import annotations

import time
from typing import Any

import torch

from posttrain.async_rl import SingleTurn
from posttrain.tasks import build_task
from recipes.ppo import train_on_batch


def step_prompts(source, step: int, n: int) -> tuple[list[torch.Tensor], list]:
    """The prompts of training step ``step`` and their metadata, each repeated ``n`` times (one
    entry per response, a prompt's group together)."""
    prompts, metas = source.prompts_at(step)
    return [p for p in prompts for _ in range(n)], [meta for meta in metas for _ in range(n)]


def rl_step(cfg, step: int, actor, critic, reference, rollout, source=None, samples: int = 0) -> dict[str, Any]:
    """One RL step on any role implementation; returns its metrics (``samples`` > 0: that many
    generations' text rows as ``"samples"``). ``source``: the task (None builds it)."""
    source = source if source is not None else build_task(cfg.data, cfg.engine.model.path, cfg.reward)
    t0 = time.perf_counter()
    prompts, metas = step_prompts(source, step, cfg.algo.n_samples)
    rollout.sync_weights(version=step + 1)  # version = 1 + the actor updates so far
    batch = rollout.generate(prompts, seed_offset=step)
    rollout.release()
    timings = {"rollout_s": time.perf_counter() - t0}
    scored = SingleTurn(source, cfg.rollout.max_new_tokens, cfg.rollout.temperature).score(batch, metas)
    return train_on_batch(cfg, step, scored, timings, actor=actor, critic=critic, reference=reference, rollout=rollout, samples=samples)
