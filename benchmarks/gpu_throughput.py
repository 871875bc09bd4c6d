"""GPU throughput: tokens/s and MFU of a ~0.9B Llama-style model, bf16, packed, both backends.

The model is built from a config (no download): 16 layers, hidden 2048, 16 heads / 8 KV heads,
SwiGLU 5632, vocab 32000 (~0.89B parameters). One global batch of log-normal lengths
(16..2048 tokens) trains with dynamic batching (a real-token budget per micro-batch), bf16
compute with fp32 master weights and AdamW, on one GPU. Each backend runs in its own spawned
process (megatron's parallel state is process-global); megatron uses the Transformer-Engine
layer spec when TE imports (``megatron.layer_spec=auto``), else the local spec.

MFU = model FLOPs / (step time x peak dense bf16 FLOP/s). Model FLOPs per step (the PaLM /
Megatron convention): 6 x N x tokens + 12 x layers x hidden x sum(len^2), with N the
parameters excluding the input embedding, and attention counted as non-causal. Peak: 989
TFLOP/s (H100 SXM dense bf16; H200 has the same tensor cores); ``--peak-tflops`` overrides.
Tokens are real (unpadded) tokens.

Without CUDA the script prints "no CUDA; skipped" and exits 0 (``--smoke`` instead runs the
same code path on CPU with a tiny model in fp32, to check the plumbing; no MFU).

Run: ``.venv/bin/python -m benchmarks.gpu_throughput [--backends fsdp megatron] [--json out.json]``.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import tempfile
import time

import torch

from benchmarks.common import ModelSpec, Report, Row, build_model, cli, command_line, emit, lognormal_lengths, nll_loss, random_batch

GPU_SPEC = ModelSpec(
    vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632, max_position_embeddings=4096
)
SMOKE_SPEC = ModelSpec(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
H100_PEAK_TFLOPS = 989.0
TARGET_MFU = 0.45


def model_flops(spec: ModelSpec, lengths: list[int]) -> float:
    """Training FLOPs of one step over ``lengths`` (see the module docstring)."""
    n = spec.params() - spec.vocab_size * spec.hidden_size  # the input embedding is a lookup
    return 6.0 * n * sum(lengths) + 12.0 * spec.num_layers * spec.hidden_size * sum(x * x for x in lengths)


def run_backend(backend: str, path: str, lengths: list[int], vocab: int, max_tokens: int, steps: int, warmup: int, smoke: bool) -> dict:
    """In a spawned process: build the engine, warm up, time ``steps`` train steps (synchronised)."""
    from engine_api import build_engine, load_config

    overrides = [
        f"strategy={backend}",
        f"model.path={path}",
        f"model.dtype={'float32' if smoke else 'bfloat16'}",
        "use_remove_padding=true",
        f"max_token_len_per_micro_batch={max_tokens}",
        "optim.lr=1e-5",
    ]
    engine = build_engine(load_config(None, overrides))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    batch = random_batch(lengths, vocab)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    info = {}
    if backend == "megatron":
        from backends.megatron.model import use_te_spec

        info["layer_spec"] = "transformer-engine" if use_te_spec(engine.config) else "local"
    else:
        info["attn"] = getattr(engine.model.config, "_attn_implementation", "?")
    with engine.train_mode():
        for _ in range(warmup):
            engine.train_batch(batch)
        sync()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.train_batch(batch)
            sync()
            times.append(time.perf_counter() - start)
    times.sort()
    info["step_s"] = times[len(times) // 2]
    info["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return info


def main(argv=None) -> Report:
    parser = cli(__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["fsdp", "megatron"], choices=["fsdp", "megatron"])
    parser.add_argument("--peak-tflops", type=float, default=H100_PEAK_TFLOPS, help="peak dense bf16 TFLOP/s of the GPU")
    parser.add_argument("--smoke", action="store_true", help="run the code path on CPU with a tiny fp32 model (no MFU)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    smoke = args.smoke and not cuda
    spec = SMOKE_SPEC if smoke else GPU_SPEC
    cap, n_seq, budget = (128, 8, 256) if smoke else (2048, 64, 16384)
    lengths = lognormal_lengths(n_seq, cap / 4, 1.0, 16, cap, seed=0)
    report = Report(
        benchmark="gpu_throughput",
        title="GPU throughput: tokens/s and MFU, ~0.9B Llama-style, bf16, packed",
        command=command_line("benchmarks.gpu_throughput", argv),
        setup=(
            f"{spec.describe()}; {n_seq} sequences, log-normal lengths 16..{cap} ({sum(lengths)} real tokens), dynamic batching "
            f"{budget} tokens/micro-batch; peak {args.peak_tflops:g} TFLOP/s dense bf16 (H100 SXM); median of 5 steps after 2 warm-up."
        ),
    )
    if not cuda and not smoke:
        print("no CUDA; skipped")
        report.rows.append(
            Row(case="fsdp and megatron", values={"status": "pending: needs a GPU machine"}, target=f"MFU >= {TARGET_MFU:.0%}")
        )
        report.notes.append("No GPU was available when BENCHMARKS.md was generated; run this script on an H100/H200 to fill the row.")
        emit(report, args.json)
        return report
    flops = model_flops(spec, lengths)
    with tempfile.TemporaryDirectory(prefix="ek_bench_") as tmp:
        path = build_model(tmp, spec)
        for backend in args.backends:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                r = pool.submit(run_backend, backend, path, lengths, spec.vocab_size, budget, 5, 2, smoke).result()
            mfu = flops / (r["step_s"] * args.peak_tflops * 1e12)
            report.rows.append(
                Row(
                    case=backend,
                    values={**r, "tokens_per_s": sum(lengths) / r["step_s"], "model_tflops_per_s": flops / r["step_s"] / 1e12, "mfu": mfu},
                    target=f"MFU >= {TARGET_MFU:.0%}",
                    met=None if smoke else mfu >= TARGET_MFU,
                    note="CPU smoke run: plumbing only"
                    if smoke
                    else ("" if mfu >= TARGET_MFU else f"by {100 * (TARGET_MFU - mfu):.1f} points"),
                )
            )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
