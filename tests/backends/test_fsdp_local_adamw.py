"""FSDPEngine's AdamW step on each parameter's local shard (``FSDPEngine._apply_update``: torch's
single-tensor AdamW on the DTensors' local tensors, issue 60 item 12) is torch's own
``torch.optim.AdamW.step()`` bit for bit: after every step the parameters, both moments
(``exp_avg``, ``exp_avg_sq``; ``max_exp_avg_sq`` with amsgrad) and the step counts are
``torch.equal`` to those of the same engine stepping through ``optimizer.step()``.

The reference is the same engine with one no-op step pre-hook on its optimizer: the fast path
steps aside for any step hook (``_steps_locally``), so ``optimizer.step()`` runs torch's AdamW on
the DTensors, as before the fast path. Both engines start from the same checkpoint and run the
same batches, so while their updates agree their gradients do too; one differing bit in a step
shows in that step's state. The learning rate warms up (a different ``lr`` every step) and the
gradients are clipped, as in training. One process (the whole tensor is the local shard) and two
(each rank steps its shard of every parameter).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.support.hf_utils import engine_for, make_model, make_test_batch
from tests.support.launch import run_distributed

STEPS = 4
# (weight_decay, amsgrad): decoupled decay off and on, and amsgrad's running maximum.
CASES = {"no-decay": (0.0, False), "decay": (0.1, False), "decay-amsgrad": (0.1, True)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama", num_layers=1)


def _engine(model_dir: str, weight_decay: float, amsgrad: bool, local: bool):
    engine = engine_for(model_dir, f"optim.weight_decay={weight_decay}", f"optim.warmup_steps={STEPS}")
    for group in engine.optimizer.param_groups:
        group["amsgrad"] = amsgrad  # not an engine option; torch reads it from the group at every step
    if not local:  # any step hook sends the engine through optimizer.step() (_steps_locally)
        engine.optimizer.register_step_pre_hook(lambda *_: None)
    return engine


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _state(engine) -> dict[str, torch.Tensor]:
    """Every parameter's local shard and its AdamW state, by parameter name."""
    out = {}
    for name, p in engine.model.named_parameters():
        out[name] = _local(p).detach().clone()
        for key, value in engine.optimizer.state[p].items():
            out[f"{name}:{key}"] = _local(value).clone()
    return out


def _train(model_dir: str, weight_decay: float, amsgrad: bool) -> tuple[list[tuple[dict, dict, int]], bool]:
    """Per step: the fast path's state, the reference's, and how many times the fast path had
    run; and whether some parameter's local shard is only part of it (more than one rank)."""
    import backends.fsdp.engine as fsdp_engine

    real, calls = fsdp_engine.adam_step, []
    fsdp_engine.adam_step = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        fast, plain = (_engine(model_dir, weight_decay, amsgrad, local) for local in (True, False))
        out = []
        for step in range(STEPS):
            batch = make_test_batch(seed=step)
            with fast.train_mode():
                fast.train_batch(fast.shard_data(batch))
            taken = len(calls)
            with plain.train_mode():
                plain.train_batch(plain.shard_data(batch))
            assert len(calls) == taken  # the reference never took the fast path
            out.append((_state(fast), _state(plain), taken))
        return out, any(_local(p).numel() < p.numel() for p in fast.model.parameters())
    finally:
        fsdp_engine.adam_step = real


def _assert_equal(steps: list[tuple[dict, dict, int]], amsgrad: bool) -> None:
    assert len(steps) == STEPS
    for step, (got, want, taken) in enumerate(steps):
        assert taken == step + 1  # the engine under test took the fast path at every step
        assert got.keys() == want.keys()
        moments = {k.split(":")[1] for k in want if ":" in k}
        assert moments == {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
        differ = [k for k in want if not torch.equal(got[k], want[k])]
        assert not differ, f"step {step + 1}: {differ}"
        assert all(float(want[k]) == step + 1 for k in want if k.endswith(":step"))


@pytest.mark.parametrize("case", CASES)
def test_local_adamw_is_torch_adamw_bit_for_bit(model_dir, case):
    weight_decay, amsgrad = CASES[case]
    steps, _ = _train(model_dir, weight_decay, amsgrad)
    _assert_equal(steps, amsgrad)


def _two_rank_worker(rank, world, model_dir, weight_decay, amsgrad):
    return _train(model_dir, weight_decay, amsgrad)


@pytest.mark.slow
def test_local_adamw_is_torch_adamw_bit_for_bit_on_two_ranks(model_dir):
    weight_decay, amsgrad = CASES["decay-amsgrad"]
    for steps, sharded in run_distributed(_two_rank_worker, 2, model_dir, weight_decay, amsgrad, timeout=300):
        assert sharded
        _assert_equal(steps, amsgrad)
