"""Many LoRA runs on one base model: the Tinker server's shared engine (``tinker_server.shared_engine.
SharedEngine``) with N = 1, 4 and 16 runs, on a ~100M-parameter Llama-style model whose
weights dominate resident memory.

Per case, each measured in a fresh process, the cases alternating (A B C D A B C D: two rounds,
so a change in the machine's background load reaches every case alike), without HTTP:

* memory per run: the bytes of each run's state while another run is resident (the host copy
  ``run_state`` took out: adapters, AdamW's two moments and, with a forward_backward pending,
  the gradients), against the run's adapter + AdamW size (target: at most twice that). Taken
  from the states themselves, not from the process's resident-memory deltas, which move with
  the allocator and the machine's other work (under load they once reported 2.53x, then 0.37x:
  below the physical floor). The process's resident memory is shown beside it, for scale;
* time: a step of each run (forward_backward + optim_step of 4 datums x 64 tokens) with the N
  runs taking turns, against a step of one run alone (median per step over both rounds), in
  wall seconds and in this process's CPU seconds (its threads' work, which another process's
  load does not inflate the way it does wall time);
* the swap: one ``run_state`` + ``load_run_state`` (what a call of another run costs);
* for comparison, N = 4 runs with an engine each (``engine.share=false``): the bytes each such
  engine holds (the base model's weights, the adapters, their gradients and AdamW state).

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
ROUNDS_OF_CASES = 2  # A B A B


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
            f"N runs (seeds 0..N-1) taking turns for {rounds} rounds after one warm-up step each; every case in a fresh process, "
            f"the cases alternating over {ROUNDS_OF_CASES} rounds (A B .. A B ..); medians over both; memory per run from the "
            "runs' state sizes"
        ),
    )
    cases = [(n, True) for n in counts] + [(4, False)]
    measured: dict[tuple[int, bool], list[dict]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="ek_bench_multi_") as tmp:
        root = Path(tmp) / "models"
        build_tiny_model(root / "m", family="llama", vocab_size=VOCAB, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                         intermediate_size=2048, max_position_embeddings=256)  # fmt: skip
        params = sum(t.numel() for t in _model_tensors(root / "m"))
        for round_ in range(ROUNDS_OF_CASES):
            for n, share in cases:
                # each case in a fresh process: freed host memory is not handed back to the OS, and
                # one case's allocations would otherwise shape the next one's
                ctx = multiprocessing.get_context("spawn")
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
                    m = pool.submit(_measure, n, str(root), tmp, rounds, args.threads, share).result()
                print(f"round {round_}, N={n}{'' if share else ' (an engine each)'}: {_brief(m)}", flush=True)
                measured[(n, share)].append(m)
    alone = _pooled(measured[(1, True)])
    for n in counts:
        m = _pooled(measured[(n, True)])
        values = {
            "resident_MB": m["resident"] / 2**20,
            "per_run_MB": m["per_run"] / 2**20,
            "per_run/(adapter+adam)": m["per_run"] / (3 * m["adapter"]),  # adapters + AdamW's two moments
            "step_s": m["step"],
            "step_cpu_s": m["step_cpu"],
            "swap_s": m["swap"],
        }
        if n == 1:
            # one run is always resident: no state of it is out on the host
            del values["per_run_MB"], values["per_run/(adapter+adam)"]
            report.rows.append(Row(f"N = 1 (alone): ~{params / 1e6:.0f}M parameters, adapters {m['adapter'] / 2**20:.1f} MB", values))
            continue
        values.update({"step/alone": m["step"] / alone["step"], "step_cpu/alone": m["step_cpu"] / alone["step_cpu"]})
        ratio = values["per_run/(adapter+adam)"]
        report.rows.append(Row(f"N = {n} runs on one engine", values, target="per run <= 2x (adapter + AdamW)", met=ratio <= 2.0))
    m = _pooled(measured[(4, False)])
    report.rows.append(
        Row(
            "N = 4, an engine per run (engine.share=false), for comparison",
            {"resident_MB": m["resident"] / 2**20, "per_run_MB": m["per_run"] / 2**20, "step_s": m["step"], "step_cpu_s": m["step_cpu"]},
        )
    )
    report.notes = [
        "per_run_MB: the bytes of each run's state while another run is resident (adapters, AdamW's two moments and, with a "
        "forward_backward pending, as measured here, the gradients: the worst case), read from the states the swap took out; "
        "the base weights are held once. For the engine-per-run comparison: the bytes each engine holds (base weights, "
        "adapters, gradients, AdamW state). resident_MB: the process's resident memory added by the case (RSS on the CPU), "
        "for scale only: it moves with the allocator and the machine's load.",
        "step/alone: a run's step while N runs take turns, against the same step with one run, in wall seconds; step_cpu "
        "the same in this process's CPU seconds (all its threads), which another process's load does not inflate. The swap "
        "(two host copies of the run state) is what interleaving adds; the forward and backward are the same work.",
    ]
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


def _brief(m: dict) -> str:
    """One measurement on one line (the step lists as their medians)."""
    shown = {k: statistics.median(v) if isinstance(v, list) else v for k, v in m.items()}
    return ", ".join(f"{k}={v:.4g}" for k, v in shown.items())


def _pooled(ms: list[dict]) -> dict:
    """One case's rounds in one: step times pooled (their median), sizes and swap the median."""
    out = {k: statistics.median(m[k] for m in ms) for k in ms[0] if not k.startswith("steps")}
    out["step"] = statistics.median(t for m in ms for t in m["steps"])
    out["step_cpu"] = statistics.median(t for m in ms for t in m["steps_cpu"])
    return out


