"""``make gpu-check``: every GPU-only path in one go, one report.

On a GPU machine it runs, each step in its own process so one failure does not hide the others:

1. ``pytest -m gpu``: bf16 FSDP vs fp32 HF, bf16 FSDP vs Megatron one step (dense and Qwen3-MoE at
   EP=1), the offload device-memory test, vLLM's routed experts (router replay R3) against HF's own
   ``router_logits``, and every other ``gpu``-marked test; the tests of ``NAMED_GPU_TESTS`` get a
   row of their own in the report (passed / skipped and why / failed / not run), so a GPU-only
   path that was skipped or never collected shows by name, not only in the counts;
2. ``benchmarks.gpu_throughput``: tokens/s and MFU of the ~0.9B model on both backends;
3. ``benchmarks.gather`` is CPU/gloo; the NCCL gather needs two GPUs (one rank per GPU) and is
   reported as skipped on a one-GPU machine.

It then writes ``gpu_check.md`` and ``gpu_check.json`` (the environment: torch, CUDA, the device,
which optional GPU packages are installed; then each step's outcome and numbers) to ``--out``.
Transformer-Engine and flash-attn are not carried to the GPU machine (their builds are large), so
the report says the megatron runs used the local layer spec and FSDP used SDPA when they are absent.

``--smoke`` (what CI runs, on CPU): the same steps and report, with the GPU tests skipped by pytest
and the throughput run in its CPU smoke mode; it checks the plumbing, measures nothing.

Run: ``make gpu-check`` (``bash ci/gpu_check.sh``: on the GPU machine it installs the carried
wheels first), or ``python -m benchmarks.gpu_check [--smoke] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
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


def _run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}", time.perf_counter() - start


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
    """``pytest -m gpu``; counts from its summary line, and the named tests' own outcomes."""
    code, log, seconds = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider"], timeout)
    with open(os.path.join(out_dir, "gpu_tests.log"), "w") as f:
        f.write(log)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", log.splitlines()[-1] if log else "")}
    # pytest exits 5 when every test was deselected/skipped: not a failure of the check
    ok = code in (0, 5) and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
    rows = named_outcomes(log)
    # A named test that failed or was never collected fails the step even if the counts look clean.
    ok = ok and all(row["outcome"] not in ("failed", "error", "not run") for row in rows)
    return {"step": "pytest -m gpu", "ok": ok, "exit": code, "seconds": round(seconds, 1), **counts, "log": "gpu_tests.log", "rows": rows}


def throughput(out_dir: str, smoke: bool, timeout: float) -> dict:
    """``benchmarks.gpu_throughput`` (its ``--smoke`` mode without CUDA)."""
    json_path = os.path.join(out_dir, "gpu_throughput.json")
    cmd = [sys.executable, "-m", "benchmarks.gpu_throughput", "--json", json_path, *(["--smoke"] if smoke else [])]
    code, log, seconds = _run(cmd, timeout)
    with open(os.path.join(out_dir, "gpu_throughput.log"), "w") as f:
        f.write(log)
    rows = []
    if os.path.exists(json_path):
        with open(json_path) as f:
            rows = [{"case": r["case"], **{k: r["values"].get(k) for k in ("tokens_per_s", "mfu", "step_s")}} for r in json.load(f)["rows"]]
    return {"step": "benchmarks.gpu_throughput", "ok": code == 0, "exit": code, "seconds": round(seconds, 1), "rows": rows}


def nccl_gather(env: dict) -> dict:
    if len(env["devices"]) < 2:
        return {"step": "tensor gathers on NCCL", "ok": True, "skipped": "needs 2 GPUs (one NCCL rank per GPU); this machine has "
                f"{len(env['devices'])}"}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine_api/test_batch.py", "-k", "unshard"]
    code, log, seconds = _run(cmd, 600)
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
    for step in report["steps"]:
        details = {k: v for k, v in step.items() if k not in ("step", "ok", "rows")}
        lines.append(f"| {step['step']} | {'yes' if step['ok'] else 'NO'} | {json.dumps(details)} |")
        for row in step.get("rows", []):
            lines.append(f"|  - {row['case']} | | {json.dumps({k: v for k, v in row.items() if k != 'case'})} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: check the plumbing (CI)")
    parser.add_argument(
        "--out", default=os.environ.get("OUT") or "outputs/gpu_check", help="report directory (default $OUT or outputs/gpu_check)"
    )
    parser.add_argument("--timeout", type=float, default=1500, help="seconds per step")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    smoke = args.smoke or not env["devices"]
    report = {"smoke": smoke, "environment": env, "steps": []}
    report["steps"].append(gpu_tests(args.out, args.timeout))
    report["steps"].append(throughput(args.out, smoke, args.timeout))
    report["steps"].append(nccl_gather(env))
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = render(report)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(step["ok"] for step in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
