"""GPU throughput: the engines against a hand-written FSDP2 loop, ~0.9B Llama-style, bf16, packed.

The model is built from a config (no download): 16 layers, hidden 2048, 16 heads / 8 KV heads,
SwiGLU 5632, vocab 32000 (~0.89B parameters), fp32 weights on disk. One global batch of 64
log-normal lengths (16..2048 tokens) trains with dynamic batching (at most 16,384 real tokens per
micro-batch), bf16 compute with fp32 master weights, AdamW, on one GPU. Rows, in this order, each
in its own process (a fresh interpreter; megatron's parallel state is process-global, and a
crash, a hang or an out-of-memory takes down only its own row):

1. ``loop``: the hand-written FSDP2 loop of :mod:`benchmarks.raw_fsdp_gpu` (packed rows, torch's
   ``varlen_attn``, the engine's micro-batches, fused AdamW; the baseline);
2. ``fsdp engine``: the FSDP engine (``compile`` off), with its engine/loop time ratio;
3. ``megatron (local spec)``, and ``megatron (TE spec)`` when ``transformer_engine`` imports;
4. ``loop compiled``: the loop with ``layer.compile()`` on each decoder layer;
5. ``fsdp engine compiled``: the engine with ``compile=true``, its ratio against row 4.

The compiled rows come last because they take longest: a run that is short of time
(``--budget``) loses them first, as ``not run`` rows.

Every row is written as soon as it is measured: the JSON (``--json``) is rewritten and the row
printed after each one, so a later crash keeps the earlier rows. A row that fails (an exception,
its process dying, its timeout, or no time left in ``--budget``) is a ``failed`` row with the
error and its log file; the other rows still run. The exit code is 1 when any row failed.

Per row: ``step_s`` (median of the timed steps, synchronised), ``tokens_per_s`` (real, unpadded
tokens), ``mfu``, ``peak_mem_gib`` (``torch.cuda.max_memory_allocated`` over the whole row,
warm-up included), ``first_step_s`` (the first warm-up step: compilation included),
``first_loss`` (the first step's loss: every row starts from the same weights and batch, so
equal losses say the rows train the same objective on the same micro-batches), and for
engine rows ``engine_over_loop``: the engine's step time over the loop's, compile off against
off and on against on. Targets (issue 52; ``met`` per row): FSDP engine / loop <= 1.03 in time
per step with compile off and on; FSDP engine MFU >= 0.35 uncompiled and >= 0.45 compiled;
megatron tokens/s >= 0.9 x the FSDP engine's (compile off; megatron has no compile switch).

MFU = model FLOPs / (step time x peak dense bf16 FLOP/s). Model FLOPs per step (the PaLM /
Megatron convention): 6 x N x tokens + 12 x layers x hidden x sum(len^2), with N the
parameters excluding the input embedding, and attention counted as non-causal (the convention
most published MFU figures use; a causal count would halve the attention term). Peak: 989
TFLOP/s (H100 SXM dense bf16; H200 has the same tensor cores); ``--peak-tflops`` overrides.

Time: on one H200 each plain row takes well under a minute (start, load, 1 warm-up step, 3
timed steps), a compiled one about a minute and a half (2 warm-up steps: the first compiles,
the second recompiles for dynamic micro-batch lengths); ``--budget`` bounds the whole run.

Without CUDA the script prints "no CUDA; skipped" and exits 0. ``--smoke`` instead runs every
row's code path on CPU with a tiny fp32 model (the loop's attention: causal SDPA per sequence,
since ``varlen_attn`` needs CUDA; ``compile`` with dynamo's ``eager`` backend, which traces the
layers without generating kernels): plumbing only, no target is judged.

Run: ``.venv/bin/python -m benchmarks.gpu_throughput [--rows loop "fsdp engine" ...] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.common import ModelSpec, Report, Row, build_model, command_line, lognormal_lengths, random_batch

GPU_SPEC = ModelSpec(
    vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632, max_position_embeddings=4096
)
# The CPU smoke run: the tiny model's dimensions (posttrain.tiny_model.TinyModelConfig).
SMOKE_SPEC = ModelSpec(vocab_size=512)
H100_PEAK_TFLOPS = 989.0
MAX_ENGINE_OVER_LOOP = 1.03
MIN_MFU = {False: 0.35, True: 0.45}  # FSDP engine, by compile
MIN_MEGATRON_OVER_FSDP = 0.9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Case:
    """One row: what runs (``loop``, ``fsdp`` or ``megatron``), compiled or not, and its limit."""

    name: str
    kind: str
    compiled: bool = False
    layer_spec: str = "local"  # megatron only
    timeout_s: float = 150.0  # on a GPU; smoke rows get SMOKE_TIMEOUT_S


# The compiled rows come last: they take the longest, and a run short of time loses them first.
CASES = (
    Case("loop", "loop"),
    Case("fsdp engine", "fsdp"),
    Case("megatron (local spec)", "megatron"),
    Case("megatron (TE spec)", "megatron", layer_spec="te"),
    Case("loop compiled", "loop", compiled=True, timeout_s=240.0),
    Case("fsdp engine compiled", "fsdp", compiled=True, timeout_s=240.0),
)
SMOKE_TIMEOUT_S = 120.0
MIN_ROW_S = 20.0  # a row is not started with less time than this left in the budget


@dataclass(frozen=True)
class Workload:
    spec: ModelSpec
    lengths: list[int]
    budget: int  # real tokens per micro-batch
    warmup: int
    steps: int

    def describe(self) -> str:
        cap = max(self.lengths)
        return (
            f"{self.spec.describe()}; {len(self.lengths)} sequences, log-normal lengths up to {cap} ({sum(self.lengths)} real "
            f"tokens), dynamic batching {self.budget} tokens/micro-batch; median of {self.steps} steps after "
            f"{self.warmup} warm-up ({self.warmup + 1} when compiled)"
        )


def workload(smoke: bool) -> Workload:
    """The batch every row trains on (seeded: parent and row processes agree)."""
    spec, cap, n_seq, budget = (SMOKE_SPEC, 128, 8, 256) if smoke else (GPU_SPEC, 2048, 64, 16384)
    steps = 2 if smoke else 3
    return Workload(spec, lognormal_lengths(n_seq, cap / 4, 1.0, 16, cap, seed=0), budget, warmup=1, steps=steps)


def model_flops(spec: ModelSpec, lengths: list[int]) -> float:
    """Training FLOPs of one step over ``lengths`` (see the module docstring)."""
    n = spec.params() - spec.vocab_size * spec.hidden_size  # the input embedding is a lookup
    return 6.0 * n * sum(lengths) + 12.0 * spec.num_layers * spec.hidden_size * sum(x * x for x in lengths)


# ------------------------------------------------------------------------------ one row (its own process)


def _eager_compile() -> None:
    """Smoke mode: ``nn.Module.compile`` with dynamo's ``eager`` backend (traces, generates no
    kernels), so the compiled rows' code path runs on CPU in seconds."""
    original = torch.nn.Module.compile

    def compile_eager(self, *args, **kwargs):
        kwargs.setdefault("backend", "eager")
        return original(self, *args, **kwargs)

    torch.nn.Module.compile = compile_eager