def _engine_bytes(engine) -> int:
    """What one engine holds: every parameter (the frozen base too), the gradients and the
    optimizer's state tensors."""
    params = list({id(p): p for module in engine._modules() for p in module.parameters()}.values())  # (a tied weight once)
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for opt in engine._torch_optimizers():
        for state in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _measure(n: int, root: str, tmp: str, rounds: int, threads: int, share: bool = True) -> dict:
    """N runs on one factory's shared engine (module docstring), in this (fresh) process;
    ``share=False``: an engine per run (``engine.share=false``), for comparison."""
    set_threads(threads)
    from tinker_server.config import load_server_config
    from tinker_server.contract import AdamIn, LoraIn
    from tinker_server.factory import EngineFactory

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
    steps, steps_cpu = [], []
    for r in range(rounds):
        for i, run in enumerate(runs):
            t, c = time.perf_counter(), time.process_time()
            run.forward_backward(_datums(100 * r + i), "cross_entropy", None, False)
            run.optim_step(adam)
            steps.append(time.perf_counter() - t)
            steps_cpu.append(time.process_time() - c)
    for i, run in enumerate(runs):  # gradients pending in every run's state: the worst case
        run.forward_backward(_datums(7 + i), "cross_entropy", None, False)
    gc.collect()
    out = {"steps": steps, "steps_cpu": steps_cpu}
    if not share:
        out["resident"] = _resident() - before
        out["per_run"] = statistics.median(_engine_bytes(run.shared.engine) for run in runs)
        return out
    with runs[0].shared.serving(runs[0]):  # run 0 resident: every other run's state is out on the host
        pass
    gc.collect()
    out["resident"] = _resident() - before
    shared = factory.engines[0]
    out["adapter"] = sum(p.numel() * p.element_size() for p in shared.engine._trainable_parameters())
    # the bytes of each swapped-out run's state (run 0 is resident; with N = 1 there is none)
    out["per_run"] = statistics.median(run.state.nbytes() for run in runs[1:]) if n > 1 else 0
    state = shared.engine.run_state()
    t = time.perf_counter()
    for _ in range(5):
        shared.engine.load_run_state(state)
        state = shared.engine.run_state()
    out["swap"] = (time.perf_counter() - t) / 5
    return out


def _model_tensors(model_dir: Path):
    from safetensors.torch import load_file

    for path in sorted(model_dir.glob("*.safetensors")):
        yield from load_file(str(path)).values()


if __name__ == "__main__":
    main()
