"""Suite-wide pytest setup: ``@pytest.mark.gpu`` tests skip cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU-only path); run on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
