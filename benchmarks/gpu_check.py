"""``make gpu-check``: every GPU-only path in one go, one report, within a time budget.

On a GPU machine it runs, each step in its own process session so one failure does not hide the
others (and a step past its time is killed with everything it started):

1. ``pytest -m gpu``: bf16 FSDP vs fp32 HF, bf16 FSDP vs Megatron one step (dense and Qwen3-MoE at
   EP=1), the offload device-memory tests, vLLM's routed experts (router replay R3) against HF's own
   ``router_logits``, and every other ``gpu``-marked test; the tests of ``NAMED_GPU_TESTS`` get a
   row of their own in the report (passed / skipped and why / failed / not run), so a GPU-only
   path that was skipped or never collected shows by name, not only in the counts. It runs on a
   bare GPU machine: test modules that need an optional extra the machine lacks (Tinker, Ray,
   ``datasets``, ...) are skipped, not collection errors (``tests/support/extras.py``);
2. ``benchmarks.gpu_throughput``: the hand-written FSDP2 loop, the FSDP engine (compile off and on)
   and the megatron engine on the ~0.9B model; per row tokens/s, MFU, peak memory, the engine/loop
   ratio and the issue's targets. The step fails if any row failed (rows that did not fit in the
   budget count as failed);
3. ``benchmarks.gather`` is CPU/gloo; the NCCL gather needs two GPUs (one rank per GPU) and is
   reported as skipped on a one-GPU machine.

Time: ``--budget`` (default :data:`BUDGET_S`, so that ``make gpu-check`` with the wheels' install
ends within 8 minutes on one H200) bounds the whole check. ``pytest -m gpu`` gets at most
``--tests-timeout`` and never the time the throughput rows need (:data:`MIN_THROUGHPUT_S`); the
throughput run gets the rest, skips the rows that no longer fit and writes each row as it is
measured.

The report, ``gpu_check.md`` and ``gpu_check.json`` in ``--out`` (the environment: torch, CUDA, the
device, which optional GPU packages are installed; then each step's outcome and numbers, and the
throughput rows as a table), is rewritten as soon as each step's outcome is known, so a later
crash or kill keeps the earlier results; each step's full output is in its own log there
(``gpu_tests.log``, ``gpu_throughput.log`` and one ``gpu_throughput_<row>.log`` per row).
Transformer-Engine and flash-attn are not carried to the GPU machine (their builds are large), so
the report says the megatron runs used the local layer spec when they are absent.

``--smoke`` (what CI runs, on CPU): the same steps and report, with the GPU tests skipped by pytest
and the throughput rows in their CPU smoke mode; it checks the plumbing, measures nothing.

Run: ``make gpu-check`` (``bash ci/gpu_check.sh``: on the GPU machine it installs the carried
wheels first), or ``python -m benchmarks.gpu_check [--smoke] [--out DIR] [--budget S]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = ("transformer_engine", "flash_attn")
# report row -> the gpu-marked test file whose outcome it names (run inside ``pytest -m gpu``)
NAMED_GPU_TESTS = {
    "vLLM routed experts (R3) vs HF router_logits": "tests/rollout/test_vllm_routing.py",
    "megatron context parallelism CP=2 vs CP=1 (2 GPUs, TE)": "tests/backends/test_megatron_cp_gpu.py",
}
# pytest -rA short-summary outcomes, the worst first (a file's row takes its worst test's)
_OUTCOMES = ("FAILED", "ERROR", "XPASS", "PASSED", "XFAIL", "SKIPPED")
# Time (s): the whole check (issue 52: `make gpu-check` ends within 8 minutes on one H200; the
# carried wheels' install and interpreter start take the rest), pytest -m gpu's share at most,
# what the throughput rows keep however long the tests take, and what is kept for the last step.
BUDGET_S = 450.0
TESTS_S = 180.0
MIN_THROUGHPUT_S = 240.0
RESERVE_S = 10.0


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        **{f"{name} installed": importlib.util.find_spec(name) is not None for name in OPTIONAL},
    }


def _run(cmd: list[str], timeout: float, log_path: str, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` with its output going to ``log_path`` as it comes (a step killed at its timeout
    keeps what it printed); returns (exit code, the log, seconds). A timeout kills the step's whole
    session (its ranks and row processes too) and reads as exit code 124."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
            with open(log_path, "a") as f:
                f.write(f"\n[gpu_check] timed out after {timeout:.0f} s (killed)\n")
    with open(log_path, errors="replace") as f:
        return code, f.read(), time.perf_counter() - start


def named_outcomes(log: str) -> list[dict]:
    """One row per ``NAMED_GPU_TESTS`` entry from ``pytest -rA``'s short summary: its file's worst
    outcome (``skipped`` with pytest's reason), or ``not run`` where none of its tests appear."""
    rows = []
    for case, path in NAMED_GPU_TESTS.items():
        seen = {}
        for line in log.splitlines():
            word = line.split(" ", 1)[0]
            if word in _OUTCOMES and path in line:
                # ``SKIPPED [1] path:line: reason``; the others: ``WORD path::test[ - message]``
                seen.setdefault(word, line.split(path, 1)[1].split(": ", 1)[-1] if word == "SKIPPED" else "")
        worst = next((w for w in _OUTCOMES if w in seen), None)
        row = {"case": case, "outcome": worst.lower() if worst else "not run"}
        if worst == "SKIPPED":
            row["reason"] = seen[worst].strip()
        rows.append(row)
    return rows


def gpu_tests(out_dir: str, timeout: float) -> dict:
    """``pytest -m gpu``; counts from its summary line, and the named tests' own outcomes. Test
    modules that need an optional extra the machine lacks are skipped, not errors
    (``tests/support/extras.py``; ``ENGINEKIT_REQUIRE_EXTRAS=0``): this step runs on bare GPU machines."""
    env = {**os.environ, "ENGINEKIT_REQUIRE_EXTRAS": "0"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider"]
    code, log, seconds = _run(cmd, timeout, os.path.join(out_dir, "gpu_tests.log"), env)
    summary = next(
        (line for line in reversed(log.splitlines()) if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)), ""
    )
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    # pytest exits 5 when every test was deselected/skipped: not a failure of the check
    ok = code in (0, 5) and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
    rows = named_outcomes(log)
    # A named test that failed or was never collected fails the step even if the counts look clean.
    ok = ok and all(row["outcome"] not in ("failed", "error", "not run") for row in rows)
    step = {"step": "pytest -m gpu", "ok": ok, "exit": code, "seconds": round(seconds, 1), **counts, "log": "gpu_tests.log", "rows": rows}
    if code == 124:
        step["timed_out"] = f"killed after {timeout:.0f} s"
    return step


ROW_FIELDS = ("status", "step_s", "tokens_per_s", "mfu", "peak_mem_gib", "engine_over_loop", "over_fsdp_engine", "error")


def throughput(out_dir: str, smoke: bool, budget: float) -> dict:
    """``benchmarks.gpu_throughput`` (its ``--smoke`` mode without CUDA) within ``budget`` seconds:
    it skips the rows that no longer fit and writes each row as it is measured, so the rows here
    are whatever it finished, even if it was killed. The step fails if any row failed."""
    json_path = os.path.join(out_dir, "gpu_throughput.json")
    if os.path.exists(json_path):
        os.unlink(json_path)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu_throughput",
        "--json",
        json_path,
        "--budget",
        f"{budget:.0f}",
        *(["--smoke"] if smoke else []),
    ]
    code, _, seconds = _run(cmd, budget + 30, os.path.join(out_dir, "gpu_throughput.log"))  # it stops itself at the budget
    rows, finished = [], False
    if os.path.exists(json_path):
        with open(json_path) as f:
            saved = json.load(f)
        finished = saved.get("finished", False)
        for r in saved["rows"]:
            rows.append(
                {"case": r["case"], **{k: r["values"][k] for k in ROW_FIELDS if k in r["values"]}, "target": r["target"], "met": r["met"]}
            )
    ok = code == 0 and finished and bool(rows) and all(r.get("status") == "ok" for r in rows)
    step = {
        "step": "benchmarks.gpu_throughput",
        "ok": ok,
        "exit": code,
        "seconds": round(seconds, 1),
        "log": "gpu_throughput.log",
        "rows": rows,
    }
    if not finished:
        step["unfinished"] = "the run stopped before its last row (see the log)"
    return step


