"""One bf16 train step on the GPU for ``tests/backends/test_gpu_parity.py``, in its own process
(megatron's parallel state is process-global): ``python -m tests.backends.gpu_step STRATEGY
MODEL_DIR [override ...]`` prints one JSON line with the step's loss, grad norm and the
engine's log-probs of the batch after the step (the whole batch, printed by rank 0 under torchrun)."""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.support.hf_utils import engine_for, make_test_batch


def step(strategy: str, model_dir: str, *overrides: str, dtype: str = "bfloat16", engine_hook=None) -> dict:
    """One train step of ``make_test_batch()`` in ``dtype``; the loss, the grad norm and the
    log-probs of the batch after the step (the whole batch; ``[]`` off the output ranks).
    ``engine_hook(engine)`` runs after the step (e.g. to inspect parameter dtypes)."""
    extra = ["megatron.layer_spec=local"] if strategy == "megatron" else []
    engine = engine_for(model_dir, f"model.dtype={dtype}", "micro_batch_size=2", "optim.lr=1e-3", *extra, *overrides, strategy=strategy)
    batch = make_test_batch()
    with engine.train_mode():
        metrics = engine.train_batch(engine.shard_data(batch))
    with engine.eval_mode():
        out = engine.infer_batch(engine.shard_data(batch))
        out = None if out is None else engine.unshard_data(out)
    if engine_hook is not None:
        engine_hook(engine)
    log_probs = [] if out is None else [row.float().cpu().tolist() for row in out["log_probs"].unbind()]
    return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]), "log_probs": log_probs}


def main(argv: list[str]) -> None:
    strategy, model_dir, *overrides = argv
    result = step(strategy, model_dir, *overrides)
    if os.environ.get("RANK", "0") != "0":
        return
    print(json.dumps(result))
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
