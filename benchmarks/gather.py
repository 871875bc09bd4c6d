"""Gathering per-token outputs over data-parallel ranks: pickled objects vs tensor collectives.

``unshard_data`` (and every role's global gather of log-probs, values, entropy) used to move each
rank's TensorDict with ``all_gather_object``: a pickle to host bytes on every rank per call. It
now uses ``engine_api.dist.all_gather_rows``: the row lengths, then each field's flat values,
with ``all_gather`` on the communication device. This script times both on 2 gloo ranks (CPU)
for global batches of 64 to 4096 sequences of 64-512 tokens with two per-token float fields
(log-probs, entropy), the shape of an RL step's gathers. The median of several rounds per case,
both methods alternating in one run; the ratio is pickled / tensor.

Run: ``.venv/bin/python -m benchmarks.gather [--quick]``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import Report, Row, cli, command_line, emit, run_ranks

SIZES = (64, 256, 1024, 4096)


def _local(rank: int, world: int, n: int):
    from engine_api import make_batch

    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(64, 513, (n // world,), generator=g).tolist()
    seqs = [torch.zeros(k, dtype=torch.long) for k in lengths]
    return make_batch(seqs, log_probs=[torch.randn(k, generator=g) for k in lengths], entropy=[torch.rand(k, generator=g) for k in lengths])


def _pickled(local):
    from engine_api.dist import all_gather_objects

    shards = all_gather_objects(local.cpu(), None)
    return torch.cat(shards)


def _worker(rank: int, world: int, port: int, rounds: int, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from engine_api.batch import unshard_batch

    results = {}
    for n in SIZES:
        local = _local(rank, world, n)
        times = {"pickled": [], "tensor": []}
        for _ in range(rounds):
            for name, fn in (("pickled", _pickled), ("tensor", lambda b: unshard_batch(b, None))):
                dist.barrier()
                t0 = time.perf_counter()
                gathered = fn(local)
                times[name].append(time.perf_counter() - t0)
        tokens = int(gathered["input_ids"].values().numel())
        results[n] = {name: statistics.median(v) for name, v in times.items()} | {"tokens": tokens}
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> Report:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    rounds = 3 if args.quick else 9
    start = time.perf_counter()
    results = run_ranks(_worker, 2, rounds, timeout=600)
    report = Report(
        benchmark="gather",
        title="Gathering per-token outputs over 2 DP ranks: pickled objects vs tensor collectives (CPU, gloo)",
        command=command_line("benchmarks.gather", argv),
        setup=f"2 ranks; sequences of 64-512 tokens, fields input_ids (int64), log_probs and entropy (fp32); median of {rounds} rounds.",
    )
    for n, r in results.items():
        report.rows.append(
            Row(
                case=f"{n} sequences ({r['tokens']:,} tokens)",
                values={"pickled_ms": r["pickled"] * 1e3, "tensor_ms": r["tensor"] * 1e3, "pickled/tensor": r["pickled"] / r["tensor"]},
                target="tensor not slower (ratio >= 1)",
                met=r["pickled"] >= r["tensor"],
            )
        )
    report.notes.append("On NCCL the pickled path also copies device->host and back per call; the tensor path stays on the device.")
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
