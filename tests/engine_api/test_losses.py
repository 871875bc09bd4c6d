"""engine_api.losses against a direct, loop-by-loop computation of docs/design.md section 4."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine_api.losses import (
    AGG_MODES,
    DeferredNormalizer,
    NormCounts,
    agg_loss,
    agg_numerator,
    backward_scale,
    build_norm_context,
)
from tests.support.launch import run_distributed

C = 5.0


def _jagged(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _case(seed=0, lengths=(4, 7, 1, 5), empty_row=None):
    g = torch.Generator().manual_seed(seed)
    loss_rows = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    mask_rows = [(torch.rand(n, generator=g) > 0.4).double() for n in lengths]
    if empty_row is not None:
        mask_rows[empty_row] = torch.zeros(lengths[empty_row], dtype=torch.float64)
    loss = _jagged(loss_rows)
    mask = torch.nested.nested_tensor_from_jagged(torch.cat(mask_rows), loss.offsets())
    return loss, mask, loss_rows, mask_rows


def _direct(mode, loss_rows, mask_rows):
    """The formula, written out per sequence."""
    seqs = [
        (lr * m).sum() / m.sum() if mode == "seq-mean-token-mean" else (lr * m).sum()
        for lr, m in zip(loss_rows, mask_rows, strict=True)
        if m.sum() > 0
    ]
    token_sum = sum(float((lr * m).sum()) for lr, m in zip(loss_rows, mask_rows, strict=True))
    tokens = sum(float(m.sum()) for m in mask_rows)
    if mode == "token-mean":
        return token_sum / tokens
    if mode == "sum":
        return token_sum
    if mode == "seq-mean-token-sum-norm":
        return token_sum / (len(seqs) * C)
    return float(sum(seqs)) / len(seqs)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("empty_row", [None, 1])
def test_agg_loss_matches_formula(mode, empty_row):
    loss, mask, loss_rows, mask_rows = _case(empty_row=empty_row)
    norm = build_norm_context(mask, mode, None, C)
    assert math.isclose(float(agg_loss(loss, mask, norm)), _direct(mode, loss_rows, mask_rows), rel_tol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_contributions_sum_to_global_loss(mode):
    """Contributions of any split, normalised by the whole batch's context, add up exactly."""
    loss, mask, loss_rows, mask_rows = _case(lengths=(3, 6, 2, 8, 5, 4))
    norm = build_norm_context(mask, mode, None, C)
    for cut in ([0, 1, 6], [0, 3, 4, 6], [0, 2, 5, 6]):
        parts = [
            agg_loss(
                _jagged(loss_rows[a:b]),
                torch.nested.nested_tensor_from_jagged(torch.cat(mask_rows[a:b]), _jagged(loss_rows[a:b]).offsets()),
                norm,
            )
            for a, b in zip(cut[:-1], cut[1:], strict=True)
        ]
        assert math.isclose(float(sum(parts)), _direct(mode, loss_rows, mask_rows), rel_tol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradient_matches_formula_gradient(mode):
    loss, mask, loss_rows, mask_rows = _case()
    values = loss.values().clone().requires_grad_(True)
    agg_loss(torch.nested.nested_tensor_from_jagged(values, loss.offsets()), mask, build_norm_context(mask, mode, None, C)).backward()
    rows = [r.clone().requires_grad_(True) for r in loss_rows]
    torch.tensor(0.0, dtype=torch.float64).add(_direct_tensor(mode, rows, mask_rows)).backward()
    assert torch.allclose(values.grad, torch.cat([r.grad for r in rows]), rtol=1e-12, atol=0)


def _direct_tensor(mode, rows, masks):
    seqs = [
        (r * m).sum() / m.sum() if mode == "seq-mean-token-mean" else (r * m).sum() for r, m in zip(rows, masks, strict=True) if m.sum() > 0
    ]
    tokens = sum(float(m.sum()) for m in masks)
    total = sum((r * m).sum() for r, m in zip(rows, masks, strict=True))
    return {"token-mean": total / tokens, "seq-mean-token-sum-norm": total / (len(seqs) * C), "sum": total}.get(mode, sum(seqs) / len(seqs))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_flat_values_in_the_mask_layout_equal_the_jagged_loss(mode):
    """Roles pass flat per-token values (no jagged wrapper on the autograd path): same value,
    same gradient as the jagged loss."""
    loss, mask, _, _ = _case(empty_row=1)
    norm = build_norm_context(mask, mode, None, C)
    flat = loss.values().clone().requires_grad_(True)
    jag = loss.values().clone().requires_grad_(True)
    a = agg_loss(flat, mask, norm)
    b = agg_loss(torch.nested.nested_tensor_from_jagged(jag, loss.offsets()), mask, norm)
    (a + b).backward()
    assert float(a) == float(b)
    assert torch.equal(flat.grad, jag.grad)


def test_flat_values_of_the_wrong_length_are_rejected():
    _, mask, _, _ = _case()
    with pytest.raises(ValueError, match="loss_mask"):
        agg_numerator(torch.ones(mask.values().numel() + 1, dtype=torch.float64), mask, "token-mean")


def test_counts_skip_sequences_with_empty_mask():
    _, mask, _, mask_rows = _case(empty_row=2)
    counts = NormCounts.from_mask(mask)
    assert counts.tokens == sum(float(m.sum()) for m in mask_rows)
    assert counts.seqs == sum(1 for m in mask_rows if m.sum() > 0) == 3


def test_all_masked_batch_raises_before_backward():
    mask = _jagged([torch.zeros(3), torch.zeros(2)])
    with pytest.raises(ValueError, match="selects no token"):
        build_norm_context(mask, "token-mean", None)


def test_norm_mode_needs_constant_and_unknown_mode_is_named():
    mask = _jagged([torch.ones(3)])
    with pytest.raises(ValueError, match="loss_agg_constant"):
        build_norm_context(mask, "seq-mean-token-sum-norm", None)
    with pytest.raises(ValueError, match="'token-sum'.*token-mean"):
        build_norm_context(mask, "token-sum", None)


def test_numerator_rejects_mismatched_layouts():
    with pytest.raises(ValueError, match="loss_mask"):
        agg_numerator(_jagged([torch.ones(3)]), _jagged([torch.ones(4)]), "token-mean")


def test_backward_scale_undoes_dp_average_and_defers_denominator():
    mask = _jagged([torch.ones(3), torch.ones(5)])
    norm = build_norm_context(mask, "token-mean", None)
    assert backward_scale(norm, deferred=False) == 1.0
    norm = dataclasses.replace(norm, dp_size=4)  # as if reduced over 4 ranks
    assert backward_scale(norm, deferred=False) == 4.0
    assert backward_scale(norm, deferred=True) == 4.0 * 8
    assert backward_scale(norm, deferred=False, grads_averaged_over_dp=False) == 1.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_deferred_normalizer_equals_one_shot_denominator(mode):
    _, mask, _, mask_rows = _case(lengths=(3, 6, 2, 8, 5, 4))
    whole = build_norm_context(mask, mode, None, C)
    deferred = DeferredNormalizer(mode, C)
    for a, b in ((0, 2), (2, 3), (3, 6)):
        deferred.add(NormCounts.from_mask(_jagged(mask_rows[a:b])))
    assert math.isclose(deferred.grad_scale(), 1.0 / whole.denominator, rel_tol=1e-15)
    deferred.reset()
    with pytest.raises(RuntimeError, match="no loss tokens"):
        deferred.grad_scale()


def _counts_worker(rank, world):
    rows = [torch.ones(2 + rank), torch.zeros(3), torch.ones(1)] if rank == 0 else [torch.ones(4)]
    ctx = build_norm_context(_jagged(rows), "seq-mean-token-sum", None)
    return ctx.counts, ctx.dp_size


def test_counts_are_all_reduced_over_dp_group():
    (c0, n0), (c1, n1) = run_distributed(_counts_worker, 2)
    assert c0 == c1 == NormCounts(tokens=2 + 1 + 4, seqs=3)  # rank 0: 2 + 0 + 1 tokens, 2 non-empty rows
    assert n0 == n1 == 2


# ----------------------------------------------------------------------------- boundaries
# Found by `make mutate` (docs/mutation.md): off-by-one thresholds and flags that no other fast
# test pinned down.


@pytest.mark.parametrize("mode", AGG_MODES)
def test_a_batch_with_one_loss_token_is_a_valid_batch(mode):
    """Denominator 1 (one token, one sequence, C = 1) is legal: the loss is that token's value."""
    mask = torch.nested.nested_tensor_from_jagged(torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0, 3]))
    loss = torch.nested.nested_tensor_from_jagged(torch.tensor([9.0, -2.5, 9.0]), torch.tensor([0, 3]))
    constant = 1.0 if mode == "seq-mean-token-sum-norm" else None
    norm = build_norm_context(mask, mode, None, constant)
    assert norm.denominator == 1.0 and norm.constant == constant
    assert float(agg_loss(loss, mask, norm)) == -2.5
    deferred = DeferredNormalizer(mode, constant)
    deferred.add(norm.counts)
    assert deferred.grad_scale() == 1.0