def _timed(step, warmup: int, steps: int) -> dict:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    first = loss = None
    for i in range(warmup):
        start = time.perf_counter()
        out = step()
        sync()
        if i == 0:
            first = time.perf_counter() - start
            loss = float(out["loss"] if isinstance(out, dict) else out)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return {"step_s": sorted(times)[len(times) // 2], "first_step_s": first, "first_loss": loss, "steps_s": times}


def _loop_row(case: Case, path: str, w: Workload, smoke: bool) -> dict:
    from benchmarks.raw_fsdp_gpu import LoopTrainer, device_micro_batches
    from engine_api.partition import partition_balanced

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with socket.socket() as s:  # a free port for this 1-rank group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    trainer = LoopTrainer(path, device, bf16=not smoke, compiled=case.compiled)
    parts = partition_balanced(w.lengths, w.budget)
    micro_batches, total = device_micro_batches(random_batch(w.lengths, w.spec.vocab_size), parts, device)
    out = _timed(lambda: trainer.step(micro_batches, total), w.warmup + case.compiled, w.steps)
    out["attn"] = "varlen_attn" if cuda else "sdpa per sequence (CPU)"
    out["micro_batches"] = len(parts)
    return out


def _engine_row(case: Case, path: str, w: Workload, smoke: bool) -> dict:
    from benchmarks.common import nll_loss
    from engine_api import build_engine, load_config

    overrides = [
        f"strategy={case.kind}",
        f"model.path={path}",
        f"model.dtype={'float32' if smoke else 'bfloat16'}",
        "use_remove_padding=true",
        f"max_token_len_per_micro_batch={w.budget}",
        "optim.lr=1e-5",
        "optim.weight_decay=0.01",
        "optim.clip_grad=1.0",
    ]
    if case.compiled:
        overrides.append("compile=true")  # the key is absent where the engine cannot compile: the row fails, named
    if case.kind == "megatron":
        overrides.append(f"megatron.layer_spec={case.layer_spec}")
    engine = build_engine(load_config(None, overrides))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    batch = random_batch(w.lengths, w.spec.vocab_size)
    with engine.train_mode():
        out = _timed(lambda: engine.train_batch(batch), w.warmup + case.compiled, w.steps)
    if case.kind == "fsdp":
        out["attn"] = getattr(engine.model.config, "_attn_implementation", "?")
    return out


def run_row(name: str, path: str, smoke: bool) -> dict:
    """Build and time one row (in this process); measured values only, no verdicts."""
    case = next(c for c in CASES if c.name == name)
    w = workload(smoke)
    if smoke:
        torch.set_num_threads(1)
        _eager_compile()
    start = time.perf_counter()
    out = (_loop_row if case.kind == "loop" else _engine_row)(case, path, w, smoke)
    out["row_s"] = time.perf_counter() - start
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return out


# ------------------------------------------------------------------------------ the run (parent)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _spawn_row(case: Case, path: str, smoke: bool, timeout: float, log_path: str) -> dict:
    """Run :func:`run_row` in a new interpreter (its own session: a timeout kills its helpers
    too, e.g. inductor's compile workers); raise ``RuntimeError`` naming why it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    cmd = [sys.executable, "-m", "benchmarks.gpu_throughput", "--run-row", case.name, "--model", path, "--result", result]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [*cmd, *(["--smoke"] if smoke else [])], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(f"timed out after {timeout:.0f} s (killed)") from None
        if code != 0:
            raise RuntimeError(f"exit code {code}: {_last_error(log_path)}")
        with open(result) as f:
            return json.load(f)
    finally:
        os.unlink(result)


def _last_error(log_path: str) -> str:
    """The last exception of a row's log with its message's following lines (a config error
    lists its problems there), at most 800 characters; else the log's last line."""
    with open(log_path, errors="replace") as f:
        lines = [line.rstrip() for line in f if line.strip()]
    starts = [i for i, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    text = " ".join(line.strip() for line in lines[starts[-1] :]) if starts else (lines or ["(no output)"])[-1]
    return text[:800]


def _verdict(case: Case, values: dict, rows: dict[str, dict], smoke: bool) -> tuple[str, bool | None, str]:
    """(target, met, note) of a measured row; ratios against the rows it is judged by."""
    checks: list[tuple[str, float | None, bool]] = []  # (what, value, whether it is met)
    if case.kind == "fsdp":
        loop = rows.get("loop compiled" if case.compiled else "loop", {})
        ratio = values["step_s"] / loop["step_s"] if loop.get("status") == "ok" else None
        values["engine_over_loop"] = ratio
        checks.append((f"engine/loop <= {MAX_ENGINE_OVER_LOOP}", ratio, ratio is not None and ratio <= MAX_ENGINE_OVER_LOOP))
        floor = MIN_MFU[case.compiled]
        checks.append((f"MFU >= {floor}", values["mfu"], values["mfu"] >= floor))
    elif case.kind == "megatron":
        fsdp = rows.get("fsdp engine", {})
        ratio = values["tokens_per_s"] / fsdp["tokens_per_s"] if fsdp.get("status") == "ok" else None
        values["over_fsdp_engine"] = ratio
        checks.append((f"tokens/s >= {MIN_MEGATRON_OVER_FSDP} x fsdp engine", ratio, ratio is not None and ratio >= MIN_MEGATRON_OVER_FSDP))
    target = "; ".join(what for what, _, _ in checks)
    if not checks:
        return "", None, "the baseline" + (" (CPU smoke run: plumbing only)" if smoke else "")
    if smoke:
        return target, None, "CPU smoke run: plumbing only"
    missed = [f"{what}: {value if value is None else round(value, 3)}" for what, value, ok in checks if not ok]
    return target, not missed, ("missed " + ", ".join(missed)) if missed else ""


def _save(report: Report, json_path: str | None, finished: bool) -> None:
    """Rewrite the JSON with the rows so far (atomically: a crash mid-write keeps the last one)."""
    if not json_path:
        return
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**asdict(report), "finished": finished}, f, indent=1)
    os.replace(tmp, json_path)


def _print_row(row: Row) -> None:
    verdict = {True: "MET", False: "MISSED", None: "-"}[row.met]
    values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.values.items() if k != "steps_s")
    print(f"- {row.case}: {values} | target {row.target or '-'}: {verdict} {row.note}", flush=True)


