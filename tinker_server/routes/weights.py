"""Saving and loading a model's weights: ``save_weights`` (``tinker://{model_id}/weights/{name}``:
weights and optimizer), ``save_weights_for_sampler`` (named: ``tinker://{model_id}/sampler_weights/{name}``;
unnamed: a sampling session of the current weights), and ``load_weights``, into a model
(``model_id`` + ``seq_id``) or as a new model from the checkpoint (``session_id`` + ``model_seq_id``:
its base model and LoRA config, then the load). Every save goes through a staging directory that is
swapped into place (``CheckpointStore.begin`` / ``commit``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Request

from tinker_server import wire
from tinker_server.checkpoints import CheckpointStore
from tinker_server.contract import LoraIn, UserError
from tinker_server.futures import Outcome
from tinker_server.guard import read_json
from tinker_server.ids import CheckpointRef, check_name, parse_tinker_path
from tinker_server.registry import Model, Registry, SamplerSession
from tinker_server.routes import Server

router = APIRouter(prefix="/api/v1")


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


def _save(
    store: CheckpointStore, ref: CheckpointRef, model: Model, overwrite: bool, write: Callable[[Path], object], user_metadata, ttl_seconds
) -> None:
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


@router.post("/save_weights")
async def save_weights(request: Request, server: Server):
    data = await read_json(request, "save_weights")
    store = server.store

    def prepare(model: Model):
        req = wire.parse(wire.SaveWeightsIn, data, "save_weights")
        wire.check_ttl(req.ttl_seconds)
        ref = CheckpointRef(model.id, "weights", check_name(req.path or f"state-{req.seq_id:06d}", "path"))
        _check_free(store, ref, req.overwrite)

        def work() -> Outcome:
            _save(store, ref, model, req.overwrite, lambda d: model.run.save_state(d, True), req.user_metadata, req.ttl_seconds)
            return Outcome.json({"path": ref.tinker_path, "type": "save_weights"})

        return work

    return await server.sequenced(data.get("model_id"), data.get("seq_id"), "save_weights", prepare)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, server: Server):
    data = await read_json(request, "save_weights_for_sampler")
    return await server.sequenced(
        data.get("model_id"), data.get("seq_id"), "save_weights_for_sampler", lambda model: _prepare_sampler_save(server, model, data)
    )


def _prepare_sampler_save(server: Registry, model: Model, data: dict) -> Callable[[], Outcome]:
    """The work of a ``save_weights_for_sampler`` request (checked first): named, the run writes
    sampler weights that ``factory.load_sampler`` serves later; unnamed, a snapshot sampler."""
    req = wire.parse(wire.SaveWeightsForSamplerIn, data, "save_weights_for_sampler")
    wire.check_ttl(req.ttl_seconds)
    if req.kind not in ("snapshot", "inflight"):
        raise UserError(f"kind: {req.kind!r} is not 'snapshot' or 'inflight'")
    if req.path is not None:
        ref = CheckpointRef(model.id, "sampler_weights", check_name(req.path, "path"))
        _check_free(server.store, ref, False)

        def save_named() -> Outcome:
            _save(server.store, ref, model, False, lambda d: model.run.sampler(d), req.user_metadata, req.ttl_seconds)
            return Outcome.json({"path": ref.tinker_path, "type": "save_weights_for_sampler"})

        return save_named
    if req.sampling_session_seq_id is None:
        raise UserError("save_weights_for_sampler: give a path (name) or a sampling_session_seq_id")
    # "inflight" samplers may adopt newer weights; a snapshot of the current ones satisfies that.
    sid = f"{model.session_id}:sample:{req.sampling_session_seq_id}"
    if sid in server.samplers:
        raise UserError(f"sampling_session_seq_id: {req.sampling_session_seq_id} was already used in this session")

    def snapshot() -> Outcome:
        entry = SamplerSession(
            sid, model.session_id, model.base_model, model_id=model.id, sampler=model.run.sampler(None), owner=model.owner
        )
        server.add_snapshot(model, entry)
        return Outcome.json({"sampling_session_id": sid, "type": "save_weights_for_sampler"})

    return snapshot


@router.post("/load_weights")
async def load_weights(request: Request, server: Server):
    data = await read_json(request, "load_weights")
    if data.get("model_id") is not None:
        return await server.sequenced(
            data.get("model_id"), data.get("seq_id"), "load_weights", lambda model: _prepare_load(server, model, data)
        )
    return await _create_from_state(server, data)


def _training_checkpoint(store: CheckpointStore, path: str) -> tuple[CheckpointRef, dict]:
    ref = parse_tinker_path(path, "path")
    store.check_owned(ref, "path")
    if ref.kind != "weights":
        raise UserError(
            f"path: {path} holds sampler weights; loading a training state needs a save_state checkpoint (tinker://.../weights/...)"
        )
    return ref, store.read(ref, "path")


def _targets(lora: LoraIn) -> str:
    """The layers a run's adapters are on, by its toggles (the modules each selects: signature.lora_modules)."""
    toggles = (
        ("train_attn", lora.train_attn, "the attention projections"),
        ("train_mlp", lora.train_mlp, "the MLP projections"),
        ("train_unembed", lora.train_unembed, "lm_head"),
    )
    on = " and ".join(what for _, flag, what in toggles if flag) or "no layer"
    return f"{on} ({', '.join(f'{name}={flag}' for name, flag, _ in toggles)})"


def _prepare_load(server: Registry, model: Model, data: dict) -> Callable[[], Outcome]:
    """The work of a load into ``model`` (the checkpoint checked against the run first)."""
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


async def _create_from_state(server: Registry, data: dict) -> dict:
    """A new model from a training checkpoint (its base model and LoRA config), then the load."""
    req = wire.parse(wire.LoadWeightsIn, data, "load_weights")
    if req.session_id is None or req.model_seq_id is None:
        raise UserError(
            "load_weights: give model_id and seq_id (load into a model) or session_id and model_seq_id (a new model from the checkpoint)"
        )
    session, model_id, resent = server.claim_model_id(req.session_id, req.model_seq_id)
    if resent is not None:
        return {"request_id": resent, "model_id": model_id}
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
    model = server.register_model(session, model_id, base_model, meta["lora"], req.user_metadata)
    directory = server.store.directory(ref)

    def work() -> Outcome:
        server.start_run(model, load=lambda run: run.load_state(directory, req.optimizer))
        return Outcome.json({"path": req.path, "model_id": model_id, "type": "load_weights"})

    return server.submit(model_id, 0, work, "load_weights", model_id=model_id)
