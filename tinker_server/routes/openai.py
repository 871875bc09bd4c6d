"""OpenAI-compatible sampling, as Tinker's service offers it: ``/oai/api/v1`` with
``POST /chat/completions``, ``POST /completions`` and ``GET /models``, so any OpenAI client (the
``openai`` SDK, an agent framework, an eval harness) samples a served base model or a saved
sampler by setting ``base_url=<server>/oai/api/v1``.

* ``model``: a served base model's name, or a ``tinker://<run>/sampler_weights/<name>`` path of
  ``save_weights_for_sampler`` (the same ownership rules as ``asample``'s ``model_path``).
* The API key goes as ``Authorization: Bearer <key>`` (what OpenAI clients send) or ``X-API-Key``.
* Chats are rendered with the base model's chat template (``tools`` passed to it) and answered
  through the shared implementation of the RL gateway (``posttrain.gateway.wire`` for the
  request and the answer, ``posttrain.gateway.chat`` for the rendering and the tool calls,
  parsed with the format the template writes); ``/completions`` takes ``prompt`` as a string or
  a list of token ids.
* Sampling runs on the server's worker in the caller's queue, as ``asample`` does (so one key's
  requests take turns with other keys' training calls); the answer comes in the response, not as
  a future. ``n`` up to ``server.max_num_samples``; ``max_tokens`` up to
  ``server.max_sample_tokens`` (the server's default length when absent); ``temperature``,
  ``top_p``, ``top_k``, ``seed`` and ``stop`` as given (a seeded request reproduces the native
  ``asample`` of the same prompt); ``logprobs`` gives the sampled tokens' log-probs.
* Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
  request, 404 for a model that is neither served nor a saved sampler.

Unlike the RL gateway nothing here is kept: every request is independent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from posttrain.gateway.chat import answer_of, renderer, token_logprobs
from posttrain.gateway.wire import WireError, choice, completion, models, parse_request, stream_chunks
from tinker_server.contract import ChatModel, SampleOut, SampleParamsIn, UserError
from tinker_server.guard import read_json
from tinker_server.registry import HttpError, Registry, SamplerSession
from tinker_server.routes import Server

router = APIRouter(prefix="/oai/api/v1")


def _error(exc: Exception) -> JSONResponse:
    if isinstance(exc, HttpError):
        exc = WireError(str(exc), exc.status)
    elif not isinstance(exc, WireError):
        exc = WireError(str(exc))
    return JSONResponse(exc.body(), status_code=exc.status)


@router.get("/models")
async def list_models(server: Server):
    return models(*await server.served_models())


@router.post("/chat/completions")
async def chat_completions(request: Request, server: Server):
    try:
        req = parse_request(await read_json(request, "chat/completions"), max_n=server.settings.max_num_samples)
        entry, chat = await _model(server, req.model)
        if not getattr(chat.tokenizer, "chat_template", None):
            raise WireError(f"model = {req.model!r}: its tokenizer has no chat template; fix: /completions with a prompt", param="model")
        try:
            text = renderer(chat.tokenizer, req.tools or None, {})(req.messages)
        except Exception as exc:  # noqa: BLE001 - the template's own refusal of these messages
            raise WireError(f"the chat template could not render the messages ({type(exc).__name__}: {exc})", param="messages") from None
        prompt = list(chat.tokenizer(text, add_special_tokens=False)["input_ids"])
        params = _params(server, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop, chat)
        out = await _sample(server, entry, prompt, req.n, params)
    except (WireError, UserError, HttpError) as exc:
        return _error(exc)
    tools_on = bool(req.tools) and req.tool_choice != "none"
    choices, generated = [], 0
    for i, seq in enumerate(out.sequences):
        answer = answer_of(_text(chat, seq.tokens, seq.stop_reason), seq.stop_reason == "length", chat.tool_format, tools_on)
        logprobs = token_logprobs(chat.tokenizer, seq.tokens, seq.logprobs) if req.logprobs else None
        choices.append(choice(i, answer.content, answer.calls, answer.finish, logprobs))
        generated += len(seq.tokens)
    body = completion(req.model, choices, len(prompt), generated)
    if req.stream:
        return StreamingResponse(iter(stream_chunks(body, req.include_usage)), media_type="text/event-stream")
    return body


@router.post("/completions")
async def completions(request: Request, server: Server):
    try:
        body = await read_json(request, "completions")
        model = str(body.get("model") or "")
        n = body.get("n", 1) or 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= server.settings.max_num_samples:
            raise WireError(f"n = {n!r}: must be an integer in [1, {server.settings.max_num_samples}] (server.max_num_samples)", param="n")
        if body.get("stream"):
            raise WireError("stream = true: /completions answers in one response here; fix: leave stream out", param="stream")
        # The chat request's checks of the shared fields (numbers in range, stop strings, seed).
        shared = parse_request({**{k: body[k] for k in _SHARED if k in body}, "messages": [{"role": "user", "content": ""}]})
        entry, chat = await _model(server, model)
        prompt = _prompt(chat, body.get("prompt"))
        params = _params(server, shared.max_tokens, shared.temperature, shared.top_p, shared.top_k, shared.seed, shared.stop, chat)
        out = await _sample(server, entry, prompt, n, params)
    except (WireError, UserError, HttpError) as exc:
        return _error(exc)
    want = body.get("logprobs") is not None and body.get("logprobs") is not False
    choices = []
    for i, seq in enumerate(out.sequences):
        lp = None
        if want:
            pieces = [chat.tokenizer.decode([t], skip_special_tokens=False) for t in seq.tokens]
            lp = {"tokens": pieces, "token_logprobs": list(seq.logprobs), "top_logprobs": None, "text_offset": _offsets(pieces)}
        choices.append({"index": i, "text": _text(chat, seq.tokens, seq.stop_reason), "logprobs": lp, "finish_reason": seq.stop_reason})
    generated = sum(len(s.tokens) for s in out.sequences)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated, "total_tokens": len(prompt) + generated},
    }


_SHARED = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop")


async def _model(server: Registry, model: str) -> tuple[SamplerSession, ChatModel]:
    """The sampler ``model`` names and its base model's chat facts."""
    if not model:
        raise WireError("model is missing; fix: a served base model's name or a tinker://.../sampler_weights/... path", param="model")
    path = model if model.startswith("tinker://") else None
    served = await server.served_models()
    if path is None and model not in served:
        raise WireError(
            f"model = {model!r} is not served here; fix: one of {served} or a tinker://.../sampler_weights/... path",
            404,
            param="model",
            code="model_not_found",
        )
    entry = await server.direct_sampler(None if path else model, path)
    # (a factory call: on the worker thread, as every one is)
    chat = await asyncio.wrap_future(server.worker.call(lambda: server.factory.chat_model(entry.base_model)))
    return entry, chat


