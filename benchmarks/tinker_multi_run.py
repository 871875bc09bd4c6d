"""Many LoRA runs on one base model: the Tinker server's shared engine (``tinker_server.runs.
SharedEngine``) with N = 1, 4 and 16 runs, on a ~100M-parameter Llama-style model whose
weights dominate resident memory.

Per N, in one process (the training side the server drives, without HTTP):

* memory: resident memory (RSS on CPU, the CUDA allocator on GPU) once every run has stepped
  and one more forward_backward of each is pending (each run's state then holds adapters,
  gradients and AdamW moments); the increment per run over N = 1, against the run's own
  adapter + optimizer size (target: base once, plus per run at most twice that size);
* time: a step of each run (forward_backward + optim_step of 4 datums x 64 tokens) with the N
  runs taking turns, against a step of the one run alone (median per step);
* the swap: one ``run_state`` + ``load_run_state`` (what a call of another run costs);
* for comparison, N = 4 runs with an engine each (``engine.share=false``).

Run: ``.venv/bin/python -m benchmarks.tinker_multi_run [--quick]``.
"""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Report, Row, cli, command_line, emit, set_threads

RANK, VOCAB, DATUMS, TOKENS = 16, 16384, 4, 64
ADAM = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0)


def _resident() -> int:
    """Bytes resident now: the CUDA allocator's on a GPU, the process's RSS on the CPU."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    import psutil

    return psutil.Process().memory_info().rss


def _datums(seed: int):
    from tinker_server.contract import DatumIn

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(DATUMS):
        tokens = torch.randint(0, VOCAB, (TOKENS,), generator=g)
        out.append(DatumIn(tokens, {"target_tokens": torch.randint(0, VOCAB, (TOKENS,), generator=g), "weights": torch.ones(TOKENS)}))
    return out


def main(argv=None) -> Report:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    set_threads(args.threads)
    from posttrain.tiny_model import build_tiny_model

    counts = (1, 4) if args.quick else (1, 4, 16)
    rounds = 2 if args.quick else 3
    start = time.perf_counter()
    report = Report(
        benchmark="tinker_multi_run",
        title="Tinker server: N LoRA runs on one shared engine (memory, time per step, swap cost)",
        command=command_line("benchmarks.tinker_multi_run", argv),
        setup=(
            f"Llama-style model (12 layers, hidden 768, vocab {VOCAB}: ~100M parameters), LoRA rank {RANK} on every projection and "
            f"lm_head, fp32, FSDP engine in process; a step: forward_backward + optim_step of {DATUMS} datums x {TOKENS} tokens; "
            f"N runs (seeds 0..N-1) taking turns for {rounds} rounds after one warm-up step each; medians"
        ),
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_multi_") as tmp:
        root = Path(tmp) / "models"
        build_tiny_model(root / "m", family="llama", vocab_size=VOCAB, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                         intermediate_size=2048, max_position_embeddings=256)  # fmt: skip
        params = sum(t.numel() for t in _model_tensors(root / "m"))
        alone = None
        for n in counts:
            # each N in a fresh process: freed host memory is not handed back to the OS, so RSS
            # deltas measured after another N in the same process would be wrong
            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
                m = pool.submit(_measure, n, str(root), tmp, rounds, args.threads).result()
            print(f"N={n}: {m}", flush=True)
            if n == 1:
                alone = m
                report.rows.append(
                    Row(
                        f"N = 1 (alone): ~{params / 1e6:.0f}M parameters, adapters {m['adapter'] / 2**20:.1f} MB",
                        {"resident_MB": m["resident"] / 2**20, "step_s": m["step"], "swap_s": m["swap"]},
                    )
                )
                continue
            per_run = (m["resident"] - alone["resident"]) / (n - 1)
            ratio = per_run / (3 * m["adapter"])  # adapters + AdamW's two moments
            report.rows.append(
                Row(
                    f"N = {n} runs on one engine",
                    {
                        "resident_MB": m["resident"] / 2**20,
                        "per_run_MB": per_run / 2**20,
                        "per_run/(adapter+adam)": ratio,
                        "step_s": m["step"],
                        "step/alone": m["step"] / alone["step"],
                        "swap_s": m["swap"],
                    },
                    target="per run <= 2x (adapter + AdamW)",
                    met=ratio <= 2.0,
                )
            )
        n = 4
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            m = pool.submit(_measure, n, str(root), tmp, rounds, args.threads, False).result()
        print(f"N={n}, an engine each: {m}", flush=True)
        report.rows.append(
            Row(
                f"N = {n}, an engine per run (engine.share=false), for comparison",
                {
                    "resident_MB": m["resident"] / 2**20,
                    "per_run_MB": (m["resident"] - alone["resident"]) / (n - 1) / 2**20,
                    "step_s": m["step"],
                },
            )
        )
    report.notes = [
        "Per run the host holds its state while another run is resident: adapters, AdamW's two moments and, between a "
        "forward_backward and its optim_step, the gradients (the measurement is taken then: the worst case); the base "
        "weights are held once. A dedicated engine per run would hold the base N times.",
        "step/alone: a run's step while N runs take turns, against the same step with one run: the swap (two host copies of "
        "the run state) is what interleaving adds; the forward and backward are the same work.",
    ]
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


def _measure(n: int, root: str, tmp: str, rounds: int, threads: int, share: bool = True) -> dict:
    """N runs on one factory's shared engine (module docstring), in this (fresh) process;
    ``share=False``: an engine per run (``engine.share=false``), for comparison."""
    set_threads(threads)
    from tinker_server.config import load_server_config
    from tinker_server.contract import AdamIn, LoraIn
    from tinker_server.runs import EngineFactory

    adam = AdamIn(**ADAM)
    over = [
        f"server.model_root={root}",
        f"server.state_dir={tmp}/state",
        "server.max_runs=64",
        f"engine.max_engines={64 if not share else 2}",
    ]
    cfg = load_server_config(None, [*over, f"engine.share={str(share).lower()}"])
    factory = EngineFactory(cfg.server.model_root, {}, cfg.run_settings())
    gc.collect()
    before = _resident()
    runs = [factory.create_run("m", LoraIn(rank=RANK, seed=i)) for i in range(n)]
    for i, run in enumerate(runs):  # a warm-up step each: every run's AdamW state exists
        run.forward_backward(_datums(i), "cross_entropy", None, False)
        run.optim_step(adam)
    steps = []
    for r in range(rounds):
        for i, run in enumerate(runs):
            t = time.perf_counter()
            run.forward_backward(_datums(100 * r + i), "cross_entropy", None, False)
            run.optim_step(adam)
            steps.append(time.perf_counter() - t)
    for i, run in enumerate(runs):  # gradients pending in every run's state: the worst case
        run.forward_backward(_datums(7 + i), "cross_entropy", None, False)
    shared = factory.engines[0]
    runs[0].engine  # noqa: B018 - run 0 resident: every other run's state is on the host
    gc.collect()
    resident = _resident() - before
    if not share:
        return {"resident": resident, "step": statistics.median(steps)}
    state = shared.engine.run_state()
    t = time.perf_counter()
    for _ in range(5):
        shared.engine.load_run_state(state)
        state = shared.engine.run_state()
    swap = (time.perf_counter() - t) / 5
    adapter = sum(p.numel() * p.element_size() for p in shared.engine._trainable_parameters())
    return {"resident": resident, "step": statistics.median(steps), "swap": swap, "adapter": adapter}


def _model_tensors(model_dir: Path):
    from safetensors.torch import load_file

    for path in sorted(model_dir.glob("*.safetensors")):
        yield from load_file(str(path)).values()


if __name__ == "__main__":
    main()
