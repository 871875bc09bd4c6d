"""Shared pieces of the benchmark scripts: models, batches, the loss, interleaved timing, reports.

Timing is built for a noisy shared machine: the cases of one comparison run in alternating
order (A B, B A, ...) round after round, each round gives one engine/baseline *ratio*, and the
report is the median of those ratios with its interquartile range. Slow drift in background
load then moves both sides of a ratio together instead of biasing whichever ran later.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from posttrain.tiny_model import TinyModelConfig, build_tiny_model

# ---------------------------------------------------------------------------------- models


@dataclass(frozen=True, kw_only=True)
class ModelSpec(TinyModelConfig):
    """A Llama-style model built from a config: the tiny model's declaration
    (``posttrain.tiny_model.TinyModelConfig``: family, dimensions, seed) at a benchmark's size,
    with the vocabulary and positions the benchmark's data needs."""

    vocab_size: int
    max_position_embeddings: int = 2048

    def params(self) -> int:
        """Parameter count (untied embeddings, GQA attention, SwiGLU MLP, RMSNorms)."""
        h, kv = self.hidden_size, self.hidden_size // self.num_heads * self.num_kv_heads
        layer = h * h * 2 + h * kv * 2 + 3 * h * self.intermediate_size + 2 * h
        return 2 * self.vocab_size * h + self.num_layers * layer + h

    def describe(self) -> str:
        return (
            f"Llama-style {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads / {self.num_kv_heads} KV, "
            f"FFN {self.intermediate_size}, vocab {self.vocab_size} ({self.params() / 1e6:.1f}M params)"
        )


def build_model(path: str, spec: ModelSpec, seed: int | None = None) -> str:
    """Build the model from its config with a fixed seed (``seed``; None: ``spec.seed``, 0 unless
    set) and ``save_pretrained`` it to ``path``."""
    return build_tiny_model(path, **asdict(spec if seed is None else replace(spec, seed=seed)))


# ---------------------------------------------------------------------------------- data


def uniform_lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    """``n`` lengths drawn uniformly from ``[low, high]`` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int, seed: int) -> list[int]:
    """``n`` log-normal lengths (``median`` = exp(mu)) clipped to ``[low, high]`` (seeded):
    many short sequences and a long tail, like real prompt + response lengths."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.log(torch.tensor(float(median))) + sigma * torch.randn(n, generator=g, dtype=torch.float64))
    return x.round().clamp(low, high).long().tolist()


def random_batch(lengths: Sequence[int], vocab_size: int, seed: int = 0):
    """A protocol batch of random tokens; the loss mask is the default (every position but 0)."""
    from engine_api import make_batch

    g = torch.Generator().manual_seed(seed)
    return make_batch([torch.randint(0, vocab_size, (n,), generator=g) for n in lengths])


