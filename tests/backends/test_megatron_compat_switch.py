"""The CPU compatibility layer is an explicit, reversible, reference-counted switch.

It rewrites CUDA device arguments of every torch call in the process and patches globals of
torch and megatron-core, so it must never be a side effect and must leave nothing behind:

* importing ``backends.megatron`` or running the FSDP engine leaves it off; the first megatron
  engine on a CPU machine switches it on and prints one line; a second engine prints nothing
  more (subprocess);
* ``disable()`` puts every patched global back, by identity, and pops its torch-function mode;
  nested users keep it on until the last lets go; ``active()`` restores on an exception; a
  ``disable()`` that cannot pop the mode safely refuses and changes nothing (in this process:
  ``tests/conftest.py`` also fails any test that leaves the layer in place);
* after a megatron engine trained and inferred on CPU, releasing the layer (or interpreter exit)
  leaves no patched global (subprocess).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from engine_api.conformance.fixtures import build_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the compat layer is for CPU-only machines")

ROOT = Path(__file__).resolve().parents[2]
LINE = "[enginekit] megatron on CPU: compatibility layer on"


def run_script(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


# ----------------------------------------------------------------------------- in this process
@pytest.fixture
def compat():
    from backends.megatron import cpu_compat

    assert not cpu_compat.leftovers(), "an earlier test left the compat layer in place"
    return cpu_compat


def snapshot(compat) -> dict[str, object]:
    """Every target's raw value now (``vars(owner)``, so a class's staticmethod is compared as
    the object stored in the class, not the function it unwraps to)."""
    return {name: vars(owner).get(attr, compat.MISSING) for name, (owner, attr) in compat.targets().items()}


def changed(compat, before: dict[str, object]) -> list[str]:
    now = snapshot(compat)
    return sorted(name for name in before if now[name] is not before[name])


def assert_fully_off(compat, before: dict[str, object], modes_before: list) -> None:
    assert not compat.is_active()
    assert not changed(compat, before), "globals not restored to their original objects"
    assert _get_current_function_mode_stack() == modes_before, "the mode stack differs from before enable()"
    assert not compat.leftovers()


def test_the_table_covers_every_kind_of_patch(compat):
    names = set(compat.targets())
    for name in (
        "torch.cuda.current_device",
        "torch.cuda.synchronize",
        "torch.cuda.Stream",
        "torch.distributed.all_gather",
        "megatron.core.tensor_parallel.random._set_cuda_rng_state",
        "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
        "megatron.core.tensor_parallel.mappings._AllToAll.backward",
    ):
        assert name in names, name


def test_enable_then_disable_restores_every_patched_global(compat):
    before, modes = snapshot(compat), _get_current_function_mode_stack()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # the control: CPU-only torch refuses CUDA
    assert compat.enable() is True
    try:
        assert compat.is_active()
        assert changed(compat, before) == sorted(before), "enable() left some target unpatched"
        assert compat.originals().keys() == before.keys()
        assert all(compat.originals()[n] is before[n] for n in before)
        assert isinstance(_get_current_function_mode_stack()[-1], TorchFunctionMode)
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # the layer really redirects
    finally:
        assert compat.disable() is False
    assert_fully_off(compat, before, modes)
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_nested_enables_stay_on_until_the_last_disable(compat):
    before, modes = snapshot(compat), _get_current_function_mode_stack()
    assert compat.enable() and compat.enable()
    assert compat.disable() is True  # one user still holds it
    assert compat.is_active() and changed(compat, before) == sorted(before)
    assert torch.cuda.current_device() == 0 and torch.zeros(1, device="cuda").device.type == "cpu"
    with compat.active() as on:  # a nested context on top of an enable()
        assert on
    assert compat.is_active()
    assert compat.disable() is False
    assert_fully_off(compat, before, modes)
    with pytest.raises(RuntimeError, match="without a matching enable"):
        compat.disable()


def test_the_context_manager_restores_on_an_exception(compat):
    before, modes = snapshot(compat), _get_current_function_mode_stack()
    with pytest.raises(ValueError, match="boom"):
        with compat.active() as on:
            assert on and compat.is_active()
            raise ValueError("boom")
    assert_fully_off(compat, before, modes)


class _OtherMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_disable_refuses_what_it_cannot_undo_safely_and_changes_nothing(compat):
    before, modes = snapshot(compat), _get_current_function_mode_stack()
    compat.enable()
    try:
        # Another mode above the layer's: popping would remove that one instead.
        with _OtherMode():
            with pytest.raises(RuntimeError, match="another torch-function mode"):
                compat.disable()
            assert compat.is_active() and changed(compat, before) == sorted(before)
        # The mode stack is per thread: another thread cannot pop it.
        errors = []
        thread = threading.Thread(target=lambda: errors.append(_try(compat.disable)))
        thread.start()
        thread.join()
        assert errors and isinstance(errors[0], RuntimeError) and "thread" in str(errors[0])
        assert compat.is_active()
    finally:
        compat.disable()
    assert_fully_off(compat, before, modes)


def _try(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- returned to the asserting thread
        return exc
    return None


def test_leftovers_names_a_global_that_was_not_put_back(compat, monkeypatch):
    """The check ``tests/conftest.py`` runs after every test: a disable that forgets one global
    is reported by name (here simulated by re-patching one after a correct disable)."""
    with compat.active():
        stand_in = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "current_device", stand_in)
    assert compat.leftovers() == ["torch.cuda.current_device"]
    monkeypatch.undo()
    assert not compat.leftovers()


def test_a_global_another_library_replaced_meanwhile_is_theirs(compat):
    """vLLM's CPU platform puts its own ``torch.cuda.Stream`` stand-in in place (seen in the
    suite): that is not the layer's, so ``leftovers`` does not report it, and a switch-off does not
    overwrite it with the original the layer saw."""
    original, theirs = torch.cuda.Stream, type("TheirStream", (), {})
    compat.enable()
    torch.cuda.Stream = theirs  # another library, while the layer is on
    try:
        compat.disable()
        assert torch.cuda.Stream is theirs and not compat.leftovers()
    finally:
        torch.cuda.Stream = original


# ----------------------------------------------------------------------------- a subprocess
CODE = """
import sys
from backends.megatron import cpu_compat
from engine_api import build_engine, load_config
assert not cpu_compat.is_active(), "importing backends.megatron switched the compat layer on"
def engine(strategy):
    e = build_engine(load_config(None, [f"strategy={strategy}", "model.path=" + sys.argv[1]]))
    e.init_model()
    return e
