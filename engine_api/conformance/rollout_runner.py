"""Running the rollout conformance kit: one engine, every check of ``engine_api.conformance.rollout_checks``
in order, one report (``python -m engine_api.conformance --rollout BACKEND``)."""

from __future__ import annotations

import math
import os
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine_api.conformance import fixtures as fx
from engine_api.conformance import rollout_checks  # noqa: F401  (registers the checks in ROLLOUT_CHECKS)
from engine_api.conformance.checks import CheckFailed, Skipped
from engine_api.conformance.rollout_kit import ROLLOUT_CHECKS, TRAINER, VOCAB, Kit, build_model, first_line
from engine_api.conformance.runner import Outcome, Report


@dataclass
class RolloutReport(Report):
    """Every outcome of one rollout conformance run (``strategy`` holds the backend)."""

    def summary(self) -> str:
        lines = super().summary().splitlines()
        lines[0] = f"rollout conformance of backend {self.strategy!r} (one engine, one process):"
        return "\n".join(lines)


def run_rollout_conformance(
    backend: str,
    workdir: str | None = None,
    only: Sequence[str] | None = None,
    options: Mapping[str, Any] | None = None,
) -> RolloutReport:
    """Run the rollout checks (all, or ``only`` these names, in the kit's order) against
    ``backend`` in this process.

    Args:
        backend: a registered name (``hf``, ``vllm``), an entry-point name, or
            ``package.module:ClassName`` of a ``BaseRollout`` subclass.
        workdir: where the model goes (default: a temporary directory).
        only: check names (see ``ROLLOUT_CHECKS``).
        options: ``RolloutEngineConfig.options`` of the engine (backend settings).

    Raises:
        ValueError: ``backend`` names no rollout backend (or its extra is missing), or an
            unknown check is asked for.
    """
    from engine_api.rollout_registry import get_rollout_class

    get_rollout_class(backend)  # an unknown backend fails here, before anything is built
    names = list(ROLLOUT_CHECKS) if only is None else [n for n in ROLLOUT_CHECKS if n in set(only)]
    unknown = [n for n in (only or ()) if n not in ROLLOUT_CHECKS]
    if unknown:
        raise ValueError(f"unknown rollout check(s) {unknown}; fix: use some of {', '.join(ROLLOUT_CHECKS)}")
    from transformers.utils import logging as hf_logging

    bars, verbosity, threads = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity(), torch.get_num_threads()
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model would bury the report
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)  # see the module docstring
    try:
        return _run(backend, workdir, names, options)
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _run(backend: str, workdir: str | None, names: list[str], options: Mapping[str, Any] | None) -> RolloutReport:
    report = RolloutReport(backend, 1)
    with tempfile.TemporaryDirectory(prefix="enginekit-rollout-conformance-") as tmp:
        workdir = workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        model_dir = build_model(os.path.join(workdir, "model"))
        kit = Kit(backend, model_dir, options)
        try:
            if "sync_after_step" in names:  # before the rollout engine, as a colocated job builds them
                kit.trainer, kit.trainer_error = _trained_engine(model_dir)
            try:
                kit.start()
            except Exception as exc:  # noqa: BLE001 - every check fails with the reason
                detail = f"the engine could not be built: {type(exc).__name__}: {first_line(exc)}"
                report.outcomes += [Outcome(n, "failed", detail) for n in names]
                return report
            for name in names:
                outcome = _run_check(kit, name)
                if outcome.status == "failed" and name != names[-1]:
                    try:
                        rebuilt = kit.restore()
                    except Exception as exc:  # noqa: BLE001
                        outcome.detail += f" [the engine could not be rebuilt: {type(exc).__name__}: {first_line(exc)}]"
                        report.outcomes.append(outcome)
                        report.outcomes += [
                            Outcome(n, "failed", "not run: the engine could not be rebuilt") for n in names[names.index(name) + 1 :]
                        ]
                        return report
                    if rebuilt:
                        outcome.detail += f" [{rebuilt}]"
                report.outcomes.append(outcome)
        finally:
            kit.close()
    return report


def _run_check(kit: Kit, name: str) -> Outcome:
    try:
        return Outcome(name, "passed", ROLLOUT_CHECKS[name].fn(kit) or "ok")
    except Skipped as exc:
        return Outcome(name, "skipped", str(exc))
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
        if isinstance(exc, CheckFailed):
            return Outcome(name, "failed", str(exc).strip())
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return Outcome(name, "failed", f"{type(exc).__name__} at {os.path.basename(where.filename)}:{where.lineno}: {first_line(exc)}")


def _trained_engine(model_dir: str):
    """``(engine, None)``: a ``TRAINER`` engine on the kit's model after one optimizer step of
    the conformance loss; ``(None, why)`` when it cannot be built."""
    try:
        from engine_api import build_engine, load_config
        from engine_api.conformance.checks import window

        engine = build_engine(load_config(None, fx.engine_overrides(TRAINER, model_dir)))
        engine.init_model()
        engine.set_loss_fn(fx.loss_fn)
        step = window(engine, fx.make_test_batch(vocab=VOCAB))
        if not math.isfinite(step["grad_norm"]):
            return None, f"the {TRAINER} step was not finite (grad norm {step['grad_norm']})"
        return engine, None
    except Exception as exc:  # noqa: BLE001 - reported as the check's skip reason
        return None, f"{TRAINER} training engine could not be built or stepped ({type(exc).__name__}: {first_line(exc)})"
