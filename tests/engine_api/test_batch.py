"""The batch protocol: construction, validation, packing, padding, splitting, sharding."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from engine_api.batch import (
    cat_rows,
    loss_mask_of,
    make_batch,
    pack,
    pad,
    restore_order,
    shard_batch,
    split_by_size,
    take_rows,
    unpack,
    unpad,
    unshard_batch,
    validate_batch,
)
from engine_api.microbatch import make_micro_batches
from tests.support.launch import run_distributed


def _seqs(lengths=(3, 5, 2, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (n,), generator=g) for n in lengths]


def test_make_batch_fields_share_layout_and_default_mask():
    seqs = _seqs()
    b = make_batch(seqs, advantages=[torch.randn(len(s)) for s in seqs], reward=torch.arange(4.0), calculate_entropy=True)
    assert b.batch_size == torch.Size([4])
    assert b["input_ids"].is_nested and b["advantages"].is_nested
    assert b["advantages"].offsets() is b["input_ids"].offsets()  # jagged arithmetic between fields works
    (b["advantages"] * b["loss_mask"]).values()
    for s, m in zip(seqs, b["loss_mask"].unbind(), strict=True):
        assert m.tolist() == [0.0] + [1.0] * (len(s) - 1)
    assert b["reward"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert b.get_non_tensor("calculate_entropy") is True


def test_uniform_lengths_stay_jagged():
    b = make_batch([torch.arange(4), torch.arange(4)], values=[torch.zeros(4), torch.ones(4)])
    assert b["input_ids"].is_nested and b["values"].is_nested
    assert b[1:]["values"].values().tolist() == [1.0] * 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sequences": []}, "empty batch"),
        ({"sequences": [torch.arange(3), torch.tensor([], dtype=torch.long)]}, r"input_ids\[1\]"),
        ({"sequences": [torch.rand(3)]}, "integer dtype"),
        (
            {"sequences": [torch.arange(3), torch.arange(2)], "advantages": [torch.ones(3), torch.ones(3)]},
            r"advantages\[1\] has 3 tokens but input_ids\[1\] has 2",
        ),
        ({"sequences": [torch.arange(3)], "loss_mask": [torch.ones(3)]}, r"loss_mask\[0\] is set at position 0"),
        ({"sequences": [torch.arange(3), torch.arange(2)], "reward": torch.ones(3)}, "leading dimension B"),
    ],
)
def test_make_batch_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_batch(**kwargs)


def test_validate_batch_checks_vocab_length_and_layout():
    b = make_batch([torch.tensor([1, 2, 60])])
    with pytest.raises(ValueError, match="token id 60, outside"):
        validate_batch(b, vocab_size=50)
    with pytest.raises(ValueError, match="more than the max of 2"):
        validate_batch(b, max_seq_len=2)
    with pytest.raises(ValueError, match="dense tensor"):
        validate_batch(_dense())
    with pytest.raises(ValueError, match="no 'input_ids'"):
        validate_batch(b.exclude("input_ids"))


def _dense():
    from tensordict import TensorDict

    return TensorDict({"input_ids": torch.ones(2, 3, dtype=torch.long)}, batch_size=[2])


def test_loss_mask_default_when_absent():
    b = make_batch(_seqs()).exclude("loss_mask")
    m = loss_mask_of(b)
    assert m.values()[b["input_ids"].offsets()[:-1]].sum() == 0
    assert float(m.values().sum()) == sum(len(s) - 1 for s in _seqs())


def test_pack_unpack_roundtrip_and_positions():
    seqs = _seqs()
    b = make_batch(seqs)
    p = pack(b["input_ids"])
    assert torch.equal(p.input_ids, torch.cat(seqs))
    assert p.position_ids.tolist() == [i for s in seqs for i in range(len(s))]
    assert p.cu_seqlens.tolist() == [0, 3, 8, 10, 14] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 5
    back = unpack(p.input_ids * 2, b["input_ids"])
    assert [r.tolist() for r in back.unbind()] == [(s * 2).tolist() for s in seqs]


def test_pad_unpad_roundtrip_keeps_gradients():
    seqs = _seqs()
    b = make_batch(seqs)
    padded, mask = pad(b["input_ids"], value=-1)
    assert padded.shape == (4, 5) and mask.sum() == 14
    assert (padded[~mask] == -1).all()
    x = torch.randn(4, 5, 3, requires_grad=True)
    un = unpad(x, b["input_ids"])
    assert un.values().shape == (14, 3)
    un.values().sum().backward()
    assert torch.equal(x.grad[..., 0], mask.float())


def test_split_and_restore_order():
    b = make_batch(_seqs((3, 5, 2, 4, 6)))
    parts = split_by_size(b, 2)
    assert [p.batch_size[0] for p in parts] == [2, 2, 1]
    perm = torch.tensor([3, 0, 4, 1, 2])
    restored = restore_order(b[perm], perm)
    assert torch.equal(restored["input_ids"].values(), b["input_ids"].values())


def _rich_batch():
    """Every kind of field: jagged float / int / bool / with a trailing dim, dense 1-D and 2-D,
    and metadata."""
    b = make_batch(_seqs((3, 5, 2, 4, 6, 1)), temperature=0.7, calculate_entropy=True)
    lengths = [len(r) for r in b["input_ids"].unbind()]
    g = torch.Generator().manual_seed(1)
    b["advantages"] = torch.nested.nested_tensor_from_jagged(torch.randn(sum(lengths), generator=g), b["input_ids"].offsets())
    b["keep"] = torch.nested.nested_tensor_from_jagged(torch.rand(sum(lengths), generator=g) > 0.5, b["input_ids"].offsets())
    b["pair"] = torch.nested.nested_tensor_from_jagged(torch.randn(sum(lengths), 2, generator=g), b["input_ids"].offsets())
    b["prompt_len"] = torch.arange(6)
    b["score"] = torch.randn(6, 3, generator=g)
    return b


def _same_batch(got, want):
    assert set(got.keys()) == set(want.keys()) and got.batch_size == want.batch_size
    offsets = None
    for key in want.keys():
        w = want.get(key)
        if not isinstance(w, torch.Tensor):
            assert got.get_non_tensor(key) == want.get_non_tensor(key), key
            continue
        g = got.get(key)
        assert g.dtype == w.dtype and g.is_nested == w.is_nested, key
        if w.is_nested:
            assert [r.tolist() for r in g.unbind()] == [r.tolist() for r in w.unbind()], key
            offsets = g.offsets() if offsets is None else offsets
            assert g.offsets() is offsets, f"{key}: jagged fields must share one offsets tensor"
        else:
            assert torch.equal(g, w), key


@pytest.mark.parametrize("rows", [[4, 0, 5, 2], [1], [5, 4, 3, 2, 1, 0], [2, 2, 0]], ids=["part", "one", "reverse", "repeat"])
def test_take_rows_equals_tensordict_indexing(rows):
    """The reference is TensorDict's own indexing (row by row, field by field)."""
    b = _rich_batch()
    index = torch.tensor(rows)
    got = take_rows(b, index)
    _same_batch(got, b[index])
    assert got["input_ids"].values().data_ptr() != b["input_ids"].values().data_ptr()  # copies, as b[index]
    _same_batch(take_rows(b, torch.tensor([-1, 0])), b[torch.tensor([-1, 0])])  # negative: TensorDict's meaning
    view = take_rows(b, slice(1, 4))
    _same_batch(view, b[1:4])
    # a slice is a view, as TensorDict's slicing: writing into it writes into the batch
    view["advantages"].values()[0] = 123.0
    assert float(b["advantages"][1][0]) == 123.0


