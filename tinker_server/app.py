"""A Tinker-API-compatible HTTP server over Enginekit's training engines.

The official ``tinker`` SDK (0.38) drives it unchanged: ``tinker.ServiceClient(base_url=...,
api_key="tml-...")``. The training side is reached only through the contract
(:mod:`tinker_server.contract`): a :class:`RunFactory`, its ``TrainingRun``s and
``Sampler``s. Wire conversions live in :mod:`~tinker_server.wire`, the futures and the
single worker thread in :mod:`~tinker_server.futures`, checkpoints on disk in
:mod:`~tinker_server.checkpoints`.

Endpoints (all under ``/api/v1``; every one but ``healthz`` needs an ``X-API-Key`` in
``settings.api_keys``, any key when that is empty):

Tenants (``tinker_server.tenants``): each key owns the sessions it creates and everything under
them (runs, futures, samplers, checkpoints; the key's tag is recorded always); with two or more
keys another key's ids are answered as unknown, and listings leave them out (``settings.tenants``
false: shared). Every key has its own limits (``settings.max_runs_per_key``,
``settings.max_sampling_sessions_per_key``) and the worker serves the keys round-robin.

Logging (python ``logging``, logger ``tinker_server.app``): one INFO line per run created and per
run ended, naming the run and its owner's tag (never the key); each call's queue wait and run time
at DEBUG.

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
                                         sampling session of the current weights (the last
                                         ``snapshots_per_model`` per model are kept, default 4)
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
import collections
import concurrent.futures
import inspect
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone

import zstandard
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from tinker_server import tenants, wire
from tinker_server.checkpoints import (
    CheckpointRef,
    CheckpointStore,
    check_model_id,
    check_name,
    check_session_id,
    parse_tinker_path,
)
from tinker_server.contract import LoraIn, RunFactory, Sampler, ServerSettings, TrainingRun, UserError
from tinker_server.datums import check_loss_request
from tinker_server.futures import FuturesTable, OrderedWorker, Outcome, QueueClosed, SeqConflict, outcome_of_exception

log = logging.getLogger(__name__)

_MAX_POLL_S = 40.0  # the SDK gives up on a retrieve_future after 45 s


class HttpError(Exception):
    """A refused request: status and message (the body is the SDK's error shape)."""

    def __init__(self, status: int, message: str, category: str = "user"):
        super().__init__(message)
        self.status = status
        self.category = category


class BodyTooLarge(Exception):
    pass


# ---------------------------------------------------------------------------------- registry
@dataclass
class _Session:
    id: str
    user_metadata: dict | None
    display_name: str | None
    last_seen: float = field(default_factory=time.monotonic)
    finished: str | None = None  # the reason, once finished
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    owner: str = field(default_factory=tenants.current)  # its tenant (tinker_server.tenants)


@dataclass
class _Model:
    id: str
    session_id: str
    base_model: str
    lora: LoraIn
    user_metadata: dict | None
    run: TrainingRun | None = None  # set (and cleared) on the worker thread only
    closed: str | None = None  # the reason, once closed
    last_request: float = field(default_factory=time.time)
    snapshots: collections.deque = field(default_factory=collections.deque)  # sampling session ids
    owner: str = ""  # its session's tenant


@dataclass
class _SamplerSession:
    id: str
    session_id: str | None
    base_model: str
    model_path: str | None = None
    model_id: str | None = None  # for a snapshot of a training run
    sampler: Sampler | None = None  # loaded on the worker, on first use (base / path) or at save (snapshot)
    gone: str | None = None  # why it can no longer sample
    clients: int = 0
    owner: str = field(default_factory=tenants.current)
    counted: bool = False  # opened by create_sampling_session: counts against max_sampling_sessions_per_key


class TinkerServer:
    """The server's state and request handlers (one per app)."""

    def __init__(self, settings: ServerSettings, factory: RunFactory):
        self.settings = settings
        self.factory = factory
        ownerless = tenants.owner_tag(settings.ownerless_runs_owner) if settings.ownerless_runs_owner else ""
        self.store = CheckpointStore(settings.state_dir, ownerless_owner=ownerless)
        self.store.clean_staging()  # what a killed server's saves left (before any save of this one runs)
        self.futures = FuturesTable()
        self.worker = OrderedWorker()
        self.lock = threading.Lock()
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _SamplerSession] = {}
        self.base_samplers: dict[str, Sampler] = {}  # worker thread only
        self.path_samplers: collections.OrderedDict[tuple, Sampler] = collections.OrderedDict()  # worker only; LRU
        self._served: list[str] | None = None
        self.poll_s = min(float(settings.poll_timeout_s), _MAX_POLL_S)
        self.session_timeout_s = float(settings.session_timeout_s)
        self.snapshots_per_model = int(settings.extra.get("snapshots_per_model", 4))
        self.loaded_samplers = int(settings.extra.get("loaded_samplers", 4))

    # ------------------------------------------------------------------ helpers
    async def served_models(self) -> list[str]:
        """``factory.served_models()``, asked once, on the worker thread like every factory call."""
        if self._served is None:
            self._served = list(await asyncio.wrap_future(self.worker.call(self.factory.served_models)))
        return self._served

    async def check_base_model(self, base_model: str, field_name: str) -> None:
        served = await self.served_models()
        if base_model not in served:
            raise UserError(f"{field_name}: {base_model!r} is not served here; this server serves {served}")

    def session(self, session_id: object, field_name: str = "session_id") -> _Session:
        check_session_id(session_id, field_name)
        found = self.sessions.get(session_id)  # type: ignore[arg-type]
        if found is None or not tenants.visible(found.owner):  # another tenant's session is unknown to this one
            raise HttpError(404, f"{field_name}: unknown session {session_id!r} (create one with ServiceClient)")
        if found.finished:
            raise UserError(f"{field_name}: session {session_id!r} is finished ({found.finished}); create a new ServiceClient")
        found.last_seen = time.monotonic()
        return found

    def model(self, model_id: object, field_name: str = "model_id") -> _Model:
        check_model_id(model_id, field_name)
        found = self.models.get(model_id)  # type: ignore[arg-type]
        if found is None or not tenants.visible(found.owner):
            raise HttpError(404, f"{field_name}: unknown model {model_id!r} on this server")
        if found.closed:
            raise UserError(f"{field_name}: model {model_id!r} is closed ({found.closed})")
        self.session(found.session_id)
        found.last_request = time.time()
        return found

    def live_runs(self, owner: str | None = None) -> int:
        """Runs not closed (of ``owner``'s key only, when given)."""
        return sum(1 for m in self.models.values() if not m.closed and (owner is None or m.owner == owner))

    def check_capacity(self) -> None:
        """Refuse a new run past ``max_runs`` (the server's) or ``max_runs_per_key`` (this key's)."""
        freeing = (
            "finish a session (ServiceClient.close()) or unload a model (unload_model) to free one; the session of a client "
            f"that stopped without close() (no heartbeat) is finished and its runs freed {self.session_timeout_s:g} s after "
            "its last heartbeat (server.session_timeout_s)"
        )
        if self.live_runs() >= self.settings.max_runs:
            raise UserError(
                f"create_model: this server already holds max_runs={self.settings.max_runs} training runs; {freeing}; "
                "or start the server with a larger server.max_runs"
            )
        per_key = self.settings.max_runs_per_key
        if self.live_runs(tenants.current()) >= per_key:
            raise UserError(
                f"create_model: this API key already holds server.max_runs_per_key={per_key} training runs (the runs one key "
                f"may hold, so that one key cannot fill the server's max_runs={self.settings.max_runs}); {freeing}; or start "
                "the server with a larger server.max_runs_per_key"
            )

    def check_sampling_sessions(self) -> None:
        """Refuse a new sampling session past this key's ``max_sampling_sessions_per_key``."""
        mine = tenants.current()
        held = sum(1 for e in self.samplers.values() if e.owner == mine and e.counted and e.gone is None)
        limit = self.settings.max_sampling_sessions_per_key
        if held >= limit:
            raise UserError(
                f"create_sampling_session: this API key already holds server.max_sampling_sessions_per_key={limit} sampling "
                "sessions; they are freed when their ServiceClient session finishes (ServiceClient.close()); fix: reuse a "
                "sampling client, close the sessions you are done with, or start the server with a larger "
                "server.max_sampling_sessions_per_key"
            )

    def submit(self, key: str, seq: int | None, work: Callable[[], Outcome], what: str, **extra) -> dict:
        """Queue ``work`` on the worker; the answer the SDK expects (``UntypedAPIFuture``)."""
        request_id = self.futures.create()
        owner, queued = tenants.current(), time.perf_counter()

        def job() -> None:
            if not self.futures.start(request_id):
                return  # cancelled (cancel_future) before it started
            began = time.perf_counter()
            try:
                outcome = work()
            except Exception as e:  # noqa: BLE001 - every failure becomes a failed future
                outcome = outcome_of_exception(e, what)
            # (logged before the future completes: a client that has its answer finds the line written)
            log.debug(
                "%s of %s (owner %s): ran %.3f s after waiting %.3f s in the queue",
                what,
                key,
                owner or "none",
                time.perf_counter() - began,
                began - queued,
            )
            self.futures.complete(request_id, outcome)

        def fail(message: str) -> None:
            self.futures.complete(request_id, Outcome.failed(f"{what}: {message}", "user"))

        try:
            self.worker.submit(key, seq, job, fail, request_id)
        except (QueueClosed, SeqConflict) as e:
            fail(str(e))
            raise UserError(f"{what}: {e}") from None
        return {"request_id": request_id, **extra}

    async def sequenced(self, model_id: object, seq_id: int | None, what: str, prepare: Callable[[_Model], object]) -> dict:
        """A model's request: runs in ``seq_id`` order. ``prepare`` checks the request and returns
        the work (or an awaitable of it). A request refused here still uses up its ``seq_id``, so
        the client's later requests are not left waiting for it."""
        model = self.model(model_id)
        if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 0:
            shown = "missing" if seq_id is None else repr(seq_id)
            raise UserError(f"{what}: seq_id ({shown}) must be an integer >= 0 (the SDK numbers every request of a training client)")
        claimed, request_id = self.worker.claimed(model.id, seq_id)
        if request_id is not None:
            return {"request_id": request_id, "model_id": model.id}  # the SDK re-sent a request
        try:
            work = prepare(model)
            if inspect.isawaitable(work):
                work = await work
        except Exception:
            if not claimed:
                self.worker.skip(model.id, seq_id)
            raise
        return self.submit(model.id, seq_id, work, what, model_id=model.id)  # type: ignore[arg-type]

    def close_run(self, model: _Model) -> None:
        """Close the model's run (worker thread; idempotent)."""
        run, model.run = model.run, None
        if run is not None:
            run.close()

    def close_model(self, model: _Model, reason: str) -> concurrent.futures.Future:
        """Refuse the model's waiting and later requests, drop its snapshots, close its run."""
        with self.lock:
            already = model.closed is not None
            model.closed = model.closed or reason
            snapshots = list(model.snapshots)
        if not already:
            log.info("run %s ended (%s); owner %s", model.id, reason, model.owner or "none")
            self.worker.close(model.id, f"model {model.id} was closed ({reason})")
            for sid in snapshots:
                self.drop_sampler(sid, f"its training run {model.id} was closed ({reason})")
        return self.worker.call(lambda: self.close_run(model))

    def drop_sampler(self, sampler_id: str, reason: str) -> None:
        entry = self.samplers.get(sampler_id)
        if entry is not None and entry.gone is None:
            entry.gone = reason
            self.worker.close(sampler_id, f"sampler {sampler_id} is gone ({reason})")
            self.worker.call(lambda: setattr(entry, "sampler", None))  # freed on the worker, after any sample in flight

    async def finish_session(self, session: _Session, reason: str) -> None:
        """Finish a session: close its runs (waited for) and its samplers."""
        if session.finished:
            return
        session.finished = reason
        with self.lock:  # the worker adds snapshot samplers to the session
            models, samplers = list(session.models), list(session.samplers)
        closing = [self.close_model(self.models[m], f"session {session.id} finished") for m in models]
        for sid in samplers:
            self.drop_sampler(sid, f"session {session.id} finished")
        for future in closing:
            try:
                await asyncio.wrap_future(future)
            except Exception:  # noqa: BLE001 - a run that fails to close must not keep the others open
                log.exception("closing a run of session %s failed", session.id)

    async def reap(self) -> None:
        """Finish sessions that went silent (their client died): frees their runs."""
        while True:
            await asyncio.sleep(min(5.0, self.session_timeout_s / 4))
            cutoff = time.monotonic() - self.session_timeout_s
            for session in list(self.sessions.values()):
                if not session.finished and session.last_seen < cutoff:
                    log.warning("session %s sent nothing for %.0f s; finishing it", session.id, self.session_timeout_s)
                    try:
                        await self.finish_session(session, f"no heartbeat for {self.session_timeout_s:.0f} s")
                    except Exception:  # noqa: BLE001 - keep reaping the others
                        log.exception("finishing session %s failed", session.id)

    async def shutdown(self) -> None:
        for session in list(self.sessions.values()):
            await self.finish_session(session, "the server stopped")
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.worker.call(self.factory.close)), 300)
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.exception("closing the run factory failed")
        await asyncio.to_thread(self.worker.stop)

    # ------------------------------------------------------------------ samplers (worker thread)
    def sampler_of(self, entry: _SamplerSession) -> Sampler:
        if entry.gone:
            raise UserError(f"sampling_session_id: {entry.id} can no longer sample: {entry.gone}")
        if entry.model_path is not None:
            # Loaded from disk, so cheap to drop: the last `loaded_samplers` paths used stay loaded
            # (an RL loop that saves and samples a new named checkpoint every step loads one each).
            # The cache is keyed by what is on disk now (the metadata file's identity and time), so a
            # deleted checkpoint is refused and one saved again under the same name is reloaded.
            ref = parse_tinker_path(entry.model_path, "model_path")
            key = (entry.model_path, self.store.stamp(ref, "model_path"))
            sampler = self.path_samplers.pop(key, None)
            if sampler is None:
                sampler = self.factory.load_sampler(self.store.directory(ref))
            self.path_samplers[key] = sampler
            while len(self.path_samplers) > self.loaded_samplers:
                self.path_samplers.popitem(last=False)
            return sampler
        if entry.sampler is None:
            if entry.model_id is None:
                if entry.base_model not in self.base_samplers:
                    self.base_samplers[entry.base_model] = self.factory.base_sampler(entry.base_model)
                entry.sampler = self.base_samplers[entry.base_model]
            else:
                raise UserError(f"sampling_session_id: {entry.id} has no weights (its save did not complete)")
        return entry.sampler

    def add_snapshot(self, model: _Model, entry: _SamplerSession) -> None:
        """Register a snapshot sampler; the oldest beyond ``snapshots_per_model`` are dropped."""
        with self.lock:
            self.samplers[entry.id] = entry
            model.snapshots.append(entry.id)
            session = self.sessions.get(model.session_id)
            if session is not None:
                session.samplers.append(entry.id)
            evicted = []
            while len(model.snapshots) > self.snapshots_per_model:
                evicted.append(model.snapshots.popleft())
        self.worker.open(entry.id, ordered=False, owner=entry.owner)
        for sid in evicted:
            self.drop_sampler(sid, f"more than {self.snapshots_per_model} newer snapshots of {model.id} were taken since")


