"""Weight export for rollout sync: per-tensor vs bucketed export vs a raw state_dict copy.

Seconds per GB of fp32 weights (CPU, gloo): ``export_weights()`` (one collective per tensor)
and ``export_weights(bucket_mb=B)`` (one per bucket) of the FSDP engine on 1 and 2 ranks
(``backends/fsdp/export.py``) and of the megatron engine at TP=1, TP=2 and PP=2 on 1-2 ranks
(``backends/megatron/export.py``: a TP all-gather and a PP broadcast per bucket), against the
floor: copying an unsharded HF model's ``state_dict`` tensor by tensor in one process. Median
of several rounds; the target is bucketed within 1.5x of the raw copy.

Run: ``.venv/bin/python -m benchmarks.export_buckets [--quick] [--bucket-mb 512] [--backends fsdp megatron]``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.common import ModelSpec, Report, Row, build_model, cli, command_line, emit, run_ranks

SPEC = ModelSpec(vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1376)


# case -> (backend, ranks, engine overrides)
CASES = {
    "fsdp, 1 rank": ("fsdp", 1, []),
    "fsdp, 2 ranks": ("fsdp", 2, []),
    "megatron, 1 rank": ("megatron", 1, []),
    "megatron, TP=2": ("megatron", 2, ["megatron.tensor_model_parallel_size=2"]),
    "megatron, PP=2": ("megatron", 2, ["megatron.pipeline_model_parallel_size=2"]),
}


def _worker(rank: int, world: int, port: int, path: str, rounds: int, bucket_mb: float, backend: str, overrides: list, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from engine_api import build_engine, load_config

    engine = build_engine(load_config(None, [f"strategy={backend}", f"model.path={path}", *overrides]))
    engine.init_model()
    times = {"per_tensor": [], "bucketed": []}
    nbytes = 0
    for _ in range(rounds):
        for name, kwargs in (("per_tensor", {}), ("bucketed", {"bucket_mb": bucket_mb})):
            dist.barrier()
            t0 = time.perf_counter()
            nbytes = sum(t.numel() * t.element_size() for _, t in engine.export_weights(**kwargs))
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in times.items()} | {"bytes": nbytes})
    dist.barrier()
    dist.destroy_process_group()


def _raw_copy(path: str, rounds: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        copied = {k: v.detach().clone() for k, v in model.state_dict().items()}
        times.append(time.perf_counter() - t0)
        del copied
    return statistics.median(times)


def main(argv=None) -> Report:
    parser = cli(__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--backends", nargs="+", default=["fsdp", "megatron"], choices=["fsdp", "megatron"])
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else 5
    start = time.perf_counter()
    report = Report(
        benchmark="export_buckets",
        title="Weight export: per-tensor vs bucketed export vs raw state_dict copy (CPU, gloo)",
        command=command_line("benchmarks.export_buckets", argv),
        setup=f"{SPEC.describe()}, fp32; bucket {args.bucket_mb:g} MB; median of {rounds} rounds; s_per_GB = seconds / GB exported.",
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_") as tmp:
        path = build_model(tmp, SPEC)
        raw = _raw_copy(path, rounds)
        gb = SPEC.params() * 4 / 1e9
        for case, (backend, world, overrides) in CASES.items():
            if backend not in args.backends:
                continue
            r = run_ranks(_worker, world, path, rounds, args.bucket_mb, backend, overrides)
            gb = r["bytes"] / 1e9
            report.rows.append(
                Row(
                    case=case,
                    values={
                        "raw_copy_s_per_GB": raw / gb,
                        "per_tensor_s_per_GB": r["per_tensor"] / gb,
                        "bucketed_s_per_GB": r["bucketed"] / gb,
                        "bucketed/raw": r["bucketed"] / raw,
                        "per_tensor/bucketed": r["per_tensor"] / r["bucketed"],
                    },
                    target="bucketed <= 1.5x raw copy",
                    met=r["bucketed"] <= 1.5 * raw,
                )
            )
    report.notes.append("raw copy: one process, unsharded HF model, state_dict tensors cloned one by one (no communication).")
    report.notes.append(
        "megatron exports on CPU: the HF layout conversion (fused QKV / gate-up split) and the copy to CPU happen at every "
        "layout; at TP=2 each split parameter is also gathered, at PP=2 every tensor is broadcast from its stage."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
