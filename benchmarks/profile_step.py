"""Profiles behind the benchmark rows that miss their targets: where the time goes.

``--case overhead``: cProfile of the engine's train step and the hand-written step (the
:mod:`benchmarks.overhead` setup), per backend; prints each side's step time under the
profiler and, for the engine, the engine-side functions (``engine_api``, ``backends``, the
nested-tensor and TensorDict layers they use, megatron's optimizer) by cumulative time per step.
cProfile slows Python-heavy code more than tensor kernels, so the listed costs are upper bounds;
the benchmark rows, not this listing, are the measurements.

``--case packing``: torch.profiler operator table of one packed-one-row and one
dynamic-batching step of the :mod:`benchmarks.packing` setup (attention's share of the step).

Run: ``.venv/bin/python -m benchmarks.profile_step --case overhead|packing [--backends fsdp megatron]``.
"""

from __future__ import annotations

import concurrent.futures
import cProfile
import io
import multiprocessing
import pstats
import tempfile
import time

from benchmarks.common import build_fsdp_engine, build_model, cli, engine_overrides, nll_loss, random_batch, set_threads

ENGINE_SIDE = r"engine_api/|backends/|tensordict/_td|torch/nested/|megatron/core/optimizer/(optimizer|clip_grads)|cpu_compat"
STEPS = 3


def _profile(fn, steps: int) -> pstats.Stats:
    fn()
    # CPU time, not wall time: other processes' load must not show up as our cost.
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    return pstats.Stats(prof)


def _listing(stats: pstats.Stats, steps: int, pattern: str, limit: int) -> str:
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("cumulative").print_stats(pattern, limit)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    rows = [f"{'ms/step':>9} {'calls/step':>10}  function"]
    for line in lines[start + 1 :]:
        parts = line.split(None, 5)
        if len(parts) == 6:
            calls = parts[0].split("/")[0]
            rows.append(f"{1e3 * float(parts[3]) / steps:9.2f} {int(calls) / steps:10.1f}  {parts[5].replace('/work/main/', '')}")
    return "\n".join(rows)


def _overhead_profiles(backend: str, path: str, threads: int) -> str:
    """Runs in a spawned process (megatron's state is process-global; FSDP kept alike): every
    :data:`benchmarks.overhead.CASES` entry of one backend."""
    from benchmarks.overhead import CASES

    set_threads(threads)
    return "\n\n".join(_overhead_profile(backend, path, mbs) for mbs in CASES.values())


def _overhead_profile(backend: str, path: str, micro_batch_size: int | None) -> str:
    from benchmarks.overhead import LENGTHS, SPEC

    batch = random_batch(LENGTHS, SPEC.vocab_size)
    extra = [f"micro_batch_size={micro_batch_size}"] if micro_batch_size else []
    n_micro = len(LENGTHS) // micro_batch_size if micro_batch_size else 1
    if backend == "fsdp":
        from benchmarks.raw_fsdp import RawFSDPTrainer

        engine, raw = build_fsdp_engine(path, *extra), RawFSDPTrainer(path)
    else:
        from benchmarks.raw_megatron import RawMegatronTrainer
        from engine_api import build_engine, load_config

        config = load_config(None, ["strategy=megatron", "megatron.layer_spec=local", *engine_overrides(path, *extra)])
        engine = build_engine(config)
        engine.init_model()
        engine.set_loss_fn(nll_loss)
        raw = RawMegatronTrainer(config)
    with engine.train_mode():
        e_stats = _profile(lambda: engine.train_batch(batch), STEPS)
        r_stats = _profile(lambda: raw.step(batch, n_micro), STEPS)
    head = (
        f"### {backend}, {n_micro} micro-batch(es): CPU time under cProfile, engine {1e3 * e_stats.total_tt / STEPS:.1f} ms/step "
        f"({e_stats.total_calls / STEPS:.0f} calls), raw {1e3 * r_stats.total_tt / STEPS:.1f} ms/step ({r_stats.total_calls / STEPS:.0f} calls)"
    )
    return head + "\n\n" + _listing(e_stats, STEPS, ENGINE_SIDE, 40)


def _packing_profile(path: str, threads: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.packing import CAP, LOW, MEDIAN, N_SEQ, SIGMA, SPEC, lognormal_lengths

    set_threads(threads)
    batch = random_batch(lognormal_lengths(N_SEQ, MEDIAN, SIGMA, LOW, CAP, seed=0), SPEC.vocab_size)
    out = []
    for name, extra in (("packed, one row", []), (f"packed, dynamic batching ({CAP})", [f"max_token_len_per_micro_batch={CAP}"])):
        engine = build_fsdp_engine(path, *extra)
        with engine.train_mode():
            engine.train_batch(batch)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.train_batch(batch)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        attn = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
        out.append(f"### {name}: {total / 1e6:.2f} s CPU, attention kernels {100 * attn / total:.0f}%\n")
        out.append(events.table(sort_by="self_cpu_time_total", row_limit=8))
    return "\n".join(out)


def main(argv=None) -> str:
    parser = cli(__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["overhead", "packing"], default="overhead")
    parser.add_argument("--backends", nargs="+", default=["fsdp", "megatron"], choices=["fsdp", "megatron"])
    args = parser.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    sections = []
    with tempfile.TemporaryDirectory(prefix="ek_prof_") as tmp:
        if args.case == "packing":
            from benchmarks.packing import SPEC

            sections.append(_packing_profile(build_model(tmp, SPEC), args.threads))
        else:
            from benchmarks.overhead import SPEC

            path = build_model(tmp, SPEC)
            for backend in args.backends:
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
                    sections.append(pool.submit(_overhead_profiles, backend, path, args.threads).result())
    text = "\n\n".join(sections)
    print(text)
    return text


if __name__ == "__main__":
    main()
