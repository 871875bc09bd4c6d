"""save_state before the first optim_step, with gradients pending (a forward_backward already
ran), then a load with the optimizer: the Tinker server's calls on its engine (``shared_engine.EngineRun``,
FSDP + LoRA, fp32 on CPU), without the HTTP layer. torch's ``get_state_dict`` initialises a
never-stepped optimizer only when no parameter holds a gradient: such a save wrote no optimizer
state and the fresh run loading it failed (``CheckpointException``: "Missing key in checkpoint
state_dict: optimizer.state...step"); a load into a run with gradients pending read no moments."""

from __future__ import annotations

import pytest
import torch

from tests.support.tinker import ADAM, ALPHA, RANK, datums, plain
from tests.support.user_data import build_model_dir
from tinker_server.config import load_server_config
from tinker_server.contract import AdamIn, LoraIn
from tinker_server.factory import EngineFactory


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> EngineFactory:
    models = tmp_path_factory.mktemp("models")
    build_model_dir(models / "tiny", family="llama")
    cfg = load_server_config("configs/tinker_tiny.yaml", [f"server.model_root={models}", f"tinker.lora_alpha={ALPHA}"])
    return EngineFactory(cfg.server.model_root, {}, cfg.run_settings())


def _run(factory):
    return factory.create_run("tiny", LoraIn(rank=RANK, seed=3))


def _fb(run, seed: int) -> None:
    run.forward_backward(plain(datums(seed)), "cross_entropy", None, False)


def _step(run, seed: int) -> None:
    _fb(run, seed)
    run.optim_step(AdamIn(**ADAM))


def _adapter(run) -> dict[str, torch.Tensor]:
    with run.shared.serving(run) as engine:
        return {k: v.detach().clone() for k, v in engine.export_adapter_weights()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad[:3]} differ"


def test_save_with_gradients_pending_before_the_first_step(factory, tmp_path):
    """The save changes no training (the pending gradients are kept; the steps after it are
    bit-identical), and a fresh run loading it with the optimizer trains as a fresh run."""
    plain_run = _run(factory)
    for s in (1, 2):
        _step(plain_run, s)
    want = _adapter(plain_run)

    saved = _run(factory)
    _fb(saved, 1)
    saved.save_state(tmp_path / "zero", with_optimizer=True)
    saved.optim_step(AdamIn(**ADAM))
    _step(saved, 2)
    _same(_adapter(saved), want, "2 steps around a save with gradients pending vs without it")

    loaded = _run(factory)
    loaded.load_state(tmp_path / "zero", with_optimizer=True)
    for s in (1, 2):
        _step(loaded, s)
    _same(_adapter(loaded), want, "2 steps after loading that checkpoint vs a fresh run")


def test_load_into_a_run_with_gradients_pending_reads_the_moments(factory, tmp_path):
    """A stepped checkpoint loaded into a run that never stepped but holds gradients: the AdamW
    moments and step count are the checkpoint's (the next step equals the uninterrupted run's)."""
    first = _run(factory)
    _step(first, 1)
    first.save_state(tmp_path / "one", with_optimizer=True)
    _step(first, 2)

    other = _run(factory)
    _fb(other, 7)
    other.load_state(tmp_path / "one", with_optimizer=True)
    _step(other, 2)
    _same(_adapter(other), _adapter(first), "the step after the load vs the uninterrupted run")
