"""The Tinker SDK's JSON requests <-> the plain types of :mod:`tinker_server.contract`.

Every call but ``forward_backward`` arrives as JSON, validated into the request models here
(:func:`parse`); ``forward_backward`` and the protobuf results are :mod:`tinker_server.proto`'s.
Every conversion of client input raises :class:`UserError` naming the field and the value.

The error shape of every refused request and failed future is the SDK's ``RequestFailedResponse``:
``{"error": <message>, "category": "user" | "server"}``.
"""

from __future__ import annotations

import math
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from roles.datum_losses import LOSSES, REFUSED_LOSSES
from tinker_server.contract import AdamIn, LoraIn, SampleParamsIn, UserError

# The losses and the refused names come from the one registry (roles.datum_losses.LOSSES /
# REFUSED_LOSSES), read at each call: a loss registered there is served here unchanged.


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
