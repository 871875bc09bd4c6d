"""``engine_api.offload``: the offload record and the moves that keep it true, on their own.

A fake ``move`` records every call, so the component's rules are checked without a model: what
moves and in which order, that nothing moves twice, that ``loaded`` restores what was offloaded
(also after an error), that compute on an offloaded part is refused, and how ``to`` reads a
device. The engines' end-to-end behaviour (storage released, bit-identical training) is
``tests/reliability/test_offload_record.py`` and the conformance kit's ``offload`` check.
"""

from __future__ import annotations

import pytest
import torch

from engine_api.offload import Offloader, relocate_module, relocate_state


def _offloader():
    calls: list[tuple[str, bool]] = []
    return Offloader(lambda kind, load: calls.append((kind, load))), calls


def test_an_offload_moves_the_optimizer_first_and_each_part_once():
    off, calls = _offloader()
    off.offload(model=True, optimizer=True)
    assert calls == [("optimizer", False), ("model", False)]
    off.offload(model=True, optimizer=True)  # already offloaded: nothing moves
    assert len(calls) == 2 and off.offloaded == {"model": True, "optimizer": True}
    off.load(model=True, optimizer=False)
    assert calls[2:] == [("model", True)] and off.offloaded == {"model": False, "optimizer": True}
    off.load(model=True, optimizer=True)
    assert calls[3:] == [("optimizer", True)] and off.offloaded == {"model": False, "optimizer": False}


def test_loaded_restores_what_was_offloaded_also_after_an_error():
    off, calls = _offloader()
    off.offload(model=True, optimizer=True)
    calls.clear()
    with pytest.raises(KeyError):
        with off.loaded(optimizer=False):
            assert off.offloaded == {"model": False, "optimizer": True}
            raise KeyError("the body failed")
    assert calls == [("model", True), ("model", False)] and off.offloaded == {"model": True, "optimizer": True}
    calls.clear()
    with off.loaded():  # nothing offloaded afterwards that was loaded before
        pass
    assert calls == [("model", True), ("optimizer", True), ("optimizer", False), ("model", False)]


def test_compute_on_an_offloaded_part_is_refused_naming_it():
    off, _ = _offloader()
    off.require_loaded(model=True, optimizer=True)
    off.offload(model=False, optimizer=True)
    off.require_loaded(model=True, optimizer=False)
    with pytest.raises(RuntimeError, match=r"the optimizer is offloaded .*fix: call this inside engine.train_mode"):
        off.require_loaded(model=True, optimizer=True)


def test_to_reads_the_compute_device_as_load_and_the_cpu_as_offload():
    off, calls = _offloader()
    off.to("cpu", "cuda:1", model=True, optimizer=False)
    assert calls == [("model", False)]
    off.to("cuda", "cuda:1", model=True, optimizer=True)  # "cuda" matches this rank's cuda:1
    assert calls[1:] == [("model", True)]
    with pytest.raises(ValueError, match=r"engine.to\('cuda:0'\): this rank computes on cuda:1 .*fix: pass 'cuda:1'"):
        off.to("cuda:0", "cuda:1", model=True, optimizer=True)
    assert len(calls) == 2  # refused before anything moved
    off.offload(model=True, optimizer=True)
    off.to("cpu", "cpu", model=True, optimizer=True)  # a CPU-only machine: "cpu" is the compute device, so it loads
    assert off.offloaded == {"model": False, "optimizer": False}


def test_relocating_copies_and_releases_the_old_storage_on_the_same_device():
    """On a CPU-only machine a load and an offload are both "cpu": the move must still copy, so
    the storage the part held is released (``module.to`` would return the same tensors)."""
    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(1, 3)).sum().backward()
    opt = torch.optim.AdamW(layer.parameters())
    opt.step()
    before = {id(p): (p.untyped_storage().data_ptr(), p.detach().clone()) for p in layer.parameters()}
    moments = [v.untyped_storage().data_ptr() for s in opt.state.values() for k, v in s.items() if k != "step"]
    relocate_module(layer, "cpu")
    relocate_state(opt, "cpu")
    for p in layer.parameters():
        ptr, value = before[id(p)]  # the same Parameter object, a new storage, the same values
        assert p.untyped_storage().data_ptr() != ptr and torch.equal(p.detach(), value) and p.grad is not None
    after = [v.untyped_storage().data_ptr() for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert not set(after) & set(moments)
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())
