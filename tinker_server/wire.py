"""The Tinker SDK's wire format <-> the plain types of :mod:`tinker_server.contract`.

Requests arrive as JSON (every call but ``forward_backward``) or as the SDK's public protobuf
(``forward_backward``: ``tinker_public_pb2.ForwardBackwardRequest``); the results of
``forward_backward`` and ``asample`` go back as protobuf (``ForwardBackwardOutput``,
``SampleResponse``), every other result as JSON. Every conversion of client input raises
:class:`UserError` naming the field and the value; a result the training side returned in a shape
the SDK can not decode raises ``ValueError`` (a server error).

The error shape of every refused request and failed future is the SDK's ``RequestFailedResponse``:
``{"error": <message>, "category": "user" | "server"}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pydantic
import torch
from pydantic import BaseModel, ConfigDict
from tinker.proto import tinker_public_pb2 as pb

from roles.datum_losses import INPUT_FIELDS, LOSSES, REFUSED_LOSSES
from tinker_server.contract import AdamIn, DatumIn, ForwardBackwardOut, LoraIn, SampleOut, SampleParamsIn, UserError

PROTO = "application/x-protobuf"

# The losses and the refused names come from the one registry (roles.datum_losses.LOSSES /
# REFUSED_LOSSES), read at each call: a loss registered there is served here unchanged.
# loss_fn_inputs that are per token: their first dimension must be the model input's length.
_PER_TOKEN_INPUTS = ("target_tokens", "weights", "advantages", "logprobs")
_METRIC_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")


# The largest learning rate optim_step takes. A finite but huge rate passes the engine's
# non-finite check (the weights become ~lr, not inf) and poisons every later call of the run.
MAX_LEARNING_RATE = 10.0


def too_large_message(what: str, limit: int) -> str:
    """The refusal of a request that is (or would become) larger than the body limit."""
    return (
        f"{what}: larger than this server's limit of {limit} bytes (server.max_body_mb={limit / 2**20:g}); "
        "send fewer datums per call, or start the server with a larger server.max_body_mb"
    )


def error_body(message: str, category: str = "user") -> dict[str, str]:
    """The SDK's failed-request shape (``RequestFailedResponse``)."""
    return {"error": message, "category": category}


# ---------------------------------------------------------------------------------- JSON requests
class _In(BaseModel):
    # Unknown fields are ignored: newer SDKs add optional ones.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionIn(_In):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionIdIn(_In):
    session_id: str


class LoraConfigIn(_In):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModelIn(_In):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigIn | None = None
    optimizer_config: OptimizerConfigIn = OptimizerConfigIn()


class ModelIdIn(_In):
    model_id: str


class AdamParamsIn(_In):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepIn(_In):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParamsIn | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsIn(_In):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerIn(_In):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsIn(_In):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfigIn | None = None


class ModelInputIn(_In):
    chunks: list[dict[str, Any]]


class SamplingParamsIn(_In):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleIn(_In):
    num_samples: int = 1
    prompt: ModelInputIn
    sampling_params: SamplingParamsIn
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class CreateSamplingSessionIn(_In):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class SamplingSessionIdIn(_In):
    sampling_session_id: str


class RetrieveFutureIn(_In):
    request_id: str
    allow_metadata_only: bool = False


class RequestIdIn(_In):
    request_id: str


class WeightsInfoIn(_In):
    tinker_path: str


