"""Offload as one component: which parts of an engine are offloaded, and the moves that change it.

An engine has two parts that can leave the compute device: ``"model"`` (parameters and
gradients) and ``"optimizer"`` (optimizer state). :class:`Offloader` keeps the record of which
are offloaded and calls the backend's ``move(kind, load)`` to change it; ``BaseEngine`` owns one
and routes ``train_mode`` / ``eval_mode`` (load on enter, offload by ``config.offload`` on exit),
``to``, and the temporary loads of saving, loading and exporting through it.

The record, not the tensors' devices, is the truth: on a CPU-only machine the compute device
*is* the CPU, so no device shows an offload, yet the bytes still move (into a host copy, the
loaded storage released: :func:`relocate_module`, :func:`relocate_state`) and the record
changes exactly as on a GPU. Compute on an offloaded part is refused (:meth:`Offloader.require_loaded`),
so a mode that forgot to load something fails on every machine, not only where the bytes are missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

KINDS = ("model", "optimizer")
# ``move(kind, load)``: bring ``kind`` onto the compute device (``load``) or to the CPU.
MoveFn = Callable[[str, bool], None]


def relocate_module(module: torch.nn.Module, device: str | torch.device) -> None:
    """Move ``module``'s parameters, gradients and buffers to ``device`` as new copies (in
    place: the ``Parameter`` objects stay, so an optimizer keeps them), releasing the old
    storage. Unlike ``module.to(device)``, which returns the very same tensors when they are
    already there, this also works on a CPU-only machine, where loading and offloading are
    both "cpu". An FSDP2 module re-registers its shards itself (``FSDPModule._apply``)."""
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
    """The offload record of one engine and the moves that keep it true.

    Args:
        move: ``move(kind, load)``, the backend's move of one part (``BaseEngine._move``).

    Every method moves only what the record says must move: loading a loaded part or
    offloading an offloaded one does nothing, so the calls nest freely.
    """

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
        """The model (and, when ``optimizer``, the optimizer state) on the compute device for
        the duration: saving and loading need both, exporting only the model (a rollout sync
        should not bring the Adam moments onto the GPU). What was offloaded before is
        offloaded again after, also when the body raises."""
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
        """``engine.to(device)``: the compute device (``"cuda"`` matches ``cuda:<index>``) loads,
        the CPU offloads; on a CPU-only machine ``"cpu"`` is the compute device, so it loads.
        Any other device is refused (``ValueError``, nothing moved)."""
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
