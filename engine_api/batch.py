"""The batch protocol (docs/design.md, section 3): jagged TensorDicts and the helpers engines share.

A batch is a ``tensordict.TensorDict`` with ``batch_size=[B]`` whose per-token fields are
jagged nested tensors (``layout=torch.jagged``) that share ``input_ids``' offsets, whose
per-sample fields are plain tensors with leading dimension ``B``, and whose run-time switches
are non-tensor metadata. Nothing here is padded unless a helper says so.

Helpers: :func:`make_batch`, :func:`validate_batch`, :func:`loss_mask_of`, micro-batch
splitting (:func:`split_by_size`), packing (:func:`pack` / :func:`unpack`), padding
(:func:`pad` / :func:`unpad`), DP sharding (:func:`shard_batch` / :func:`unshard_batch`) and
order restoration (:func:`restore_order`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_api.dist import all_gather_rows, group_size
from engine_api.logprobs import TARGETS_FIELD, TOPK_META

_META_TYPES = (bool, int, float, str, type(None))


def make_batch(sequences, loss_mask=None, **fields) -> TensorDict:
    """Build a protocol batch.

    Args:
        sequences: token ids, a list of 1-D integer tensors (or lists of ints), or a jagged
            nested tensor. Each sequence needs at least one token.
        loss_mask: optional per-token mask (list of 1-D tensors or jagged). Default: every
            position except position 0, which nothing predicts.
        **fields: a list/tuple of 1-D tensors or a jagged tensor is a per-token field (it must
            match the sequence lengths); any other tensor is a per-sample field (leading
            dimension B); a bool/int/float/str/None is non-tensor metadata.

    Returns:
        TensorDict with ``batch_size=[B]``; every per-token field shares ``input_ids``'
        offsets, so jagged arithmetic between fields works. Uniform lengths stay jagged.

    Raises:
        ValueError: empty batch, empty sequence, non-integer ids, or a per-token field whose
            lengths disagree with ``input_ids``.
    """
    seqs = _as_list(sequences, "input_ids")
    if not seqs:
        raise ValueError("make_batch got an empty batch; fix: pass at least one sequence")
    for i, s in enumerate(seqs):
        if s.dim() != 1 or s.numel() == 0:
            raise ValueError(f"input_ids[{i}] has shape {tuple(s.shape)}; fix: each sequence must be a non-empty 1-D tensor")
        if s.is_floating_point() or s.is_complex() or s.dtype == torch.bool:
            raise ValueError(f"input_ids[{i}] has dtype {s.dtype}; fix: token ids must be an integer dtype")
    input_ids = torch.nested.as_nested_tensor([s.long() for s in seqs], layout=torch.jagged)
    lengths = [s.numel() for s in seqs]
    data = {"input_ids": input_ids}
    if loss_mask is None:
        mask_values = torch.ones(sum(lengths), dtype=torch.float32)
        mask_values[input_ids.offsets()[:-1]] = 0.0
        data["loss_mask"] = torch.nested.nested_tensor_from_jagged(mask_values, input_ids.offsets())
    else:
        fields = {"loss_mask": loss_mask, **fields}
    meta = {}
    for name, value in fields.items():
        if isinstance(value, _META_TYPES):
            meta[name] = value
        elif isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.is_nested):
            rows = _as_list(value, name)
            _check_lengths(name, [r.shape[0] if r.dim() else 0 for r in rows], lengths)
            values = torch.cat(rows)
            if name == "loss_mask":
                values = values.float()
            data[name] = torch.nested.nested_tensor_from_jagged(values, input_ids.offsets())
        elif isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != len(seqs):
                raise ValueError(
                    f"per-sample field {name!r} has shape {tuple(value.shape)} for a batch of {len(seqs)}; "
                    "fix: give it leading dimension B, or pass a list of 1-D tensors for a per-token field"
                )
            data[name] = value
        else:
            raise ValueError(
                f"field {name!r} has unsupported type {type(value).__name__}; fix: pass a tensor, a list of tensors or a scalar"
            )
    batch = TensorDict(data, batch_size=[len(seqs)])
    for name, value in meta.items():
        batch.set_non_tensor(name, value)
    validate_batch(batch)
    return batch


def validate_batch(
    batch: TensorDict,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    max_seq_len_field: str = "max_seq_len",
) -> None:
    """Raise a ``ValueError`` naming the field and value if ``batch`` breaks the protocol.

    Checks: a non-empty 1-D batch; ``input_ids`` present, jagged (``layout=torch.jagged``, not
    torch's default strided nested layout), integer, every sequence non-empty (and within
    ``vocab_size`` / ``max_seq_len`` when given); every other jagged field is jagged too and
    built on ``input_ids``' offsets (same lengths is not enough: torch refuses arithmetic
    between jagged tensors with different offsets, so the loss would fail mid-step);
    ``loss_mask`` (if present) is finite, non-negative and 0 at every position 0; the
    run-time switches the engines read (:data:`METADATA_RULES`: ``temperature`` a finite
    number > 0, ``calculate_entropy`` a bool). Reads only: nothing is modified, so engines
    call it before touching any state.

    Args:
        batch: the batch to check.
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_seq_len: the longest sequence allowed.
        max_seq_len_field: the setting ``max_seq_len`` comes from, named in the error.
    """
    if not isinstance(batch, TensorDict):
        raise ValueError(f"batch is a {type(batch).__name__}; fix: build it with engine_api.make_batch")
    if batch.batch_dims != 1 or batch.batch_size[0] == 0:
        raise ValueError(f"batch has batch_size {list(batch.batch_size)}; fix: pass a non-empty 1-D batch of sequences")
    if "input_ids" not in batch.keys():
        raise ValueError(f"batch has no 'input_ids' (fields: {sorted(batch.keys())}); fix: add the token ids")
    ids = batch["input_ids"]
    _check_jagged("input_ids", ids)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"input_ids has dtype {ids.dtype}; fix: token ids must be an integer dtype")
    lengths = seq_lengths(batch)
    if int(lengths.min()) < 1:
        raise ValueError(f"input_ids[{int(lengths.argmin())}] is empty; fix: drop empty sequences")
    if max_seq_len is not None and int(lengths.max()) > max_seq_len:
        i = int(lengths.argmax())
        raise ValueError(
            f"input_ids[{i}] has {int(lengths[i])} tokens, more than the max of {max_seq_len} ({max_seq_len_field}); "
            f"fix: truncate or drop the sequence, or raise {max_seq_len_field}"
        )
    if vocab_size is not None:
        v = ids.values()
        bad = (v < 0) | (v >= vocab_size)
        if bool(bad.any()):
            tok = int(v[bad][0])
            raise ValueError(f"input_ids holds token id {tok}, outside [0, {vocab_size}); fix: tokenise with the model's vocabulary")
    if TARGETS_FIELD in batch.keys():
        _check_targets(batch[TARGETS_FIELD], vocab_size)
    offsets = ids.offsets()
    for name in batch.keys():
        field = batch.get(name)
        # A field built on input_ids' offsets tensor (make_batch, unpack) has its lengths.
        if isinstance(field, torch.Tensor) and field.is_nested and name != "input_ids":
            _check_jagged(name, field)
            if field.offsets() is not offsets:
                _check_lengths(name, (field.offsets()[1:] - field.offsets()[:-1]).tolist(), lengths.tolist())
                raise ValueError(
                    f"{name} has input_ids' lengths but its own offsets tensor: torch cannot combine jagged tensors with "
                    f"different offsets (the loss would fail mid-step); fix: build it on input_ids' offsets, "
                    f"torch.nested.nested_tensor_from_jagged(values, batch['input_ids'].offsets()), or build the batch "
                    "with engine_api.make_batch"
                )
    _check_metadata(batch)
    if vocab_size is not None and TOPK_META in batch.keys() and batch.get_non_tensor(TOPK_META) > vocab_size:
        raise ValueError(
            f"batch metadata {TOPK_META} = {batch.get_non_tensor(TOPK_META)}: more candidates than the model's {vocab_size} "
            f"tokens; fix: at most {vocab_size}"
        )
    if "loss_mask" in batch.keys():
        if not batch["loss_mask"].is_nested:
            raise ValueError(
                f"loss_mask is a dense tensor of shape {tuple(batch['loss_mask'].shape)}; fix: per-token fields must be jagged "
                "(torch.nested, layout=torch.jagged); build the batch with engine_api.make_batch"
            )
        mask_values = batch["loss_mask"].values()  # one jagged dispatch, not two
        _check_mask_values(mask_values)
        first = mask_values[offsets[:-1]]
        if bool((first != 0).any()):
            i = int((first != 0).nonzero()[0])
            raise ValueError(
                f"loss_mask[{i}] is set at position 0, which no token predicts; "
                "fix: mask position 0 out (responses are the last R tokens of a sequence)"
            )


def _check_targets(targets: torch.Tensor, vocab_size: int | None) -> None:
    """``target_ids`` (``engine_api.logprobs``): jagged integer ids, ``[T]`` or ``[T, K]`` per sequence,
    within the vocabulary (its offsets are checked with every jagged field's)."""
    _check_jagged(TARGETS_FIELD, targets)
    values = targets.values()
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValueError(f"{TARGETS_FIELD} has dtype {values.dtype}; fix: target token ids must be an integer dtype")
    if values.dim() not in (1, 2):
        raise ValueError(
            f"{TARGETS_FIELD} has {values.dim() - 1} dims per token (shape {tuple(values.shape)}); fix: one target per "
            "position ([T] per sequence) or K candidates per position ([T, K])"
        )
    if vocab_size is not None and values.numel():
        bad = (values < 0) | (values >= vocab_size)
        if bool(bad.any()):
            raise ValueError(
                f"{TARGETS_FIELD} holds token id {int(values[bad][0])}, outside [0, {vocab_size}); fix: tokenise with the model's vocabulary"
            )


def seq_lengths(batch: TensorDict) -> torch.Tensor:
    """Token count of each sequence (int64, shape [B])."""
    offsets = batch["input_ids"].offsets()
    return offsets[1:] - offsets[:-1]


def loss_mask_of(batch: TensorDict) -> torch.Tensor:
    """The batch's jagged float ``loss_mask``; if absent, every position but position 0."""
    if "loss_mask" in batch.keys():
        return batch["loss_mask"]
    ids = batch["input_ids"]
    values = torch.ones(ids.values().shape[0], dtype=torch.float32, device=ids.device)
    values[ids.offsets()[:-1]] = 0.0
    return torch.nested.nested_tensor_from_jagged(values, ids.offsets())


def split_by_size(batch: TensorDict, micro_batch_size: int) -> list[TensorDict]:
    """Consecutive micro-batches of ``micro_batch_size`` sequences (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size = {micro_batch_size}; fix: use a positive micro-batch size")
    if micro_batch_size >= batch.batch_size[0]:
        # One part: a shallow copy (new container, same tensors, as split would give) costs
        # microseconds; TensorDict.split rebuilds every jagged field (~0.1 ms each on CPU).
        return [batch.copy()]
    # (TensorDict.split, not take_rows with slices: measured equal or faster for contiguous parts)
    return list(batch.split(micro_batch_size))


def restore_order(batch: TensorDict, order: torch.Tensor) -> TensorDict:
    """Undo a reordering: ``batch[j]`` is original row ``order[j]``; returns rows 0..B-1.

    The identity order (one micro-batch, or fixed-size ones: ``make_micro_batches``) has nothing
    to undo: a shallow copy (new container, the same tensors) instead of a gather that would
    copy every field into the same values (measured: ~1.3 ms of a tiny GRPO step's ~75 ms)."""
    if order.numel() == batch.batch_size[0] and torch.equal(order, torch.arange(order.numel(), device=order.device)):
        return batch.copy()
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return take_rows(batch, inverse)


def take_rows(batch: TensorDict, rows: slice | torch.Tensor) -> TensorDict:
    """``batch[rows]`` (a slice: views, as TensorDict's slicing; an index tensor: copies), with
    every jagged field on one new offsets tensor, the dense fields indexed alike and the
    non-tensor metadata kept.

    Why not ``batch[rows]`` for an index: TensorDict gathers each jagged field through the
    nested-tensor dispatcher; here the offsets and the token index are computed once and each
    field is one ``index_select`` of its flat values (measured on CPU, 4 parts of 64 rows with
    two jagged fields: 1.7 ms vs 2.8 ms; a permutation of 1024 rows: 0.74 vs 1.2 ms). Anything
    else (a nested TensorDict, a jagged field whose row lengths differ from the first jagged
    field's) goes through ``batch[rows]``.
    """
    if isinstance(rows, slice) and rows.step not in (None, 1):
        return batch[rows]
    if isinstance(rows, torch.Tensor) and (rows.numel() == 0 or rows.dtype == torch.bool or bool((rows < 0).any())):
        return batch[rows]  # empty, a mask, or negative indices: TensorDict's own semantics
    fields = {k: batch.get(k) for k in batch.keys()}
    tensors = {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}
    jagged = [k for k, v in tensors.items() if v.is_nested]
    if any(isinstance(v, TensorDict) for v in fields.values()):
        return batch[rows]
    offsets = tensors[jagged[0]].offsets() if jagged else None
    for key in jagged[1:]:
        other = tensors[key].offsets()
        if other is not offsets and not torch.equal(other, offsets):
            return batch[rows]
    out: dict[str, torch.Tensor] = {}
    if isinstance(rows, slice):
        start, stop, _ = rows.indices(batch.batch_size[0])
        stop = max(start, stop)
        size = stop - start
        if jagged:
            lo, hi = int(offsets[start]), int(offsets[stop])
            new_offsets = offsets[start : stop + 1] - lo
            for key in jagged:
                out[key] = torch.nested.nested_tensor_from_jagged(tensors[key].values()[lo:hi], new_offsets)
        for key, value in tensors.items():
            if not value.is_nested:
                out[key] = value[start:stop]
    else:
        rows = rows.to(torch.int64)
        size = rows.numel()
        if jagged:
            lengths = (offsets[1:] - offsets[:-1])[rows.to(offsets.device)]
            new_offsets = torch.cat([offsets.new_zeros(1), lengths.cumsum(0)])
            total = int(new_offsets[-1])
            # token t of new row r comes from old position offsets[rows[r]] + (t - new_offsets[r])
            shift = offsets[:-1][rows.to(offsets.device)] - new_offsets[:-1]
            token = torch.repeat_interleave(shift, lengths, output_size=total) + torch.arange(total, device=offsets.device)
            for key in jagged:
                values = tensors[key].values()
                out[key] = torch.nested.nested_tensor_from_jagged(values.index_select(0, token.to(values.device)), new_offsets)
        for key, value in tensors.items():
            if not value.is_nested:
                out[key] = value.index_select(0, rows.to(value.device))
    result = TensorDict({k: out[k] for k in tensors}, batch_size=[size], device=batch.device)
    for key in fields:
        if key not in tensors:
            result.set_non_tensor(key, batch.get_non_tensor(key))
    return result


def cat_rows(batches: list[TensorDict]) -> TensorDict:
    """Concatenate batches with the same fields along rows (``torch.cat`` of TensorDicts), every
    jagged field on one new offsets tensor, the first batch's metadata kept; each jagged field
    is one ``torch.cat`` of flat values (see :func:`take_rows` for why not TensorDict's own)."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    tensors = [k for k in first.keys() if isinstance(first.get(k), torch.Tensor)]
    jagged = [k for k in tensors if first.get(k).is_nested]
    keys = set(first.keys())
    if any(isinstance(first.get(k), TensorDict) for k in keys) or any(set(b.keys()) != keys for b in batches[1:]):
        return torch.cat(batches)  # nested TensorDicts, or other key sets (torch.cat's own checks and errors)
    out: dict[str, torch.Tensor] = {}
    if jagged:
        lengths = [b.get(jagged[0]).offsets().diff() for b in batches]
        all_lengths = torch.cat(lengths)
        offsets = torch.cat([all_lengths.new_zeros(1), all_lengths.cumsum(0)])
        for key in jagged:
            parts = [b.get(key) for b in batches]
            if any(not torch.equal(p.offsets().diff(), n) for p, n in zip(parts, lengths, strict=True)):
                return torch.cat(batches)  # a field whose rows differ from the first jagged field's
            out[key] = torch.nested.nested_tensor_from_jagged(torch.cat([p.values() for p in parts]), offsets)
    for key in tensors:
        if key not in out:
            out[key] = torch.cat([b.get(key) for b in batches])
    result = TensorDict({k: out[k] for k in tensors}, batch_size=[sum(b.batch_size[0] for b in batches)], device=first.device)
    for key in first.keys():
        if key not in tensors:
            result.set_non_tensor(key, first.get_non_tensor(key))
    return result


@dataclass(frozen=True)
class Packed:
    """A micro-batch packed into one row (THD / varlen layout).

    Attributes:
        input_ids: flat token ids, shape [total].
        position_ids: per-sequence positions 0..len-1, shape [total].
        cu_seqlens: int32 cumulative sequence lengths, shape [B + 1] (flash-attn convention).
        max_seqlen: length of the longest sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def pack(input_ids: torch.Tensor) -> Packed:
    """Pack jagged ``input_ids`` into flat tokens with per-sequence positions."""
    offsets = input_ids.offsets()
    lengths = offsets[1:] - offsets[:-1]
    starts = torch.repeat_interleave(offsets[:-1], lengths)
    position_ids = torch.arange(int(offsets[-1]), device=offsets.device) - starts
    return Packed(
        input_ids=input_ids.values(),
        position_ids=position_ids,
        cu_seqlens=offsets.to(torch.int32),
        max_seqlen=int(lengths.max()),
    )


def unpack(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Jagged view of flat per-token ``values`` (first dim = total tokens) with ``like``'s layout.

    Sharing ``like``'s offsets makes the result composable with the batch's other jagged
    fields; autograd flows through.
    """
    offsets = like.offsets()
    # The token count from the offsets: like.values() would cost a jagged dispatch per call.
    tokens = int(offsets[-1])
    if values.shape[0] != tokens:
        raise ValueError(f"unpack got {values.shape[0]} values for {tokens} tokens")
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def attach(batch: TensorDict, **flat: torch.Tensor) -> TensorDict:
    """Set each of ``flat`` (flat per-token values, first dim = the batch's total tokens) on
    ``batch`` as a jagged field in ``input_ids``' layout (:func:`unpack`); returns ``batch``.

    Raises:
        ValueError: a field's first dimension is not the batch's token count.
    """
    like = batch["input_ids"]
    for name, values in flat.items():
        batch.set(name, unpack(values, like))
    return batch


def pad(jagged: torch.Tensor, value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a jagged tensor to ``[B, T, ...]``; returns ``(padded, attention_mask)``.

    ``attention_mask`` is a bool ``[B, T]`` that is True on real tokens.
    """
    offsets = jagged.offsets()
    lengths = offsets[1:] - offsets[:-1]
    padded = torch.nested.to_padded_tensor(jagged, value)
    mask = torch.arange(padded.shape[1], device=lengths.device)[None, :] < lengths[:, None]
    return padded, mask


def unpad(padded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pad`: the real tokens of ``padded`` ``[B, T, ...]`` as a tensor with
    ``like``'s jagged layout (autograd flows through)."""
    offsets = like.offsets()
    lengths = (offsets[1:] - offsets[:-1]).to(padded.device)
    mask = torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None]
    return unpack(padded[mask], like)


def shard_batch(batch: TensorDict, dp_rank: int, dp_size: int) -> TensorDict:
    """This DP rank's contiguous shard of a global batch.

    Raises:
        ValueError: the batch size is not a multiple of ``dp_size``. Equal shards are what
            keep the micro-batch count equal on every rank, which FSDP and megatron need.
    """
    size = batch.batch_size[0]
    if size % dp_size:
        raise ValueError(
            f"global batch of {size} sequences does not split over dp_size = {dp_size}; fix: make the global batch a multiple of {dp_size}"
        )
    if dp_size == 1:
        # The whole batch: a shallow copy (new container, the same tensors and offsets) costs
        # microseconds; slicing rebuilds every jagged field (~1.7 ms for a tiny GRPO batch).
        return batch.copy()
    per_rank = size // dp_size
    return batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def unshard_batch(local: TensorDict, group: dist.ProcessGroup | None) -> TensorDict:
    """Gather every DP rank's shard (:func:`shard_batch` order) back into the global batch.

    Collective over ``group``, with tensor collectives only (``all_gather_rows``: on the
    communication device, never pickled): each rank's row lengths (two all-gathers), then one
    all-gather per dtype for the jagged fields' values side by side, and one per dense field.
    The result is on ``local``'s device, its jagged fields on one shared offsets tensor;
    non-tensor metadata is ``local``'s. Every rank must hold the same fields with the same
    dtypes and trailing shapes (as the outputs of one engine call do).
    """
    if group_size(group) == 1:
        return local
    tensors = {k: local.get(k) for k in local.keys() if isinstance(local.get(k), torch.Tensor)}
    jagged = [k for k, v in tensors.items() if v.is_nested]
    first = tensors[jagged[0]].offsets().diff() if jagged else torch.zeros(local.batch_size[0], dtype=torch.long)
    parts = all_gather_rows(first, group)
    rows = [int(p.shape[0]) for p in parts]
    all_lengths = torch.cat(parts)
    tokens = [int(p.sum()) for p in parts]
    offsets = torch.cat([all_lengths.new_zeros(1), all_lengths.cumsum(0)])
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in jagged:
        by_dtype.setdefault(tensors[key].dtype, []).append(key)
    for keys in by_dtype.values():
        # the fields' values side by side ([tokens, width] each), gathered in one call
        flats = [tensors[k].values().reshape(tensors[k].values().shape[0], -1) for k in keys]
        widths = [f.shape[1] for f in flats]
        gathered = torch.cat(all_gather_rows(torch.cat(flats, 1), group, counts=tokens))
        for key, piece in zip(keys, gathered.split(widths, 1), strict=True):
            values = piece.reshape(-1, *tensors[key].values().shape[1:])
            out[key] = torch.nested.nested_tensor_from_jagged(values.contiguous(), offsets.to(values.device))
    for key, value in tensors.items():
        if not value.is_nested:
            out[key] = torch.cat(all_gather_rows(value, group, counts=rows))
    result = TensorDict({k: out[k] for k in tensors}, batch_size=[sum(rows)])
    for key in local.keys():
        if key not in tensors:
            result.set_non_tensor(key, local.get_non_tensor(key))
    return result


def to_device(batch: TensorDict, device: torch.device | str) -> TensorDict:
    """Move a batch, keeping every jagged field on one shared offsets tensor.

    ``TensorDict.to`` moves each jagged field's offsets separately, which gives each field its
    own ragged size and breaks arithmetic between fields; this moves the offsets once.
    """
    device = torch.device(device)
    ids = batch.get("input_ids", None)
    if isinstance(ids, torch.Tensor) and ids.is_nested and ids.device == device:
        return batch  # the common case (already there), without scanning every field
    jagged = _jagged_keys(batch)
    if not jagged:
        return batch.to(device)
    ref = batch.get("input_ids" if "input_ids" in jagged else jagged[0])
    if ref.device == device:
        return batch
    return relayout(batch.to(device), ref.offsets().to(device))


def relayout(batch: TensorDict, offsets: torch.Tensor | None = None) -> TensorDict:
    """Rebuild every jagged field of ``batch`` on one ``offsets`` tensor (default: the
    ``input_ids`` offsets, or the first jagged field's). The row lengths must agree. A field
    already on that tensor is kept as it is (rebuilding it would give the same field, at a
    jagged dispatch and a construction each: the outputs of a forward usually are)."""
    jagged = _jagged_keys(batch)
    if not jagged:
        return batch
    if offsets is None:
        offsets = batch.get("input_ids" if "input_ids" in jagged else jagged[0]).offsets()
    for key in jagged:
        field = batch.get(key)
        if field.offsets() is not offsets:
            batch.set(key, torch.nested.nested_tensor_from_jagged(field.values(), offsets))
    return batch


def _jagged_keys(batch: TensorDict) -> list[str]:
    return [k for k in batch.keys() if isinstance(batch.get(k), torch.Tensor) and batch.get(k).is_nested]


def _as_list(value, name: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return list(value.unbind())
        raise ValueError(f"{name} is a dense tensor; fix: pass a list of 1-D tensors or a jagged nested tensor")
    return [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in value]


def _check_jagged(name: str, field: torch.Tensor) -> None:
    if not field.is_nested:
        raise ValueError(
            f"{name} is a dense tensor of shape {tuple(field.shape)}; fix: per-token fields must be jagged "
            "(torch.nested, layout=torch.jagged); build the batch with engine_api.make_batch"
        )
    if field.layout != torch.jagged:
        raise ValueError(
            f"{name} is a nested tensor with layout {field.layout} (torch.nested.nested_tensor's default); fix: use "
            "layout=torch.jagged, e.g. torch.nested.nested_tensor(seqs, layout=torch.jagged), or engine_api.make_batch"
        )


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# Batch metadata the engines read: name -> (accepts the value, what it must be).
METADATA_RULES = {
    "temperature": (_positive_number, "a finite number > 0 (log-probs are of logits / temperature)"),
    "calculate_entropy": (lambda v: isinstance(v, bool), "True or False"),
    # Forward-only calls of a LoRA engine: run the base weights (the adapters bypassed).
    "disable_adapters": (lambda v: isinstance(v, bool), "True or False"),
    # MoE routing (engine_api.moe, "Routing replay"): route by the batch's routed_experts; return the router's own.
    "replay_routing": (lambda v: isinstance(v, bool), "True or False"),
    "return_routing": (lambda v: isinstance(v, bool), "True or False"),
    # engine_api.logprobs, "Top-k": each position's K most likely tokens (0: off).
    TOPK_META: (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0 (0: no top-k outputs)"),
}


def _check_metadata(batch: TensorDict) -> None:
    for name, (ok, what) in METADATA_RULES.items():
        if name in batch.keys():
            value = batch.get_non_tensor(name)
            if not ok(value):
                raise ValueError(f"batch metadata {name} = {value!r}; fix: {what}, set with batch.set_non_tensor({name!r}, ...)")


def _check_mask_values(values: torch.Tensor) -> None:
    # A NaN or negative weight would silently poison the global denominators (the counts).
    if values.is_complex():
        raise ValueError(f"loss_mask has dtype {values.dtype}; fix: use a real (float or bool) mask")
    values = values.float()
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"loss_mask holds {float(values[i])} at flat position {i}; fix: mask weights must be finite and >= 0")


def _check_lengths(name: str, got: Sequence[int], want: Sequence[int]) -> None:
    if len(got) != len(want):
        raise ValueError(f"{name} has {len(got)} rows for {len(want)} sequences; fix: one row per sequence")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            raise ValueError(f"{name}[{i}] has {g} tokens but input_ids[{i}] has {w}; fix: give per-token fields the sequence's length")