def test_cat_rows_equals_torch_cat_and_restores_any_order():
    b = _rich_batch()
    parts = [b[0:2], b[2:3], b[3:6]]
    _same_batch(cat_rows(parts), torch.cat(parts))
    perm = torch.tensor([3, 0, 5, 1, 2, 4])
    _same_batch(restore_order(take_rows(b, perm), perm), b)


def test_take_rows_falls_back_when_jagged_fields_have_other_rows():
    """A jagged field whose rows differ from input_ids' (not a per-token field) is still
    indexed correctly (through TensorDict's own indexing)."""
    b = make_batch(_seqs((3, 5, 2)))
    b["other"] = torch.nested.nested_tensor_from_jagged(torch.arange(6.0), torch.tensor([0, 1, 3, 6]))
    got = take_rows(b, torch.tensor([2, 0]))
    assert [r.tolist() for r in got["other"].unbind()] == [[3.0, 4.0, 5.0], [0.0]]
    assert [r.tolist() for r in got["input_ids"].unbind()] == [r.tolist() for r in b["input_ids"].unbind()][::-2]


@pytest.mark.parametrize("mode", [{"micro_batch_size": 2}, {"max_token_len": 7}, {}])
def test_micro_batches_restore_original_order(mode):
    b = make_batch(_seqs((3, 5, 2, 4, 6, 1)))
    plan = make_micro_batches(b, mode.get("micro_batch_size"), mode.get("max_token_len"), None)
    if "max_token_len" in mode:
        assert all(int(mb["input_ids"].offsets()[-1]) <= 7 for mb in plan.batches)
    restored = plan.restore([mb.select("input_ids") for mb in plan.batches])
    assert [r.tolist() for r in restored["input_ids"].unbind()] == [r.tolist() for r in b["input_ids"].unbind()]


