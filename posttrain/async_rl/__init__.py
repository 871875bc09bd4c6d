"""Asynchronous RL: the rollout runs ahead of training under a staleness bound (docs/async.md).

* ``config``: ``AsyncConfig`` (the recipe's ``async`` section);
* ``producer``: the ``Producer`` protocol (what makes and scores a batch), ``ScoredBatch`` and
  the single-turn producer (the multi-turn one is ``posttrain.agents.AgentProducer``);
* ``driver``: ``Pipeline``, the per-step schedule (admission, partial rollouts, overlap);
* ``state``: the pipeline's checkpointed state (admitted batches and their producers' work).
"""

from posttrain.async_rl.config import AsyncConfig
from posttrain.async_rl.driver import LEDGER_FILE, Pipeline, Schedule
from posttrain.async_rl.producer import Producer, ScoredBatch, SingleTurn

__all__ = ["LEDGER_FILE", "AsyncConfig", "Pipeline", "Producer", "Schedule", "ScoredBatch", "SingleTurn"]
