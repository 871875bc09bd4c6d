"""What the server holds and decides, without HTTP: sessions, models (training runs), sampling
sessions, their owners and limits, the futures and the one worker thread every training-side
call runs on. The routers (``tinker_server.routes``) parse requests and answer them; everything
they look up, count, refuse, queue or close goes through the :class:`Registry`.

Tenants (``tinker_server.tenants``): each key owns the sessions it creates and everything under
them (runs, futures, samplers, checkpoints; the key's tag is recorded always); with two or more
keys another key's ids are answered as unknown (``settings.tenants`` false: shared). Every key has
its own limits (``settings.max_runs_per_key``, ``settings.max_sampling_sessions_per_key``) and the
worker serves the keys round-robin.

Logging (python ``logging``, logger ``tinker_server.registry``): one INFO line per run created and
per run ended, naming the run and its owner's tag (never the key); each call's queue wait and run
time at DEBUG.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tinker_server import tenants
from tinker_server.checkpoints import CheckpointStore
from tinker_server.contract import LoraIn, RunFactory, Sampler, ServerSettings, TrainingRun, UserError
from tinker_server.futures import FuturesTable, OrderedWorker, Outcome, QueueClosed, SeqConflict, outcome_of_exception
from tinker_server.ids import check_model_id, check_session_id, parse_tinker_path

log = logging.getLogger(__name__)

_MAX_POLL_S = 40.0  # the SDK gives up on a retrieve_future after 45 s


class HttpError(Exception):
    """A refused request: status and message (the body is the SDK's error shape)."""

    def __init__(self, status: int, message: str, category: str = "user"):
        super().__init__(message)
        self.status = status
        self.category = category


@dataclass
class Session:
    """A ``ServiceClient`` session: its models and sampling sessions, and when it was last heard."""

    id: str
    user_metadata: dict | None
    display_name: str | None
    last_seen: float = field(default_factory=time.monotonic)
    finished: str | None = None  # the reason, once finished
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    owner: str = field(default_factory=tenants.current)  # its tenant (tinker_server.tenants)


@dataclass
class Model:
    """A training client's model: its LoRA settings and, once built on the worker, its run."""

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
class SamplerSession:
    """A sampling session: a base model, a sampler checkpoint path, or a run's snapshot."""

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


class Registry:
    """The server's state (one per app; ``app.state.tinker``)."""

    def __init__(self, settings: ServerSettings, factory: RunFactory):
        self.settings = settings
        self.factory = factory
        ownerless = tenants.owner_tag(settings.ownerless_runs_owner) if settings.ownerless_runs_owner else ""
        self.store = CheckpointStore(settings.state_dir, ownerless_owner=ownerless)
        self.store.clean_staging()  # what a killed server's saves left (before any save of this one runs)
        self.futures = FuturesTable()
        self.worker = OrderedWorker()
        self.lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplerSession] = {}
        self.base_samplers: dict[str, Sampler] = {}  # worker thread only
        self.path_samplers: collections.OrderedDict[tuple, Sampler] = collections.OrderedDict()  # worker only; LRU
        self._served: list[str] | None = None
        self.poll_s = min(float(settings.poll_timeout_s), _MAX_POLL_S)
        self.session_timeout_s = float(settings.session_timeout_s)
        self.snapshots_per_model = int(settings.snapshots_per_model)
        self.loaded_samplers = int(settings.extra.get("loaded_samplers", 4))

    # ------------------------------------------------------------------ lookups
    async def served_models(self) -> list[str]:
        """``factory.served_models()``, asked once, on the worker thread like every factory call."""
        if self._served is None:
            self._served = list(await asyncio.wrap_future(self.worker.call(self.factory.served_models)))
        return self._served

    async def check_base_model(self, base_model: str, field_name: str) -> None:
        """Refuse a base model this server does not serve, naming the ones it does."""
        served = await self.served_models()
        if base_model not in served:
            raise UserError(f"{field_name}: {base_model!r} is not served here; this server serves {served}")

    def session(self, session_id: object, field_name: str = "session_id") -> Session:
        """The caller's live session ``session_id`` (heard from now)."""
        check_session_id(session_id, field_name)
        found = self.sessions.get(session_id)  # type: ignore[arg-type]
        if found is None or not tenants.visible(found.owner):  # another tenant's session is unknown to this one
            raise HttpError(404, f"{field_name}: unknown session {session_id!r} (create one with ServiceClient)")
        if found.finished:
            raise UserError(f"{field_name}: session {session_id!r} is finished ({found.finished}); create a new ServiceClient")
        found.last_seen = time.monotonic()
        return found

    def model(self, model_id: object, field_name: str = "model_id") -> Model:
        """The caller's open model ``model_id`` (its session heard from now)."""
        check_model_id(model_id, field_name)
        found = self.models.get(model_id)  # type: ignore[arg-type]
        if found is None or not tenants.visible(found.owner):
            raise HttpError(404, f"{field_name}: unknown model {model_id!r} on this server")
        if found.closed:
            raise UserError(f"{field_name}: model {model_id!r} is closed ({found.closed})")
        self.session(found.session_id)
        found.last_request = time.time()
        return found

    def sampler_entry(self, sid: object) -> SamplerSession:
        """The caller's sampling session ``sid`` (its session, if any, heard from now)."""
        entry = self.samplers.get(sid) if isinstance(sid, str) else None
        if entry is None or not tenants.visible(entry.owner):
            raise HttpError(404, f"sampling_session_id: unknown sampler {sid!r} on this server")
        if entry.session_id is not None:
            self.session(entry.session_id, "sampling_session_id")
        return entry

    # ------------------------------------------------------------------ limits
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

    # ------------------------------------------------------------------ models
    def claim_model_id(self, session_id: object, model_seq_id: int) -> tuple[Session, str, str | None]:
        """The id of the caller's new model ``model_seq_id`` in session ``session_id`` (for
        create_model and create-from-state alike): ``(session, model_id, request_id)``, where
        ``request_id`` is the earlier request's when the SDK re-sent this one (answer it again).

        Raises:
            UserError: a negative ``model_seq_id``, or a model of that id exists already.
        """
        session = self.session(session_id)
        if model_seq_id < 0:
            raise UserError(f"model_seq_id: {model_seq_id} must be >= 0")
        model_id = f"{session.id}:train:{model_seq_id}"
        _, request_id = self.worker.claimed(model_id, 0)
        if request_id is None and model_id in self.models:
            raise UserError(f"model_seq_id: model {model_id} already exists")
        return session, model_id, request_id

    def register_model(self, session: Session, model_id: str, base_model: str, lora: LoraIn, user_metadata) -> Model:
        """A new model of ``session`` (within the run limits) and its ordered queue."""
        with self.lock:
            self.check_capacity()
            model = Model(model_id, session.id, base_model, lora, user_metadata, owner=session.owner)
            self.models[model_id] = model
            session.models.append(model_id)
        self.worker.open(model_id, ordered=True, owner=model.owner)
        return model

    def start_run(self, model: Model, load: Callable[[TrainingRun], None] | None = None) -> None:
        """Worker: create the run (and load a checkpoint into it); on failure the model is forgotten."""
        try:
            model.run = self.factory.create_run(model.base_model, model.lora)
            if load is not None:
                load(model.run)
            self.store.write_run(model.id, model.base_model, model.lora, model.user_metadata, owner=model.owner)
        except BaseException:
            self.close_model(model, "its creation failed")
            raise
        log.info("run %s created: %s, LoRA rank %d; owner %s", model.id, model.base_model, model.lora.rank, model.owner or "none")
        if model.closed:  # closed while being created: the close job may already have run
            self.close_run(model)

    def close_run(self, model: Model) -> None:
        """Close the model's run (worker thread; idempotent)."""
        run, model.run = model.run, None
        if run is not None:
            run.close()

    def close_model(self, model: Model, reason: str) -> concurrent.futures.Future:
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

    # ------------------------------------------------------------------ calls
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

    async def answer(self, key: str, work: Callable[[], object], what: str) -> object:
        """Run ``work`` on the worker in ``key``'s queue (its turn among the tenants, as
        :meth:`submit`'s calls) and await its result: for the endpoints that answer in the
        response (``/oai/api/v1``) instead of through a future. Raises what ``work`` raised, or a
        :class:`UserError` when the queue closed first."""
        try:
            return await asyncio.wrap_future(self.worker.call(work, key))
        except QueueClosed as e:
            raise UserError(f"{what}: {e}") from None

    async def sequenced(self, model_id: object, seq_id: int | None, what: str, prepare: Callable[[Model], object]) -> dict:
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

    # ------------------------------------------------------------------ samplers
    async def new_sampler_session(self, session_id: str | None, sid: str, base_model: str | None, model_path: str | None) -> SamplerSession:
        """A (new, unregistered) sampling session for a base model or a sampler checkpoint path."""
        if model_path is not None:
            ref = parse_tinker_path(model_path, "model_path")
            self.store.check_owned(ref, "model_path")
            if ref.kind != "sampler_weights":
                raise UserError(
                    f"model_path: {model_path} is a training state; sample from save_weights_for_sampler weights (tinker://.../sampler_weights/...)"
                )
            meta = self.store.read(ref, "model_path")
            if base_model is not None and base_model != meta["base_model"]:
                raise UserError(f"base_model: {base_model!r} differs from the checkpoint's base model {meta['base_model']!r}")
            return SamplerSession(sid, session_id, meta["base_model"], model_path=model_path)
        if base_model is None:
            raise UserError("create_sampling_session: give model_path or base_model")
        await self.check_base_model(base_model, "base_model")
        return SamplerSession(sid, session_id, base_model)

    async def direct_sampler(self, base_model: str | None, model_path: str | None) -> SamplerSession:
        """The sampler of a request that names its weights itself (``asample`` without a session,
        ``/oai/api/v1``): one per tenant and base model or path, registered on first use."""
        key = f"direct:{tenants.current()}:{model_path or base_model}"
        entry = self.samplers.get(key)
        if entry is None:
            entry = self.register_sampler(await self.new_sampler_session(None, key, base_model, model_path))
        if entry.gone:
            raise UserError(f"sampling_session_id: {entry.id} can no longer sample: {entry.gone}")
        return entry

    def register_sampler(self, entry: SamplerSession) -> SamplerSession:
        """Register ``entry`` (or return the one registered under its id first) and its queue."""
        with self.lock:
            existing = self.samplers.setdefault(entry.id, entry)
            if existing is entry and entry.session_id is not None:
                self.sessions[entry.session_id].samplers.append(entry.id)
        self.worker.open(existing.id, ordered=False, owner=existing.owner)
        return existing

    def add_snapshot(self, model: Model, entry: SamplerSession) -> None:
        """Register a snapshot sampler; past ``snapshots_per_model`` the least recently used of
        the model's snapshots are dropped (``model.snapshots`` is kept in order of last use:
        :meth:`touch_snapshot`)."""
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
        n = self.snapshots_per_model
        for sid in evicted:
            self.drop_sampler(
                sid,
                f"it was the least recently used of the {n} sampling snapshots {model.id} keeps (server.snapshots_per_model = {n}) "
                "when a newer one was taken; fix: raise server.snapshots_per_model, or save named weights "
                "(save_weights_for_sampler with a name) for a sampler kept on disk",
            )

    def touch_snapshot(self, entry: SamplerSession) -> None:
        """A request sampled or scored with ``entry``: if it is a run's snapshot, it becomes that
        run's most recently used (the last to be evicted)."""
        if entry.model_id is None:
            return
        with self.lock:
            model = self.models.get(entry.model_id)
            if model is not None and entry.id in model.snapshots:
                model.snapshots.remove(entry.id)
                model.snapshots.append(entry.id)

    def sampler_of(self, entry: SamplerSession) -> Sampler:
        """Worker: the sampler of a sampling session, loaded on first use."""
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

    def drop_sampler(self, sampler_id: str, reason: str) -> None:
        """The sampling session can no longer sample (``reason``); its sampler is freed on the worker."""
        entry = self.samplers.get(sampler_id)
        if entry is not None and entry.gone is None:
            entry.gone = reason
            self.worker.close(sampler_id, f"sampler {sampler_id} is gone ({reason})")

            def free() -> None:  # on the worker, after any sample in flight
                entry.sampler = None

            self.worker.call(free)

    # ------------------------------------------------------------------ sessions
    async def finish_session(self, session: Session, reason: str) -> None:
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
        """Finish every session, close the factory, stop the worker."""
        for session in list(self.sessions.values()):
            await self.finish_session(session, "the server stopped")
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.worker.call(self.factory.close)), 300)
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.exception("closing the run factory failed")
        await asyncio.to_thread(self.worker.stop)
