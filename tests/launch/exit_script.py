"""A finished script with no teardown of its own (issue 28): build an engine, train one batch,
infer, print, fall off the end. Usage: ``[torchrun ...] exit_script.py OUT_DIR MODEL_DIR STRATEGY``.

An ``atexit`` handler registered before the engine exists runs after the engine's own exit
handlers (LIFO) and records, per rank, whether a process group was still alive at that point.
"""

import atexit
import os
import sys

import torch
import torch.distributed as dist

out_dir, model_dir, strategy = sys.argv[1:4]


def _record() -> None:
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out_dir, f"exit{rank}.txt"), "w") as f:
        f.write(f"group_alive={dist.is_initialized()}\n")


atexit.register(_record)

from engine_api import build_engine, load_config  # noqa: E402 - after the handler, on purpose
from tests.support.hf_utils import make_test_batch, pg_loss  # noqa: E402

torch.set_num_threads(1)
engine = build_engine(load_config(f"configs/engine/{strategy}.yaml", [f"model.path={model_dir}", "optim.lr=1e-2"]))
engine.init_model()
engine.set_loss_fn(pg_loss)
batch = engine.shard_data(make_test_batch(seed=0))
with engine.train_mode():
    engine.train_batch(batch)
with engine.eval_mode():
    out = engine.infer_batch(batch)
print(f"done rank {dist.get_rank()} {float(out['log_probs'].values().sum()):.6f}", flush=True)
