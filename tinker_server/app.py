"""A Tinker-API-compatible HTTP server over Enginekit's training engines.

The official ``tinker`` SDK (0.38) drives it unchanged: ``tinker.ServiceClient(base_url=...,
api_key="tml-...")``. The app is routers over a registry: :mod:`~tinker_server.registry` holds the
sessions, models, samplers, their limits, the futures and the one worker thread (no HTTP there);
one router per API area (:mod:`tinker_server.routes`) parses and answers; :mod:`~tinker_server.guard`
checks every request's key and body size first. The training side is reached only through the
contract (:mod:`tinker_server.contract`): a :class:`RunFactory`, its ``TrainingRun``s and
``Sampler``s. Wire conversions live in :mod:`~tinker_server.wire` (JSON) and
:mod:`~tinker_server.proto` (protobuf), the futures and the single worker thread in
:mod:`~tinker_server.futures`, checkpoints on disk in :mod:`~tinker_server.checkpoints`.

Endpoints (all under ``/api/v1``; every one but ``healthz`` needs an ``X-API-Key`` in
``settings.api_keys``, any key when that is empty):

Tenants, limits and logging: :mod:`~tinker_server.registry`. Routers: ``routes.service`` (client
setup, sessions, futures), ``routes.training``, ``routes.weights`` (save / load), ``routes.sampling``,
``routes.listings`` (REST checkpoints), ``routes.openai`` (``/oai/api/v1``: OpenAI-compatible
chat and text completions over a base model or a saved sampler).

Client setup and sessions
    ``POST client/config``               feature flags: API-key auth (no JWT), plain httpx, client-side custom
                                         losses, per-request futures; ``settings.extra["client_config"]`` overrides
    ``POST client/dynamic_config``       refresh interval; sample cancellation off
    ``POST create_session``              a session (``session_id``); finished after ``settings.session_timeout_s``
                                         without a heartbeat or request (default 60 s: the SDK beats every 10 s)
    ``POST session_heartbeat``           keeps a session alive; 410 once it is finished (stops the SDK's loop)
    ``POST sessions/{id}/finish``        finishes a session: closes its runs and samplers (``run.close()``)
    ``GET  sessions``, ``GET sessions/{id}``   live sessions, a session's training runs and samplers
    ``GET  healthz``, ``GET get_server_capabilities``   health; ``factory.served_models()``
    ``POST telemetry``                   accepted and dropped; ``POST cancel_future``: a call not started never
                                         runs (its future fails as cancelled); a started (or finished) one is
                                         refused as a user error, and its future keeps its real outcome
Training (each a future, executed in the model's ``seq_id`` order)
    ``POST create_model``                a LoRA run (``factory.create_run``); id ``{session_id}:train:{n}``
    ``POST get_info``                    base model, LoRA rank (answered at once, no future)
    ``POST forward_backward``            protobuf body; ``forward_only`` for ``forward``; result protobuf
    ``POST optim_step``                  Adam step (``AdamParams``)
    ``POST save_weights``                ``tinker://{model_id}/weights/{name}`` (weights and optimizer)
    ``POST save_weights_for_sampler``    named: ``tinker://{model_id}/sampler_weights/{name}``; unnamed: a
                                         sampling session of the current weights (the
                                         ``server.snapshots_per_model`` most recently used per
                                         model are kept, default 4)
    ``POST load_weights``                into a model (``model_id`` + ``seq_id``, optimizer or not), or
                                         create-from-state (``session_id`` + ``model_seq_id``): a new run with
                                         the checkpoint's base model and LoRA config, then the load
    ``POST unload_model``                closes a run (frees one of ``settings.max_runs``; runs share engines:
                                         ``tinker_server.shared_engine.SharedEngine``)
Sampling
    ``POST create_sampling_session``     from ``base_model`` or a ``sampler_weights`` path (the last
                                         ``loaded_samplers`` paths used stay loaded, default 4; others reload)
    ``GET  samplers/{id}``               its base model and path
    ``POST join_sampling_session``       a clone id for an unpickled SamplingClient
    ``POST asample``                     JSON request, protobuf result (``compute_logprobs`` is an asample with
                                         ``prompt_logprobs``; ``prompt_logprobs_last_n`` honoured)
OpenAI-compatible (``/oai/api/v1``; ``model``: a base model or a ``sampler_weights`` path; key as a bearer token)
    ``POST chat/completions``            chat template, ``tools`` / ``tool_calls``, ``n``, ``logprobs``, ``stream``
    ``POST completions``                 ``prompt`` as text or token ids
    ``GET  models``                      the served base models
Futures
    ``POST retrieve_future``             the result; held open up to ``poll_timeout_s``, then ``try_again``
Checkpoints (REST)
    ``GET  training_runs``, ``GET training_runs/{id}``, ``GET training_runs/{id}/checkpoints``,
    ``DELETE training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}``, ``GET checkpoints``,
    ``POST weights_info``

Refused, with a user error that says why: losses ``stable_reinforce`` (needs server-side sampling
records) and ``custom`` / ``create_custom_loss`` (custom losses run client-side: the config tells
the SDK so, and ``forward_backward_custom`` works over ``forward`` + weighted ``cross_entropy``);
non-text model-input chunks (images, audio); optimizers other than AdamW; top-k / target prompt
logprobs, prompt alt tokens and stability records in sampling; ``save_weights_external`` and
``copy_weights``; ``create_model`` past ``settings.max_runs`` live runs; bodies over
``settings.max_body_bytes`` (413, naming ``server.max_body_mb``), also sparse tensors that would inflate
past it; samples past ``max_sample_tokens`` / ``max_num_samples`` or the model's positions. Unknown
keys get 401.

Errors have the SDK's shape ``{"error", "category"}``: client mistakes ``category: user`` (HTTP 400,
or 404 for an unknown id; a failed future for errors the training side raises as ``UserError``),
anything else a failed future with ``category: server`` and the exception's text. Never a 5xx for a
failed call: the SDK retries those for minutes.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tinker_server import wire
from tinker_server.contract import RunFactory, ServerSettings, UserError
from tinker_server.guard import BodyTooLarge, Guard, too_large_body
from tinker_server.registry import HttpError, Registry
from tinker_server.routes import listings, openai, sampling, service, training, weights

log = logging.getLogger(__name__)


def build_app(settings: ServerSettings, factory: RunFactory) -> FastAPI:
    """The FastAPI app serving the Tinker API over ``factory`` (see the module docstring).

    Shutting the app down finishes every session (closing its runs) and closes ``factory``."""
    app = FastAPI(title="Enginekit Tinker server", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = Registry(settings, factory)
    app.add_middleware(Guard, api_keys=tuple(settings.api_keys), max_body=settings.max_body_bytes, tenants_on=settings.tenants)
    for error, handler in (
        (UserError, _user_error),
        (HttpError, _http_error),
        (BodyTooLarge, _body_too_large),
        (RequestValidationError, _invalid),
        (Exception, _bug),
        (404, _not_found),
        (405, _bad_method),
    ):
        app.add_exception_handler(error, handler)
    for area in (service, training, weights, sampling, listings, openai):
        app.include_router(area.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    server: Registry = app.state.tinker
    await server.served_models()  # asked once, before any request needs it
    reaper = asyncio.create_task(server.reap())
    try:
        yield
    finally:
        reaper.cancel()
        await server.shutdown()


async def _user_error(_request: Request, e: UserError):
    return JSONResponse(wire.error_body(str(e)), status_code=400)


async def _http_error(_request: Request, e: HttpError):
    return JSONResponse(wire.error_body(str(e), e.category), status_code=e.status)


async def _body_too_large(request: Request, _e: BodyTooLarge):
    return JSONResponse(too_large_body(request.app.state.tinker.settings.max_body_bytes), status_code=413)


async def _invalid(_request: Request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())) or "request"
    return JSONResponse(wire.error_body(f"{where}: {first.get('msg', 'invalid')} ({first.get('input')!r})"), status_code=400)


async def _bug(request: Request, e: Exception):
    # A bug here, not a bad request; still not a 5xx: the SDK retries those for minutes, and a
    # deterministic failure would only come back each time.
    log.error("%s %s failed", request.method, request.url.path, exc_info=e)
    return JSONResponse(wire.error_body(f"{request.url.path}: server error: {type(e).__name__}: {e}", "server"), status_code=400)


async def _not_found(request: Request, _e: Exception):
    return JSONResponse(wire.error_body(f"{request.method} {request.url.path}: no such endpoint on this Tinker server"), status_code=404)


async def _bad_method(request: Request, _e: Exception):
    return JSONResponse(wire.error_body(f"{request.method} {request.url.path}: method not allowed"), status_code=405)


def serve(settings: ServerSettings, factory: RunFactory) -> None:
    """Run the server with uvicorn on ``settings.host:settings.port`` until interrupted."""
    import uvicorn

    # The run and call lines of tinker_server's loggers (server.log_level), on stderr beside uvicorn's.
    logger = logging.getLogger("tinker_server")
    logger.setLevel(settings.log_level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    # No access log: the SDK long-polls retrieve_future continuously.
    uvicorn.run(build_app(settings, factory), host=settings.host, port=settings.port, log_level="info", access_log=False)
