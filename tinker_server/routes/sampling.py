"""Sampling: ``create_sampling_session`` (from ``base_model`` or a ``sampler_weights`` path; the
last ``loaded_samplers`` paths used stay loaded), ``samplers/{id}``, ``join_sampling_session``
(a clone id for an unpickled SamplingClient) and ``asample`` (JSON request, protobuf result;
``compute_logprobs`` is an asample with ``prompt_logprobs``; ``prompt_logprobs_last_n`` honoured)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tinker_server import proto, wire
from tinker_server.contract import UserError
from tinker_server.futures import Outcome
from tinker_server.guard import read_json
from tinker_server.routes import Server

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request, server: Server):
    req = wire.parse(wire.CreateSamplingSessionIn, await read_json(request, "create_sampling_session"), "create_sampling_session")
    session = server.session(req.session_id)
    sid = f"{session.id}:sample:{req.sampling_session_seq_id}"
    if sid not in server.samplers:
        server.check_sampling_sessions()
        entry = await server.new_sampler_session(session.id, sid, req.base_model, req.model_path)
        if sid not in server.samplers:  # (no await from here on: the check and the registration are one step)
            server.check_sampling_sessions()  # again: another request of this key may have opened one meanwhile
            entry.counted = True
            server.register_sampler(entry)
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, server: Server):
    entry = server.sampler_entry(sampler_id)
    return {"sampler_id": entry.id, "base_model": entry.base_model, "model_path": entry.model_path}


@router.post("/join_sampling_session")
async def join_sampling_session(request: Request, server: Server):
    req = wire.parse(wire.SamplingSessionIdIn, await read_json(request, "join_sampling_session"), "join_sampling_session")
    entry = server.sampler_entry(req.sampling_session_id)
    entry.clients += 1
    return {"type": "join_sampling_session", "client_counter": entry.clients}


@router.post("/asample")
async def asample(request: Request, server: Server):
    req = wire.parse(wire.SampleIn, await read_json(request, "asample"), "asample")
    wire.check_sample_features(req)
    wire.check_sample_limits(req, server.settings.max_sample_tokens, server.settings.max_num_samples)
    prompt = wire.tokens_from_chunks(req.prompt.chunks, "prompt.chunks")
    params = wire.sample_params_from_wire(req.sampling_params)
    want_lp = bool(req.prompt_logprobs)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and (not want_lp or not 1 <= last_n <= len(prompt) - 1):
        raise UserError(f"prompt_logprobs_last_n: {last_n} needs prompt_logprobs and 1 <= n <= {len(prompt) - 1} (the prompt's length - 1)")
    if req.sampling_session_id is not None:
        entry = server.sampler_entry(req.sampling_session_id)
        if entry.gone:
            raise UserError(f"sampling_session_id: {entry.id} can no longer sample: {entry.gone}")
        server.touch_snapshot(entry)  # eviction is by last use
    else:  # sampling without a session: one shared sampler per base model or path
        entry = await server.direct_sampler(req.base_model, req.model_path)

    def work() -> Outcome:
        out = server.sampler_of(entry).sample(prompt, req.num_samples, params, want_lp)
        return Outcome(proto.sample_to_proto(out, req.num_samples, len(prompt), want_lp, last_n), proto.PROTO)

    answer = server.submit(entry.id, None, work, "sample")
    answer["sample_sequence_ids"] = [f"{answer['request_id']}:{i}" for i in range(req.num_samples)]
    return answer
