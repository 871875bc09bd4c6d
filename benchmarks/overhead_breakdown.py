"""Where the FSDP engine's per-micro-batch overhead goes, without a profiler's distortion.

Wraps the engine-side functions of one train step (micro-batch split, batch validation,
normalization context, device moves, packing, row layout, log-probs, the jagged view of the
outputs, the loss reduction) and the model's forward, ``backward`` and the optimizer step with
per-process CPU timers, then runs ``train_batch`` on the tiny model of :mod:`benchmarks.overhead`
with 1 and 4 micro-batches. The wrappers add a few microseconds per call; cProfile (in
:mod:`benchmarks.profile_step`) adds far more to Python-heavy code, so this listing is the
one to read for the sizes of the engine-side pieces.

Run: ``.venv/bin/python -m benchmarks.overhead_breakdown [--rounds N]``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import tempfile
import time

import torch

from benchmarks.common import build_fsdp_engine, build_model, random_batch, set_threads
from benchmarks.overhead import LENGTHS, TINY

PIECES = {
    "engine_api.step": ("make_micro_batches", "validate_call", "build_norm_context", "to_device"),
    "backends.fsdp.forward": ("pack", "packed_rows", "token_log_probs", "unpack"),
    "engine_api.losses": ("agg_numerator",),
}


def _timed(table: collections.Counter, key: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key] += time.process_time() - start

    return wrapper


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    set_threads(1)
    table: collections.Counter = collections.Counter()
    for module_name, names in PIECES.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, _timed(table, f"{module_name}.{name}", getattr(module, name)))
    backward = torch.Tensor.backward
    torch.Tensor.backward = _timed(table, "autograd backward", backward)
    path = build_model(tempfile.mkdtemp(prefix="ek_breakdown_"), TINY)
    batch = random_batch(LENGTHS, TINY.vocab_size)
    totals = {}
    for n_micro, mbs in ((1, None), (4, 2)):
        engine = build_fsdp_engine(path, *([f"micro_batch_size={mbs}"] if mbs else []))
        engine.model.forward = _timed(table, "model forward", engine.model.forward)
        engine.optimizer_step = _timed(table, "optimizer step", engine.optimizer_step)
        with engine.train_mode():
            for _ in range(5):
                engine.train_batch(batch)
            table.clear()
            start = time.process_time()
            for _ in range(args.rounds):
                engine.train_batch(batch)
            totals[n_micro] = (time.process_time() - start) / args.rounds
        print(f"\n{n_micro} micro-batch(es): train_batch {totals[n_micro] * 1e3:.2f} ms/step (CPU time, {args.rounds} steps)")
        for key, seconds in sorted(table.items(), key=lambda kv: -kv[1]):
            print(f"  {seconds / args.rounds * 1e3:7.2f} ms  {key}")
    torch.Tensor.backward = backward


if __name__ == "__main__":
    main()