def cases(names: list[str] | None) -> list[Case]:
    """The rows to run: ``names`` (all by default); the TE-spec row only where TE imports."""
    te = importlib.util.find_spec("transformer_engine") is not None
    return [c for c in CASES if (names is None or c.name in names) and (c.layer_spec != "te" or te)]


def main(argv=None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the report here (rewritten after every row)")
    parser.add_argument("--rows", nargs="+", default=None, choices=[c.name for c in CASES], help="run only these rows")
    parser.add_argument("--peak-tflops", type=float, default=H100_PEAK_TFLOPS, help="peak dense bf16 TFLOP/s of the GPU")
    parser.add_argument("--smoke", action="store_true", help="run every row's code path on CPU with a tiny fp32 model (no targets)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run; rows that do not fit fail as 'not run'")
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # benchmarks.run_all passes it to every script
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-row", default=None, help=argparse.SUPPRESS)  # a row's own process
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_row:
        out = run_row(args.run_row, args.model, args.smoke and not torch.cuda.is_available())
        with open(args.result, "w") as f:
            json.dump(out, f)
        sys.exit(0)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    smoke = args.smoke and not cuda
    w = workload(smoke)
    report = Report(
        benchmark="gpu_throughput",
        title="GPU throughput: FSDP and megatron engines against a hand-written FSDP2 loop, ~0.9B Llama-style, bf16, packed",
        command=command_line("benchmarks.gpu_throughput", argv),
        setup=f"{w.describe()}; peak {args.peak_tflops:g} TFLOP/s dense bf16 (H100 SXM)"
        + (" (CPU smoke run: tiny fp32 model)" if smoke else ""),
    )
    print(f"\n## {report.title}\n{report.setup}\n", flush=True)
    if not cuda and not smoke:
        print("no CUDA; skipped")
        report.rows.append(Row(case="loop, fsdp engine, megatron", values={"status": "pending: needs a GPU machine"}))
        report.notes.append("No GPU was available when BENCHMARKS.md was generated; run this script on an H100/H200 to fill the rows.")
        _save(report, args.json, finished=True)
        return report
    flops = model_flops(w.spec, w.lengths)
    log_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else tempfile.mkdtemp(prefix="ek_gpu_throughput_")
    measured: dict[str, dict] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="ek_bench_") as tmp:
        path = build_model(tmp, w.spec)
        for case in cases(args.rows):
            log_path = os.path.join(log_dir, f"gpu_throughput_{_slug(case.name)}.log")
            left = None if args.budget is None else args.budget - (time.perf_counter() - start)
            timeout = SMOKE_TIMEOUT_S if smoke else case.timeout_s
            try:
                if left is not None and left < MIN_ROW_S:
                    raise RuntimeError(f"not run: {max(left, 0):.0f} s left of the {args.budget:.0f} s budget")
                values = _spawn_row(case, path, smoke, timeout if left is None else min(timeout, left), log_path)
            except (RuntimeError, OSError, ValueError) as exc:
                failed = True
                measured[case.name] = {"status": "failed"}
                row = Row(case=case.name, values={"status": "failed", "error": str(exc), "log": log_path}, met=False, note=str(exc))
            else:
                values = {
                    "status": "ok",
                    "step_s": values["step_s"],
                    "tokens_per_s": sum(w.lengths) / values["step_s"],
                    "mfu": flops / (values["step_s"] * args.peak_tflops * 1e12),
                    "peak_mem_gib": values["peak_mem_gib"],
                    "first_step_s": values["first_step_s"],
                    "first_loss": values["first_loss"],
                    "row_s": values["row_s"],
                    **{k: v for k, v in values.items() if k in ("attn", "micro_batches", "steps_s")},
                }
                measured[case.name] = values
                target, met, note = _verdict(case, values, measured, smoke)
                row = Row(case=case.name, values=values, target=target, met=met, note=note)
            report.rows.append(row)
            report.seconds = time.perf_counter() - start
            _save(report, args.json, finished=False)
            _print_row(row)
    report.seconds = time.perf_counter() - start
    report.notes.append(f"row logs: {log_dir}/gpu_throughput_*.log")
    _save(report, args.json, finished=True)
    print(f"  note: {report.notes[-1]}\n  total {report.seconds:.0f} s", flush=True)
    if failed:
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
