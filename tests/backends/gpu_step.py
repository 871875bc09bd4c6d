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


def main(argv: list[str]) -> None:
    strategy, model_dir, *overrides = argv
    extra = ["megatron.layer_spec=local"] if strategy == "megatron" else []
    engine = engine_for(model_dir, "model.dtype=bfloat16", "micro_batch_size=2", "optim.lr=1e-3", *extra, *overrides, strategy=strategy)
    batch = make_test_batch()
    with engine.train_mode():
        metrics = engine.train_batch(engine.shard_data(batch))
    with engine.eval_mode():
        out = engine.infer_batch(engine.shard_data(batch))
        out = None if out is None else engine.unshard_data(out)
    if os.environ.get("RANK", "0") != "0":
        return
    log_probs = [] if out is None else [row.float().cpu().tolist() for row in out["log_probs"].unbind()]
    print(json.dumps({"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]), "log_probs": log_probs}))
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
