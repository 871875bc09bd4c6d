"""Long context on the FSDP engine: activation memory per rank and step time, Ulysses SP=1 vs SP=2.

One training step (forward + backward, token-mean NLL) on one sequence of ``L`` tokens, for
each ``L``: at SP=1 on one process, at SP=2 on two processes that split the sequence
(``engine.fsdp.ulysses_sequence_parallel_size=2``; one DP rank, so both runs see the same
data). Each case runs in fresh processes with one torch thread each.

What is measured:

* ``act_mb`` (per rank): the activation peak of the measured step, the rank's peak memory
  during the step minus its memory just before it (the model, its gradients from the warm-up
  step and AdamW state are already resident). GPU: the CUDA allocator; CPU: the resident set
  (``benchmarks.memory.PeakMemory``: VmHWM reset before the step). The worse rank is reported.
* ``step_s``: the step's wall time (rank 0), the median of ``--rounds`` steps after a warm-up.
* ``a2a_s``: the time rank 0 spends inside the all-to-alls around attention (forward and
  backward; every ``dist.all_to_all_single`` call timed) per step, and ``a2a_share`` its part of
  the step. On this CPU with gloo over loopback they are memory copies through the kernel; on
  GPUs NCCL over NVLink.

Run: ``.venv/bin/python -m benchmarks.long_context [--quick] [--lengths 1024 2048 ...] [--json out.json]``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import ModelSpec, Report, Row, build_model, cli, command_line, emit, nll_loss, run_ranks, set_threads

SPEC = ModelSpec(
    vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688, max_position_embeddings=16384
)
LENGTHS = (1024, 2048, 4096, 8192)
QUICK_LENGTHS = (512, 1024)
MB = 2**20


def _timed_all_to_all(spent: list[float]):
    """Wrap ``torch.distributed.all_to_all_single`` so every call adds its seconds to ``spent``."""
    import torch.distributed as dist

    inner = dist.all_to_all_single

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    dist.all_to_all_single = timed


def _rank(rank: int, world: int, port: int, path: str, length: int, rounds: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    set_threads(1)
    from benchmarks.memory import PeakMemory
    from engine_api import build_engine, load_config, make_batch

    spent = [0.0]
    _timed_all_to_all(spent)
    engine = build_engine(
        load_config(None, ["strategy=fsdp", f"model.path={path}", "optim.lr=1e-4", f"fsdp.ulysses_sequence_parallel_size={world}"])
    )
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(length)
    mask[0] = 0  # position 0 predicts nothing
    batch = make_batch([torch.randint(0, SPEC.vocab_size, (length,), generator=g)], loss_mask=[mask])
    meter = PeakMemory()
    times, a2a, peaks = [], [], []
    with engine.train_mode():
        for step in range(rounds + 1):
            torch.distributed.barrier()
            before = meter.current()
            meter.reset()
            spent[0] = 0.0
            start = time.perf_counter()
            engine.train_batch(engine.shard_data(batch))
            if step:  # the first step allocates AdamW state: warm-up
                times.append(time.perf_counter() - start)
                a2a.append(spent[0])
                peaks.append(meter.peak() - before)
    worst = torch.tensor([max(peaks)], dtype=torch.float64)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        queue.put({"act_mb": float(worst) / MB, "step_s": statistics.median(times), "a2a_s": statistics.median(a2a)})
    torch.distributed.destroy_process_group()


def main(argv=None) -> Report:
    parser = cli(__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help=f"sequence lengths (default {LENGTHS})")
    parser.add_argument("--rounds", type=int, default=3, help="measured steps per case (after one warm-up step)")
    args = parser.parse_args(argv)
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    start = time.perf_counter()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (RSS), gloo"
    report = Report(
        benchmark="long_context",
        title=f"Long context: Ulysses SP=1 vs SP=2 on the FSDP engine, activation peak per rank and step time, {device}",
        command=command_line("benchmarks.long_context", argv),
        setup=(
            f"{SPEC.describe()}; one sequence of L tokens, one training step (forward + backward, NLL), sdpa attention; "
            f"SP=1: 1 process, SP=2: 2 processes (1 DP rank); 1 thread each; median of {args.rounds} steps after a warm-up."
        ),
    )
    # Before the ranks start (glibc reads it once): see the module docstring.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(os.path.join(tmp, "model"), SPEC)
        for length in lengths:
            one = run_ranks(_rank, 1, path, length, args.rounds)
            two = run_ranks(_rank, 2, path, length, args.rounds)
            report.rows.append(
                Row(
                    case=f"L={length}",
                    values={
                        "sp1_act_mb": round(one["act_mb"], 1),
                        "sp2_act_mb": round(two["act_mb"], 1),
                        "sp2/sp1_act": round(two["act_mb"] / max(one["act_mb"], 1e-9), 3),
                        "sp1_step_s": round(one["step_s"], 3),
                        "sp2_step_s": round(two["step_s"], 3),
                        "sp2_a2a_s": round(two["a2a_s"], 4),
                        "a2a_share": round(two["a2a_s"] / two["step_s"], 3),
                    },
                    target="SP=2 activation peak per rank <= 0.6x SP=1",
                    met=two["act_mb"] <= 0.6 * one["act_mb"],
                )
            )
    report.notes.append(
        "act_mb is the step's peak minus the memory held before it, on the worse rank. SP=2 holds half of every "
        "activation (its tokens for the MLPs and logits, its heads for attention) plus the all-to-all buffers of one layer."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
