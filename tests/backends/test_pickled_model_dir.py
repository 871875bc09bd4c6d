"""A model directory whose ``pytorch_model.bin`` pickles a callable (issue 28): nothing runs, and
the error advises safetensors instead of torch's ``weights_only=False`` (the unsafe step)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.support.hf_utils import engine_for, make_model


class _RunsCode:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling would create the sentinel file


def test_pickled_code_in_model_dir_is_refused_with_safe_advice(tmp_path):
    path = make_model(tmp_path / "m", "llama")
    state = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    sentinel = tmp_path / "ran"
    torch.save({**state, "payload": _RunsCode(str(sentinel))}, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError) as err:
        engine_for(path)
    message = str(err.value)
    assert "model.path" in message and "safetensors" in message and "fix:" in message
    assert "weights_only" not in message  # torch's advice to turn the safe loader off is not passed on
    assert not sentinel.exists()
