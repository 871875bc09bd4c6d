"""Asynchronous RL: the rollout runs ahead of training under a staleness bound (docs/async.md).

* ``config``: ``AsyncConfig`` (the recipe's ``async`` section);
* ``driver``: ``Pipeline``, the per-step schedule (admission, partial rollouts, overlap);
* ``state``: the pipeline's checkpointed state (admitted batches, kept tokens, versions).
"""

from posttrain.async_rl.config import AsyncConfig
from posttrain.async_rl.driver import LEDGER_FILE, Pipeline

__all__ = ["LEDGER_FILE", "AsyncConfig", "Pipeline"]
