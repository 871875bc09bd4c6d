"""``trainer.use_legacy_worker_impl``: its values and the config problems of the legacy workers.

A leaf module (it imports only ``engine_api``) so that both sides of the seam can read the flag
without importing each other: ``roles.factory`` (which chooses the implementation and imports
``roles.legacy`` lazily), ``roles.legacy.worker`` (which refuses configs it cannot run) and
``recipes.ppo`` (which reports them at config load).
"""

from __future__ import annotations

from engine_api import EngineConfig

__all__ = ["FLAG", "FLAG_VALUES", "legacy_problems", "use_legacy"]

FLAG = "trainer.use_legacy_worker_impl"
FLAG_VALUES = ("auto", "enable", "disable", True, False)


def use_legacy(value: object) -> bool:
    """Interpret ``trainer.use_legacy_worker_impl``: ``enable`` / true select the legacy workers;
    ``disable`` / false / ``auto`` select the engine roles (``auto`` means "the current default",
    which is the engine roles)."""
    if value is True or value == "enable":
        return True
    if value is False or value in ("disable", "auto"):
        return False
    raise ValueError(f"{FLAG} = {value!r}: unknown; fix: use one of auto, enable, disable, true, false")


def legacy_problems(value: object, engine: EngineConfig) -> list[str]:
    """Config problems of the flag and of its combination with ``engine`` (empty when fine).

    The legacy workers are a direct FSDP2 implementation of the default feature set, kept as a
    parity baseline: FSDP only, fixed-size micro-batches, no offload, no deferred normalization.
    """
    try:
        legacy = use_legacy(value)
    except ValueError as exc:
        return [str(exc)]
    if not legacy:
        return []
    fix = f"fix: set {FLAG}=disable (the engine roles support it) or"
    out = []
    if engine.strategy != "fsdp":
        out.append(
            f"{FLAG} = {value!r} with engine.strategy = {engine.strategy!r}: the legacy workers are FSDP only; {fix} engine.strategy=fsdp"
        )
    if engine.max_token_len_per_micro_batch is not None:
        out.append(
            f"{FLAG} = {value!r} with engine.max_token_len_per_micro_batch = {engine.max_token_len_per_micro_batch}: "
            f"the legacy workers use fixed-size micro-batches; {fix} engine.max_token_len_per_micro_batch=null"
        )
    if engine.offload.param or engine.offload.optimizer:
        out.append(f"{FLAG} = {value!r} with engine.offload = {engine.offload}: the legacy workers do not offload; {fix} turn offload off")
    if engine.model.lora.enabled:
        out.append(
            f"{FLAG} = {value!r} with engine.model.lora.rank = {engine.model.lora.rank}: the legacy workers have no LoRA; {fix} engine.model.lora.rank=0"
        )
    if engine.deferred_normalization:
        out.append(
            f"{FLAG} = {value!r} with engine.deferred_normalization = true: the legacy workers normalize per call; "
            f"{fix} engine.deferred_normalization=false"
        )
    return out
