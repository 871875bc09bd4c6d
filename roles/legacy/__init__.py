"""The legacy worker implementation, selected by ``trainer.use_legacy_worker_impl=enable``.

A direct FSDP2 implementation of the actor, critic and reference that does *not* go through
``BaseEngine``: each worker owns its HF model, ``fully_shard`` wrapping, AdamW, LR schedule and
its own micro-batch / optimizer loop. It is kept as the parity baseline for the engine roles
(``tests/roles/test_legacy.py``: 5 PPO steps give identical metrics and weights) and is
deprecated: building it logs one warning per process.

What it shares with the FSDP engine, and why: the HF loading and FSDP2 wrapping
(``backends.fsdp.model``), the HF forward (``backends.fsdp.forward``), DCP checkpoints
(``backends.fsdp.checkpoint``), the batch protocol helpers and the PPO/value objectives
(``roles.actor.policy_objective``, ``roles.critic.value_objective``). What it does not share
is the engine layer the parity test guards: ``BaseEngine``'s templates, the registry,
``engine_api.step.forward_backward_loop``, micro-batch planning, ``engine_api.optim`` and the
roles' ``train_epochs`` / ``infer_global``.

Only ``roles.factory.build_roles`` imports this package.
"""

from __future__ import annotations

import logging

from roles.legacy.roles import LegacyActor, LegacyCritic, LegacyReference

__all__ = ["LegacyActor", "LegacyCritic", "LegacyReference", "warn_deprecated"]

_log = logging.getLogger("enginekit.legacy")
_warned = False


def warn_deprecated() -> None:
    """Log the deprecation warning, once per process."""
    global _warned
    if not _warned:
        _warned = True
        _log.warning(
            "trainer.use_legacy_worker_impl=enable: the legacy FSDP workers are deprecated and kept only as a parity "
            "baseline; they support FSDP only. Fix: set trainer.use_legacy_worker_impl=disable (the default) to use "
            "the engine roles on any registered backend."
        )
