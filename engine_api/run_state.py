"""One engine, many training runs: the state a training run owns on an engine whose other weights
(a LoRA run's frozen base) it shares, taken out (``BaseEngine.run_state``) and put back
(``BaseEngine.load_run_state``) so several runs take turns on one engine and each computes
exactly what it would on an engine of its own.

What a run owns, per rank (its own shards; nothing is collective), is what the engine declares in
``BaseEngine._run_owned_state`` (:class:`RunOwned`); this module reads nothing else of it:

* the trainable parameters (with LoRA: the adapters), their gradients (a ``None`` gradient kept
  as ``None``) and the backend's gradient buffers (``BaseEngine._grad_buffers``: megatron's
  ``main_grad``);
* every torch optimizer's parameters (the fp32 main copies of a mixed-precision optimizer), its
  per-parameter state (AdamW's moments and step) and each parameter group's hyperparameters;
* the engine attributes ``BaseEngine.run_state_attributes`` names (the step counter, the
  deferred-normalization window, the gradient-clipping setting, the broken flag), and the
  per-rank extra a checkpoint saves (LR scheduler, RNG streams).

Assumptions: the engine is between calls (no ``forward_backward_step`` running); the runs were
built with the same engine settings (the same trainable parameters in the same order, shapes
and shardings: checked, a mismatch raises before anything is changed); an optimizer creates a
parameter's state at its first step and never drops it (torch's and megatron's do): a run
that never stepped restores as zeroed state, which ``reset_optimizer_state`` documents to step
exactly as fresh state does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s local shard on the CPU (pinned when it lives on a GPU, so the copy back
    can overlap)."""
    local = _local(t).detach()
    if local.device.type == "cpu":
        return local.clone()
    out = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
    out.copy_(local, non_blocking=True)
    return out


@dataclass
class RunOwned:
    """What a training run owns on an engine, live: the engine's own tensors, optimizers and
    attribute values, not copies (``BaseEngine._run_owned_state`` gives it; :func:`capture`
    copies it out, :func:`restore` copies back into it).

    Attributes:
        trainable: the trainable parameters: their values and gradients.
        grad_buffers: gradient storage besides ``.grad`` (``BaseEngine._grad_buffers``).
        optimizers: the torch optimizers: their parameters, per-parameter state and groups.
        attributes: the engine attributes a run owns, by name (``BaseEngine.run_state_attributes``).
        extra: the per-rank extra of a checkpoint (``BaseEngine._checkpoint_extra``).
    """

    trainable: list[torch.Tensor]
    grad_buffers: list[torch.Tensor]
    optimizers: list[torch.optim.Optimizer]
    attributes: dict[str, Any]
    extra: dict[str, Any]


