"""The REST side of checkpoints: ``training_runs``, ``training_runs/{id}``,
``training_runs/{id}/checkpoints``, ``DELETE training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}``,
``checkpoints`` and ``weights_info``. Each key lists and reaches only its own runs' records
(``tinker_server.tenants``); a damaged or ownerless record is skipped in listings, logged."""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Request

from tinker_server import tenants, wire
from tinker_server.guard import read_json
from tinker_server.ids import CheckpointRef, check_model_id, parse_tinker_path
from tinker_server.registry import HttpError, Registry
from tinker_server.routes import Server

router = APIRouter(prefix="/api/v1")


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat()


def _checkpoint_json(server: Registry, ref: CheckpointRef, meta: dict) -> dict:
    return {
        "checkpoint_id": ref.checkpoint_id,
        "checkpoint_type": ref.checkpoint_type,
        "time": _iso(meta.get("created", 0.0)),
        "tinker_path": ref.tinker_path,
        "size_bytes": server.store.size_bytes(ref),
        "public": False,
        "user_metadata": meta.get("user_metadata"),
        "expires_at": _iso(meta.get("expires_at")),
    }


def _run_json(server: Registry, model_id: str, record: dict | None = None) -> dict:
    record = record or server.store.owned_run(model_id)
    if record is None:
        raise HttpError(404, f"training_run_id: unknown training run {model_id!r} on this server")
    checkpoints = server.store.list(model_id)
    last = {
        kind: next((_checkpoint_json(server, r, m) for r, m in reversed(checkpoints) if r.kind == kind), None)
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


@router.get("/training_runs")
async def training_runs(server: Server, limit: int = 20, offset: int = 0):
    runs = server.store.visible_runs()  # (a damaged or ownerless record is skipped, logged)
    return {
        "training_runs": [_run_json(server, m, record) for m, record in runs[offset : offset + limit]],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
    }


@router.get("/training_runs/{model_id}")
async def training_run(model_id: str, server: Server):
    return _run_json(server, check_model_id(model_id, "training_run_id"))


@router.get("/training_runs/{model_id}/checkpoints")
async def checkpoints(model_id: str, server: Server):
    store = server.store
    check_model_id(model_id, "training_run_id")
    found = store.list(model_id)
    if store.read_run(model_id) is None:
        if found and tenants.is_enforced():
            store.refuse_ownerless(model_id, "training_run_id")  # checkpoints whose run record is gone
    elif store.owned_run(model_id) is None:
        raise HttpError(404, f"training_run_id: unknown training run {model_id!r} on this server")
    return {"checkpoints": [_checkpoint_json(server, r, m) for r, m in found]}


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(model_id: str, kind: str, name: str, server: Server):
    ref = parse_tinker_path(f"tinker://{model_id}/{kind}/{name}", "checkpoint_id")
    server.store.check_owned(ref, "checkpoint_id")
    server.store.delete(ref)
    return {}


@router.get("/checkpoints")
async def all_checkpoints(server: Server, limit: int = 100, offset: int = 0):
    store = server.store
    found = [_checkpoint_json(server, r, m) for model_id, _ in store.visible_runs() for r, m in store.list(model_id)]
    return {"checkpoints": found[offset : offset + limit], "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}


@router.post("/weights_info")
async def weights_info(request: Request, server: Server):
    req = wire.parse(wire.WeightsInfoIn, await read_json(request, "weights_info"), "weights_info")
    ref = parse_tinker_path(req.tinker_path, "tinker_path")
    server.store.check_owned(ref, "tinker_path")
    meta = server.store.read(ref, "tinker_path")
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
