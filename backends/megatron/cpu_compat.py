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
  CPU generator), and megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``;
* for the MoE layer: ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``stream``
  (the token dispatcher's device-to-host side stream; CPU work is synchronous, so every wait
  and record is a no-op and a stream context changes nothing), and
  ``moe_utils.te_general_gemm``, which megatron binds only when Transformer-Engine imports
  and tests against None (so it must read None without TE);
* for expert parallelism: the token dispatcher's ``maybe_move_tensor_to_cpu`` hands the
  all-to-all split sizes over as numpy arrays on a GPU (its device-to-host copy), but leaves a
  CPU tensor a tensor, which gloo's ``all_to_all_single`` rejects as split sizes; the stand-in
  gives CPU tensors the numpy form the GPU path produces;
* gloo's ``all_gather`` takes equal sizes only; megatron's token dispatcher gathers the
  tokens of the expert-tensor-parallel ranks with uneven sizes (each routes its own number of
  tokens). ``torch.distributed.all_gather`` with uneven first dimensions on a gloo group pads
  every tensor to the largest, gathers, and copies the real rows out (equal sizes, and every
  other backend, go straight through);
* the mode is thread-local state that autograd does not carry into a custom Function's
  ``backward`` (measured: the mode stack is empty there), so the ``backward`` of megatron's
  communication Functions (``tensor_parallel.mappings``, ``moe.moe_utils``; e.g. the
  all-to-all of expert parallelism allocates its output with ``device=current_device()``)
  runs with the mode entered again.

Every redirected call site (file:function) is recorded in :data:`SITES`, so
``tests/backends/test_megatron.py::test_compat_layer_sees_only_known_cuda_call_sites`` fails when a megatron-core upgrade adds a new
hard-coded CUDA call on a path we use.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
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
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = _stand_in("current_stream", lambda *a, **k: _CpuStream.current)
    torch.cuda.stream = _stand_in("stream", lambda *a, **k: contextlib.nullcontext())
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy(token_dispatcher.maybe_move_tensor_to_cpu)
    mode = _CudaToCpu()
    mode.__enter__()  # process-wide for this (main) thread (not inside custom Functions' backward: see below)
    _ACTIVE.append(mode)
    dist.all_gather = _uneven_all_gather(dist.all_gather)
    import megatron.core.tensor_parallel.mappings as mappings

    for module in (mappings, moe_utils):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, torch.autograd.Function) and "backward" in vars(value):
                value.backward = staticmethod(_under_mode(vars(value)["backward"].__func__, mode))
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


def _uneven_all_gather(original):
    """``all_gather`` that also takes uneven first dimensions on gloo (module docstring)."""

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rows = {t.shape[0] for t in tensor_list} | {tensor.shape[0]}
        if len(rows) == 1 or async_op or dist.get_backend(group) != "gloo":
            return original(tensor_list, tensor, group=group, async_op=async_op)
        _record()
        most = max(rows)
        padded = [tensor.new_empty(most, *tensor.shape[1:]) for _ in tensor_list]
        mine = torch.cat([tensor, tensor.new_zeros(most - tensor.shape[0], *tensor.shape[1:])])
        original(padded, mine.contiguous(), group=group)
        for out, full in zip(tensor_list, padded, strict=True):
            out.copy_(full[: out.shape[0]])
        return None

    return all_gather


def _under_mode(backward, mode: TorchFunctionMode):
    """A Function's ``backward`` run with the compat mode entered (autograd drops it there)."""

    def backward_on_cpu(ctx, *grads):
        with mode:
            return backward(ctx, *grads)

    return backward_on_cpu


def _host_copy(original):
    """megatron's ``maybe_move_tensor_to_cpu`` with the GPU path's result for CPU tensors."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            _record()
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


class _CpuStream:
    """``torch.cuda.Stream`` on the CPU: work is synchronous, so waits and records do nothing."""

    current: _CpuStream

    def __init__(self, *args, **kwargs) -> None:
        _record()

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)  # one CPU "stream": a side stream is the current one

    def __hash__(self) -> int:
        return 0


class _CpuEvent:
    """``torch.cuda.Event`` on the CPU (every event has already happened)."""

    def __init__(self, *args, **kwargs) -> None:
        _record()

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CpuStream.current = object.__new__(_CpuStream)


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
