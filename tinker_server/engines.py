"""What an engine of training runs is, whichever kind: the one :class:`RunEngine` protocol that
the in-process engine (``shared_engine.SharedEngine``) and the Ray worker group
(``ray_engine.RayEngine``) both satisfy, and all the factory (``factory.EngineFactory``) knows
of them.

An engine is built for one :class:`~tinker_server.signature.Signature` (base model, LoRA rank and
target modules) and serves the runs that agree on it: it opens them (``open_run``: the run's id
and the engine's count of runs are the engine's own) and closes them (each run's ``close`` hands
itself back); with its last run gone the engine closes and frees its memory or its workers.
"""

from __future__ import annotations

from typing import Protocol

from tinker_server.contract import LoraIn, TrainingRun
from tinker_server.signature import Signature
from tinker_server.snapshots import RolloutPool


class RunEngine(Protocol):
    """An engine shared by the training runs of one signature.

    Attributes:
        signature: the base model, LoRA rank and target modules of every run it serves.
        seed: the seed its adapters were built with (None until its first run built it).
        can_reseed: whether it serves runs of other seeds (it can draw their adapters:
            ``BaseEngine.reset_adapters``); if not, only runs of :attr:`seed`.
    """

    signature: Signature
    seed: int | None
    can_reseed: bool

    @property
    def closed(self) -> bool:
        """Whether it was closed (its last run closed): it serves no further run."""
        ...

    def open_run(self, base_model: str, lora: LoraIn, pool: RolloutPool) -> TrainingRun:
        """A new run of ``lora`` on this engine, sampling through ``pool``.

        Raises:
            UserError: no room for it (named, with the fix).
        """
        ...
