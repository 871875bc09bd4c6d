"""The conformance kit's own comparisons (issue 28): a kit whose tolerance or equality helper
were loosened would pass broken engines, so the helpers are pinned here with values just
outside what they accept, and the LR formula the ``lr_schedule`` check trusts is pinned
against ``engine_api.lr_schedule`` (independent code that must agree)."""

from __future__ import annotations

import math

import pytest
import torch

from engine_api.conformance import checks as C
from engine_api.conformance import fixtures as fx
from engine_api.conformance import safety_checks as safety
from engine_api.conformance import update_checks as update


def test_close_accepts_within_and_refuses_just_outside_the_tolerance():
    C.close("x", 1.0 + 0.9e-6, 1.0, 1e-6)
    with pytest.raises(C.CheckFailed, match="relative"):
        C.close("x", 1.0 + 1.1e-6, 1.0, 1e-6)
    with pytest.raises(C.CheckFailed):
        C.close("x", 1.0 + 1e-4, 1.0, update.UPDATE_RTOL)  # the 1e-4 error of issue 28
    with pytest.raises(C.CheckFailed):
        C.close("x", -2.0 * (1 + 2e-5), -2.0)  # default rtol 1e-5, negative values
    with pytest.raises(C.CheckFailed):
        C.close("x", math.nan, 1.0)


def test_same_is_bit_exact_on_tensor_dicts():
    w = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    C.same("w", {"w": {k: v.clone() for k, v in w.items()}}, {"w": w})
    off = {k: v.clone() for k, v in w.items()}
    off["a"][1, 2] = torch.nextafter(off["a"][1, 2], torch.tensor(math.inf))  # one element, one float step
    with pytest.raises(C.CheckFailed, match="a"):
        C.same("w", {"w": off}, {"w": w})
    with pytest.raises(C.CheckFailed):
        C.same("w", {"w": {"a": w["a"]}}, {"w": w})  # a tensor missing
    with pytest.raises(C.CheckFailed):
        C.same("w", {"w": {**w, "c": torch.zeros(1)}}, {"w": w})  # an extra tensor


def test_same_compares_floats_lists_and_keys():
    C.same("r", {"loss": 1.5, "lr": None, "norm": math.nan}, {"loss": 1.5, "lr": None, "norm": math.nan})
    with pytest.raises(C.CheckFailed):
        C.same("r", {"loss": 1.5 + 1e-12}, {"loss": 1.5})
    with pytest.raises(C.CheckFailed):
        C.same("r", {"steps": [{"losses": [1.0], "lr": 0.01}]}, {"steps": [{"losses": [1.0], "lr": 0.0100001}]})
    with pytest.raises(C.CheckFailed):
        C.same("r", {"loss": 1.5}, {"loss": 1.5, "lr": 0.01})  # a result missing
    with pytest.raises(C.CheckFailed):
        C.same("r", {"norm": 1.0}, {"norm": math.nan})


def test_max_diff_and_rel_see_one_element():
    from engine_api.batch import make_batch

    rows = [torch.zeros(3), torch.zeros(5)]
    jagged = make_batch([torch.zeros(3, dtype=torch.long), torch.zeros(5, dtype=torch.long)], log_probs=rows)["log_probs"]
    assert C.max_diff(jagged, [torch.zeros(3), torch.tensor([0, 0, 0, 0, 2e-5])]) == pytest.approx(2e-5)
    a = {"x": torch.ones(100)}
    b = {"x": torch.ones(100)}
    b["x"][7] += 1e-3
    assert fx.rel(a, b) > 9e-5


def test_the_lr_formula_agrees_with_the_scheduler_it_checks():
    from engine_api.config import OptimConfig
    from engine_api.lr_schedule import lr_factor

    cfg = OptimConfig(
        lr=fx.LR, lr_schedule="cosine", warmup_steps=update.LR_WARMUP, total_steps=update.LR_TOTAL, min_lr_ratio=update.LR_MIN_RATIO
    )
    for step in range(update.LR_TOTAL + 2):
        want = fx.lr_at(step, fx.LR, update.LR_WARMUP, update.LR_TOTAL, update.LR_MIN_RATIO)
        assert fx.LR * lr_factor(step, cfg) == pytest.approx(want, rel=1e-12), step
    # the check's steps cover warmup, the peak and the decay, so a frozen scheduler shows
    lrs = [fx.lr_at(s, fx.LR, update.LR_WARMUP, update.LR_TOTAL, update.LR_MIN_RATIO) for s in range(6)]
    assert len(set(lrs)) >= 5


def test_the_finite_gradient_loss_is_non_finite_with_a_finite_gradient():
    """The ``nonfinite_skip`` check's second case really is what it claims: the loss is inf,
    every gradient finite (a detached term adds to the value, not the graph)."""
    env = C.Env("x", (), "", "", rank=0, world=1)
    w = torch.tensor([0.5, -1.0], requires_grad=True)

    class _Batch(dict):
        pass

    loss_fn = safety._inf_loss_finite_grad_on(0, env)
    real = fx.loss_fn
    try:
        fx.loss_fn = lambda mb, out, norm: ((w * 2).sum(), {})
        value, _ = loss_fn(_Batch(), None, None)
    finally:
        fx.loss_fn = real
    value.backward()
    assert math.isinf(float(value.detach())) and torch.isfinite(w.grad).all()