def test_the_norm_constant_must_be_positive_and_any_positive_value_is_taken():
    mask = _jagged([torch.ones(3)])
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=rf"loss_agg_constant = {bad!r}: seq-mean-token-sum-norm needs a positive constant C; fix"):
            build_norm_context(mask, "seq-mean-token-sum-norm", None, bad)
    for good in (0.5, 1.0, 7.0):
        assert build_norm_context(mask, "seq-mean-token-sum-norm", None, good).denominator == good


def test_flat_values_must_be_one_dimensional():
    mask = _jagged([torch.ones(3), torch.ones(2)])
    norm = build_norm_context(mask, "token-mean", None)
    assert float(agg_loss(torch.full((5,), 2.0), mask, norm)) == 2.0  # flat values in the mask's layout
    with pytest.raises(ValueError, match=r"expected a jagged or 1-D per-token tensor, got shape \(5, 1\)"):
        agg_numerator(torch.ones(5, 1), torch.ones(5, 1), "token-mean")  # a 2-D mask: no layout to read
    with pytest.raises(ValueError, match=r"layout \(5, 1\)"):
        agg_loss(torch.ones(5, 1), mask, norm)


def test_numerator_accepts_equal_offsets_held_in_another_tensor():
    """Jagged fields built separately have equal but distinct offsets tensors: same layout."""
    values = torch.nested.nested_tensor_from_jagged(torch.arange(5.0), torch.tensor([0, 3, 5]))
    mask = torch.nested.nested_tensor_from_jagged(torch.ones(5), torch.tensor([0, 3, 5]))
    assert float(agg_numerator(values, mask, "token-mean")) == 10.0


