"""What every conformance check is written with: the registry (:data:`CHECKS`, :func:`check`),
the outcomes (:class:`CheckFailed`, :class:`Skipped`), what a check knows (:class:`Env`) and the
helpers that build engines, run windows and compare results. Each check is one property of the
``BaseEngine`` contract, written against the contract only (``build_engine``, the public methods,
``export_weights``), never against a backend's internals.

The checks live in one module per topic, which ``engine_api.conformance`` imports in the order
the kit runs them (importing a module registers its checks): ``output_checks`` (what the engine
computes and exports against HF), ``update_checks`` (one optimizer step, target log-probs,
per-step AdamW settings, the LR schedule), ``safety_checks`` (aborted, bad, non-finite and
refused calls leave no trace), ``lora_checks`` (LoRA against peft, runs swapped on one engine),
``offload_checks``, ``checkpoint_checks`` (resume, tampered checkpoints) and
``precision_checks`` (bf16).

Every check runs on every rank of one launch (``engine_api.conformance.runner``) and raises
:class:`CheckFailed` naming what differs and by how much; :class:`Skipped` when the backend
declares it does not take the check's setting (e.g. refuses ``model.head: value`` at
``build_engine``). Tolerances:

* against the independent HF reference (``fixtures``): max |diff| 1e-5 for per-token outputs
  (batched vs per-sequence forward differ in float summation order; measured up to 5e-7),
  relative 1e-6 for losses, grad norms and updated weights as one vector (fp32; measured
  2e-8 on every built-in backend, while a mis-scaled gradient moves the updated weights by
  ~1e-2 relative: AdamW eps 1e-3 keeps the update proportional to the gradient);
* engine against itself (abort, non-finite skip, bad batch, offload, resume): bit-exact;
* the LR: the reported one relative 1e-6 to the schedule's formula (``fx.lr_at``), the one a
  step applied (read from the weights) relative 1e-4 (fp32 rounding of ``p * (1 - lr)``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_api.conformance import fixtures as fx


class CheckFailed(AssertionError):
    """A contract property does not hold."""


class Skipped(Exception):  # noqa: N818 - reads as the outcome
    """The backend refuses this check's setting at ``build_engine`` (reported, never counted as passed)."""


@dataclass(frozen=True)
class Env:
    """What a check knows: the backend, the layout settings, where the model and files live."""

    strategy: str
    overrides: tuple[str, ...]
    model_dir: str
    workdir: str
    rank: int
    world: int


@dataclass(frozen=True)
class Check:
    """One named property; ``phase`` 2 runs in a second, fresh launch (after phase 1)."""

    name: str
    fn: Callable[[Env], str]
    doc: str
    phase: int = 1


CHECKS: dict[str, Check] = {}


def check(name: str, phase: int = 1):
    """Register the decorated function as the check ``name`` in :data:`CHECKS` (its docstring's
    first line is what ``--list`` prints); the kit runs the checks in registration order."""

    def register(fn: Callable[[Env], str]) -> Callable[[Env], str]:
        CHECKS[name] = Check(name, fn, (fn.__doc__ or "").strip().splitlines()[0], phase)
        return fn

    return register


# ----------------------------------------------------------------------------- helpers
def new_engine(env: Env, *extra: str, mode: str = "token-mean", skip_on: str | None = None):
    """An initialised engine with the kit's settings, the layout overrides and ``extra``."""
    from engine_api import build_engine, load_config

    config = load_config(None, [*fx.engine_overrides(env.strategy, env.model_dir, mode), *env.overrides, *extra])
    try:
        engine = build_engine(config)
    except ValueError as exc:
        if skip_on is not None and skip_on in str(exc):
            raise Skipped(f"build_engine refuses {skip_on}: {str(exc).splitlines()[-1].strip()}") from None
        raise
    engine.init_model()
    engine.set_loss_fn(fx.loss_fn)
    return engine


def weights(engine) -> dict[str, torch.Tensor]:
    """Full weights by HF name (collective)."""
    return {k: v.detach().clone().cpu() for k, v in engine.export_weights()}


def window(engine, batch, calls: int = 1, inside: Callable[[], None] | None = None) -> dict:
    """One accumulation window on this rank's ``batch`` split into ``calls`` consecutive
    ``forward_backward_step`` calls, the optimizer step, and the LR step when it was taken;
    ``inside()`` runs last, still in ``train_mode``."""
    n = batch.batch_size[0]
    calls = min(calls, n)
    bounds = [round(i * n / calls) for i in range(calls + 1)]
    with engine.train_mode():
        engine.optimizer_zero_grad()
        losses = [engine.forward_backward_step(batch[a:b])[1] for a, b in zip(bounds, bounds[1:], strict=False)]
        norm = engine.optimizer_step()
        lr = engine.lr_scheduler_step() if math.isfinite(norm) else None
        if inside is not None:
            inside()
    return {"losses": losses, "grad_norm": norm, "lr": lr}


def close(what: str, got: float, want: float, rtol: float = 1e-5) -> None:
    if not math.isclose(got, want, rel_tol=rtol, abs_tol=1e-12):
        raise CheckFailed(f"{what}: {got!r} vs {want!r} (relative {abs(got - want) / max(abs(want), 1e-30):.1e} > {rtol:g})")


def max_diff(jagged: torch.Tensor, rows: list[torch.Tensor]) -> float:
    return max(float((a.detach().cpu().float() - b).abs().max()) for a, b in zip(jagged.unbind(), rows, strict=True))


def same(what: str, got: dict, want: dict) -> None:
    """Bit-exact equality of two results (floats, lists and tensor dicts)."""
    if set(got) != set(want):
        raise CheckFailed(f"{what}: keys differ ({sorted(set(got) ^ set(want))[:4]})")
    for key in want:
        a, b = got[key], want[key]
        if isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                raise CheckFailed(f"{what}: {key} have other names ({sorted((set(a) if isinstance(a, dict) else set()) ^ set(b))[:4]})")
            bad = [k for k in b if not torch.equal(a[k], b[k])]
            if bad:
                raise CheckFailed(f"{what}: {key} differ ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        elif a != b and not (isinstance(b, float) and math.isnan(a) and math.isnan(b)):
            raise CheckFailed(f"{what}: {key} {a!r} vs {b!r}")


def _local(engine, seed: int = 0, **meta):
    """This rank's shard of the kit's test batch ``seed`` (``meta``: its metadata)."""
    return engine.shard_data(fx.make_test_batch(seed, **meta))


def dropout_model(env: Env) -> str:
    """The kit's model with HF attention dropout on (``fx.DROPOUT``), built by the runner."""
    return os.path.join(env.workdir, fx.DROPOUT_MODEL)
