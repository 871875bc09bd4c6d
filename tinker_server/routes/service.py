"""Client setup, sessions and futures: ``healthz``, ``client/config``, ``client/dynamic_config``,
``get_server_capabilities``, ``telemetry``, ``create_session``, ``session_heartbeat``,
``sessions/{id}/finish``, ``sessions``, ``sessions/{id}``, ``retrieve_future``, ``cancel_future``,
and the endpoints refused by name (``create_custom_loss``, ``save_weights_external``,
``copy_weights``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tinker_server import tenants, wire
from tinker_server.contract import ServerSettings, UserError
from tinker_server.futures import Outcome
from tinker_server.guard import read_json
from tinker_server.ids import check_session_id
from tinker_server.registry import HttpError, Registry, Session
from tinker_server.routes import Server

router = APIRouter(prefix="/api/v1")


def client_config(settings: ServerSettings) -> dict:
    """The SDK's feature flags for this server (``settings.extra["client_config"]`` overrides)."""
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


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.post("/client/config")
async def client_config_route(server: Server):
    return client_config(server.settings)


@router.post("/client/dynamic_config")
async def client_dynamic_config():
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/get_server_capabilities")
async def capabilities(server: Server):
    served = await server.served_models()
    return {"supported_models": [{"model_name": m, "trainable": True, "sampleable": True} for m in served]}


@router.post("/telemetry")
async def telemetry():
    return {"status": "accepted"}


@router.post("/create_session")
async def create_session(request: Request, server: Server):
    req = wire.parse(wire.CreateSessionIn, await read_json(request, "create_session"), "create_session")
    session = Session(uuid.uuid4().hex[:16], req.user_metadata, req.display_name)
    server.sessions[session.id] = session
    return {"type": "create_session", "session_id": session.id}


def _visible_session(server: Registry, session_id: str) -> Session:
    """The caller's session ``session_id``, finished or not (404 if unknown to it)."""
    session = server.sessions.get(session_id)
    if session is None or not tenants.visible(session.owner):
        raise HttpError(404, f"session_id: unknown session {session_id!r}")
    return session


@router.post("/session_heartbeat")
async def heartbeat(request: Request, server: Server):
    req = wire.parse(wire.SessionIdIn, await read_json(request, "session_heartbeat"), "session_heartbeat")
    session = _visible_session(server, req.session_id)
    if session.finished:
        raise HttpError(410, f"session_id: session {req.session_id!r} is finished ({session.finished})")
    session.last_seen = time.monotonic()
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish(session_id: str, request: Request, server: Server):
    data = await read_json(request, "finish")
    check_session_id(session_id, "session_id")
    session = _visible_session(server, session_id)
    reason = data.get("reason")
    status = reason.get("type", "finished") if isinstance(reason, dict) else "finished"
    await server.finish_session(session, f"closed by the client: {status}")
    return {}


@router.get("/sessions")
async def list_sessions(server: Server, limit: int = 20, offset: int = 0):
    ids = [s.id for s in server.sessions.values() if not s.finished and tenants.visible(s.owner)]
    return {"sessions": ids[offset : offset + limit]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, server: Server):
    session = _visible_session(server, session_id)
    return {
        "training_run_ids": session.models,
        "sampler_ids": session.samplers,
        "user_metadata": session.user_metadata,
        "display_name": session.display_name,
    }


@router.post("/retrieve_future")
async def retrieve_future(request: Request, server: Server):
    req = wire.parse(wire.RetrieveFutureIn, await read_json(request, "retrieve_future"), "retrieve_future")
    try:
        outcome = await server.futures.wait(req.request_id, server.poll_s)
    except KeyError:
        raise HttpError(410, f"request_id: {req.request_id!r} is unknown or expired on this server (was it restarted?)") from None
    if outcome is None:
        return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
    return Response(outcome.body, media_type=outcome.media_type)


@router.post("/cancel_future")
async def cancel_future(request: Request, server: Server):
    req = wire.parse(wire.RequestIdIn, await read_json(request, "cancel_future"), "cancel_future")
    unknown = HttpError(404, f"request_id: {req.request_id!r} is unknown or expired on this server")
    if not server.futures.known(req.request_id):
        raise unknown
    # A call not started yet never runs (its future fails as cancelled). A started one cannot be
    # undone (its gradients are in the run): refused, and its future keeps the real outcome.
    answer = server.futures.cancel(req.request_id, Outcome.failed(f"request {req.request_id} was cancelled by the client", "user"))
    if answer == "unknown":
        raise unknown
    if answer != "cancelled":
        now = "has already started" if answer == "started" else "has already finished"
        raise UserError(
            f"cancel_future: request {req.request_id} {now} and cannot be cancelled: a started call runs to its end and "
            "keeps its effect (a forward_backward's gradients reach the next optim_step); its future holds its real "
            "outcome; fix: retrieve it with retrieve_future instead of sending the call again"
        )
    return {}


def _refuse(path: str, why: str) -> Callable[[], Awaitable[None]]:
    async def refused():
        raise UserError(f"{path}: refused: {why}")

    return refused


REFUSED = {
    "create_custom_loss": wire.REFUSED_LOSSES["custom"],
    "save_weights_external": "external (Hugging Face) exports are not supported; use save_state / save_weights_for_sampler",
    "copy_weights": "there are no projects or accounts on this server to copy weights between",
}
for _path, _why in REFUSED.items():
    router.post(f"/{_path}")(_refuse(_path, _why))