def _params(
    server: Registry,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: tuple[str, ...],
    chat: ChatModel,
) -> SampleParamsIn:
    limit = server.settings.max_sample_tokens
    if max_tokens is not None and max_tokens > limit:
        raise WireError(f"max_tokens = {max_tokens}: above this server's limit of {limit} (server.max_sample_tokens)", param="max_tokens")
    return SampleParamsIn(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_k=-1 if top_k is None else top_k,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop_strings=stop,
        stop_token_ids=chat.stop_token_ids,
    )


async def _sample(server: Registry, entry: SamplerSession, prompt: list[int], n: int, params: SampleParamsIn) -> SampleOut:
    def work() -> SampleOut:
        return server.sampler_of(entry).sample(prompt, n, params, False)

    return await server.answer(entry.id, work, "oai sample")


def _prompt(chat: ChatModel, prompt: Any) -> list[int]:
    if isinstance(prompt, str) and prompt:
        return list(chat.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    shown = json.dumps(prompt)[:60] if prompt is not None else "missing"
    raise WireError(f"prompt = {shown}: a non-empty string or a list of token ids (one prompt per request)", param="prompt")


def _text(chat: ChatModel, tokens: list[int], stop_reason: str) -> str:
    """The answer's text: its tokens decoded, an ending stop token left out."""
    ends = tokens and stop_reason == "stop" and tokens[-1] in chat.stop_token_ids
    return chat.tokenizer.decode(tokens[:-1] if ends else tokens, skip_special_tokens=False)


def _offsets(pieces: list[str]) -> list[int]:
    out, at = [], 0
    for p in pieces:
        out.append(at)
        at += len(p)
    return out
