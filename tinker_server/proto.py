"""The Tinker SDK's protobuf messages <-> the plain types of :mod:`tinker_server.contract`.

``forward_backward`` arrives as the SDK's public protobuf (``tinker_public_pb2.ForwardBackwardRequest``);
the results of ``forward_backward`` and ``asample`` go back as protobuf (``ForwardBackwardOutput``,
``SampleResponse``). Client input that does not convert raises :class:`UserError` naming the field
and the value (sizes checked before any tensor is built); a result the training side returned in a
shape the SDK can not decode raises ``ValueError`` (a server error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from roles.datum_losses import INPUT_FIELDS
from tinker_server.contract import DatumIn, ForwardBackwardOut, SampleOut, UserError
from tinker_server.wire import check_loss_fn, too_large_message

PROTO = "application/x-protobuf"

# loss_fn_inputs that are per token: their first dimension must be the model input's length.
_PER_TOKEN_INPUTS = ("target_tokens", "weights", "advantages", "logprobs")
_METRIC_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")


# ---------------------------------------------------------------------------------- protobuf in
@dataclass(frozen=True)
class ForwardBackwardIn:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    forward_only: bool
    datums: list[DatumIn]


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """Parse the protobuf body (only the envelope: the datums are converted separately)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others; all mean a bad body
        raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({type(e).__name__}: {e})") from None
    return msg


def forward_backward_from_proto(msg: pb.ForwardBackwardRequest, max_bytes: int) -> ForwardBackwardIn:
    """The datums, loss and config of a ``ForwardBackwardRequest`` (all checked). Names, shapes and
    the bytes every tensor will take are checked before any tensor is built: sparse tensors may
    inflate the request to at most ``max_bytes`` (the body limit), as zstd bodies may."""
    loss_fn = check_loss_fn(msg.loss_fn)
    if not msg.data:
        raise UserError("data: no datums")
    _check_inputs_before_building(msg, max_bytes)
    datums = [_datum_from_proto(d, f"data[{i}]", max_bytes) for i, d in enumerate(msg.data)]
    return ForwardBackwardIn(msg.model_id, msg.seq_id, loss_fn, _loss_config(msg), msg.forward_only, datums)


_INPUT_NAMES = ("target_tokens", *INPUT_FIELDS)


def _check_inputs_before_building(msg: pb.ForwardBackwardRequest, max_bytes: int) -> None:
    """Every ``loss_fn_inputs`` name known, every sparse tensor's first dimension the datum's token
    count, and the dense size of all tensors together within ``max_bytes``."""
    total = 0
    for i, datum in enumerate(msg.data):
        tokens = sum(len(c.encoded_text.tokens) // 4 for c in datum.model_input if c.WhichOneof("chunk") == "encoded_text")
        total += 8 * tokens  # the token ids, as int64
        for name, t in datum.loss_fn_inputs.items():
            field = f"data[{i}].loss_fn_inputs[{name!r}]"
            if name not in _INPUT_NAMES:
                raise UserError(f"{field}: not an input of any loss (they are {', '.join(_INPUT_NAMES)}); fix: drop it")
            if t.WhichOneof("encoding") != "sparse_csr":
                total += len(t.dense)
                continue
            shape = [int(s) for s in t.shape]
            if len(shape) != 2 or any(s < 0 for s in shape):
                raise UserError(f"{field}: a sparse CSR tensor must be 2-D with dimensions >= 0, got shape {shape}")
            if shape[0] != tokens:
                raise UserError(f"{field}: shape {shape} does not match the model input's {tokens} tokens ([T] or [T, K])")
            total += math.prod(shape) * (8 if t.dtype == pb.DTYPE_INT64 else 4)
            if total > max_bytes:
                raise UserError(too_large_message(f"{field}: sparse shape {shape}: the request's tensors, built dense,", max_bytes))
    if total > max_bytes:
        raise UserError(too_large_message("data: the request's tensors, built dense,", max_bytes))


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float] | None:
    # Newer SDKs write loss_fn_config_v2 (numbers or strings) and mirror numbers into the legacy map.
    config: dict[str, float] = {}
    if msg.loss_fn_config_v2:
        for key, value in msg.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise UserError(f"loss_fn_config[{key!r}]: only numbers are supported, got {value.WhichOneof('value') or 'nothing'}")
            config[key] = value.number
    else:
        config = {key: float(value) for key, value in msg.loss_fn_config.items()}
    return config or None


