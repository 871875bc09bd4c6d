"""FSDP checkpoint contents: ``torch.distributed.checkpoint`` (DCP) shards of
``{"model", "optimizer"}`` plus per-rank ``extra_rank<r>.pt`` (scheduler, RNG, step), written
inside the shared directory protocol of ``engine_api.ckpt_layout`` (temp dir, atomic rename,
``latest`` marker, retention, remote copy)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from engine_api.kit import ckpt_layout

BACKEND = "fsdp"  # recorded in enginekit.json


def _options(lora: dict) -> StateDictOptions:
    # LoRA: the frozen base is the HF directory the engine loads at init; the checkpoint holds
    # only what training changes (the adapters, a trained head copy) and their optimizer state.
    # Loading then sets only those keys (not strict about the frozen rest); dcp.load itself
    # fails if a trainable key is missing from the checkpoint.
    return StateDictOptions(ignore_frozen_params=bool(lora), strict=not lora)


@contextlib.contextmanager
def _grads_set_aside(optimizer) -> Iterator[None]:
    """While an optimizer that never stepped is in the block, its parameters hold no gradients;
    they are put back after. torch's ``get_state_dict`` / ``set_state_dict`` initialise such an
    optimizer's state (``_init_optim_state``: one step at lr 0 on zero gradients) only when no
    parameter has a gradient, and skip it silently otherwise. With gradients pending (a
    ``forward_backward`` before the first step) a save then wrote no optimizer state at all,
    while the fresh engine that loads it expects every key (DCP: "Missing key in checkpoint
    state_dict: optimizer.state...step"); and a load into such an engine read no moments. Set
    aside, both sides always see the same keys. A stepped optimizer: nothing to do."""
    if optimizer is None or optimizer.state:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def _state(model, optimizer, lora: dict) -> dict:
    """``{"model", "optimizer"}`` state dicts as DCP saves and loads them. With LoRA only the
    trainable parameters: torch's ``ignore_frozen_params`` drops a frozen parameter under its
    first name only, so a tied LM head (Qwen2, Llama-3.2: ``lm_head.weight`` is the frozen
    ``embed_tokens.weight``) would otherwise be saved in full under its second name. The
    optimizer's state is always there, gradients pending or not (:func:`_grads_set_aside`)."""
    with _grads_set_aside(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(lora))
    if lora:
        frozen = _frozen(model)
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
    return {"model": model_sd, "optimizer": optim_sd}


def _frozen(model) -> set[str]:
    """Every name of every frozen parameter (a tied weight has two)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _model_shapes(model, lora: dict) -> dict[str, tuple[int, ...]]:
    """DCP key -> global shape of the model tensors :func:`_state` saves and loads, read from
    ``model.state_dict()`` (``get_state_dict`` would first initialise an optimizer that never
    stepped: a change to the engine before a load that may yet be refused)."""
    frozen = _frozen(model) if lora else set()
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and k not in frozen}


def save(model, optimizer, extra: dict, root: str, step: int, keep: int | None, remote: str | None, lora: dict | None = None) -> str:
    """Save model + optimizer (sharded, DCP) and ``extra`` (per rank). With LoRA (``lora``: the
    settings a resume must match, recorded in ``enginekit.json``) only the trainable
    parameters. Collective.

    Raises:
        CheckpointError: writing failed (a full disk: named, with the fix); the incomplete save
            is removed and earlier checkpoints are intact.
    """
    lora = lora or {}
    # torch's get_state_dict gives an optimizer that never stepped its state by running one step
    # at lr 0: AdamW's step counter becomes 1 and every later update would use the wrong bias
    # correction. A save must not change training: that state is saved (DCP needs the keys)
    # and then dropped again, and the checkpoint records that it is not a real one.
    stepped = optimizer is None or bool(optimizer.state)
    tmp = ckpt_layout.begin(root, step)
    try:
        with ckpt_layout.writing(tmp):
            dcp.save(_state(model, optimizer, lora), checkpoint_id=tmp)
            ckpt_layout.save_extra(tmp, extra)
    finally:
        if not stepped:
            optimizer.state.clear()
    return ckpt_layout.commit(root, step, keep, remote, {"backend": BACKEND, "lora": lora, "optimizer_stepped": stepped})


def load(
    model, optimizer, local_path: str, remote: str | None, del_local_after_load: bool, verify: bool = True, lora: dict | None = None
) -> dict:
    """Load into ``model``/``optimizer`` in place; return this rank's ``extra``. Collective.

    ``local_path`` without a complete checkpoint: ``remote`` is downloaded into it first, and
    deleted after loading when ``del_local_after_load`` (else kept as a local checkpoint).
    The checkpoint is verified first (``ckpt_layout.open_checkpoint``; ``verify``: with
    sha256). DCP reshards: a checkpoint saved on a different number of ranks loads too
    (``ckpt_layout.load_extra`` says what happens to the RNG streams).

    Raises:
        CorruptCheckpointError: verification failed; nothing was loaded.
        ValueError: the checkpoint was written by another backend, with other LoRA settings, or
            for another model (a tensor's shape differs: named with both shapes); nothing was loaded.
        CheckpointError: the load itself failed (naming the checkpoint).
    """
    path, downloaded, info = ckpt_layout.open_checkpoint(local_path, remote, not del_local_after_load, verify)
    if info.get("backend") != BACKEND:
        ckpt_layout.finish_load(downloaded)
        raise ValueError(f"checkpoint {path} was written by backend {info.get('backend')!r}; fix: load it with that engine.strategy")
    lora = lora or {}
    problem = ckpt_layout.lora_mismatch(info.get("lora") or {}, lora)
    if problem:
        ckpt_layout.finish_load(downloaded)
        raise ValueError(f"checkpoint {path} was {problem}")
    options = _options(lora)
    try:  # another model's checkpoint: refused by name before DCP's opaque size error, state untouched
        ckpt_layout.check_shapes(path, _model_shapes(model, lora))
    except ValueError:
        ckpt_layout.finish_load(downloaded)
        raise
    stepped = info.get("optimizer_stepped", True)
    with ckpt_layout.reading(path):
        state = _state(model, optimizer, lora)
        if optimizer is not None and not stepped:
            # Saved before the first step (see save()): its optimizer state is the lr-0 dummy,
            # dropped here anyway, and a checkpoint written with gradients pending by an earlier
            # version holds none; only the parameter groups (the hyperparameters) are read.
            state["optimizer"] = {"param_groups": state["optimizer"]["param_groups"]}
        dcp.load(state, checkpoint_id=path)
        optim_sd = state["optimizer"] if stepped or optimizer is None else {"state": {}, **state["optimizer"]}
        with _grads_set_aside(optimizer):
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd, options=options)
        if optimizer is not None and not stepped:
            optimizer.state.clear()
    extra = ckpt_layout.load_extra(path, info)
    ckpt_layout.finish_load(downloaded)
    return extra
