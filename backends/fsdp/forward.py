"""The HF forward of one micro-batch in the protocol's layouts, shared by ``FSDPEngine`` and
the legacy FSDP workers (``roles/legacy``), so both read the same logits."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tensordict import TensorDict

from backends.fsdp.attention import VARLEN, is_packed_kernel, packing_kwargs
from backends.fsdp.lm_head import head_serves
from backends.fsdp.ulysses import SP_KWARG, SequenceShard
from engine_api.kit import HeadRequest, align_to_tokens, gather_dim1, lm_token_outputs, outputs_from_columns, pack, pad, unpack

# FSDP2 warns when a wrapped model returns a view (HF's token-classification head does): an
# in-place op on it would skip the pre-backward hook. hf_forward only reads the outputs
# out of place (slicing, gather, division into new tensors), so the warning never applies here.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def hf_forward(
    model: nn.Module,
    mb: TensorDict,
    head: str,
    remove_padding: bool,
    on_rows: Callable[[int, torch.Tensor], None] | None = None,
    sp_group: dist.ProcessGroup | None = None,
    chunked: bool = False,
) -> TensorDict:
    """Per-token outputs of micro-batch ``mb`` (jagged ``input_ids`` on the model's device).

    ``head: lm`` gives ``log_probs`` (and ``entropy`` when the metadata ``calculate_entropy`` is
    True; logits are divided by metadata ``temperature``, default 1); ``head: value`` gives
    ``values``, where ``values[i]`` is predicted from the prefix before token i (0 at 0).

    ``remove_padding``: packed rows with per-sequence positions, no mask and no KV cache, so
    HF starts a new sequence wherever the positions restart: one row with varlen kernels
    (flash-attn's, torch's ``varlen``), else the rows of :func:`packed_rows`; the packed
    kernels of ``backends.fsdp.attention`` also get the rows' ``cu_seqlens``. Otherwise a
    right-padded batch with an attention mask.

    ``chunked`` (``head: lm`` only): the LM head computes the outputs itself, chunk by chunk,
    without ``[tokens, vocab]`` logits for the whole micro-batch (``backends.fsdp.lm_head``;
    the caller checked the model with ``chunked_head_exact``).

    ``on_rows(rows, token_rows)`` is called before the model runs with the layout's row count
    (tokens of all its rows) and, for each real token in packed order, its row: what an MoE
    routing recorder needs (``engine_api.moe.RoutingRecorder.begin``).

    ``sp_group``: run sequence-parallel over this group (:func:`sp_forward`); every rank of it
    holds the same ``mb`` and gets the same outputs.
    """
    if sp_group is not None and dist.get_world_size(sp_group) > 1:
        return sp_forward(model, mb, head, remove_padding, sp_group, on_rows)
    ids = mb["input_ids"]
    packed = pack(ids)
    kwargs = {}
    if remove_padding and _varlen_kernels(model):
        rows, pos, index = packed.input_ids[None], packed.position_ids[None], None
    elif remove_padding:
        # No varlen kernel (SDPA / eager / the doc-masked SDPA): attention over one packed row
        # costs (row tokens)^2 whatever the block-diagonal mask hides; several narrower rows
        # cost rows x width^2 (measured: benchmarks/packing.py).
        rows, pos, index = packed_rows(packed.input_ids, packed.position_ids, ids.offsets(), model.config)
    else:
        rows, mask = pad(ids)
        pos, index = None, mask.reshape(-1).nonzero().squeeze(1)
        kwargs["attention_mask"] = mask.long()
    if pos is not None:
        kwargs["position_ids"] = pos
        if is_packed_kernel(model):  # the boundaries from the batch, once per forward
            kwargs.update(packing_kwargs(pos))
    if on_rows is not None:
        on_rows(rows.numel(), torch.arange(rows.numel(), device=rows.device) if index is None else index)
    if head == "lm" and chunked:
        request = HeadRequest.of(mb, packed.input_ids, packed.cu_seqlens, index)
        with head_serves(model, request):
            columns = model(input_ids=rows, use_cache=False, **kwargs).logits[0]
        flat_outputs = request.outputs(columns)
        return TensorDict({k: unpack(v, ids) for k, v in flat_outputs.items()}, batch_size=mb.batch_size)
    out = model(input_ids=rows, use_cache=False, **kwargs)
    flat = out.logits.flatten(0, 1)
    flat = flat if index is None else flat[index]  # back to packed order
    if head == "value":
        values = align_to_tokens(flat[:-1, 0].float(), packed.cu_seqlens)
        return TensorDict({"values": unpack(values, ids)}, batch_size=mb.batch_size)
    temperature = float(mb.get_non_tensor("temperature", 1.0))
    logits = flat / temperature if temperature != 1.0 else flat
    flat_outputs = lm_token_outputs(logits, packed.input_ids, packed.cu_seqlens, mb)
    return TensorDict({k: unpack(v, ids) for k, v in flat_outputs.items()}, batch_size=mb.batch_size)


def sp_forward(
    model: nn.Module,
    mb: TensorDict,
    head: str,
    remove_padding: bool,
    group: dist.ProcessGroup,
    on_rows: Callable[[int, torch.Tensor], None] | None = None,
) -> TensorDict:
    """:func:`hf_forward`'s outputs, computed sequence-parallel (``backends.fsdp.ulysses``).

    The rows are laid out as without SP (one packed row with varlen kernels, the rows of
    :func:`packed_rows`, or right-padded rows), widened to a multiple of the group size with
    a tail that restarts its positions at 0 (a sequence no real token attends to), and this
    rank runs its block of columns. Each column's prediction about the next token of its row
    (log-prob of that token, entropy, value) is computed on the local logits and the columns are
    gathered, so no rank holds more than its share of logits; the gathered predictions are then
    aligned exactly as :func:`hf_forward` aligns them.
    """
    ids = mb["input_ids"]
    packed = pack(ids)
    rows, pos, index = _layout(model, ids, packed, remove_padding)
    sp = dist.get_world_size(group)
    extra = -rows.shape[1] % sp
    if extra:
        index = index // rows.shape[1] * (rows.shape[1] + extra) + index % rows.shape[1]
        rows = F.pad(rows, (0, extra))
        pos = torch.cat([pos, torch.arange(extra, device=pos.device).expand(pos.shape[0], extra)], 1)
    shard = SequenceShard(group, pos, tail=extra)
    width, w, rank = rows.shape[1], shard.local_width, shard.rank
    if on_rows is not None:
        col = index % width
        mine = (col >= rank * w) & (col < (rank + 1) * w)
        local_row = (index // width) * w + col - rank * w
        on_rows(rows.shape[0] * w, torch.where(mine, local_row, torch.full_like(local_row, -1)))
    out = model(input_ids=shard.local(rows), position_ids=shard.local(pos), use_cache=False, **{SP_KWARG: shard})  # logits [R, w, V]

    def whole(per_column: torch.Tensor) -> torch.Tensor:
        # this rank's [R, w] -> every column's, in packed token order, less the last (it predicts nothing)
        return gather_dim1(per_column, group).reshape(-1)[index][:-1]

    following = shard.local(F.pad(rows[:, 1:], (0, 1)))  # the token after each column in its row
    return outputs_from_columns(mb, out.logits, following, whole, head)


def _layout(model: nn.Module, ids: torch.Tensor, packed, remove_padding: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [R, W], position_ids [R, W], index)`` of the rows :func:`hf_forward` would
    run, ``index[t]`` packed token t's place in the flattened rows."""
    total = packed.input_ids.numel()
    if remove_padding and _varlen_kernels(model):
        return packed.input_ids[None], packed.position_ids[None], torch.arange(total, device=ids.device)
    if remove_padding:
        rows, pos, index = packed_rows(packed.input_ids, packed.position_ids, ids.offsets(), model.config)
        return rows, pos, torch.arange(total, device=ids.device) if index is None else index
    padded, mask = pad(ids)
    pos = torch.arange(padded.shape[1], device=ids.device).expand_as(padded)
    return padded, pos, mask.reshape(-1).nonzero().squeeze(1)


def packed_rows_exact(model: nn.Module, vocab_size: int, device: torch.device, half: bool = False) -> bool:
    """Whether this model honours packed rows: HF starts a new sequence where the positions
    restart, in the attention (mask or varlen kernel) of most families, but not of every one
    (measured: GPT-OSS's attention, with its sinks, attends across the boundary on CPU and its
    packed log-probs are off by nats). Two short seeded sequences, packed into one row as
    :func:`hf_forward` runs them, against each alone; logits within 1e-4 (fp32; 2e-2 when
    ``half``: a half-precision compute dtype). One small forward per sequence, without gradients; a
    collective under FSDP (every rank runs the same)."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g).to(device) for n in (5, 3)]
    positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = model(input_ids=torch.cat(seqs)[None], position_ids=positions[None], use_cache=False).logits[0].float()
            alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0].float() for s in seqs])
    finally:
        model.train(training)
    tol = 2e-2 if half else 1e-4
    return bool(torch.allclose(packed, alone, rtol=tol, atol=tol))


def _varlen_kernels(model: nn.Module) -> bool:
    """Whether attention runs varlen kernels (cost per sequence, not per packed row): flash-attn's,
    also under Ulysses' wrapper of them (``enginekit_ulysses_flash_attention_2``), or torch's."""
    kernel = getattr(model.config, "_attn_implementation", None) or ""
    return kernel.endswith("flash_attention_2") or kernel == VARLEN


def packed_rows(
    input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: torch.Tensor, config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Lay packed sequences out in the rows :func:`row_layout` picks for ``config``.

    Args:
        input_ids: flat token ids of the packed micro-batch, shape [total].
        position_ids: their per-sequence positions, shape [total].
        offsets: sequence boundaries, shape [B + 1].
        config: the HF model config (sizes for the cost model).

    Returns:
        ``(input_ids [R, L], position_ids [R, L], index)``: ``index[t]`` is packed token t's
        place in the flattened ``[R * L]`` rows, or None when everything fits one row
        (``R == 1``, no gather needed). Sequences go first-fit-decreasing into rows; a
        row's unused tail gets positions restarting at 0, so HF treats it as a sequence of
        its own that no real token attends to.
    """
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    width, rows = row_layout(lengths, config)
    if len(rows) == 1:
        return input_ids[None], position_ids[None], None
    device = input_ids.device
    starts = [0] * len(lengths)  # flat start of each sequence in [R * L]
    loads = []
    for r, members in enumerate(rows):
        col = r * width
        for i in members:
            starts[i] = col
            col += lengths[i]
        loads.append(col - r * width)
    total = input_ids.numel()
    shift = torch.tensor(starts, device=device) - offsets[:-1]
    index = torch.repeat_interleave(shift, offsets[1:] - offsets[:-1], output_size=total) + torch.arange(total, device=device)
    flat_ids = input_ids.new_zeros(len(rows) * width)
    flat_ids[index] = input_ids
    # Real tokens keep their per-sequence positions; each row's tail restarts at 0.
    tail_start = torch.tensor(loads, device=device).repeat_interleave(width)
    flat_pos = torch.arange(len(rows) * width, device=device) % width - tail_start
    flat_pos[index] = position_ids
    return flat_ids.view(len(rows), width), flat_pos.view(len(rows), width), index


def _first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices per row: longest first, each into the first row with room."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, load in enumerate(loads) if load + lengths[i] <= width), len(rows))
        if j == len(rows):
            rows.append([])
            loads.append(0)
        rows[j].append(i)
        loads[j] += lengths[i]
    return rows


def row_layout(lengths: list[int], config) -> tuple[int, list[list[int]]]:
    """The row width with the fewest modelled FLOPs and its rows (sequence indices per row,
    first-fit-decreasing). Cost: rows x width x (per-token linear cost + per-token attention
    cost x width), over the longest sequence times powers of two and everything in one row
    (``sum(lengths)``). Wider rows waste less padding; narrower rows do less masked attention.
    Powers of two keep the search to log(total / longest) packings. A width whose least
    possible cost (``ceil(total / width)`` full rows) is not below the best cost so far cannot
    be chosen, so it is not packed (each packing is a Python loop over the sequences and rows:
    most of this function's time on a tiny model).

    The model counts the attention of a dense (block-diagonal masked) row, which is what SDPA
    and eager attention compute; it is not used with varlen kernels.
    """
    h, layers = config.hidden_size, config.num_hidden_layers
    kv = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv *= getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = layers * 2 * (2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size) + 2 * h * config.vocab_size
    per_token_per_col = layers * 4 * h  # QK^T and AV over the whole row
    total = sum(lengths)
    best = (total, [list(range(len(lengths)))])
    best_cost = total * (per_token + per_token_per_col * total)
    width = max(lengths)
    while width < total:
        if -(-total // width) * width * (per_token + per_token_per_col * width) < best_cost:
            rows = _first_fit_decreasing(lengths, width)
            cost = len(rows) * width * (per_token + per_token_per_col * width)
            if cost < best_cost:
                best, best_cost = (width, rows), cost
        width *= 2
    return best
