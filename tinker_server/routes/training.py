"""Training models and their calls: ``create_model``, ``get_info``, ``forward_backward`` (and
``forward``), ``optim_step``, ``unload_model``. Each call but ``get_info`` is a future, run on the
worker in the model's ``seq_id`` order (``Registry.sequenced``)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from fastapi import APIRouter, Request

from tinker_server import proto, wire
from tinker_server.contract import UserError
from tinker_server.datums import check_loss_request
from tinker_server.futures import Outcome, outcome_of_exception
from tinker_server.guard import decompress, read_json
from tinker_server.registry import Model
from tinker_server.routes import Server

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(request: Request, server: Server):
    req = wire.parse(wire.CreateModelIn, await read_json(request, "create_model"), "create_model")
    session, model_id, resent = server.claim_model_id(req.session_id, req.model_seq_id)
    if resent is not None:
        return {"request_id": resent, "model_id": model_id}  # a re-sent create
    lora = wire.lora_from_wire(req.lora_config)
    wire.check_optimizer_config(req.optimizer_config, "optimizer_config")
    await server.check_base_model(req.base_model, "base_model")
    model = server.register_model(session, model_id, req.base_model, lora, req.user_metadata)

    def work() -> Outcome:
        server.start_run(model)
        return Outcome.json({"model_id": model_id, "type": "create_model"})

    return server.submit(model_id, 0, work, "create_model", model_id=model_id)


@router.post("/get_info")
async def get_info(request: Request, server: Server):
    req = wire.parse(wire.ModelIdIn, await read_json(request, "get_info"), "get_info")
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


@router.post("/forward_backward")
async def forward_backward(request: Request, server: Server):
    if "json" in request.headers.get("content-type", ""):
        raise UserError("forward_backward: send a protobuf body (tinker SDK >= 0.38); JSON forward_backward is not supported")
    body = await request.body()
    encoding = request.headers.get("content-encoding", "identity")
    max_bytes = server.settings.max_body_bytes
    if encoding == "zstd":
        body = await asyncio.to_thread(decompress, body, max_bytes)
    elif encoding != "identity":
        raise UserError(f"Content-Encoding: {encoding!r} is not supported (identity or zstd)")
    msg = await asyncio.to_thread(proto.parse_forward_backward, body)

    async def prepare(model: Model):
        # Converting many datums takes a while: off the event loop.
        fb = await asyncio.to_thread(proto.forward_backward_from_proto, msg, max_bytes)

        def work() -> Outcome:
            # The loss's values (config and per-token thresholds) are checked here, once, before
            # the run is touched (and before a Ray run fans the call out), failing the future: a
            # 400 could stop the SDK sending the call's other chunks, whose seq_ids would then
            # hold every later request of the model.
            check_loss_request(fb.loss_fn, fb.loss_fn_config, fb.datums)
            out = model.run.forward_backward(fb.datums, fb.loss_fn, fb.loss_fn_config, fb.forward_only)
            return Outcome(proto.forward_backward_to_proto(out, len(fb.datums)), proto.PROTO)

        return work

    return await server.sequenced(msg.model_id, msg.seq_id, "forward" if msg.forward_only else "forward_backward", prepare)


@router.post("/optim_step")
async def optim_step(request: Request, server: Server):
    data = await read_json(request, "optim_step")

    def prepare(model: Model):
        adam = wire.adam_from_wire(wire.parse(wire.OptimStepIn, data, "optim_step"))
        return lambda: Outcome.json({"metrics": {str(k): float(v) for k, v in model.run.optim_step(adam).items()}})

    return await server.sequenced(data.get("model_id"), data.get("seq_id"), "optim_step", prepare)


@router.post("/unload_model")
async def unload_model(request: Request, server: Server):
    req = wire.parse(wire.ModelIdIn, await read_json(request, "unload_model"), "unload_model")
    model = server.model(req.model_id)
    request_id = server.futures.create(started=True)  # the close is under way at once: not cancellable
    closing = server.close_model(model, "unloaded by the client")

    def done(future: concurrent.futures.Future) -> None:
        error = future.exception()
        outcome = outcome_of_exception(error, "unload_model") if error else Outcome.json({"model_id": model.id, "type": "unload_model"})
        server.futures.complete(request_id, outcome)

    closing.add_done_callback(done)
    return {"request_id": request_id, "model_id": model.id}
