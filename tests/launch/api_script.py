"""The README's API example as a script, for launcher tests: no ``init_process_group`` of its
own and, on purpose, no ``if __name__ == "__main__":`` guard (a library that starts helper
processes with the spawn method would re-run this file in them and crash).

Usage: ``[torchrun ...] api_script.py OUT_DIR MODEL_DIR STRATEGY [override ...]``. One train step
on this rank's shard of a fixed batch, then a checkpoint; each rank writes
``OUT_DIR/rank<r>.pt``: the topology it saw, the step's metrics and the exported HF weights.
"""

import os
import sys

import torch
import torch.distributed as dist

from engine_api import build_engine, load_config
from tests.support.hf_utils import EPS, make_test_batch, pg_loss

out_dir, model_dir, strategy, *overrides = sys.argv[1:]
torch.set_num_threads(1)
cfg = load_config(f"configs/engine/{strategy}.yaml", [f"model.path={model_dir}", "optim.lr=1e-2", f"optim.eps={EPS}", *overrides])
engine = build_engine(cfg)
engine.init_model()
engine.set_loss_fn(pg_loss)
with engine.train_mode():
    metrics = engine.train_batch(engine.shard_data(make_test_batch(seed=0)))
weights = {name: tensor.clone().cpu() for name, tensor in engine.export_weights()}
engine.save_checkpoint(os.path.join(out_dir, "ckpt"), global_step=1)
result = {
    "world_size": dist.get_world_size(),
    "dp_size": engine.dp_size,
    "metrics": metrics,
    "weights": weights,
}
torch.save(result, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