def test_restore_lays_outputs_on_the_callers_offsets():
    """With ``like``, restored jagged outputs share the caller's offsets tensor, so they combine
    with the caller's own jagged fields (torch refuses arithmetic across distinct offsets)."""
    b = make_batch(_seqs((3, 5, 2, 4, 6, 1)))
    plan = make_micro_batches(b, None, 7, None)
    outputs = [
        TensorDict({"v": unpack(mb["input_ids"].values().float(), mb["input_ids"])}, batch_size=mb.batch_size) for mb in plan.batches
    ]
    restored = plan.restore(outputs, like=b["input_ids"])
    assert restored["v"].offsets() is b["input_ids"].offsets()
    assert torch.equal((restored["v"] - b["input_ids"].float()).values(), torch.zeros(21))
    with pytest.raises(ValueError, match="got 1 outputs for"):
        plan.restore(outputs[:1])


def test_micro_batching_modes_are_exclusive():
    with pytest.raises(ValueError, match="set only one"):
        make_micro_batches(make_batch(_seqs()), 2, 8, None)


def test_shard_requires_divisible_batch():
    b = make_batch(_seqs((3, 5, 2)))
    with pytest.raises(ValueError, match="multiple of 2"):
        shard_batch(b, 0, 2)


def _shard_worker(rank, world):
    # Rank 0's shard is long sequences, rank 1's short ones: dynamic batching must still
    # give both ranks the same number of micro-batches.
    b = make_batch(_seqs((9, 9, 8, 9, 1, 1, 1, 2)))
    local = shard_batch(b, rank, world)
    plan = make_micro_batches(local, None, 10, None)
    gathered = unshard_batch(local.select("input_ids"), None)
    return len(plan.batches), [r.tolist() for r in gathered["input_ids"].unbind()], [r.tolist() for r in b["input_ids"].unbind()]


def test_shard_unshard_and_equal_micro_batch_counts_over_two_ranks():
    (k0, g0, want), (k1, g1, _) = run_distributed(_shard_worker, 2)
    assert g0 == g1 == want
    assert k0 == k1 == 4  # rank 0 needs 4 parts (each holds one ~9-token sequence); rank 1 follows


def _unshard_fields_worker(rank, world):
    """Uneven shards per rank (rank r holds r + 1 rows), every dtype a gather meets: float and
    int jagged fields, a bool jagged mask, a dense per-row field with trailing dims, metadata."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(rank)
    n = rank + 1
    seqs = [torch.randint(0, 50, (int(k),), generator=g) for k in torch.randint(1, 7, (n,), generator=g)]
    local = make_batch(seqs, log_probs=[torch.randn(len(s), generator=g) for s in seqs], mask=[s > 20 for s in seqs])
    local.set("score", torch.randn(n, 2, generator=g))
    local.set_non_tensor("temperature", 0.7)
    calls = []
    original = dist.all_gather_object
    dist.all_gather_object = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        gathered = unshard_batch(local, None)
    finally:
        dist.all_gather_object = original
    return calls, {k: gathered[k] for k in ("input_ids", "log_probs", "mask", "score")}, gathered.get_non_tensor("temperature"), local


def test_unshard_gathers_uneven_shards_of_every_field_with_tensor_collectives():
    results = run_distributed(_unshard_fields_worker, 2)
    locals_ = [r[3] for r in results]
    for calls, fields, temperature, _ in results:
        assert calls == []  # no pickled collective
        assert temperature == 0.7
        for key in ("input_ids", "log_probs", "mask"):
            want = [row for local in locals_ for row in local[key].unbind()]
            got = list(fields[key].unbind())
            assert len(got) == 3 and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True)), key
        assert torch.equal(fields["score"], torch.cat([local["score"] for local in locals_]))
        # one offsets tensor for every jagged field: they combine without relayout
        assert (fields["log_probs"] * fields["mask"]).values().shape == fields["log_probs"].values().shape
