"""Let real megatron-core run on CPU (gloo) where CUDA is unavailable. Test infrastructure for
CPU CI; never active on a CUDA machine (``enable()`` returns False there and changes nothing).

A reversible, explicit, reference-counted switch:

* :func:`enable` takes a reference and installs the layer on the first one; :func:`disable`
  drops a reference and, on the last one, restores every patched global to the exact object
  it replaced (identity; an attribute the layer added is deleted again) and pops the
  ``TorchFunctionMode``. :func:`active` is the context-manager form (restores on exception).
  Nested users compose: the layer stays on until the last of them lets go.
* The megatron engine takes one reference when it runs on the CPU
  (``backends.megatron.model.init_parallel``) and never gives it back while the process runs:
  megatron's parallel state and buffers outlive the engine object, and there is no engine
  ``close()``. Whatever is still held is released at interpreter exit (:func:`release_all`,
  registered with ``atexit`` on the first switch-on of the process).
* Importing this module or ``backends.megatron``, or running another engine, changes nothing.
  The first switch-on of a process says so once on stderr.
* All patched globals live in one table (:func:`targets` names them, :func:`originals` holds
  what the last switch-on replaced), built by one function for both directions, so switching
  on and off cannot drift apart; :func:`leftovers` lists whatever is still patched
  (``tests/conftest.py`` fails a test that leaves any).

The mode must be popped by the thread that pushed it, from the top of that thread's mode stack
(torch's mode stack is thread-local and ``TorchFunctionMode.__exit__`` pops whatever is on top):
:func:`disable` refuses, changing nothing, when either does not hold.

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
  and of ``tensor_parallel.random``'s ``CheckpointFunction`` (activation recomputation reruns
  the layer's forward there, and the MoE router's ``gating`` moves its weight to
  ``current_device()``) runs with the mode entered again.

Every redirected call site (file:function) is recorded in :data:`SITES`, so
``tests/backends/test_megatron.py::test_compat_layer_sees_only_known_cuda_call_sites`` (its list is
``KNOWN_CUDA_SITES`` in ``tests/support/megatron_workers.py``) fails when a megatron-core upgrade adds a new
hard-coded CUDA call on a path we use.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

# (file basename, function) -> how often the compat layer redirected a CUDA use there.
SITES: Counter = Counter()
_MEGATRON_ROOT = os.sep + "megatron" + os.sep
_LINE = (
    "[enginekit] megatron on CPU: compatibility layer on (CUDA device arguments of torch calls go to the CPU, "
    "torch.cuda RNG/sync calls use CPU stand-ins; backends/megatron/cpu_compat.py)"
)
# Stands for "the attribute did not exist": restoring it means deleting the attribute again.
MISSING = object()


class _Switch:
    """The process's switch state (one instance, :data:`_SWITCH`)."""

    def __init__(self) -> None:
        self.references = 0  # enable() calls not yet matched by disable()
        self.mode: _CudaToCpu | None = None  # the pushed mode while on
        self.thread: int | None = None  # the thread whose mode stack holds it
        # name -> (owner, attribute, original raw value) of the current or last switch-on;
        # kept after switching off so leftovers() can tell a global that was not put back.
        self.originals: dict[str, tuple[object, str, object]] = {}
        # name -> the object the layer put there: only where it is still that object is the layer
        # in place (another library may replace the same global later, e.g. vLLM's CPU platform
        # its torch.cuda.Stream stand-in: that is not ours to report or to undo).
        self.installed: dict[str, object] = {}
        self.announced = False
        self.exit_hook = False


_SWITCH = _Switch()