def _datum_from_proto(datum: pb.Datum, field: str, max_bytes: int) -> DatumIn:
    parts = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(
                f"{field}.model_input[{j}]: chunk type {kind!r} is not supported; this server takes text tokens only (EncodedTextChunk)"
            )
        parts.append(_frombuffer(chunk.encoded_text.tokens, np.int32, f"{field}.model_input[{j}].tokens"))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    if tokens.size == 0:
        raise UserError(f"{field}.model_input: empty (no tokens)")
    if (tokens < 0).any():
        raise UserError(f"{field}.model_input: negative token id {int(tokens.min())}")
    inputs = {name: tensor_from_proto(t, f"{field}.loss_fn_inputs[{name!r}]", max_bytes) for name, t in datum.loss_fn_inputs.items()}
    if "target_tokens" not in inputs:
        raise UserError(f"{field}.loss_fn_inputs: 'target_tokens' is missing")
    for name in _PER_TOKEN_INPUTS:
        if name not in inputs:
            continue
        t = inputs[name]
        if t.ndim not in (1, 2) or t.shape[0] != tokens.size:
            raise UserError(
                f"{field}.loss_fn_inputs[{name!r}]: shape {list(t.shape)} does not match the model input's {tokens.size} tokens ([T] or [T, K])"
            )
        if name == "target_tokens":
            if t.dtype != torch.int64:
                raise UserError(f"{field}.loss_fn_inputs['target_tokens']: dtype {t.dtype} must be int64")
            if (t < 0).any():
                raise UserError(f"{field}.loss_fn_inputs['target_tokens']: negative token id {int(t.min())}")
        elif t.dtype != torch.float32:
            inputs[name] = t.to(torch.float32)  # integer weights (np.ones(..., int)) mean the same numbers
    return DatumIn(tokens=torch.from_numpy(tokens.astype(np.int64)), inputs=inputs)


_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}