# ---------------------------------------------------------------------------------- the app
class _Guard:
    """ASGI middleware: the API key, and the body size limit (counted as the body arrives)."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body: int, tenants_on: bool = True):
        self.app = app
        self.api_keys = set(api_keys)
        self.max_body = max_body
        self.enforced = tenants.enforced(self.api_keys, tenants_on)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_keys and scope["path"] != "/api/v1/healthz" and headers.get("x-api-key") not in self.api_keys:
            shown = "missing" if "x-api-key" not in headers else "not one of this server's keys"
            body = wire.error_body(f"X-API-Key: {shown}; pass api_key= (or TINKER_API_KEY) with a key from the server's api_keys")
            return await _send_json(send, 401, body)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await _send_json(send, 413, _too_large(self.max_body))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise BodyTooLarge()
            return message

        token = tenants.enter(tenants.tag_of(headers.get("x-api-key")), self.enforced)
        try:
            return await self.app(scope, counted, send)
        finally:
            tenants.leave(token)


def _too_large(limit: int) -> dict:
    return wire.error_body(wire.too_large_message("request body", limit))


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _json(request: Request, what: str) -> dict:
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except RecursionError:
        data = None  # nested past Python's recursion limit: refused below
    except ValueError as e:
        raise UserError(f"{what}: the body is not JSON ({e})") from None
    if data is None or _depth_over(data, _MAX_JSON_DEPTH):
        raise UserError(f"{what}: the body nests JSON arrays or objects more than {_MAX_JSON_DEPTH} deep; no request of the API does")
    if not isinstance(data, dict):
        raise UserError(f"{what}: the body must be a JSON object")
    return data


_MAX_JSON_DEPTH = 64


def _depth_over(data: object, limit: int) -> bool:
    """Whether ``data`` nests lists / dicts more than ``limit`` deep (iterative: no recursion)."""
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _decompress(raw: bytes, limit: int) -> bytes:
    """A zstd body, refused as too large once it inflates past ``limit`` (a small bomb stays small)."""
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            while chunk := reader.read(1 << 20):
                out += chunk
                if len(out) > limit:
                    raise BodyTooLarge()
    except zstandard.ZstdError as e:
        raise UserError(f"request body: not valid zstd ({e})") from None
    return bytes(out)


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat()


def _client_config(settings: ServerSettings) -> dict:
    config = {
        "pjwt_auth_enabled": False,  # the server checks plain API keys
        "credential_default_source": "api_key",
        "use_pyqwest_transport": False,  # plain httpx
        "parallel_fwdbwd_chunks": True,  # chunks arrive out of order; the worker runs them in seq order
        # One forward_backward call = one request up to half the body limit (the SDK's size estimate
        # is approximate): a request is atomic (refused whole, nothing applied), and nothing in the
        # requests of a chunked call says they belong together, so a refused chunk cannot undo its
        # siblings (docs/tinker.md).
        "fwdbwd_max_chunk_len": 1 << 20,
        "fwdbwd_max_chunk_bytes_count": max(1, settings.max_body_bytes // 2),
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,  # one retrieve_future poll per request
        "custom_loss_server_side": False,  # custom losses run in the client
        "sample_join_sampling_session": False,
        "sample_no_retries": False,
    }
    config.update(settings.extra.get("client_config", {}))
    return config


def build_app(settings: ServerSettings, factory: RunFactory) -> FastAPI:
    """The FastAPI app serving the Tinker API over ``factory`` (see the module docstring).

    Shutting the app down finishes every session (closing its runs) and closes ``factory``."""
    server = TinkerServer(settings, factory)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await server.served_models()  # asked once, before any request needs it
        reaper = asyncio.create_task(server.reap())
        try:
            yield
        finally:
            reaper.cancel()
            await server.shutdown()

    app = FastAPI(title="Enginekit Tinker server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = server
    app.add_middleware(_Guard, api_keys=tuple(settings.api_keys), max_body=settings.max_body_bytes, tenants_on=settings.tenants)

    @app.exception_handler(UserError)
    async def _user_error(_request: Request, e: UserError):
        return JSONResponse(wire.error_body(str(e)), status_code=400)

    @app.exception_handler(HttpError)
    async def _http_error(_request: Request, e: HttpError):
        return JSONResponse(wire.error_body(str(e), e.category), status_code=e.status)

    @app.exception_handler(BodyTooLarge)
    async def _body_too_large(_request: Request, _e: BodyTooLarge):
        return JSONResponse(_too_large(settings.max_body_bytes), status_code=413)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "request"
        return JSONResponse(wire.error_body(f"{where}: {first.get('msg', 'invalid')} ({first.get('input')!r})"), status_code=400)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        # A bug here, not a bad request; still not a 5xx: the SDK retries those for minutes, and a
        # deterministic failure would only come back each time.
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return JSONResponse(wire.error_body(f"{request.url.path}: server error: {type(e).__name__}: {e}", "server"), status_code=400)

    @app.exception_handler(404)
    async def _not_found(request: Request, _e: Exception):
        return JSONResponse(
            wire.error_body(f"{request.method} {request.url.path}: no such endpoint on this Tinker server"), status_code=404
        )

    @app.exception_handler(405)
    async def _bad_method(request: Request, _e: Exception):
        return JSONResponse(wire.error_body(f"{request.method} {request.url.path}: method not allowed"), status_code=405)

    _add_service_routes(app, server)
    _add_training_routes(app, server)
    _add_sampling_routes(app, server)
    _add_rest_routes(app, server)
    return app


def _add_service_routes(app: FastAPI, server: TinkerServer) -> None:
    settings = server.settings

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config():
        return _client_config(settings)

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        served = await server.served_models()
        return {"supported_models": [{"model_name": m, "trainable": True, "sampleable": True} for m in served]}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request):
        req = wire.parse(wire.RequestIdIn, await _json(request, "cancel_future"), "cancel_future")
        if not server.futures.known(req.request_id):
            raise HttpError(404, f"request_id: {req.request_id!r} is unknown or expired on this server")
        # A call not started yet never runs (its future fails as cancelled). A started one cannot be
        # undone (its gradients are in the run): refused, and its future keeps the real outcome.
        answer = server.futures.cancel(req.request_id, Outcome.failed(f"request {req.request_id} was cancelled by the client", "user"))
        if answer == "unknown":
            raise HttpError(404, f"request_id: {req.request_id!r} is unknown or expired on this server")
        if answer != "cancelled":
            now = "has already started" if answer == "started" else "has already finished"
            raise UserError(
                f"cancel_future: request {req.request_id} {now} and cannot be cancelled: a started call runs to its end and "
                "keeps its effect (a forward_backward's gradients reach the next optim_step); its future holds its real "
                "outcome; fix: retrieve it with retrieve_future instead of sending the call again"
            )
        return {}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        req = wire.parse(wire.CreateSessionIn, await _json(request, "create_session"), "create_session")
        session = _Session(uuid.uuid4().hex[:16], req.user_metadata, req.display_name)
        server.sessions[session.id] = session
        return {"type": "create_session", "session_id": session.id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        req = wire.parse(wire.SessionIdIn, await _json(request, "session_heartbeat"), "session_heartbeat")
        session = server.sessions.get(req.session_id)
        if session is None or not tenants.visible(session.owner):
            raise HttpError(404, f"session_id: unknown session {req.session_id!r}")
        if session.finished:
            raise HttpError(410, f"session_id: session {req.session_id!r} is finished ({session.finished})")
        session.last_seen = time.monotonic()
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        data = await _json(request, "finish")
        check_session_id(session_id, "session_id")
        session = server.sessions.get(session_id)
        if session is None or not tenants.visible(session.owner):
            raise HttpError(404, f"session_id: unknown session {session_id!r}")
        reason = data.get("reason")
        status = reason.get("type", "finished") if isinstance(reason, dict) else "finished"
        await server.finish_session(session, f"closed by the client: {status}")
        return {}

    @app.get("/api/v1/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0):
        ids = [s.id for s in server.sessions.values() if not s.finished and tenants.visible(s.owner)]
        return {"sessions": ids[offset : offset + limit]}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str):
        session = server.sessions.get(session_id)
        if session is None or not tenants.visible(session.owner):
            raise HttpError(404, f"session_id: unknown session {session_id!r}")
        return {
            "training_run_ids": session.models,
            "sampler_ids": session.samplers,
            "user_metadata": session.user_metadata,
            "display_name": session.display_name,
        }

    for path, why in {
        "create_custom_loss": wire.REFUSED_LOSSES["custom"],
        "save_weights_external": "external (Hugging Face) exports are not supported; use save_state / save_weights_for_sampler",
        "copy_weights": "there are no projects or accounts on this server to copy weights between",
    }.items():
        app.post(f"/api/v1/{path}")(_refuse(path, why))


def _refuse(path: str, why: str) -> Callable[[], Awaitable[None]]:
    async def refused():
        raise UserError(f"{path}: refused: {why}")

    return refused


def _add_training_routes(app: FastAPI, server: TinkerServer) -> None:
    store = server.store
    settings = server.settings

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        req = wire.parse(wire.CreateModelIn, await _json(request, "create_model"), "create_model")
        session = server.session(req.session_id)
        if req.model_seq_id < 0:
            raise UserError(f"model_seq_id: {req.model_seq_id} must be >= 0")
        model_id = f"{session.id}:train:{req.model_seq_id}"
        claimed, request_id = server.worker.claimed(model_id, 0)
        if request_id is not None:
            return {"request_id": request_id, "model_id": model_id}  # a re-sent create
        if model_id in server.models:
            raise UserError(f"model_seq_id: model {model_id} already exists")
        lora = wire.lora_from_wire(req.lora_config)
        wire.check_optimizer_config(req.optimizer_config, "optimizer_config")
        await server.check_base_model(req.base_model, "base_model")
        model = _register_model(server, session, model_id, req.base_model, lora, req.user_metadata)

        def work() -> Outcome:
            _start_run(server, model)
            return Outcome.json({"model_id": model_id, "type": "create_model"})

        return server.submit(model_id, 0, work, "create_model", model_id=model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        req = wire.parse(wire.ModelIdIn, await _json(request, "get_info"), "get_info")
        model = server.model(req.model_id)
        return {
            "type": "get_info",
            "model_id": model.id,
            "model_data": {"arch": None, "model_name": model.base_model, "tokenizer_id": model.base_model},
            "model_name": model.base_model,
            "is_lora": True,
            "lora_rank": model.lora.rank,
            "optimizer_config": {"type": "adamw"},
        }

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        if "json" in request.headers.get("content-type", ""):
            raise UserError("forward_backward: send a protobuf body (tinker SDK >= 0.38); JSON forward_backward is not supported")
        body = await request.body()
        encoding = request.headers.get("content-encoding", "identity")
        if encoding == "zstd":
            body = await asyncio.to_thread(_decompress, body, settings.max_body_bytes)
        elif encoding != "identity":
            raise UserError(f"Content-Encoding: {encoding!r} is not supported (identity or zstd)")
        msg = await asyncio.to_thread(wire.parse_forward_backward, body)

        async def prepare(model: _Model):
            # Converting many datums takes a while: off the event loop.
            fb = await asyncio.to_thread(wire.forward_backward_from_proto, msg, settings.max_body_bytes)

            def work() -> Outcome:
                # The loss's values (config and per-token thresholds) fail the future, before the run
                # is touched: a 400 here could stop the SDK sending the call's other chunks, whose
                # seq_ids would then hold every later request of the model.
                check_loss_request(fb.loss_fn, fb.loss_fn_config, fb.datums)
                out = model.run.forward_backward(fb.datums, fb.loss_fn, fb.loss_fn_config, fb.forward_only)
                return Outcome(wire.forward_backward_to_proto(out, len(fb.datums)), wire.PROTO)

            return work

        return await server.sequenced(msg.model_id, msg.seq_id, "forward" if msg.forward_only else "forward_backward", prepare)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        data = await _json(request, "optim_step")

        def prepare(model: _Model):
            adam = wire.adam_from_wire(wire.parse(wire.OptimStepIn, data, "optim_step"))
            return lambda: Outcome.json({"metrics": {str(k): float(v) for k, v in model.run.optim_step(adam).items()}})

        return await server.sequenced(data.get("model_id"), data.get("seq_id"), "optim_step", prepare)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        data = await _json(request, "save_weights")

        def prepare(model: _Model):
            req = wire.parse(wire.SaveWeightsIn, data, "save_weights")
            wire.check_ttl(req.ttl_seconds)
            ref = CheckpointRef(model.id, "weights", check_name(req.path or f"state-{req.seq_id:06d}", "path"))
            _check_free(store, ref, req.overwrite)

            def work() -> Outcome:
                _save(store, ref, model, req.overwrite, lambda d: model.run.save_state(d, True), req.user_metadata, req.ttl_seconds)
                return Outcome.json({"path": ref.tinker_path, "type": "save_weights"})

            return work

        return await server.sequenced(data.get("model_id"), data.get("seq_id"), "save_weights", prepare)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        data = await _json(request, "save_weights_for_sampler")

        def prepare(model: _Model):
            req = wire.parse(wire.SaveWeightsForSamplerIn, data, "save_weights_for_sampler")
            wire.check_ttl(req.ttl_seconds)
            if req.kind not in ("snapshot", "inflight"):
                raise UserError(f"kind: {req.kind!r} is not 'snapshot' or 'inflight'")
            if req.path is not None:
                ref = CheckpointRef(model.id, "sampler_weights", check_name(req.path, "path"))
                _check_free(store, ref, False)

                def save_named() -> Outcome:
                    # The run writes the sampler weights; they are served later by factory.load_sampler.
                    _save(store, ref, model, False, lambda d: model.run.sampler(d), req.user_metadata, req.ttl_seconds)
                    return Outcome.json({"path": ref.tinker_path, "type": "save_weights_for_sampler"})

                return save_named
            if req.sampling_session_seq_id is None:
                raise UserError("save_weights_for_sampler: give a path (name) or a sampling_session_seq_id")
            # "inflight" samplers may adopt newer weights; a snapshot of the current ones satisfies that.
            sid = f"{model.session_id}:sample:{req.sampling_session_seq_id}"
            if sid in server.samplers:
                raise UserError(f"sampling_session_seq_id: {req.sampling_session_seq_id} was already used in this session")

            def snapshot() -> Outcome:
                entry = _SamplerSession(
                    sid, model.session_id, model.base_model, model_id=model.id, sampler=model.run.sampler(None), owner=model.owner
                )
                server.add_snapshot(model, entry)
                return Outcome.json({"sampling_session_id": sid, "type": "save_weights_for_sampler"})

            return snapshot

        return await server.sequenced(data.get("model_id"), data.get("seq_id"), "save_weights_for_sampler", prepare)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        data = await _json(request, "load_weights")
        if data.get("model_id") is not None:
            return await _load_into(server, data)
        return await _create_from_state(server, data)

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request):
        req = wire.parse(wire.ModelIdIn, await _json(request, "unload_model"), "unload_model")
        model = server.model(req.model_id)
        request_id = server.futures.create(started=True)  # the close is under way at once: not cancellable
        closing = server.close_model(model, "unloaded by the client")

        def done(future: concurrent.futures.Future) -> None:
            error = future.exception()
            outcome = outcome_of_exception(error, "unload_model") if error else Outcome.json({"model_id": model.id, "type": "unload_model"})
            server.futures.complete(request_id, outcome)

        closing.add_done_callback(done)
        return {"request_id": request_id, "model_id": model.id}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        req = wire.parse(wire.RetrieveFutureIn, await _json(request, "retrieve_future"), "retrieve_future")
        try:
            outcome = await server.futures.wait(req.request_id, server.poll_s)
        except KeyError:
            raise HttpError(410, f"request_id: {req.request_id!r} is unknown or expired on this server (was it restarted?)") from None
        if outcome is None:
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        return Response(outcome.body, media_type=outcome.media_type)


def _register_model(server: TinkerServer, session: _Session, model_id: str, base_model: str, lora: LoraIn, user_metadata) -> _Model:
    with server.lock:
        server.check_capacity()
        model = _Model(model_id, session.id, base_model, lora, user_metadata, owner=session.owner)
        server.models[model_id] = model
        session.models.append(model_id)
    server.worker.open(model_id, ordered=True, owner=model.owner)
    return model


def _start_run(server: TinkerServer, model: _Model, load: Callable[[TrainingRun], None] | None = None) -> None:
    """Worker: create the run (and load a checkpoint into it); on failure the model is forgotten."""
    try:
        model.run = server.factory.create_run(model.base_model, model.lora)
        if load is not None:
            load(model.run)
        server.store.write_run(model.id, model.base_model, model.lora, model.user_metadata, owner=model.owner)
    except BaseException:
        server.close_model(model, "its creation failed")
        raise
    log.info("run %s created: %s, LoRA rank %d; owner %s", model.id, model.base_model, model.lora.rank, model.owner or "none")
    if model.closed:  # closed while being created: the close job may already have run
        server.close_run(model)


def _check_free(store: CheckpointStore, ref: CheckpointRef, overwrite: bool) -> None:
    if not overwrite:
        try:
            store.read(ref, "path")
        except UserError:
            return
        raise UserError(
            f"path: checkpoint {ref.tinker_path} already exists; choose another name"
            + (" (or overwrite=True)" if ref.kind == "weights" else "")
        )


def _save(store: CheckpointStore, ref: CheckpointRef, model: _Model, overwrite: bool, write, user_metadata, ttl_seconds) -> None:
    """Worker: a staging directory beside the checkpoint, filled by ``write``, then its metadata and
    the swap into place (on failure the staging directory is removed; an older checkpoint of the
    name stays as it was)."""
    staging = store.begin(ref, overwrite)
    try:
        write(staging)
        store.commit(
            ref,
            staging,
            model.base_model,
            model.lora,
            with_optimizer=ref.kind == "weights",
            user_metadata=user_metadata,
            ttl_seconds=ttl_seconds,
        )
    except BaseException:
        store.abort(staging)
        raise


def _training_checkpoint(store: CheckpointStore, path: str) -> tuple[CheckpointRef, dict]:
    ref = parse_tinker_path(path, "path")
    store.check_owned(ref, "path")
    if ref.kind != "weights":
        raise UserError(
            f"path: {path} holds sampler weights; loading a training state needs a save_state checkpoint (tinker://.../weights/...)"
        )
    return ref, store.read(ref, "path")


async def _load_into(server: TinkerServer, data: dict) -> dict:
    def prepare(model: _Model):
        req = wire.parse(wire.LoadWeightsIn, data, "load_weights")
        ref, meta = _training_checkpoint(server.store, req.path)
        if meta["base_model"] != model.base_model or meta["lora"].rank != model.lora.rank:
            raise UserError(
                f"path: {req.path} is a checkpoint of {meta['base_model']} with LoRA rank {meta['lora'].rank}; "
                f"model {model.id} is {model.base_model} with rank {model.lora.rank}"
            )
        theirs, ours = _targets(meta["lora"]), _targets(model.lora)
        if theirs != ours:
            # Adapters on other layers: the engine's checkpoint would not fit this run's adapters.
            raise UserError(
                f"path: {req.path} holds adapters on {theirs}; model {model.id} adapts {ours}; the adapters of one cannot "
                "load into the other; fix: create_training_client_from_state(path) (a new run with the checkpoint's LoRA "
                "targets), or load a checkpoint saved by a run created with the same train_attn / train_mlp / train_unembed"
            )
        directory = server.store.directory(ref)

        def work() -> Outcome:
            model.run.load_state(directory, req.optimizer)
            return Outcome.json({"path": req.path, "model_id": model.id, "type": "load_weights"})

        return work

    return await server.sequenced(data.get("model_id"), data.get("seq_id"), "load_weights", prepare)


def _targets(lora: LoraIn) -> str:
    """The layers a run's adapters are on, by its toggles (the modules each selects: runs.lora_modules)."""
    toggles = (
        ("train_attn", lora.train_attn, "the attention projections"),
        ("train_mlp", lora.train_mlp, "the MLP projections"),
        ("train_unembed", lora.train_unembed, "lm_head"),
    )
    on = " and ".join(what for _, flag, what in toggles if flag) or "no layer"
    return f"{on} ({', '.join(f'{name}={flag}' for name, flag, _ in toggles)})"