def nccl_gather(env: dict, out_dir: str, timeout: float) -> dict:
    if len(env["devices"]) < 2:
        return {"step": "tensor gathers on NCCL", "ok": True, "skipped": "needs 2 GPUs (one NCCL rank per GPU); this machine has "
                f"{len(env['devices'])}"}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine_api/test_batch.py", "-k", "unshard"]
    code, _, seconds = _run(cmd, timeout, os.path.join(out_dir, "nccl_gather.log"))
    return {"step": "tensor gathers (2 ranks)", "ok": code == 0, "exit": code, "seconds": round(seconds, 1)}


def render(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# gpu-check ({'smoke, CPU' if report['smoke'] else 'GPU'})",
        "",
        f"python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}, devices {env['devices'] or 'none'}",
        "optional GPU packages: "
        + ", ".join(f"{n} {'installed' if env[f'{n} installed'] else 'NOT installed (not carried)'}" for n in OPTIONAL),
        "",
        "| step | ok | details |",
        "|---|---|---|",
    ]
    table = []
    for step in report["steps"]:
        details = {k: v for k, v in step.items() if k not in ("step", "ok", "rows")}
        lines.append(f"| {step['step']} | {'yes' if step['ok'] else 'NO'} | {json.dumps(details)} |")
        if step["step"] == "benchmarks.gpu_throughput":
            table = _throughput_table(step["rows"])
            continue
        for row in step.get("rows", []):
            lines.append(f"|  - {row['case']} | | {json.dumps({k: v for k, v in row.items() if k != 'case'})} |")
    if not report.get("finished", True):
        lines.append(f"| (running: {len(report['steps'])} of 3 steps done) | | |")
    return "\n".join(lines + table) + "\n"