def tensor_from_proto(msg: pb.Tensor, field: str, max_bytes: int) -> torch.Tensor:
    """A public ``Tensor`` (dense, or sparse CSR with implicit zeros) -> a dense torch tensor."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(
            f"{field}: dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype} is not supported (float32 or int64)"
        )
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise UserError(f"{field}: negative dimension in shape {shape}")
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        return torch.from_numpy(_dense_from_csr(msg.sparse_csr, dtype, shape, field, max_bytes))
    values = _frombuffer(msg.dense, dtype, field)
    if not shape:
        shape = [values.size]  # a TensorData without shape is 1-D
    if math.prod(shape) != values.size:
        raise UserError(f"{field}: shape {shape} needs {math.prod(shape)} values, got {values.size}")
    return torch.from_numpy(values.reshape(shape))


def _dense_from_csr(csr: pb.SparseCsr, dtype, shape: list[int], field: str, max_bytes: int) -> np.ndarray:
    if len(shape) != 2:
        raise UserError(f"{field}: a sparse CSR tensor must be 2-D, got shape {shape}")
    if math.prod(shape) * np.dtype(dtype).itemsize > max_bytes:
        raise UserError(too_large_message(f"{field}: sparse shape {shape}, built dense,", max_bytes))
    values = _frombuffer(csr.values, dtype, f"{field}.values")
    crow = _frombuffer(csr.crow_indices, np.int64, f"{field}.crow_indices")
    col = _frombuffer(csr.col_indices, np.int64, f"{field}.col_indices")
    rows, cols = shape
    valid = (
        crow.size == rows + 1
        and crow[0] == 0
        and crow[-1] == values.size == col.size
        and bool((np.diff(crow) >= 0).all())
        and (col.size == 0 or (col.min() >= 0 and col.max() < cols))
    )
    if not valid:
        raise UserError(
            f"{field}: inconsistent sparse CSR indices for shape {shape} ({crow.size} row pointers, {col.size} columns, {values.size} values)"
        )
    dense = np.zeros(shape, dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def _frombuffer(data: bytes, dtype, field: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise UserError(f"{field}: {len(data)} bytes is not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(data, dtype).copy()


# ---------------------------------------------------------------------------------- protobuf out
def _to_numpy(t: torch.Tensor, where: str) -> tuple[np.ndarray, int]:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: expected a torch tensor, got {type(t).__name__}")
    t = t.detach().cpu()
    if t.dtype.is_floating_point:
        return t.to(torch.float32).contiguous().numpy(), pb.DTYPE_FLOAT32
    return t.to(torch.int64).contiguous().numpy(), pb.DTYPE_INT64


def check_metrics(metrics: dict[str, float], where: str) -> dict[str, float]:
    """Metric keys must be ``name:reduction`` (the SDK splits on ':' to combine chunks)."""
    out = {}
    for key, value in metrics.items():
        parts = str(key).split(":")
        if len(parts) != 2 or parts[1] not in _METRIC_REDUCTIONS:
            raise ValueError(f"{where}: metric key {key!r} is not 'name:reduction' with a reduction in {_METRIC_REDUCTIONS}")
        out[str(key)] = float(value)
    return out


def forward_backward_to_proto(out: ForwardBackwardOut, num_datums: int) -> bytes:
    """:class:`ForwardBackwardOut` -> serialized ``ForwardBackwardOutput`` (per-datum outputs, metrics)."""
    if len(out.outputs) != num_datums:
        raise ValueError(f"forward_backward returned {len(out.outputs)} outputs for {num_datums} datums")
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in check_metrics(out.metrics, "forward_backward").items():
        msg.metrics[key] = value
    arrays = [{name: _to_numpy(t, f"outputs[{i}][{name!r}]") for name, t in sorted(o.items())} for i, o in enumerate(out.outputs)]
    names = list(arrays[0]) if arrays else []
    # One ArrayRecord per run of datums whose fields agree in dtype and trailing shape (the SDK
    # decodes each record as rectangular past the first dimension).
    groups: list[list[dict]] = []
    signature = None
    for i, datum in enumerate(arrays):
        if list(datum) != names:
            raise ValueError(f"forward_backward output {i} has fields {list(datum)}, output 0 has {names}")
        sig = tuple((dt, a.shape[1:]) for a, dt in datum.values())
        if sig != signature:
            groups.append([])
            signature = sig
        groups[-1].append(datum)
    for group in groups:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(group))
        for name in names:
            parts = [d[name][0].reshape(-1) if d[name][0].ndim == 0 else d[name][0] for d in group]
            offsets = np.cumsum([0] + [p.nbytes for p in parts], dtype=np.int64)
            field = record.fields[name]
            field.data = b"".join(p.tobytes() for p in parts)
            field.offsets = offsets.tobytes()
            field.dtype = group[0][name][1]
            field.trailing_shape.extend(parts[0].shape[1:])
    return msg.SerializeToString()


_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def sample_to_proto(out: SampleOut, num_samples: int, prompt_len: int, prompt_logprobs: bool, last_n: int | None) -> bytes:
    """:class:`SampleOut` -> serialized ``SampleResponse`` (prompt logprobs: NaN where None)."""
    if len(out.sequences) != num_samples:
        raise ValueError(f"the sampler returned {len(out.sequences)} sequences for num_samples={num_samples}")
    msg = pb.SampleResponse()
    for i, seq in enumerate(out.sequences):
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"sequence {i}: stop_reason {seq.stop_reason!r} is not 'stop' or 'length'")
        if seq.logprobs and len(seq.logprobs) != len(seq.tokens):
            raise ValueError(f"sequence {i}: {len(seq.logprobs)} logprobs for {len(seq.tokens)} tokens")
        item = msg.sequences.add(stop_reason=_STOP_REASONS[seq.stop_reason], tokens=np.asarray(seq.tokens, np.int32).tobytes())
        if seq.logprobs:
            item.logprobs = np.asarray(seq.logprobs, np.float32).tobytes()
    if prompt_logprobs:
        values = out.prompt_logprobs
        if values is None or len(values) != prompt_len:
            raise ValueError(
                f"the sampler returned {None if values is None else len(values)} prompt logprobs for a {prompt_len}-token prompt"
            )
        lp = np.array([math.nan if v is None else v for v in values], np.float32)
        if last_n is not None:
            lp[: prompt_len - last_n] = math.nan  # prompt_logprobs_last_n: earlier positions unscored
        msg.prompt_logprobs = lp.tobytes()
    return msg.SerializeToString()
