"""An optimizer step cannot poison the weights silently (issue 13, item 3).

An update can turn weights into NaN/inf while the loss and the grad norm of the step are
finite, so the step is not marked skipped (on main: ``optim.lr=inf``, now refused by the config
check; an fp32 overflow or a 0/0 in the optimizer). On main the run went on, every later step
skipped, and it wrote NaN checkpoints. Here the poisoned update is injected on rank 0 only (a
step post-hook on the torch optimizer writes a NaN into this rank's first parameter shard), so
the other rank sees finite local shards and must still stop. The step raises
``NonFiniteUpdateError`` on every rank, naming the step; the engine then refuses to train, save
(which could rotate good checkpoints out) or export until a checkpoint is loaded, which
restores it. Both backends, 1 rank and 2 ranks (megatron also at TP=2).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from engine_api.optim import NonFiniteUpdateError
from tests.reliability._step_common import BACKENDS, local_batch, new_engine, run, run_window, snapshot, snapshot_diff, torch_optimizers

pytestmark = pytest.mark.slow


def _poison_first_param(optimizer, args, kwargs) -> None:
    with torch.no_grad():
        param = optimizer.param_groups[0]["params"][0]
        local = param.to_local() if isinstance(param, DTensor) else param  # this rank's shard only: no collective
        local.view(-1)[0] = float("nan")


def poisoned_update(rank, world, strategy, model_dir, root, overrides) -> dict:
    torch.set_num_threads(1)
    engine = new_engine(strategy, model_dir, *overrides)
    run_window(engine, local_batch(engine, seed=1))  # one good step, checkpointed
    engine.save_checkpoint(root, global_step=engine.global_step)
    initial = snapshot(engine)
    if rank == 0:
        for opt in torch_optimizers(engine.optimizer):
            opt.register_step_post_hook(_poison_first_param)
    out = {}
    try:
        run_window(engine, local_batch(engine))
        out["step_error"] = None
    except NonFiniteUpdateError as exc:
        out["step_error"] = str(exc)
    out["refused"] = {}
    for what, call in {
        "save_checkpoint": lambda: engine.save_checkpoint(root, global_step=1),
        "train_mode": lambda: engine.train_mode().__enter__(),
        "export_weights": lambda: next(iter(engine.export_weights())),
    }.items():
        try:
            call()
            out["refused"][what] = None
        except RuntimeError as exc:
            out["refused"][what] = str(exc)
    out["loaded_step"] = engine.load_checkpoint(root)
    restored = snapshot(engine)
    out["restored_diff"] = snapshot_diff(initial, restored)
    out["restored_finite"] = all(bool(torch.isfinite(p).all()) for p in restored["params"].values())
    return out


CASES = [(s, 1, []) for s in BACKENDS] + [(s, 2, []) for s in BACKENDS] + [("megatron", 2, ["megatron.tensor_model_parallel_size=2"])]


@pytest.mark.parametrize(("strategy", "world", "overrides"), CASES, ids=lambda c: str(c))
def test_a_step_that_writes_non_finite_weights_stops_and_the_engine_refuses_to_go_on(strategy, world, overrides, model_dir, tmp_path):
    for rank, got in enumerate(run(poisoned_update, world, strategy, model_dir, str(tmp_path), overrides)):
        assert got["step_error"] is not None, f"rank {rank}: the poisoned step raised nothing"
        assert "optimizer step 2 wrote non-finite values" in got["step_error"] and "fix:" in got["step_error"]
        for what, message in got["refused"].items():
            assert message is not None and f"{what} refused" in message, f"rank {rank}: {what} was not refused: {message}"
        assert got["loaded_step"] == 1 and got["restored_diff"] == [] and got["restored_finite"]
