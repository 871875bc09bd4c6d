"""No pickled collective on a per-step path (issue 18, item 1): during training and inference
steps, their global gathers (``unshard_data``, the roles' ``infer_global``) and the weight
export a rollout sync makes every RL step, every rank's data moves with tensor collectives. ``all_gather_object`` and the other object collectives pickle
each rank's data to host bytes (on NCCL: a device->host copy, a pickle and a host->device copy
per call), so the test makes them raise during the steps, on every backend at its 2-rank
layouts plus megatron's PP=2 (where the last stage's outputs, metrics and loss go to the other
stages: ``MegatronEngine._collect``, through ``engine_api.dist.broadcast_tensors``). Engine
construction and checkpoints may still use them (once per run, not per step).
"""

from __future__ import annotations

import pytest

from roles.common import infer_global
from tests.reliability._step_common import BACKENDS, new_engine, run, two_rank_layouts, worker_setup
from tests.support.hf_utils import make_test_batch
from tests.support.object_collectives import no_object_collectives


def _tag(mb, out, ctx):
    out.set_non_tensor("tag", "seen")
    return out


def _steps_worker(rank, world, strategy, model_dir, layout):
    worker_setup()
    engine = new_engine(strategy, model_dir, "max_token_len_per_micro_batch=24", *layout)
    batch = make_test_batch()
    with no_object_collectives():
        outputs = infer_global(engine, batch, calculate_entropy=True)
        with engine.train_mode():
            metrics = engine.train_batch(engine.shard_data(batch))
        with engine.eval_mode():
            local = engine.infer_batch(engine.shard_data(batch))
        gathered = engine.unshard_data(local) if local is not None else None
        exported = sum(1 for _ in engine.export_weights()) + sum(1 for _ in engine.export_weights(bucket_mb=0.05))
        with engine.eval_mode():  # a postprocess_fn's non-tensor field reaches the caller (megatron PP: in the header)
            tagged = engine.forward_backward_step(engine.shard_data(batch), forward_only=True, postprocess_fn=_tag)[0]
    assert tagged is None or tagged.get_non_tensor("tag") == "seen"
    assert exported > 0
    assert metrics["step_skipped"] == 0.0
    return outputs["log_probs"].values().shape[0], float(metrics["loss"]), None if gathered is None else gathered.batch_size[0]


@pytest.mark.parametrize("strategy", BACKENDS)
def test_steps_and_gathers_use_no_pickled_collective(strategy, model_dir):
    layouts = dict(two_rank_layouts(strategy))
    if strategy == "megatron":
        layouts["pp2"] = ["megatron.pipeline_model_parallel_size=2"]
    for name, layout in layouts.items():
        results = run(_steps_worker, 2, strategy, model_dir, layout)
        tokens = sum(len(r) for r in make_test_batch()["input_ids"].unbind())
        for n_tokens, _loss, rows in results:
            assert n_tokens == tokens, name  # every rank got the whole global batch back
            assert rows in (None, 6), name