async def _create_from_state(server: TinkerServer, data: dict) -> dict:
    req = wire.parse(wire.LoadWeightsIn, data, "load_weights")
    if req.session_id is None or req.model_seq_id is None:
        raise UserError(
            "load_weights: give model_id and seq_id (load into a model) or session_id and model_seq_id (a new model from the checkpoint)"
        )
    session = server.session(req.session_id)
    if req.model_seq_id < 0:
        raise UserError(f"model_seq_id: {req.model_seq_id} must be >= 0")
    model_id = f"{session.id}:train:{req.model_seq_id}"
    _, request_id = server.worker.claimed(model_id, 0)
    if request_id is not None:
        return {"request_id": request_id, "model_id": model_id}
    if model_id in server.models:
        raise UserError(f"model_seq_id: model {model_id} already exists")
    ref, meta = _training_checkpoint(server.store, req.path)
    wire.check_optimizer_config(req.optimizer_config, "optimizer_config")
    base_model = meta["base_model"]
    if req.base_model is not None and req.base_model != base_model:
        # The adapters were trained on the checkpoint's base: on another base (same shapes, other
        # weights) they would load without a word and compute something else.
        raise UserError(
            f"base_model: {req.base_model!r} differs from the base model of {req.path} ({base_model!r}); its adapters were "
            f"trained on {base_model!r}; fix: omit base_model (or pass {base_model!r})"
        )
    await server.check_base_model(base_model, "base_model")
    model = _register_model(server, session, model_id, base_model, meta["lora"], req.user_metadata)
    directory = server.store.directory(ref)

    def work() -> Outcome:
        _start_run(server, model, load=lambda run: run.load_state(directory, req.optimizer))
        return Outcome.json({"path": req.path, "model_id": model_id, "type": "load_weights"})

    return server.submit(model_id, 0, work, "load_weights", model_id=model_id)