def parse(model: type[BaseModel], data: object, what: str):
    """Validate a JSON body; a :class:`UserError` names the first bad field and its value."""
    if not isinstance(data, dict):
        raise UserError(f"{what}: the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        value = first.get("input")
        shown = "missing" if first["type"] == "missing" else repr(value)[:200]
        raise UserError(f"{what}: field {field!r} ({shown}): {first['msg']}") from None


# ---------------------------------------------------------------------------------- plain types
def lora_from_wire(lora: LoraConfigIn | None) -> LoraIn:
    """``CreateModelRequest.lora_config`` -> :class:`LoraIn`."""
    if lora is None:
        raise UserError("lora_config: missing; this server trains LoRA adapters only (create_lora_training_client)")
    if lora.rank < 1:
        raise UserError(f"lora_config.rank: {lora.rank} must be at least 1")
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise UserError("lora_config: at least one of train_mlp, train_attn, train_unembed must be true")
    return LoraIn(rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp, train_attn=lora.train_attn, train_unembed=lora.train_unembed)


def check_optimizer_config(config: OptimizerConfigIn | None, field: str) -> None:
    """Only AdamW (the SDK default) is served."""
    if config is not None and config.type != "adamw":
        raise UserError(f"{field}.type: {config.type!r} is not supported; this server trains with AdamW only (optimizer type 'adamw')")


def adam_from_wire(req: OptimStepIn) -> AdamIn:
    """``OptimStepRequest`` -> :class:`AdamIn` (Adam only; every value checked)."""
    if req.adam_params is None:
        if req.optimizer_params is not None:
            kind = req.optimizer_params.get("type")
            raise UserError(f"optimizer_params.type: {kind!r} is not supported; this server steps with Adam only (pass types.AdamParams)")
        raise UserError("adam_params: missing; pass types.AdamParams to optim_step")
    p = req.adam_params
    if math.isfinite(p.learning_rate) and p.learning_rate > MAX_LEARNING_RATE:
        raise UserError(
            f"adam_params.learning_rate: {p.learning_rate!r} is above {MAX_LEARNING_RATE:g}: Adam moves every weight by about the "
            "learning rate per step, so the weights would be of that size and every later forward overflow; fix: a learning rate "
            "below it (LoRA runs use 1e-5 .. 1e-2)"
        )
    checks = {
        "learning_rate": p.learning_rate >= 0,
        "beta1": 0 <= p.beta1 < 1,
        "beta2": 0 <= p.beta2 < 1,
        "eps": p.eps > 0,
        "weight_decay": p.weight_decay >= 0,
        "grad_clip_norm": p.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(p, name)
        if not ok or not math.isfinite(value):
            raise UserError(f"adam_params.{name}: {value!r} is out of range")
    return AdamIn(**p.model_dump())


def check_loss_fn(loss_fn: str) -> str:
    """A loss this server runs, else a :class:`UserError` that says why not."""
    if loss_fn in REFUSED_LOSSES:
        raise UserError(f"loss_fn: {loss_fn!r} is refused: {REFUSED_LOSSES[loss_fn]}")
    if loss_fn not in LOSSES:
        raise UserError(f"loss_fn: {loss_fn!r} is unknown; this server runs {', '.join(LOSSES)}")
    return loss_fn


def tokens_from_chunks(chunks: list[dict[str, Any]], field: str) -> list[int]:
    """A JSON ``ModelInput``'s chunks -> token ids (text chunks only)."""
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise UserError(f"{field}[{i}]: chunk type {kind!r} is not supported; this server takes text tokens only (EncodedTextChunk)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids):
            raise UserError(f"{field}[{i}].tokens: {str(ids)[:200]} must be a list of token ids (0 <= id < 2**31)")
        tokens.extend(ids)
    if not tokens:
        raise UserError(f"{field}: the prompt is empty")
    return tokens


def sample_params_from_wire(params: SamplingParamsIn) -> SampleParamsIn:
    """``SamplingParams`` -> :class:`SampleParamsIn` (``stop``: one string, strings or token ids)."""
    if params.max_tokens is not None and params.max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens: {params.max_tokens} must be at least 1")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise UserError(f"sampling_params.temperature: {params.temperature!r} must be >= 0")
    if not 0 < params.top_p <= 1:
        raise UserError(f"sampling_params.top_p: {params.top_p!r} must be in (0, 1]")
    if params.top_k == 0 or params.top_k < -1:
        raise UserError(f"sampling_params.top_k: {params.top_k} must be -1 (no limit) or at least 1")
    stop = params.stop
    strings: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif stop and isinstance(stop[0], str):
        strings = tuple(stop)  # type: ignore[arg-type]
    elif stop:
        ids = tuple(stop)  # type: ignore[arg-type]
        if any(t < 0 for t in ids):
            raise UserError(f"sampling_params.stop: {list(ids)} has a negative token id")
    return SampleParamsIn(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop_strings=strings,
        stop_token_ids=ids,
    )


_MAX_TTL_S = 10 * 365 * 86400  # the SDK's documented bound: 10 years


def check_ttl(ttl_seconds: int | None) -> None:
    """``ttl_seconds``: None (never expires) or 1 s .. 10 years."""
    if ttl_seconds is not None and not 1 <= ttl_seconds <= _MAX_TTL_S:
        raise UserError(f"ttl_seconds: {ttl_seconds} is out of range; fix: 1 <= ttl_seconds <= {_MAX_TTL_S} (10 years), or None")


def check_sample_limits(req: SampleIn, max_tokens: int, max_samples: int) -> None:
    """``num_samples`` and ``max_tokens`` within the server's limits (``server.max_num_samples``,
    ``server.max_sample_tokens``): one request may not hold the engine thread for long."""
    if not 1 <= req.num_samples <= max_samples:
        raise UserError(f"num_samples: {req.num_samples} must be in 1..{max_samples} (server.max_num_samples); fix: send several requests")
    asked = req.sampling_params.max_tokens
    if asked is not None and asked > max_tokens:
        raise UserError(f"sampling_params.max_tokens: {asked} is above this server's limit of {max_tokens} (server.max_sample_tokens)")


def check_sample_features(req: SampleIn) -> None:
    """Refuse the sampling features the contract's Sampler does not provide, saying which."""
    unsupported = {
        "topk_prompt_logprobs": req.topk_prompt_logprobs > 0,
        "topk_sample_logprobs": req.topk_sample_logprobs > 0,
        "target_prompt_logprobs": req.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": req.prompt_alt_tokens_k > 0,
        "record_stability_info": bool(req.record_stability_info),
    }
    if req.record_stability_info:
        raise UserError(f"record_stability_info: True: {REFUSED_LOSSES['stable_reinforce']}")
    for name, asked in unsupported.items():
        if asked:
            raise UserError(
                f"{name}: {getattr(req, name)!r} is not supported by this server (it returns sampled tokens, their logprobs and prompt logprobs only)"
            )
    if req.num_samples < 1:
        raise UserError(f"num_samples: {req.num_samples} must be at least 1")


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
