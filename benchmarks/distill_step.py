"""On-policy distillation: the cost of a distillation step against a GRPO step of the same shape
(issue 63 item 4).

Both run the GRPO demo (``configs/grpo_tiny.yaml``: 16 prompts x 8 responses, 4 epochs over 2
mini-batches) through the recipe for ``steps`` steps in their own process; the distillation run
adds a teacher of the same architecture (``distill.teacher_path``, a tiny model built with another
seed: the cost does not depend on what it learned). A step's seconds are its ``rollout_s +
reward_s + prepare_s + update_s`` from ``metrics.jsonl`` (the teacher's forward falls in
``prepare_s``); the first step (warm-up) is left out; medians over alternating runs. Target: a
distillation step <= 1.3x a GRPO step.

Run: ``.venv/bin/python -m benchmarks.distill_step [--quick]``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import Report, Row, cli, command_line, emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 1.3
PHASES = ("rollout_s", "reward_s", "prepare_s", "update_s")


def _steps(out: str, steps: int, threads: int, *extra: str) -> list[float]:
    cmd = [sys.executable, "-m", "recipes.ppo", "--config", os.path.join(ROOT, "configs", "grpo_tiny.yaml"), f"trainer.output_dir={out}",
           f"trainer.total_steps={steps}", "trainer.progress_bar=false", "trainer.val_every=0", "trainer.save_hf=false",
           "trainer.loggers=[jsonl]", "trainer.log_samples_every=0", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [sum(r.get(k, 0.0) for k in PHASES) for r in rows[1:]]


def main(argv=None) -> Report:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    rounds, steps = (1, 4) if args.quick else (3, 8)
    start = time.perf_counter()
    report = Report(
        benchmark="distill_step",
        title="On-policy distillation vs GRPO: seconds per step of the same shape (GRPO tiny demo, CPU)",
        command=command_line("benchmarks.distill_step", argv),
        setup=(
            f"configs/grpo_tiny.yaml ({steps} steps a run, the first left out), {rounds} round(s) of the two runs alternating, "
            f"{args.threads} thread(s); the teacher: the tiny architecture with another seed"
        ),
    )
    from posttrain.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="ek_bench_distill_") as tmp:
        teacher = build_tiny_model(os.path.join(tmp, "teacher"), seed=7)
        times: dict[str, list[float]] = {"GRPO": [], "distillation": []}
        for r in range(rounds):
            times["GRPO"] += _steps(os.path.join(tmp, f"grpo{r}"), steps, args.threads)
            times["distillation"] += _steps(os.path.join(tmp, f"distill{r}"), steps, args.threads, f"distill.teacher_path={teacher}")
    base = statistics.median(times["GRPO"])
    for name, ts in times.items():
        ratio = statistics.median(ts) / base
        row = Row(name, {"step_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "vs_grpo": ratio}, samples={"s": ts})
        if name == "distillation":
            row.target, row.met = f"<= {TARGET}x GRPO", ratio <= TARGET
        report.rows.append(row)
    report.notes.append(
        "The distillation step adds one forward of the teacher over the step's samples (no backward, no optimizer) to a step of "
        "one old-policy forward and 8 forward-backward passes; the same samples are not drawn by the two runs (their weights "
        "differ after the first update), so per-step times vary with response lengths."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
