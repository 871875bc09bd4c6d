"""``recipes.sft`` on Ray (``trainer.launcher=ray``): the engine's ranks are the workers of one
pool (``trainer.placement``; SFT has one role, ``actor``), each holding a
``recipes.sft.SFTWorker``; the recipe's process runs the loop and sends each step's global batch
through Ray's object store (every rank takes its data-parallel shard, as under torchrun)."""

from __future__ import annotations

from typing import Any

from posttrain.placement.cluster import RayCluster
from posttrain.placement.config import placement_problems
from posttrain.placement.remote import RemoteRole

_METHODS = (
    "world_size",
    "train_step",
    "has_validation",
    "evaluate",
    "eval_batch_count",
    "eval_counts",
    "sample_rows",
    "save_checkpoint",
    "load_checkpoint",
    "save_hf",
)


class RaySFT(RemoteRole):
    """The ``SFTWorker`` of every rank, driven from here; ``close`` tears the cluster down."""

    def close(self) -> None:
        self._cluster.close()


def place_on_ray(cfg) -> Any:
    """Start (or join) Ray, reserve the pool and build an ``SFTWorker`` on every rank.

    Raises:
        ValueError: a placement SFT cannot use, or a cluster that cannot hold it (before any
            model is built).
    """
    t = cfg.trainer
    problems = placement_problems(t.placement, ("actor",))
    if problems:
        raise ValueError("; ".join(problems))
    pool = t.placement.assignment(("actor",))["actor"]
    cluster = RayCluster(t.placement, {pool: ("actor",)}, t.ray_address, cfg.engine.dist_timeout_s).__enter__()
    try:
        group = cluster.spawn(pool)
        cluster.build(group, "recipes.sft:SFTWorker", cfg)
        cluster.record(t.output_dir)
        return RaySFT(cluster, group, "", _METHODS)
    except BaseException:
        cluster.close(graceful=False)
        raise