def _throughput_table(rows: list[dict]) -> list[str]:
    """The throughput rows as a table (MFU convention: benchmarks/gpu_throughput.py's docstring)."""

    def cell(v) -> str:
        return "" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    out = ["", "| row | status | step s | tokens/s | MFU | peak GiB | engine/loop | megatron/fsdp | target | met |", "|" + "---|" * 10]
    for r in rows:
        met = {True: "yes", False: "NO", None: "-"}[r.get("met")]
        status = r.get("status", "?") + (f": {r['error']}" if r.get("error") else "")
        keys = ("step_s", "tokens_per_s", "mfu", "peak_mem_gib", "engine_over_loop", "over_fsdp_engine")
        cells = [r["case"], status, *(cell(r.get(k)) for k in keys), r.get("target") or "-", met]
        out.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return out


def _write(report: dict, out_dir: str) -> str:
    """Rewrite ``gpu_check.json`` and ``gpu_check.md`` with the steps so far."""
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = render(report)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: check the plumbing (CI)")
    parser.add_argument(
        "--out", default=os.environ.get("OUT") or "outputs/gpu_check", help="report directory (default $OUT or outputs/gpu_check)"
    )
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole check (default {BUDGET_S:.0f})")
    parser.add_argument("--tests-timeout", type=float, default=TESTS_S, help=f"seconds for pytest -m gpu (default {TESTS_S:.0f})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    smoke = args.smoke or not env["devices"]
    report = {"smoke": smoke, "environment": env, "budget_s": args.budget, "steps": [], "finished": False}
    _write(report, args.out)

    def left() -> float:
        return args.budget - (time.perf_counter() - start)

    def record(step: dict) -> None:
        report["steps"].append(step)
        report["seconds"] = round(time.perf_counter() - start, 1)
        _write(report, args.out)
        print(
            f"[gpu_check] {step['step']}: {'ok' if step['ok'] else 'FAILED'} ({step.get('seconds', 0)} s; {left():.0f} s left)", flush=True
        )

    # pytest gets its share; the throughput rows get the rest (they stop themselves in time).
    record(gpu_tests(args.out, min(args.tests_timeout, max(left() - MIN_THROUGHPUT_S, 30.0))))
    record(throughput(args.out, smoke, max(left() - RESERVE_S, 0.0)))
    record(nccl_gather(env, args.out, max(left(), 30.0)))
    report["finished"] = True
    print(_write(report, args.out))
    return 0 if all(step["ok"] for step in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
