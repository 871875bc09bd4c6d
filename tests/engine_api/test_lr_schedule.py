"""LR schedules: warmup, decay shapes, and the LambdaLR wiring."""

from __future__ import annotations

import math

import pytest
import torch

from engine_api.config import OptimConfig
from engine_api.lr_schedule import build_lr_scheduler, lr_factor


def test_warmup_then_constant():
    cfg = OptimConfig(warmup_steps=4)
    assert [lr_factor(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_reaches_floor_at_total_steps_and_stays(schedule):
    cfg = OptimConfig(warmup_steps=2, lr_schedule=schedule, total_steps=12, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg) for s in range(16)]
    assert factors[1] == 1.0 and factors[2] == 1.0
    assert all(a >= b for a, b in zip(factors[2:], factors[3:], strict=False))  # non-increasing after warmup
    assert math.isclose(factors[12], 0.1) and math.isclose(factors[15], 0.1)
    midpoint = 0.1 + 0.9 * 0.5  # both shapes cross half-way at mid-decay
    assert math.isclose(factors[7], midpoint)


def test_scheduler_drives_the_optimizer_lr():
    cfg = OptimConfig(lr=0.2, warmup_steps=2, lr_schedule="linear", total_steps=6)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_lr_scheduler(opt, cfg)
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert all(math.isclose(a, cfg.lr * lr_factor(s, cfg)) for s, a in enumerate(seen))
