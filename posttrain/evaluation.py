"""Scoring a policy on held-out prompts: what an RL run's validation does every ``trainer.val_every``
steps (``val/reward``) and what ``recipes.evaluate`` repeats from a checkpoint.

The draws are fixed: one response (or trajectory) per prompt, ``chunk`` prompts per producer
call, call ``k`` seeded from ``step_seeds(rollout.seed, VAL_SEED_OFFSET + k, ...)``, with the run's
rollout settings; so the same weights give the same scores at every validation, and a checkpoint
of step N evaluated later reproduces the run's ``val/reward`` at step N. The producer is the
run's own (``posttrain.async_rl.producer``): single-turn sampling scored by the task, or
multi-turn trajectories scored by their environment and reward function.
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.async_rl.producer import Producer, ScoredBatch
from roles.rollout import step_seeds

# Validation draws from seeds this far above the training steps' ones, which they never reach.
VAL_SEED_OFFSET = 10**9


def validation_batches(producer: Producer, rollout, prompts: Sequence, metas: Sequence, chunk: int, seed: int) -> list[ScoredBatch]:
    """One scored batch per call of ``chunk`` prompts (module docstring). Collective over the
    rollout group."""
    out = []
    for k, begin in enumerate(range(0, len(prompts), chunk)):
        p, m = list(prompts[begin : begin + chunk]), list(metas[begin : begin + chunk])
        out.append(producer.produce(rollout, p, m, step_seeds(seed, VAL_SEED_OFFSET + k, len(p))))
    return out


def mean_reward(batches: Sequence[ScoredBatch]) -> float:
    """The mean reward over every trajectory of ``batches`` (``val/reward``), summed call by call."""
    return sum(float(b.scores.sum()) for b in batches) / sum(len(b.scores) for b in batches)


def validate(source, producer: Producer, rollout, chunk: int, seed: int) -> float | None:
    """The mean reward of one response (trajectory) per validation prompt of ``source``, with
    the rollout synced to the current weights first and released after; None without
    validation prompts. ``chunk``: a training step's number of responses; ``seed``:
    ``rollout.seed``. Collective."""
    val = source.val_prompts()
    if val is None:
        return None
    prompts, metas = val
    rollout.sync_weights()
    batches = validation_batches(producer, rollout, prompts, metas, chunk, seed)
    rollout.release()
    return mean_reward(batches)