engine("fsdp")
assert not cpu_compat.is_active(), "the FSDP engine switched the compat layer on"
engine("megatron")
assert cpu_compat.is_active(), "the megatron engine on CPU did not switch the compat layer on"
engine("megatron")
print("ok")
"""


def test_only_the_megatron_engine_switches_the_compat_layer_on_and_says_so_once(tmp_path):
    model = build_model(str(tmp_path / "model"))
    result = run_script(CODE, model)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr[-3000:]
    assert result.stderr.count(LINE) == 1, result.stderr[-3000:]


# A megatron engine trains and infers on CPU; then the engine's reference is released (here
# explicitly; an atexit hook registered *before* the layer's runs after it and checks what
# interpreter exit leaves).
USED_CODE = """
import atexit, sys
from torch.overrides import _get_current_function_mode_stack
from backends.megatron import cpu_compat
from engine_api import build_engine, load_config
from engine_api.conformance import fixtures as fx

before = {n: vars(o).get(a, cpu_compat.MISSING) for n, (o, a) in cpu_compat.targets().items()}
def changed():
    now = {n: vars(o).get(a, cpu_compat.MISSING) for n, (o, a) in cpu_compat.targets().items()}
    return sorted(n for n in before if now[n] is not before[n])
def at_exit():
    print("at exit:", changed(), cpu_compat.is_active(), len(_get_current_function_mode_stack()), flush=True)
atexit.register(at_exit)

engine = build_engine(load_config(None, ["strategy=megatron", "model.path=" + sys.argv[1]]))
engine.init_model()
engine.set_loss_fn(fx.loss_fn)
with engine.train_mode():
    metrics = engine.train_batch(engine.shard_data(fx.make_test_batch()))
with engine.eval_mode():
    engine.infer_batch(engine.shard_data(fx.make_test_batch()))
assert cpu_compat.is_active() and changed() == sorted(before), "the engine ran without the whole layer"
assert cpu_compat.SITES, "the layer redirected nothing"
if sys.argv[2] == "release":
    while cpu_compat.is_active():
        cpu_compat.disable()
    print("released:", changed(), cpu_compat.leftovers(), len(_get_current_function_mode_stack()), flush=True)
print("ok", metrics["loss"], flush=True)
"""


@pytest.mark.parametrize("how", ["release", "exit"])
def test_a_used_megatron_engine_leaves_no_patched_global(tmp_path, how):
    model = build_model(str(tmp_path / "model"))
    result = run_script(USED_CODE, model, how)
    out = result.stdout
    assert result.returncode == 0 and "\nok " in "\n" + out, out + result.stderr[-3000:]
    if how == "release":
        assert "released: [] [] 0" in out, out
    assert "at exit: [] False 0" in out, out + result.stderr[-3000:]
