"""Remove-padding (packed) vs padded train steps through the FSDP engine, on skewed lengths.

One batch of log-normal lengths (many short sequences, a long tail) runs through three engines
on the same HF directory: padded (``use_remove_padding=false``: every sequence padded to the
longest), packed as one row (``use_remove_padding=true``), and packed with dynamic batching
(``max_token_len_per_micro_batch`` = the length cap: several rows of at most that many real
tokens). Reported per packed case: real-token throughput relative to padded, and the target
check from the issue: packed time <= 1.2 x (real tokens / padded tokens) x padded time, i.e.
cost follows real tokens.

On CPU, HF's packed rows run SDPA with a dense block-diagonal mask over the whole row, so
attention costs (tokens in the row)^2 rather than the sum of per-sequence squares; flash-attn's
varlen kernels (the engine's choice on CUDA) do not have that cost. The dynamic-batching case
bounds the row length, which bounds that quadratic term.

Run: ``.venv/bin/python -m benchmarks.packing [--quick] [--json out.json]``.
"""

from __future__ import annotations

import contextlib
import tempfile
import time

from benchmarks.common import (
    ModelSpec,
    Report,
    Row,
    build_fsdp_engine,
    build_model,
    cli,
    command_line,
    emit,
    interleaved_times,
    lognormal_lengths,
    paired_ratio,
    quantiles,
    random_batch,
    set_threads,
)

SPEC = ModelSpec(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688)
# The issue asks for 16..1024; on a 2-core CPU a padded 1024-token batch takes tens of seconds
# per step, so the CPU run caps at 512 (stated in the report). The shape of the distribution
# (median 96, sigma 0.9) is kept.
N_SEQ, MEDIAN, SIGMA, LOW, CAP = 16, 96, 0.9, 16, 512
SLACK = 1.2


def main(argv=None) -> Report:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    set_threads(args.threads)
    rounds, warmup = (2, 1) if args.quick else (3, 1)
    start = time.perf_counter()
    lengths = lognormal_lengths(N_SEQ, MEDIAN, SIGMA, LOW, CAP, seed=0)
    real, padded_tokens = sum(lengths), len(lengths) * max(lengths)
    fraction = real / padded_tokens
    report = Report(
        benchmark="packing",
        title="Packing: remove-padding vs padded train step (FSDP engine, CPU, fp32)",
        command=command_line("benchmarks.packing", argv),
        setup=(
            f"{SPEC.describe()}; {N_SEQ} sequences, log-normal lengths (median {MEDIAN}, sigma {SIGMA}) clipped to {LOW}..{CAP} "
            f"(cap 512 instead of 1024 on CPU to keep a padded step to seconds): {real} real tokens, {padded_tokens} padded "
            f"(real/padded = {fraction:.3f}), longest {max(lengths)}; {args.threads} torch thread(s); "
            f"{rounds} interleaved rounds after {warmup} warm-up; per-process CPU time."
        ),
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_") as tmp:
        path = build_model(tmp, SPEC)
        batch = random_batch(lengths, SPEC.vocab_size)
        engines = {
            "padded": build_fsdp_engine(path, "use_remove_padding=false"),
            "packed, one row": build_fsdp_engine(path, "use_remove_padding=true"),
            f"packed, dynamic batching ({CAP} tokens/micro-batch)": build_fsdp_engine(
                path, "use_remove_padding=true", f"max_token_len_per_micro_batch={CAP}"
            ),
        }
        with contextlib.ExitStack() as stack:
            for engine in engines.values():
                stack.enter_context(engine.train_mode())
            times = interleaved_times({name: (lambda e=e: e.train_batch(batch)) for name, e in engines.items()}, rounds, warmup)
    t_padded = quantiles(times["padded"].cpu)[1]
    report.rows.append(
        Row(
            case="padded",
            values={"step_s": t_padded, "real_tok_per_s": real / t_padded, "throughput_vs_padded": 1.0, "time_vs_padded": 1.0},
        )
    )
    for name in list(engines)[1:]:
        lo, ratio, hi = paired_ratio(times[name].cpu, times["padded"].cpu)  # packed / padded time
        bound = SLACK * fraction
        t = quantiles(times[name].cpu)[1]
        report.rows.append(
            Row(
                case=name,
                values={
                    "step_s": t,
                    "real_tok_per_s": real / t,
                    "throughput_vs_padded": 1.0 / ratio,
                    "time_vs_padded": ratio,
                    "time_vs_padded_iqr": f"{lo:.3f}-{hi:.3f}",
                    "bound": bound,
                },
                target=f"time/padded <= {SLACK} x real/padded = {bound:.3f}",
                met=ratio <= bound,
                note="" if ratio <= bound else f"{ratio / bound:.2f}x the bound",
            )
        )
    report.notes.append(
        "real/padded counts tokens; attention in the padded case costs sum over rows of (longest)^2, in a packed row (row tokens)^2 "
        "on CPU SDPA (dense block-diagonal mask), so packed time cannot fall to real/padded when one row holds the whole batch."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
