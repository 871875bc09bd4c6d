"""Offload as one component: the record of which parts of an engine are offloaded (``"model"``:
parameters and gradients; ``"optimizer"``: its state), and the moves that change it.

``BaseEngine`` owns one :class:`Offloader` and routes the modes, ``to`` and the temporary loads
of saving, loading and exporting through it. The record, not tensor devices, is the truth: on a
CPU-only machine the compute device *is* the CPU, yet the bytes still move (into a host copy,
the loaded storage released: :func:`relocate_module`) and the record changes as on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

KINDS = ("model", "optimizer")
# ``move(kind, load)``: bring ``kind`` onto the compute device (``load``) or to the CPU.
MoveFn = Callable[[str, bool], None]


def relocate_module(module: torch.nn.Module, device: str | torch.device) -> None:
    """Move ``module``'s parameters, gradients and buffers to ``device`` as new copies, in place
    (the ``Parameter`` objects stay, so an optimizer keeps them), releasing the old storage;
    ``module.to`` would keep the very same tensors when they are already there (a CPU-only
    machine). An FSDP2 module re-registers its shards itself (``FSDPModule._apply``)."""
    module._apply(lambda t: t.to(device, copy=True))


def relocate_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Move ``optimizer``'s state tensors to ``device`` as new copies (see
    :func:`relocate_module`); the step counters stay where they are (AdamW keeps them on the
    CPU)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, copy=True)


class Offloader:
    """The offload record of one engine; ``move(kind, load)`` is the backend's move of one part
    (``BaseEngine._move``). Only what the record says must move is moved, so calls nest freely."""

    def __init__(self, move: MoveFn) -> None:
        self._move = move
        self._offloaded = dict.fromkeys(KINDS, False)

    @property
    def offloaded(self) -> dict[str, bool]:
        """A copy of the record: ``{"model": bool, "optimizer": bool}``."""
        return dict(self._offloaded)

    def load(self, model: bool, optimizer: bool) -> None:
        """Bring each named part onto the compute device and record it loaded."""
        for kind, wanted in (("model", model), ("optimizer", optimizer)):
            if wanted and self._offloaded[kind]:
                self._move(kind, True)
                self._offloaded[kind] = False

    def offload(self, model: bool, optimizer: bool) -> None:
        """Move each named part to the CPU and record it offloaded. The optimizer goes first,
        while the model is still loaded (megatron reads the model's storages to keep the ones
        its optimizer shares)."""
        for kind, wanted in (("optimizer", optimizer), ("model", model)):
            if wanted and not self._offloaded[kind]:
                self._move(kind, False)
                self._offloaded[kind] = True

    @contextlib.contextmanager
    def loaded(self, optimizer: bool = True) -> Iterator[None]:
        """The model (and, when ``optimizer``, the optimizer state) on the compute device for the
        duration; what was offloaded before is offloaded again after, also when the body raises."""
        before = dict(self._offloaded)
        self.load(model=True, optimizer=optimizer)
        try:
            yield
        finally:
            self.offload(model=before["model"], optimizer=before["optimizer"])

    def require_loaded(self, model: bool, optimizer: bool) -> None:
        """Raise a ``RuntimeError`` (nothing changed) when a part a call computes with is
        offloaded: on a GPU it would compute on the wrong device or on freed storage."""
        for kind, wanted in (("model", model), ("optimizer", optimizer)):
            if wanted and self._offloaded[kind]:
                raise RuntimeError(
                    f"the {kind} is offloaded (engine.offloaded[{kind!r}] is True); fix: call this inside "
                    "engine.train_mode() / eval_mode(), or engine.to(<compute device>) first"
                )

    def to(self, device: str | torch.device, compute: str | torch.device, model: bool, optimizer: bool) -> None:
        """``engine.to(device)``: the compute device (``"cuda"`` matches ``cuda:<index>``; on a
        CPU-only machine ``"cpu"``) loads, the CPU offloads, another device is refused."""
        device, compute = torch.device(device), torch.device(compute)
        if device.type == compute.type and device.index in (None, compute.index):
            self.load(model=model, optimizer=optimizer)
        elif device.type == "cpu":
            self.offload(model=model, optimizer=optimizer)
        else:
            raise ValueError(
                f"engine.to({str(device)!r}): this rank computes on {compute} and offloads to the CPU; "
                f"fix: pass {str(compute)!r} to load or 'cpu' to offload"
            )
