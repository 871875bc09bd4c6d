"""Roles beyond one process tree: ``trainer.launcher=ray`` places each role's engine group on a
resource pool of a Ray cluster and drives it from the recipe's process (a single controller).

* ``config``: ``trainer.placement`` (pools, which role runs where) and its checks; imports no Ray.
* ``cluster``: start or join Ray, check the cluster can hold the placement, one placement
  group per pool, worker groups with their own ``torch.distributed`` worlds, calls fanned out
  to every rank with fault handling and teardown.
* ``worker``: the Ray actor a rank runs in.
* ``transfer``: weights from the training group to a rollout group on another pool, over a
  process group that spans both (tensor collectives, bucketed).
* ``remote``: driver-side handles with the methods of the roles they stand for.

Ray is an optional extra (``pip install -e '.[ray]'``); only ``cluster`` and ``worker`` import it,
when a run asks for it.
"""

from posttrain.placement.config import LAUNCHERS, PlacementConfig, placement_problems

__all__ = ["LAUNCHERS", "PlacementConfig", "placement_problems"]