def _table(mode: TorchFunctionMode) -> dict[str, tuple[object, str, object]]:
    """Everything the layer patches: dotted name -> (owner, attribute, replacement).

    The one list of patched globals: switching on installs exactly these, switching off puts
    back exactly what was there before, and :func:`targets` / :func:`leftovers` read the same
    names. Building it has no side effect beyond importing the megatron modules it patches.
    """
    import megatron.core.tensor_parallel.mappings as mappings
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    cuda = torch.cuda
    table = {
        "torch.cuda.current_device": (cuda, "current_device", _stand_in("current_device", lambda: 0)),
        "torch.cuda.synchronize": (cuda, "synchronize", _stand_in("synchronize", lambda *a, **k: None)),
        "torch.cuda.get_rng_state": (cuda, "get_rng_state", _stand_in("get_rng_state", lambda *a, **k: torch.get_rng_state())),
        "torch.cuda.set_rng_state": (
            cuda,
            "set_rng_state",
            _stand_in("set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        ),
        "torch.cuda.manual_seed": (cuda, "manual_seed", _stand_in("manual_seed", lambda seed: torch.manual_seed(seed))),
        f"{mrandom.__name__}._get_cuda_rng_state": (
            mrandom,
            "_get_cuda_rng_state",
            _stand_in("_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        ),
        f"{mrandom.__name__}._set_cuda_rng_state": (
            mrandom,
            "_set_cuda_rng_state",
            _stand_in("_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        ),
        "torch.cuda.Stream": (cuda, "Stream", _CpuStream),
        "torch.cuda.Event": (cuda, "Event", _CpuEvent),
        "torch.cuda.current_stream": (cuda, "current_stream", _stand_in("current_stream", lambda *a, **k: _CpuStream.current)),
        "torch.cuda.stream": (cuda, "stream", _stand_in("stream", lambda *a, **k: contextlib.nullcontext())),
        f"{token_dispatcher.__name__}.maybe_move_tensor_to_cpu": (
            token_dispatcher,
            "maybe_move_tensor_to_cpu",
            _host_copy(token_dispatcher.maybe_move_tensor_to_cpu),
        ),
        "torch.distributed.all_gather": (dist, "all_gather", _uneven_all_gather(dist.all_gather)),
    }
    if "te_general_gemm" not in vars(moe_utils):  # bound by megatron only when TE imports
        table[f"{moe_utils.__name__}.te_general_gemm"] = (moe_utils, "te_general_gemm", None)
    # mrandom: CheckpointFunction's backward reruns the layer's forward (activation
    # recomputation), whose MoE router moves its weight to current_device().
    for module in (mappings, moe_utils, mrandom):
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.autograd.Function) and "backward" in vars(value):
                backward = vars(value)["backward"].__func__
                table[f"{module.__name__}.{value.__name__}.backward"] = (value, "backward", staticmethod(_under_mode(backward, mode)))
    return table


def targets() -> dict[str, tuple[object, str]]:
    """The globals :func:`enable` patches: dotted name -> (owner, attribute). Patches nothing
    (imports megatron-core's patched modules)."""
    if _SWITCH.references:  # on: what was patched (the table would no longer see te_general_gemm as absent)
        return {name: (owner, attr) for name, (owner, attr, _) in _SWITCH.originals.items()}
    return {name: (owner, attr) for name, (owner, attr, _) in _table(_CudaToCpu()).items()}


def originals() -> dict[str, object]:
    """What the current (or last) switch-on replaced: dotted name -> the original raw value
    (``vars(owner)[attr]``; :data:`MISSING` where the layer added the attribute). Empty before
    the first switch-on."""
    return {name: original for name, (_, _, original) in _SWITCH.originals.items()}


def enable() -> bool:
    """Take a reference on the layer, installing it on the first one. Returns whether the layer
    is active (False on a CUDA machine, where nothing is changed and nothing is counted)."""
    if torch.cuda.is_available():
        return False
    if _SWITCH.references:
        _SWITCH.references += 1
        return True
    mode = _CudaToCpu()
    table = _table(mode)
    _SWITCH.originals = {name: (owner, attr, vars(owner).get(attr, MISSING)) for name, (owner, attr, _) in table.items()}
    _SWITCH.installed = {name: replacement for name, (_, _, replacement) in table.items()}
    for owner, attr, replacement in table.values():
        setattr(owner, attr, replacement)
    mode.__enter__()  # process-wide for this (main) thread (not inside custom Functions' backward: see above)
    _SWITCH.mode, _SWITCH.thread, _SWITCH.references = mode, threading.get_ident(), 1
    if not _SWITCH.exit_hook:
        atexit.register(release_all)
        _SWITCH.exit_hook = True
    if not _SWITCH.announced:
        print(_LINE, file=sys.stderr, flush=True)
        _SWITCH.announced = True
    return True


def disable() -> bool:
    """Drop a reference taken by :func:`enable`; the last one restores every patched global to
    its original object and pops the mode. Returns whether the layer is still active.

    A no-op on a CUDA machine. Raises ``RuntimeError`` (changing nothing) without a matching
    :func:`enable`, or when the last reference is dropped from another thread than the one that
    switched the layer on, or while another torch-function mode sits above the layer's.
    """
    if not _SWITCH.references:
        if torch.cuda.is_available():
            return False
        raise RuntimeError("cpu_compat.disable() without a matching enable(): the compat layer is off")
    if _SWITCH.references > 1:
        _SWITCH.references -= 1
        return True
    if threading.get_ident() != _SWITCH.thread:
        raise RuntimeError("cpu_compat.disable(): the layer's mode lives on the thread that called enable(); switch it off there")
    stack = torch.overrides._get_current_function_mode_stack()
    if not stack or stack[-1] is not _SWITCH.mode:
        raise RuntimeError(
            f"cpu_compat.disable(): another torch-function mode is above the compat layer's ({stack[-1] if stack else None!r}); "
            "leave that mode first"
        )
    _switch_off(pop_mode=True)
    return False


@contextlib.contextmanager
def active():
    """``with cpu_compat.active() as on:`` -- the layer is on inside (``on`` is :func:`enable`'s
    result) and this reference is dropped on the way out, exception or not."""
    on = enable()
    try:
        yield on
    finally:
        if on:
            disable()


def is_active() -> bool:
    """Whether the layer is installed in this process (some :func:`enable` not yet undone)."""
    return _SWITCH.references > 0


def leftovers() -> list[str]:
    """What of the layer is still in place: the globals that still hold the layer's own objects
    (not ones another library put there since), a held reference, a compat mode on this
    thread's mode stack. Empty when the layer is fully off (or was never on)."""
    left = [name for name, (owner, attr, _) in _SWITCH.originals.items() if vars(owner).get(attr, MISSING) is _SWITCH.installed[name]]
    if _SWITCH.references:
        left.append(f"<{_SWITCH.references} reference(s) held: enable() without disable()>")
    if any(isinstance(m, _CudaToCpu) for m in torch.overrides._get_current_function_mode_stack()):
        left.append("<the compat TorchFunctionMode is on the mode stack>")
    return left


def _switch_off(pop_mode: bool) -> None:
    """Put every original back (reverse order of installation) and pop the mode."""
    if pop_mode:
        _SWITCH.mode.__exit__(None, None, None)
    for name, (owner, attr, original) in reversed(list(_SWITCH.originals.items())):
        if vars(owner).get(attr, MISSING) is not _SWITCH.installed[name]:
            continue  # replaced since by someone else: theirs now
        if original is MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    _SWITCH.mode, _SWITCH.thread, _SWITCH.references = None, None, 0


def release_all() -> None:
    """Switch the layer fully off now, whatever references are held: the interpreter-exit hook
    (the engine's reference), and tests' cleanup. Puts back every global of the last switch-on
    that is not its original. The mode is popped only where that is safe (this thread pushed it
    and it is on top); otherwise it dies with its thread's state."""
    stack = torch.overrides._get_current_function_mode_stack()
    pop = _SWITCH.mode is not None and threading.get_ident() == _SWITCH.thread and bool(stack) and stack[-1] is _SWITCH.mode
    _switch_off(pop_mode=pop)


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