def micro_batch_rows(batch, micro_batches) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The hand-written loops' micro-batches, in plain torch: ``(ids, loss_mask, offsets)`` flat,
    per micro-batch. ``micro_batches``: a count (consecutive, near-equal numbers of sequences)
    or a list of row-index tensors (e.g. the engine's dynamic-batching parts, so both sides run
    the same micro-batches; the gather is inside the caller's timed step, as it would be in a
    user's loop)."""
    ids, offsets, mask = batch["input_ids"].values(), batch["input_ids"].offsets(), batch["loss_mask"].values()
    if isinstance(micro_batches, int):
        n_seq = offsets.numel() - 1
        bounds = [round(i * n_seq / micro_batches) for i in range(micro_batches + 1)]
        out = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            a, b = int(offsets[lo]), int(offsets[hi])
            out.append((ids[a:b], mask[a:b], offsets[lo : hi + 1] - a))
        return out
    lengths = offsets.diff()
    out = []
    for rows in micro_batches:
        part = lengths[rows]
        starts = torch.cat([part.new_zeros(1), part.cumsum(0)])
        token = torch.repeat_interleave(offsets[:-1][rows] - starts[:-1], part) + torch.arange(int(starts[-1]))
        out.append((ids[token], mask[token], starts))
    return out


def nll_loss(mb, out, norm):
    """Token-mean negative log-likelihood through the engine's normalization (``agg_loss``), on
    the flat per-token values (as the roles write their losses; the raw loops are flat too)."""
    from engine_api import agg_loss

    return agg_loss(-out["log_probs"].values(), mb["loss_mask"], norm), {}


def engine_overrides(path: str, *extra: str) -> list[str]:
    """Config overrides shared by engine and baseline: AdamW lr 1e-4, wd 0.01, clip 1.0, fp32."""
    return [f"model.path={path}", "optim.lr=1e-4", "optim.weight_decay=0.01", "optim.clip_grad=1.0", *extra]


def build_fsdp_engine(path: str, *extra: str):
    """An initialised FSDP engine with :func:`nll_loss` (through the registry, as a recipe does)."""
    from engine_api import build_engine, load_config

    engine = build_engine(load_config(None, ["strategy=fsdp", *engine_overrides(path, *extra)]))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return engine


# ---------------------------------------------------------------------------------- timing


@dataclass
class Timings:
    """Per-round times of one case: wall clock and this process's CPU time.

    With one compute thread (the default here) and nothing to wait for, CPU time is the step
    time minus the time the OS gave to *other* processes, which is what makes ratios stable on
    a shared machine; wall time is kept and reported too.
    """

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def interleaved_times(cases: dict[str, Callable[[], object]], rounds: int, warmup: int = 2) -> dict[str, Timings]:
    """Wall and CPU times of each case over ``rounds`` rounds; the case order alternates every round.

    ``warmup`` untimed rounds come first (allocator, autograd graph caches, lazy inits). A
    ``gc.collect()`` before each timed call keeps one case's garbage from being collected on
    the other's clock. GPU cases must synchronise inside their callable.
    """
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            cases[name]()
    times = {name: Timings() for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            cases[name]()
            times[name].cpu.append(time.process_time() - cpu)
            times[name].wall.append(time.perf_counter() - wall)
    return times


def quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> tuple[float, float, float]:
    """Quartiles of the per-round ratios ``num[r] / den[r]`` (same-round pairs share the load)."""
    return quantiles([a / b for a, b in zip(num, den, strict=True)])


def median_ci(xs: Sequence[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap confidence interval of the median of ``xs`` (seeded, so reruns agree): how far
    the median could move with other draws of the same noise."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


# ---------------------------------------------------------------------------------- reports


@dataclass
class Row:
    """One result row: a case, its measured values (ordered columns), the target and verdict."""

    case: str
    values: dict[str, object]
    target: str = ""
    met: bool | None = None
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)  # per-round times, in the JSON only


@dataclass
class Report:
    """What one script produced; ``run_all`` renders it into BENCHMARKS.md."""

    benchmark: str
    title: str
    command: str
    setup: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_ranks(target: Callable[..., None], world: int, *args, timeout: float = 900) -> object:
    """Run ``target(rank, world, port, *args, queue)`` in ``world`` spawned processes that
    rendezvous on a free localhost port; return what rank 0 puts on ``queue``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, world, port, *args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout)
    for p in procs:
        p.join(60)
    return result


def cli(description: str) -> argparse.ArgumentParser:
    """The common CLI: ``--json PATH`` writes the report, ``--quick`` runs fewer rounds,
    ``--threads`` sets torch's intra-op threads (see :func:`set_threads`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", default=None, help="write the report as JSON here (used by benchmarks.run_all)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke test; noisier)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1: see benchmarks.common)")
    return parser


def set_threads(n: int) -> None:
    """Set torch's CPU intra-op threads. One by default: on a shared machine, OpenMP teams
    that wait for a preempted thread at every barrier made step times vary several-fold
    (measured); one thread keeps the comparison about the code, not the scheduler."""
    torch.set_num_threads(n)


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run (without ``--json``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--json" in args:
        i = args.index("--json")
        del args[i : i + 2]
    return " ".join([".venv/bin/python -m", module, *args])


def emit(report: Report, json_path: str | None) -> None:
    """Print the report as a table and write it as JSON when asked."""
    print(f"\n## {report.title}\n{report.setup}\n")
    for row in report.rows:
        verdict = {True: "MET", False: "MISSED", None: "-"}[row.met]
        values = ", ".join(f"{k}={_fmt(v)}" for k, v in row.values.items())
        print(f"- {row.case}: {values} | target {row.target or '-'}: {verdict} {row.note}")
    for note in report.notes:
        print(f"  note: {note}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(asdict(report), f, indent=1)


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def machine_info() -> dict[str, object]:
    """What the numbers were measured on (CPU, cores, library versions, load)."""
    import importlib.metadata as md

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron-core": version("megatron-core"),
        "transformers": version("transformers"),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