def _add_sampling_routes(app: FastAPI, server: TinkerServer) -> None:
    store = server.store

    async def resolve(session_id: str | None, sid: str, base_model: str | None, model_path: str | None) -> _SamplerSession:
        """A (new) sampling session for a base model or a sampler checkpoint path."""
        if model_path is not None:
            ref = parse_tinker_path(model_path, "model_path")
            store.check_owned(ref, "model_path")
            if ref.kind != "sampler_weights":
                raise UserError(
                    f"model_path: {model_path} is a training state; sample from save_weights_for_sampler weights (tinker://.../sampler_weights/...)"
                )
            meta = store.read(ref, "model_path")
            if base_model is not None and base_model != meta["base_model"]:
                raise UserError(f"base_model: {base_model!r} differs from the checkpoint's base model {meta['base_model']!r}")
            return _SamplerSession(sid, session_id, meta["base_model"], model_path=model_path)
        if base_model is None:
            raise UserError("create_sampling_session: give model_path or base_model")
        await server.check_base_model(base_model, "base_model")
        return _SamplerSession(sid, session_id, base_model)

    def register(entry: _SamplerSession) -> _SamplerSession:
        with server.lock:
            existing = server.samplers.setdefault(entry.id, entry)
            if existing is entry and entry.session_id is not None:
                server.sessions[entry.session_id].samplers.append(entry.id)
        server.worker.open(existing.id, ordered=False, owner=existing.owner)
        return existing

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        req = wire.parse(wire.CreateSamplingSessionIn, await _json(request, "create_sampling_session"), "create_sampling_session")
        session = server.session(req.session_id)
        sid = f"{session.id}:sample:{req.sampling_session_seq_id}"
        if sid not in server.samplers:
            server.check_sampling_sessions()
            entry = await resolve(session.id, sid, req.base_model, req.model_path)
            if sid not in server.samplers:  # (no await from here on: the check and the registration are one step)
                server.check_sampling_sessions()  # again: another request of this key may have opened one meanwhile
                entry.counted = True
                register(entry)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def sampler_entry(sid: object) -> _SamplerSession:
        entry = server.samplers.get(sid) if isinstance(sid, str) else None
        if entry is None or not tenants.visible(entry.owner):
            raise HttpError(404, f"sampling_session_id: unknown sampler {sid!r} on this server")
        if entry.session_id is not None:
            server.session(entry.session_id, "sampling_session_id")
        return entry

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        entry = sampler_entry(sampler_id)
        return {"sampler_id": entry.id, "base_model": entry.base_model, "model_path": entry.model_path}

    @app.post("/api/v1/join_sampling_session")
    async def join_sampling_session(request: Request):
        req = wire.parse(wire.SamplingSessionIdIn, await _json(request, "join_sampling_session"), "join_sampling_session")
        entry = sampler_entry(req.sampling_session_id)
        entry.clients += 1
        return {"type": "join_sampling_session", "client_counter": entry.clients}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        req = wire.parse(wire.SampleIn, await _json(request, "asample"), "asample")
        wire.check_sample_features(req)
        wire.check_sample_limits(req, server.settings.max_sample_tokens, server.settings.max_num_samples)
        prompt = wire.tokens_from_chunks(req.prompt.chunks, "prompt.chunks")
        params = wire.sample_params_from_wire(req.sampling_params)
        want_lp = bool(req.prompt_logprobs)
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and (not want_lp or not 1 <= last_n <= len(prompt) - 1):
            raise UserError(
                f"prompt_logprobs_last_n: {last_n} needs prompt_logprobs and 1 <= n <= {len(prompt) - 1} (the prompt's length - 1)"
            )
        if req.sampling_session_id is not None:
            entry = sampler_entry(req.sampling_session_id)
        else:
            # Sampling without a session: one shared sampler per base model or path.
            key = f"direct:{tenants.current()}:{req.model_path or req.base_model}"
            entry = server.samplers.get(key) or register(await resolve(None, key, req.base_model, req.model_path))
        if entry.gone:
            raise UserError(f"sampling_session_id: {entry.id} can no longer sample: {entry.gone}")

        def work() -> Outcome:
            out = server.sampler_of(entry).sample(prompt, req.num_samples, params, want_lp)
            return Outcome(wire.sample_to_proto(out, req.num_samples, len(prompt), want_lp, last_n), wire.PROTO)

        answer = server.submit(entry.id, None, work, "sample")
        answer["sample_sequence_ids"] = [f"{answer['request_id']}:{i}" for i in range(req.num_samples)]
        return answer


