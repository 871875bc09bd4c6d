"""The controller's per-step cost on Ray vs torchrun: the same GRPO run (tiny demo model, CPU)
as one plain process (the torchrun launcher's one-rank layout) and as a Ray driver with every
role in one worker, then with the rollout on a pool of its own (weights over the transfer
group); plus the bare round trip of a driver call to 2 workers, empty and with a batch.

Per-step time = the sum of the step's phase timings the recipe logs (rollout, reward, prepare,
update: what the driver waits for, dispatch included), median over the steps after the first
two (warm-up). The runs are sequential processes on a shared machine: compare the ratios.

Run: ``.venv/bin/python -m benchmarks.ray_dispatch [--quick]`` (needs the ray extra).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import Report, Row, cli, command_line, emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("rollout_s", "reward_s", "prepare_s", "update_s")


class Echo:
    """A worker host that does nothing: what a call costs without work."""

    def ping(self, batch=None) -> int:
        return 0 if batch is None else int(batch["input_ids"].values().numel())


def _step_seconds(out: str, steps: int, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "recipes.ppo", "--config", "configs/grpo_tiny.yaml", f"trainer.total_steps={steps}",
           f"trainer.output_dir={out}", "trainer.progress_bar=false", "trainer.loggers=[jsonl]", "trainer.log_samples_every=0", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return statistics.median(sum(r[k] for k in PHASES) for r in rows[2:])


def _round_trips(rounds: int) -> dict[str, float]:
    from engine_api import make_batch
    from posttrain.placement.cluster import RayCluster
    from posttrain.placement.config import PlacementConfig

    placement = PlacementConfig(pools={"main": 2}, cpus_per_worker=0.5)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, 256, (512,), generator=g) for _ in range(256)]  # 128k tokens, the size of an RL step's batch
    batch = make_batch(seqs, loss_mask=[torch.cat([torch.zeros(256), torch.ones(256)]) for _ in seqs])
    mb = sum(t.numel() * t.element_size() for t in batch.values(include_nested=True, leaves_only=True) if hasattr(t, "values")) / 2**20
    with RayCluster(placement, {"main": ("bench",)}, None, 120) as cluster:
        group = cluster.spawn("main")
        cluster.build(group, "benchmarks.ray_dispatch:Echo")
        times = {"empty": [], "batch": []}
        for _ in range(rounds):
            for case, args in (("empty", ()), ("batch", (batch,))):
                start = time.perf_counter()
                cluster.call(group, "ping", *args)
                times[case].append(time.perf_counter() - start)
    return {"empty_ms": 1e3 * statistics.median(times["empty"]), "batch_ms": 1e3 * statistics.median(times["batch"]), "batch_mb": mb}


def main(argv=None) -> Report:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    steps = 8 if args.quick else 20
    start = time.perf_counter()
    report = Report(
        benchmark="ray_dispatch",
        title="Ray vs torchrun: the controller's per-step cost (GRPO tiny demo, CPU, 1 rank per role group)",
        command=command_line("benchmarks.ray_dispatch", argv),
        setup=(
            f"configs/grpo_tiny.yaml, {steps} steps, median per-step time of steps 3-{steps} (sum of the logged phases); "
            "OMP_NUM_THREADS=1; the Ray runs start a local instance (cpus_per_worker 0.5). Round trips: 2 workers, median of 20."
        ),
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_ray_") as tmp:
        local = _step_seconds(os.path.join(tmp, "local"), steps, [])
        ray_colocated = _step_seconds(os.path.join(tmp, "ray"), steps, ["trainer.launcher=ray", "trainer.placement.cpus_per_worker=0.5"])
        split = ["trainer.launcher=ray", "trainer.placement.cpus_per_worker=0.5", "trainer.placement.pools.train=1",
                 "trainer.placement.pools.gen=1", "trainer.placement.roles.rollout=gen"]  # fmt: skip
        ray_split = _step_seconds(os.path.join(tmp, "split"), steps, split)
    for case, seconds in (("ray, every role in one worker", ray_colocated), ("ray, rollout on its own pool", ray_split)):
        report.rows.append(
            Row(
                case=case,
                values={"torchrun_step_s": local, "ray_step_s": seconds, "ray/torchrun": seconds / local},
                target="dispatch < 25% of a step",
                met=seconds / local < 1.25,
            )
        )
    trips = _round_trips(rounds=5 if args.quick else 20)
    report.rows.append(
        Row(
            case=f"driver call to 2 workers: empty / a {trips['batch_mb']:.1f} MB batch",
            values={"empty_ms": trips["empty_ms"], "batch_ms": trips["batch_ms"]},
            target="-",
            met=None,
        )
    )
    report.notes.append(
        "On a tiny model a step is a few hundred ms, so a fixed per-call cost shows large; on a real model the same "
        "milliseconds are a small fraction. With the rollout apart, the weights also travel over the transfer group each step."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