@dataclass
class RunState:
    """What ``BaseEngine.run_state`` took out (module docstring). Opaque to callers: load it
    back with ``BaseEngine.load_run_state`` on the engine it came from (or one built alike).

    Attributes:
        params: local copies of the trainable and optimizer parameters, in the engine's order.
        grads: each trainable parameter's gradient (None: none), then the gradient buffers.
        optim: per torch optimizer, per parameter: its state (tensors copied) or None.
        groups: per torch optimizer, per group: the hyperparameters (every key but ``params``).
        scalars: the engine attributes a run owns, by name (``global_step``, ``deferred``, ...).
        extra: the per-rank extra of a checkpoint (LR scheduler, RNG streams).
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    optim: list[list[dict[str, Any] | None]]
    groups: list[list[dict[str, Any]]]
    scalars: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Host memory this state holds (its tensors)."""
        tensors = [*self.params, *(g for g in self.grads if g is not None)]
        tensors += [v for per_opt in self.optim for s in per_opt if s for v in s.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _parameters(owned: RunOwned) -> list[torch.Tensor]:
    """The trainable parameters, then the optimizers' parameters that are other tensors (a
    mixed-precision optimizer's fp32 copies), each once, in a fixed order."""
    seen, out = set(), []
    for p in [*owned.trainable, *(q for opt in owned.optimizers for g in opt.param_groups for q in g["params"])]:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def capture(engine) -> RunState:
    """The engine's run state, copied to the host (``BaseEngine.run_state``)."""
    owned = engine._run_owned_state()
    params = _parameters(owned)
    grads: list[torch.Tensor | None] = [None if p.grad is None else _host_copy(p.grad) for p in owned.trainable]
    grads += [_host_copy(b) for b in owned.grad_buffers]
    optim, groups = [], []
    for opt in owned.optimizers:
        per = []
        for g in opt.param_groups:
            for p in g["params"]:
                state = opt.state.get(p)
                per.append(
                    None if not state else {k: _host_copy(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}
                )
        optim.append(per)
        groups.append([{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups])
    scalars = copy.deepcopy(owned.attributes)
    extra = copy.deepcopy(owned.extra)
    if any(t.device.type == "cuda" for t in params):
        torch.cuda.synchronize()  # the pinned copies are complete before anything changes the sources
    return RunState([_host_copy(p) for p in params], grads, optim, groups, scalars, extra)


def _check(owned: RunOwned, state: RunState) -> None:
    """Raise before anything changes when ``state`` does not fit the layout of the engine that
    owns ``owned``."""
    params = _parameters(owned)
    trainable, buffers = owned.trainable, owned.grad_buffers
    where = "load_run_state: the state was taken from an engine built otherwise"
    if len(params) != len(state.params) or len(trainable) + len(buffers) != len(state.grads):
        raise ValueError(
            f"{where} ({len(state.params)} parameters, {len(state.grads)} gradient slots; this engine has {len(params)} and "
            f"{len(trainable) + len(buffers)}); fix: load a run's state into an engine built with the same settings"
        )
    for i, (p, saved) in enumerate(zip(params, state.params, strict=True)):
        if tuple(_local(p).shape) != tuple(saved.shape) or _local(p).dtype != saved.dtype:
            raise ValueError(
                f"{where}: parameter {i} is {tuple(saved.shape)} {saved.dtype} in the state and {tuple(_local(p).shape)} "
                f"{_local(p).dtype} here; fix: the same model, LoRA rank and targets, and sharding"
            )
    opts = owned.optimizers
    if len(opts) != len(state.optim) or any(
        len(per) != sum(len(g["params"]) for g in opt.param_groups) for opt, per in zip(opts, state.optim, strict=True)
    ):
        raise ValueError(f"{where}: its optimizer holds other parameters; fix: the same engine settings")
    for opt, per in zip(opts, state.optim, strict=True):
        for p, saved in zip((q for g in opt.param_groups for q in g["params"]), per, strict=True):
            current = opt.state.get(p)
            if saved and not current:
                raise ValueError(
                    f"{where}: it holds optimizer state for a parameter this engine's optimizer has none for (its first step "
                    "has not run here); fix: load run states only into the engine whose runs they are"
                )


def restore(engine, state: RunState) -> None:
    """Put ``state`` back into the engine (``BaseEngine.load_run_state``): tensors copied in
    place (the engine's own storage, so offload bookkeeping and views stay valid)."""
    owned = engine._run_owned_state()
    _check(owned, state)
    trainable = owned.trainable
    with torch.no_grad():
        for p, saved in zip(_parameters(owned), state.params, strict=True):
            _local(p).copy_(saved, non_blocking=True)
        for p, saved in zip(trainable, state.grads[: len(trainable)], strict=True):
            if saved is None:
                p.grad = None
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _local(p.grad).copy_(saved, non_blocking=True)
        for b, saved in zip(owned.grad_buffers, state.grads[len(trainable) :], strict=True):
            _local(b).copy_(saved, non_blocking=True)
        for opt, per, groups in zip(owned.optimizers, state.optim, state.groups, strict=True):
            for p, saved in zip((q for g in opt.param_groups for q in g["params"]), per, strict=True):
                current = opt.state.get(p)
                if not current:
                    continue
                for key, value in current.items():
                    if saved is None:  # never stepped: zeroed state steps as fresh state does
                        if isinstance(value, torch.Tensor):
                            value.zero_()
                        elif key == "step":
                            current[key] = 0
                    elif isinstance(value, torch.Tensor):
                        _local(value).copy_(saved[key], non_blocking=True)
                    else:
                        current[key] = copy.deepcopy(saved[key])
            for g, saved in zip(opt.param_groups, groups, strict=True):
                g.update(copy.deepcopy(saved))
    if any(_local(p).device.type == "cuda" for p in trainable):
        torch.cuda.synchronize()
    engine._restore_run_owned_state(copy.deepcopy(state.scalars), copy.deepcopy(state.extra))