def _add_rest_routes(app: FastAPI, server: TinkerServer) -> None:
    store = server.store

    def checkpoint_json(ref: CheckpointRef, meta: dict) -> dict:
        return {
            "checkpoint_id": ref.checkpoint_id,
            "checkpoint_type": ref.checkpoint_type,
            "time": _iso(meta.get("created", 0.0)),
            "tinker_path": ref.tinker_path,
            "size_bytes": store.size_bytes(ref),
            "public": False,
            "user_metadata": meta.get("user_metadata"),
            "expires_at": _iso(meta.get("expires_at")),
        }

    def run_json(model_id: str, record: dict | None = None) -> dict:
        record = record or store.owned_run(model_id)
        if record is None:
            raise HttpError(404, f"training_run_id: unknown training run {model_id!r} on this server")
        checkpoints = store.list(model_id)
        last = {
            kind: next((checkpoint_json(r, m) for r, m in reversed(checkpoints) if r.kind == kind), None)
            for kind in ("weights", "sampler_weights")
        }
        live = server.models.get(model_id)
        return {
            "training_run_id": model_id,
            "base_model": record["base_model"],
            "model_owner": "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": record["lora"].rank,
            "last_request_time": _iso(live.last_request if live else record.get("created", 0.0)),
            "last_checkpoint": last["weights"],
            "last_sampler_checkpoint": last["sampler_weights"],
            "user_metadata": record.get("user_metadata"),
        }

    @app.get("/api/v1/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0):
        runs = store.visible_runs()  # (a damaged or ownerless record is skipped, logged)
        return {
            "training_runs": [run_json(m, record) for m, record in runs[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    @app.get("/api/v1/training_runs/{model_id}")
    async def training_run(model_id: str):
        return run_json(check_model_id(model_id, "training_run_id"))

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str):
        check_model_id(model_id, "training_run_id")
        found = store.list(model_id)
        if store.read_run(model_id) is None:
            if found and tenants.is_enforced():
                store.refuse_ownerless(model_id, "training_run_id")  # checkpoints whose run record is gone
        elif store.owned_run(model_id) is None:
            raise HttpError(404, f"training_run_id: unknown training run {model_id!r} on this server")
        return {"checkpoints": [checkpoint_json(r, m) for r, m in found]}

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(model_id: str, kind: str, name: str):
        ref = parse_tinker_path(f"tinker://{model_id}/{kind}/{name}", "checkpoint_id")
        store.check_owned(ref, "checkpoint_id")
        store.delete(ref)
        return {}

    @app.get("/api/v1/checkpoints")
    async def all_checkpoints(limit: int = 100, offset: int = 0):
        found = [checkpoint_json(r, m) for model_id, _ in store.visible_runs() for r, m in store.list(model_id)]
        return {"checkpoints": found[offset : offset + limit], "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        req = wire.parse(wire.WeightsInfoIn, await _json(request, "weights_info"), "weights_info")
        ref = parse_tinker_path(req.tinker_path, "tinker_path")
        store.check_owned(ref, "tinker_path")
        meta = store.read(ref, "tinker_path")
        lora = meta["lora"]
        return {
            "base_model": meta["base_model"],
            "optimizer_config": {"type": "adamw"},
            "is_lora": True,
            "lora_rank": lora.rank,
            "train_unembed": lora.train_unembed,
            "train_mlp": lora.train_mlp,
            "train_attn": lora.train_attn,
        }


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
