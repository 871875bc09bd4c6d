"""The post-step guard sees every non-finite weight, not only NaN (issue 28, item 9).

``engine_api.optim.check_update_finite`` runs after every optimizer step that was not
skipped; a weight that became +inf or -inf is as fatal as a NaN (the next forward gives NaN
logits, and a checkpoint would carry it on). The guard first takes fused L2 norms (which
overflow to inf for huge *finite* weights) and confirms a non-finite norm on the tensor itself,
so huge finite weights must not be refused either. In-process, one rank (the collective parts
return early for a group of one; the two-rank agreement is ``tests/reliability/test_update_guard.py``).
The last tests drive a real optimizer step end to end through ``BaseEngine.optimizer_step``
(``tests/engine_api/param_engine.py``: the skeleton over given parameters).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_api.optim import NonFiniteUpdateError, check_update_finite
from tests.engine_api.param_engine import ParamEngine


def _params(bad: float | None = None, where: int = 1, dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    """Three named tensors; ``bad`` is written into one element of ``w{where}``."""
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(4, 3, generator=g).to(dtype)) for i in range(3)]
    if bad is not None:
        named[where][1].view(-1)[5] = bad
    return named


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["+inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("where", [0, 2])
def test_any_non_finite_weight_raises_naming_the_parameter_and_the_step(bad, dtype, where):
    with pytest.raises(NonFiniteUpdateError, match=rf"optimizer step 7 wrote non-finite values .*\(first: w{where}\).*fix:"):
        check_update_finite(_params(bad, where, dtype), step=7)


def test_finite_weights_pass_even_when_their_norm_overflows():
    """3e38 is a finite float32 (max ~3.4e38) whose squared sum overflows the L2 norm to inf:
    a false alarm here would stop a healthy run."""
    huge = [("big", torch.full((8,), 3e38)), ("neg", torch.full((3,), -3e38)), ("small", torch.ones(2))]
    assert not math.isfinite(float(torch.linalg.vector_norm(huge[0][1])))  # the premise
    check_update_finite(huge, step=1)
    check_update_finite(_params(), step=1)
    check_update_finite([("empty", torch.empty(0)), *_params()], step=1)  # an empty shard has no values


def test_a_huge_finite_tensor_does_not_hide_an_inf_in_another_one():
    """Both tensors have a non-finite norm; only the one with an inf element is named."""
    named = [("big", torch.full((8,), 3e38)), ("w", torch.zeros(5))]
    named[1][1][3] = math.inf
    with pytest.raises(NonFiniteUpdateError, match=r"\(first: w\)"):
        check_update_finite(named, step=2)


def test_a_step_that_writes_inf_is_caught_by_the_step_itself():
    """End to end on a real optimizer: a finite gradient, an update that overflows one weight to
    +inf (an lr so large that 1.0 - lr * grad leaves float32): the step ran (the norm was
    finite), and the skeleton's post-step guard raises, naming step 4 and the weight, and marks
    the engine broken. The reference is plain arithmetic."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    engine = ParamEngine({"weight": w}, torch.optim.SGD([w], lr=3e38))
    engine.global_step = 3
    w.grad = torch.tensor([-10.0, 0.0])  # w[0] -> 1 + 3e39 = inf in float32; w[1] unchanged
    with pytest.raises(NonFiniteUpdateError, match=r"step 4 .*\(first: weight\)"):
        engine.optimizer_step()
    assert math.isinf(float(w.detach()[0])) and float(w.detach()[1]) == 2.0
    assert engine.global_step == 3
    with pytest.raises(RuntimeError, match="train_mode refused: optimizer step 4"):
        engine.train_mode().__enter__()


def test_an_inf_weight_marks_the_engine_broken_until_a_load():
    """``BaseEngine._check_update`` (what every backend calls after a step that ran) raises on
    an inf weight and records it, so training, saving and exporting are refused afterwards;
    finite weights leave the engine usable. Called on a bare object: the two methods read only
    ``global_step`` and ``_broken``."""
    from types import SimpleNamespace

    from engine_api.base import BaseEngine

    engine = SimpleNamespace(global_step=11, _broken=None)
    BaseEngine._check_update(engine, _params())
    BaseEngine._refuse_if_broken(engine, "train_mode")  # still fine
    with pytest.raises(NonFiniteUpdateError, match="optimizer step 12 "):
        BaseEngine._check_update(engine, _params(-math.inf))
    for what in ("train_mode", "save_checkpoint", "export_weights"):
        with pytest.raises(RuntimeError, match=rf"{what} refused: optimizer step 12 wrote non-finite values"):
            BaseEngine._refuse_if_broken(engine, what)


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_non_finite_gradient_skips_the_step_and_leaves_weights_and_optimizer_state(bad):
    """The skip before the step (the other half of the guard): a NaN or inf in the gradient
    gives a non-finite norm; ``optimizer_step`` returns it and does not step (AdamW state stays
    empty, weights and step counter unchanged)."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.AdamW([w], lr=0.1)
    engine = ParamEngine({"w": w}, opt, clip_grad=1.0)
    w.grad = torch.tensor([bad, 1.0])
    norm = engine.optimizer_step()
    assert not math.isfinite(norm) and (math.isnan(norm) == math.isnan(bad))
    assert w.detach().tolist() == [1.0, 2.0] and opt.state == {} and engine.global_step == 0


def test_a_non_finite_loss_in_the_window_skips_a_step_with_a_finite_gradient():
    """A NaN loss in a masked-out position can leave the gradient finite: the window's record
    skips the step (NaN is returned, as the norm itself was finite), and the record is reset
    so the next window steps."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    engine = ParamEngine({"w": w}, torch.optim.SGD([w], lr=0.5))
    engine.deferred.note_loss(math.nan)
    w.grad = torch.tensor([3.0, 4.0])
    assert math.isnan(engine.optimizer_step())
    assert w.detach().tolist() == [1.0, 2.0] and not engine.deferred.nonfinite_loss and engine.global_step == 0
    assert engine.optimizer_step() == pytest.approx(5.0)  # sqrt(9 + 16)
    assert w.detach().tolist() == pytest.approx([1.0 - 0.5 * 3.0, 2.0 - 0.5 * 4.0]) and engine.global_step == 1


def test_clipping_scales_the_gradient_to_the_max_norm_before_the_update():
    """The clip of the skeleton: a gradient of norm 5 clipped to 1 is the gradient / 5 (torch's
    ``clip_grads_with_norm_`` coefficient, max_norm / (norm + 1e-6)); SGD then moves by lr times it."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    engine = ParamEngine({"w": w}, torch.optim.SGD([w], lr=1.0), clip_grad=1.0)
    w.grad = torch.tensor([3.0, 4.0])
    assert engine.optimizer_step() == pytest.approx(5.0)  # the pre-clip norm is reported
    coef = 1.0 / (5.0 + 1e-6)
    assert w.detach().tolist() == pytest.approx([1.0 - 3.0 * coef, 2.0 - 4.0 * coef], rel=1e-6)
