"""Fixtures shared by the reliability suites: the backend parameter (every built-in engine) and
a tiny Llama-style HF directory (a module may override ``model_dir`` with its own model)."""

from __future__ import annotations

import pytest

from tests.reliability._step_common import BACKENDS
from tests.support.hf_utils import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param
