"""The gateway's HTTP server: an OpenAI-compatible API on localhost while an RL run trains, one
URL per session (``/sessions/{id}/v1``), served by a uvicorn thread of the trainer's rank 0.

Routes: ``POST /sessions/{id}/v1/chat/completions`` (``posttrain.gateway.wire``),
``GET /v1/models`` and ``GET /sessions/{id}/v1/models``. A session id that does not exist (or
belongs to a trajectory that has ended) is answered 404 / 409; a body past
``agent.max_body_bytes`` 413; a second call of a session while one is in flight 409 (a session is
one trajectory: its calls are sequential). Every refusal is an OpenAI-style error and the run
goes on.

A call waits for its session's allowance: the asynchronous pipeline lets each session make a
number of calls per round (its budget spread over the steps, as environments' turns are), so a
call past it is held until the next round, after the weight update (the agent sees a slow
answer, never an error).
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from posttrain.agents.scheduler import CallScheduler, RoundFailed
from posttrain.gateway.session import Session
from posttrain.gateway.wire import WireError, models, parse_request, stream_chunks

MAX_ENDED = 100_000


class SessionRun:
    """A session and its place in the run: its allowance of calls this round, whether it counts
    as running in the round's scheduler, and how its agent ended."""

    def __init__(self, session: Session, base_url: str, order: tuple = ()) -> None:
        self.session, self.base_url, self.order = session, base_url, order  # order: its calls' place in a rollout call
        self.allowance: int | None = 0  # calls left this round; None: no limit (synchronous runs)
        self.running = False  # counted in the round's scheduler as able to call
        self.finished = False
        self.outcome = None
        self.launched = False
        self.scheduler: CallScheduler | None = None
        self._cond = threading.Condition()
        self._busy = threading.Lock()

    # ------------------------------------------------------------------ the round's side
    def grant(self, units: int | None, scheduler: CallScheduler) -> bool:
        """``units`` more calls this round (None: any number); whether it runs in ``scheduler``'s round."""
        with self._cond:
            if self.finished:
                return False
            self.scheduler = scheduler
            if units is None:
                self.allowance = None
            elif self.allowance is not None:
                self.allowance += units
            if not self.running and self.allowance != 0:
                self.running = True
                scheduler.started()
            self._cond.notify_all()
            return self.running

    def end(self, outcome) -> None:
        """Its agent ended (``outcome``); a waiting call is refused."""
        with self._cond:
            if self.finished:
                return
            self.finished, self.outcome = True, outcome
            self._stop_running()
            self._cond.notify_all()

    def _stop_running(self) -> None:
        if self.running:
            self.running = False
            self.scheduler.ended()

    # ------------------------------------------------------------------ the agent's side
    def call(self, body: object) -> tuple[dict[str, Any], Any]:
        """One chat completion: ``(answer, request)``; blocks for the allowance and the sample.

        Raises:
            WireError: refused (the session is unchanged but for what the refusal says).
        """
        req = parse_request(body)
        if not self._busy.acquire(blocking=False):
            raise WireError("a call of this session is in flight: a session is one trajectory, its calls come one at a time", 409)
        try:
            with self._cond:
                while not self.finished and self.allowance == 0:
                    self._cond.wait()
                if self.finished:
                    raise WireError(f"session {self.session.id} has ended", 409)
                scheduler = self.scheduler
            ids, seed, amount, stop = self.session.prepare(req)
            try:
                sample = scheduler.sample(ids, seed, amount, stop, order=self.order)
            except RoundFailed as exc:
                raise WireError(f"the rollout stopped ({exc})", 500) from None
            answer = self.session.accept(req, sample, len(ids))
            with self._cond:
                if self.allowance is not None:
                    self.allowance -= 1
                    if self.allowance == 0:
                        self._stop_running()  # paused at a call boundary until the next round
            return answer, req
        finally:
            self._busy.release()


class Gateway:
    """The server and its sessions (module docstring).

    Args:
        host, port: ``agent.host`` / ``agent.port`` (0: a free port).
        max_body_bytes: ``agent.max_body_bytes``.
        model_name: ``agent.model_name``.
        threads: calls served at once (the sessions that can call at once).
    """

    def __init__(self, host: str, port: int, max_body_bytes: int, model_name: str, threads: int) -> None:
        self.max_body_bytes, self.model_name = max_body_bytes, model_name
        self.sessions: dict[str, SessionRun] = {}
        # The ids of sessions whose batch was scored (their state freed), the latest MAX_ENDED:
        # a late call of one is told it ended (409) rather than that it never existed (404).
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="enginekit-gateway")
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = None
        self._thread: threading.Thread | None = None

    def url(self, session_id: str) -> str:
        """The ``base_url`` an agent of session ``session_id`` gets."""
        return f"http://{self.host}:{self.port}/sessions/{session_id}/v1"

    def retire(self, session_ids) -> None:
        """Forget the sessions ``session_ids`` (their batch was scored): their tokens are freed,
        and a later call of one is refused as ended."""
        for sid in session_ids:
            run = self.sessions.pop(sid, None)
            if run is not None:
                run.end(run.outcome)
            self.ended[sid] = None
        while len(self.ended) > MAX_ENDED:
            self.ended.popitem(last=False)

    def start(self) -> None:
        """Serve in a daemon thread; returns once it accepts connections."""
        import uvicorn

        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, name="enginekit-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"agent gateway: the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop serving (idempotent); sessions still waiting are ended by their producer first."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._sock.close()

    # ------------------------------------------------------------------ the app
    def _app(self):
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def error(exc: WireError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.get("/v1/models")
        @app.get("/sessions/{session_id}/v1/models")
        async def list_models(session_id: str | None = None):
            if session_id is not None and session_id not in self.sessions:
                return error(WireError(f"no session {session_id!r}", 404))
            return models(self.model_name)

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def chat(session_id: str, request: Request):
            run = self.sessions.get(session_id)
            if run is None and session_id in self.ended:
                return error(WireError(f"session {session_id} has ended: its trajectory was scored; fix: end the agent's episode", 409))
            if run is None:
                return error(WireError(f"no session {session_id!r} on this gateway; fix: the base_url the agent was given", 404))
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                return error(WireError(f"the body has {declared} bytes, above agent.max_body_bytes = {self.max_body_bytes}", 413))
            raw = await request.body()
            if len(raw) > self.max_body_bytes:
                return error(WireError(f"the body has {len(raw)} bytes, above agent.max_body_bytes = {self.max_body_bytes}", 413))
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return error(WireError(f"the body is not JSON ({exc})"))
            try:
                answer, req = await asyncio.get_running_loop().run_in_executor(self._executor, run.call, body)
            except WireError as exc:
                return error(exc)
            if req.stream:
                return StreamingResponse(iter(stream_chunks(answer, req.include_usage)), media_type="text/event-stream")
            return answer

        @app.post("/v1/chat/completions")
        async def no_session():
            return error(WireError("the gateway serves sessions: use the base_url the agent was given (/sessions/{id}/v1)", 404))

        return app
