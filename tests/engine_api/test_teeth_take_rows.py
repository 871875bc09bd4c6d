"""Row slicing of jagged batches returns exactly the selected rows (issue 28, item 9).

``engine_api.batch.take_rows`` (and ``restore_order`` / ``shard_batch``, built on it) computes
new offsets and a token index itself instead of TensorDict's per-row gather. A wrong bound
there gives rows shifted by a token, a row too many or too few, or another row's tokens: the
model then trains on the wrong text. The reference here is Python lists: the batch is built
from known rows, and the expected result is those lists indexed with Python's own slice and
list semantics, compared field by field (jagged and dense) and with the metadata.
"""

from __future__ import annotations

import pytest
import torch

from engine_api.batch import make_batch, restore_order, shard_batch, take_rows

# Six rows of distinct lengths whose tokens name their row and position (row r, position t
# holds 100 * r + t), so any shift or mix-up shows in the values.
LENGTHS = (3, 1, 4, 2, 5, 2)
ROWS = [[100 * r + t for t in range(n)] for r, n in enumerate(LENGTHS)]


def _batch():
    b = make_batch([torch.tensor(r) for r in ROWS], temperature=0.5)
    b["advantages"] = torch.nested.nested_tensor_from_jagged(
        torch.tensor([float(v) + 0.5 for r in ROWS for v in r]), b["input_ids"].offsets()
    )
    b["score"] = torch.tensor([[float(r), -float(r)] for r in range(len(ROWS))])
    b["uid"] = torch.arange(len(ROWS)) * 10
    return b


def _check(got, picked: list[int]) -> None:
    """``got`` holds exactly rows ``picked`` of :data:`ROWS`, in that order, in every field."""
    assert got.batch_size == torch.Size([len(picked)])
    assert [r.tolist() for r in got["input_ids"].unbind()] == [ROWS[i] for i in picked]
    assert [r.tolist() for r in got["advantages"].unbind()] == [[v + 0.5 for v in ROWS[i]] for i in picked]
    mask = [r.tolist() for r in got["loss_mask"].unbind()]
    assert mask == [[0.0] + [1.0] * (LENGTHS[i] - 1) for i in picked]  # make_batch's default mask, per row
    assert got["score"].tolist() == [[float(i), -float(i)] for i in picked]
    assert got["uid"].tolist() == [10 * i for i in picked]
    assert got.get_non_tensor("temperature") == 0.5
    if picked:
        offsets = got["input_ids"].offsets()
        assert offsets.tolist() == [0] + list(torch.tensor([LENGTHS[i] for i in picked]).cumsum(0).tolist())
        assert got["advantages"].offsets() is offsets and got["loss_mask"].offsets() is offsets


SLICES = [
    slice(0, 6),
    slice(2, 5),
    slice(5, 6),
    slice(0, 1),
    slice(3, None),
    slice(None, 2),
    slice(4, 100),  # stop past the end: clipped, as Python does
    slice(-2, None),  # negative start
    slice(1, -1),  # negative stop
    slice(3, 3),  # empty
    slice(4, 2),  # start after stop: empty, never negative
    slice(1, 5, 1),  # an explicit step of one
    slice(0, 6, 2),  # another step: TensorDict's own slicing
]


@pytest.mark.parametrize("rows", SLICES, ids=str)
def test_a_slice_selects_exactly_pythons_rows(rows):
    _check(take_rows(_batch(), rows), list(range(len(ROWS)))[rows])


INDEXES = [[4, 0, 5, 2], [1], [5, 4, 3, 2, 1, 0], [2, 2, 0], [0, 1, 2, 3, 4, 5], [3, 5]]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("rows", INDEXES, ids=str)
def test_an_index_selects_exactly_those_rows_in_that_order(rows, dtype):
    _check(take_rows(_batch(), torch.tensor(rows, dtype=dtype)), rows)


def test_a_dense_field_first_and_no_jagged_field_at_all():
    """The offsets come from the jagged fields, whatever the field order; a batch of dense
    fields only is indexed row by row."""
    b = _batch()
    dense_first = b.select("uid", "score", "input_ids", "advantages", "loss_mask")
    dense_first.set_non_tensor("temperature", 0.5)
    _check(take_rows(dense_first, torch.tensor([3, 0, 4])), [3, 0, 4])
    _check(take_rows(dense_first, slice(1, 4)), [1, 2, 3])
    dense = b.select("uid", "score")
    got = take_rows(dense, torch.tensor([5, 1]))
    assert got["uid"].tolist() == [50, 10] and got["score"].tolist() == [[5.0, -5.0], [1.0, -1.0]]
    assert take_rows(dense, slice(2, 4))["uid"].tolist() == [20, 30]


def test_restore_order_and_shards_hold_the_right_rows():
    b = _batch()
    perm = [2, 5, 0, 4, 1, 3]  # batch[j] is original row perm[j]
    shuffled = take_rows(b, torch.tensor(perm))
    _check(restore_order(shuffled, torch.tensor(perm)), list(range(6)))
    _check(shard_batch(b, 0, 2), [0, 1, 2])
    _check(shard_batch(b, 1, 2), [3, 4, 5])
    _check(shard_batch(b, 2, 3), [4, 5])


def test_a_boolean_mask_and_an_empty_index():
    """A boolean mask selects the rows where it is True, in order; an empty index, no row."""
    b = _batch()
    _check(take_rows(b, torch.tensor([True, False, True, False, False, True])), [0, 2, 5])
    _check(take_rows(b, torch.tensor([False] * 6)), [])
    _check(take_rows(b, torch.tensor([], dtype=torch.int64)), [])