def test_deferred_normalizer_flags_a_non_finite_loss_until_reset():
    d = DeferredNormalizer("token-mean")
    assert d.nonfinite_loss is False  # a fresh window skips nothing
    d.note_loss(1.0)
    assert d.nonfinite_loss is False
    d.note_loss(float("nan"))
    assert d.nonfinite_loss is True
    d.note_loss(2.0)  # a later finite loss does not clear it
    assert d.nonfinite_loss is True
    d.reset()
    assert d.nonfinite_loss is False


def test_numerator_rejects_the_same_token_count_in_other_rows():
    """5 tokens either way, but rows of 2 + 3 against a mask of 3 + 2: not the same layout."""
    values = torch.nested.nested_tensor_from_jagged(torch.ones(5), torch.tensor([0, 2, 5]))
    mask = torch.nested.nested_tensor_from_jagged(torch.ones(5), torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="loss_mask"):
        agg_numerator(values, mask, "seq-mean-token-mean")


def test_a_flat_mask_is_one_sequence():
    """A 1-D (not jagged) loss mask is read as one sequence: its counts and the loss follow."""
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    counts = NormCounts.from_mask(mask)
    assert (counts.tokens, counts.seqs) == (3.0, 1.0)
    values = torch.tensor([5.0, 1.0, 2.0, 7.0, 3.0])
    assert float(agg_numerator(values, mask, "seq-mean-token-mean")) == 2.0  # (1 + 2 + 3) / 3, one sequence
    assert float(agg_numerator(values, mask, "seq-mean-token-sum")) == 6.0
