"""Run every benchmark and regenerate ``BENCHMARKS.md`` (``make bench``).

Each script runs in its own process (``python -m benchmarks.<name> --json ...``), so imports,
process groups, megatron's global state and peak-memory counters never leak between them. The
markdown holds generated tables only: the machine, the date, the load average around each script
(the numbers of a shared machine are only comparable as ratios), the summary, and each script's
table with its command and notes. The hand-written analysis lives in ``benchmarks/FINDINGS.md``
(linked, not copied). For a benchmark that missed a target the markdown names the
:mod:`benchmarks.profile_step` command that shows where the time goes; ``--profiles`` also runs it
and writes the cProfile dumps under ``outputs/bench/profiles/`` (git-ignored), never into the
markdown.

Run: ``.venv/bin/python -m benchmarks.run_all [--quick] [--only overhead packing ...] [--out BENCHMARKS.md] [--profiles]``;
``--render-only`` rewrites the markdown from the last run's saved results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import machine_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = (
    "dynamic_batching",
    "overhead",
    "packing",
    "memory",
    "checkpoint_verify",
    "gather",
    "export_buckets",
    "rollout",
    "ray_dispatch",
    "async_rl",
    "agent_scheduling",
    "distill_step",
    "tinker_server",
    "tinker_multi_run",
    "trl_grpo",
    "long_context",
    "gpu_throughput",
)
# The one column of each benchmark that the summary shows.
KEY = {
    "overhead": "ratio",
    "packing": "time_vs_padded",
    "dynamic_batching": "balanced_max_mean",
    "memory": "actor_update_peak_mb",
    "checkpoint_verify": "s_per_GB",
    "gather": "pickled/tensor",
    "export_buckets": "bucketed/raw",
    "rollout": "vllm/hf",
    "ray_dispatch": "ray/torchrun",
    "async_rl": "speedup",
    "agent_scheduling": "speedup",
    "distill_step": "vs_grpo",
    "tinker_server": "server/in_process",
    "tinker_multi_run": "per_run/(adapter+adam)",
    "trl_grpo": "vs_trl",
    "long_context": "sp2/sp1_act",
    "gpu_throughput": "mfu",
}
PROFILES = {"overhead": ["--case", "overhead"], "packing": ["--case", "packing"]}


def _profile_args(rep: dict) -> list[str]:
    """profile_step arguments for a report with missed rows (overhead: only the missing backends)."""
    args = list(PROFILES[rep["benchmark"]])
    if rep["benchmark"] == "overhead":
        missed = {r["case"].split(",")[0] for r in rep["rows"] if r["met"] is False}
        args += ["--backends", *sorted(missed)]
    return args


def _profile_command(rep: dict) -> str | None:
    """The on-demand profile command for a report with a missed target that profile_step covers."""
    if rep["benchmark"] not in PROFILES or not any(r["met"] is False for r in rep["rows"]):
        return None
    return " ".join([".venv/bin/python -m benchmarks.profile_step", *_profile_args(rep)])


TIMEOUT_S = 420
# Scripts that need longer (overhead: the RL-size rows run 4096-sequence steps on both backends).
# trl_grpo: 5 alternating rounds of both shapes (2,096 s measured on the 2-core machine).
TIMEOUT_OVERRIDES_S = {"overhead": 2400, "long_context": 1800, "trl_grpo": 3600, "async_rl": 1800}
# Full output of every script, the last run's results for --render-only and the --profiles dumps
# (outputs/ is git-ignored).
LOG = os.path.join(ROOT, "outputs", "bench", "run_all.log")
RESULTS = os.path.join(ROOT, "outputs", "bench", "results.json")
PROFILE_DIR = os.path.join(ROOT, "outputs", "bench", "profiles")


def _timeout(module: str) -> int:
    return TIMEOUT_OVERRIDES_S.get(module.rsplit(".", 1)[-1], TIMEOUT_S)


def _run(module: str, args: list[str], log) -> tuple[int, str, float, tuple]:
    """Run ``python -m module args`` from the repo root; returns (rc, stdout, seconds, load before/after)."""
    load0 = os.getloadavg()
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "TRANSFORMERS_VERBOSITY": "error"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=_timeout(module), check=False
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = 124, exc.stdout or "", f"timed out after {_timeout(module)}s"
        out, err = (out.decode() if isinstance(out, bytes) else out), err
    log.write(f"$ python -m {module} {' '.join(args)}  (rc {rc})\n{out}\n{err}\n")
    seconds = time.perf_counter() - start
    print(f"  {module}: rc {rc}, {seconds:.0f} s, load {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    if rc != 0:
        print(err[-3000:], file=sys.stderr)
    return rc, out, seconds, (load0[0], os.getloadavg()[0])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r["values"]))
    head = ["case", *columns, "target", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        note = r["note"].strip()
        verdict = {True: f"met {note}", False: f"**missed** {note}", None: note or "-"}[r["met"]].strip()
        cells = [r["case"], *(_fmt(r["values"].get(c, "")) for c in columns), r["target"] or "-", verdict]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def _summary(reports: list[dict]) -> str:
    lines = ["| benchmark | case | result | target | verdict |", "|---|---|---|---|---|"]
    for rep in reports:
        for r in rep["rows"]:
            key = KEY.get(rep["benchmark"])
            value = r["values"].get(key, r["values"].get("status", ""))
            verdict = {True: "met", False: "**missed**", None: "-"}[r["met"]]
            lines.append(f"| {rep['benchmark']} | {r['case']} | {key}: {_fmt(value)} | {r['target'] or '-'} | {verdict} |")
    return "\n".join(lines)


def render(reports: list[dict], info: dict, loads: dict, failures: list[str], quick: bool) -> str:
    """The whole BENCHMARKS.md: generated tables only (no hand-written analysis, no profile dumps)."""
    cores = info["cores"] or 1
    busiest = max((max(v) for v in loads.values()), default=0.0)
    loaded = busiest > 0.5 * cores
    out = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`.venv/bin/python -m benchmarks.run_all`); every table below also names the command that "
        "produced it. Each comparison is measured within one run, interleaved, as a ratio (see `benchmarks/common.py`), so "
        "the ratios, not the absolute times, are the results. What the numbers mean, why a target is missed and what was "
        "changed: [benchmarks/FINDINGS.md](benchmarks/FINDINGS.md) (hand-written).",
        "",
        f"Date: {info.get('date', '?')}." + (" **Quick mode** (fewer rounds): smoke numbers only." if quick else ""),
        "",
        "| machine | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in info.items() if k not in ("loadavg", "date")),
        "",
        "Load average (1 min) before -> after each script: "
        + ", ".join(f"{name} {a:.1f} -> {b:.1f}" for name, (a, b) in loads.items())
        + f" on {cores} cores."
        + (
            " **These numbers were taken while other jobs were running on the machine** (concurrent load); CPU-time ratios "
            "with one compute thread are used to keep them meaningful."
            if loaded
            else ""
        ),
        "",
    ]
    if failures:
        out += ["**Failed scripts:** " + ", ".join(failures) + " (see outputs/bench/run_all.log).", ""]
    out += ["## Summary", "", _summary(reports), ""]
    for i, rep in enumerate(reports, 1):
        out += [f"## {i}. {rep['title']}", "", f"Command: `{rep['command']}` ({rep['seconds']:.0f} s)", "", rep["setup"], ""]
        out += [_table(rep["rows"]), ""]
        notes = list(rep["notes"])
        command = _profile_command(rep)
        if command:
            notes.append(f"Where the time of the missed rows goes (cProfile, on demand): `{command}`.")
        out += [f"- {n}" for n in notes] + [""]
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds everywhere (smoke test)")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, default=list(SCRIPTS))
    parser.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    parser.add_argument(
        "--profiles", action="store_true", help=f"also profile the missed targets (cProfile dumps to {os.path.relpath(PROFILE_DIR, ROOT)}/)"
    )
    parser.add_argument("--render-only", action="store_true", help="re-render the last run's results (e.g. after changing the renderer)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.render_only:
        with open(RESULTS) as f:
            saved = json.load(f)
        with open(args.out, "w") as f:
            f.write(render(saved["reports"], saved["info"], saved["loads"], saved["failures"], saved["quick"]))
        print(f"re-rendered {args.out} from {RESULTS}")
        return
    info = machine_info()
    info["torch_threads"] = "1 (benchmarks set it; see benchmarks/common.py)"
    info["date"] = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    reports, loads, failures = [], {}, []
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ek_bench_json_") as tmp, open(LOG, "w") as log:
        for name in args.only:
            path = os.path.join(tmp, f"{name}.json")
            rc, _, _, loads[name] = _run(f"benchmarks.{name}", ["--json", path, *(["--quick"] if args.quick else [])], log)
            if rc != 0 or not os.path.exists(path):
                failures.append(name)
                continue
            with open(path) as f:
                reports.append(json.load(f))
        for rep in reports if args.profiles else []:
            name = rep["benchmark"]
            if _profile_command(rep):
                rc, text, _, _ = _run("benchmarks.profile_step", _profile_args(rep), log)
                os.makedirs(PROFILE_DIR, exist_ok=True)
                dump = os.path.join(PROFILE_DIR, f"{name}.txt")
                with open(dump, "w") as f:
                    f.write(f"$ {_profile_command(rep)}\n\n" + (text if rc == 0 else f"(profile failed, rc {rc}; see {LOG})\n"))
                print(f"  profile of {name}: {dump}", flush=True)
    with open(RESULTS, "w") as f:
        json.dump({"reports": reports, "info": info, "loads": loads, "failures": failures, "quick": args.quick}, f)
    with open(args.out, "w") as f:
        f.write(render(reports, info, loads, failures, args.quick))
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s" + (f"; FAILED: {failures}" if failures else ""))
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
