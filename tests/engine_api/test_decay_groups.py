"""Per-step weight decay applies whatever a load brought in (issue 53, item 3b).

``BaseEngine.set_optim_hparams(weight_decay=...)`` leaves a backend's no-decay group (biases,
norms) without decay. Which groups those are was read from the groups the first time it was
called: after loading a checkpoint whose last step used weight decay 0 (a Tinker client's
``optim_step`` with ``weight_decay=0``, then ``create_training_client_from_state_with_optimizer``),
every group looked like a no-decay group and later steps asking for decay got none (measured
through the server: 1e-3 relative = lr x wd after a step). Now fixed at ``init_model``, from the
optimizer as built. In-process, on ``ParamEngine`` (the optimizer skeleton over given tensors).
"""

from __future__ import annotations

import dataclasses

import torch

from engine_api.config import OptimConfig
from tests.engine_api.param_engine import ParamEngine


def test_weight_decay_reaches_decaying_groups_after_a_load_with_decay_zero():
    w, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    engine = ParamEngine({"w": w, "b": b}, opt)
    engine.config = dataclasses.replace(engine.config, optim=OptimConfig(weight_decay=0.01))
    engine.init_model()
    for group in opt.param_groups:  # what loading a checkpoint whose last step used weight decay 0 leaves
        group["weight_decay"] = 0.0
    engine.set_optim_hparams(weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
