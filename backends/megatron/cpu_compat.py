"""Let real megatron-core run on CPU (gloo) where CUDA is unavailable. Test infrastructure for
CPU CI; never active on a CUDA machine (``enable()`` returns False there and changes nothing).

Switched on explicitly, and only, by the megatron engine when it runs on the CPU
(``backends.megatron.model.init_parallel``), which says so once per process on stderr.
Importing this module or ``backends.megatron``, or running another engine, changes nothing.

megatron-core 0.16 hard-codes CUDA in a few places on the paths the engine uses (measured;
``docs/design.md``, the megatron-core on CPU section): factory calls with ``device="cuda"`` / ``torch.cuda.current_device()``
(rotary embedding, ``GlobalMemoryBuffer``, schedules, optimizers, clip_grads), the CUDA RNG
tracker (``torch.cuda.get_rng_state`` / ``manual_seed``, ``_set_cuda_rng_state``),
``torch.cuda.synchronize`` in p2p communication, and an assertion in ``clip_grads`` that grads
are ``torch.cuda.FloatTensor``. :func:`enable` installs:

* a process-wide ``TorchFunctionMode`` that rewrites CUDA device arguments (``"cuda"``,
  ``"cuda:N"``, ``torch.device("cuda")``, a bare device index) of any torch call, and
  ``Tensor.cuda()``, to the CPU, and answers ``Tensor.type()`` with the CUDA type name that
  clip_grads asserts;
* CPU stand-ins for ``torch.cuda.current_device`` (0, which the mode maps to the CPU),
  ``synchronize`` (no-op), ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` (the CPU
  generator: on CPU, the "device RNG" megatron forks for tensor-parallel regions *is* the
  CPU generator), and megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``.

Every redirected call site (file:function) is recorded in :data:`SITES`, so
``tests/backends/test_megatron.py::test_compat_layer_sees_only_known_cuda_call_sites`` fails when a megatron-core upgrade adds a new
hard-coded CUDA call on a path we use.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# (file basename, function) -> how often the compat layer redirected a CUDA use there.
SITES: Counter = Counter()
_ACTIVE: list[TorchFunctionMode] = []
_MEGATRON_ROOT = os.sep + "megatron" + os.sep


def enable() -> bool:
    """Install the redirections (idempotent). Returns whether the layer is active."""
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = _stand_in("current_device", lambda: 0)
    torch.cuda.synchronize = _stand_in("synchronize", lambda *a, **k: None)
    torch.cuda.get_rng_state = _stand_in("get_rng_state", lambda *a, **k: torch.get_rng_state())
    torch.cuda.set_rng_state = _stand_in("set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    torch.cuda.manual_seed = _stand_in("manual_seed", lambda seed: torch.manual_seed(seed))
    mrandom._get_cuda_rng_state = _stand_in("_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    mrandom._set_cuda_rng_state = _stand_in("_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    mode = _CudaToCpu()
    mode.__enter__()  # process-wide for this (main) thread; CPU autograd runs on it too
    _ACTIVE.append(mode)
    print(
        "[enginekit] megatron on CPU: compatibility layer on (CUDA device arguments of torch calls go to the CPU, "
        "torch.cuda RNG/sync calls use CPU stand-ins; backends/megatron/cpu_compat.py)",
        file=sys.stderr,
        flush=True,
    )
    return True


def is_active() -> bool:
    """Whether :func:`enable` installed the layer in this process."""
    return bool(_ACTIVE)


def _record() -> None:
    """Record the first megatron frame up the stack as a redirected call site."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if _MEGATRON_ROOT in path:
            SITES[(os.path.basename(path), frame.f_code.co_name)] += 1
            return
        frame = frame.f_back
    SITES[("<outside megatron>", "")] += 1


def _stand_in(name: str, fn):
    def wrapper(*args, **kwargs):
        _record()
        return fn(*args, **kwargs)

    wrapper.__name__ = f"cpu_stand_in_{name}"
    return wrapper


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_SPECIAL = frozenset({torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to})


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the process passes here: the common case (no device argument,
        # not one of the three rewritten methods) returns after one dict lookup and two
        # identity tests.
        if func not in _SPECIAL and (not kwargs or "device" not in kwargs):
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            _record()
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            # clip_grads asserts grads are 'torch.cuda.FloatTensor'; on CPU they are the same
            # dense fp32 tensors, so answer with the CUDA spelling.
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and "cuda" not in name else name
        if _is_cuda(kwargs.get("device")):
            _record()
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            _record()
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)
