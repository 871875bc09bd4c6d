"""Weight export for rollout sync: per-tensor vs bucketed FSDP export vs a raw state_dict copy.

Seconds per GB of fp32 weights, on 1 and 2 gloo ranks (CPU): ``export_weights()`` (one
``full_tensor`` all-gather per tensor), ``export_weights(bucket_mb=B)`` (one all-gather per
bucket, ``backends/fsdp/export.py``), and the floor: copying an unsharded HF model's
``state_dict`` tensor by tensor in the same process. Median of several rounds; the target is
bucketed within 1.5x of the raw copy.

Run: ``.venv/bin/python -m benchmarks.export_buckets [--quick] [--bucket-mb 512]``.
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


def _worker(rank: int, world: int, port: int, path: str, rounds: int, bucket_mb: float, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from engine_api import build_engine, load_config

    engine = build_engine(load_config(None, ["strategy=fsdp", f"model.path={path}"]))
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
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else 5
    start = time.perf_counter()
    report = Report(
        benchmark="export_buckets",
        title="Weight export: per-tensor vs bucketed FSDP export vs raw state_dict copy (CPU, gloo)",
        command=command_line("benchmarks.export_buckets", argv),
        setup=f"{SPEC.describe()}, fp32; bucket {args.bucket_mb:g} MB; median of {rounds} rounds; s_per_GB = seconds / GB exported.",
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_") as tmp:
        path = build_model(tmp, SPEC)
        raw = _raw_copy(path, rounds)
        gb = SPEC.params() * 4 / 1e9
        for world in (1, 2):
            r = run_ranks(_worker, world, path, rounds, args.bucket_mb)
            gb = r["bytes"] / 1e9
            report.rows.append(
                Row(
                    case=f"{world} rank(s)",
                    values={
                        "raw_copy_s_per_GB": raw / gb,
                        "per_tensor_s_per_GB": r["per_tensor"] / gb,
                        "bucketed_s_per_GB": r["bucketed"] / gb,
                        "bucketed/raw": r["bucketed"] / raw,
                    },
                    target="bucketed <= 1.5x raw copy",
                    met=r["bucketed"] <= 1.5 * raw,
                )
            )
    report.notes.append("raw copy: one process, unsharded HF model, state_dict tensors cloned one by one (no communication).")
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
