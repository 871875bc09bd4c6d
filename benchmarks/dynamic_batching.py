"""Dynamic batching: the engine's balanced partition vs greedy first-fit, over seeded length mixes.

For each length distribution and token budget, both partitioners split the same sequences into
micro-batches of at most ``max_tokens`` real tokens:

* balanced: ``engine_api.partition.partition_balanced`` (what the engine runs);
* greedy: first-fit in arrival order (each sequence goes to the first micro-batch with room,
  else a new one): what a data loader that packs as it reads does.

Reported: micro-batch count vs the lower bound ceil(total / budget), and max / mean token
load per micro-batch (the slowest micro-batch sets the pace of a step, and with DP every rank
waits for the slowest rank). Targets (balanced): max/mean <= 1.05 and count <= lower bound + 1.
Pure Python; no model runs.

Run: ``.venv/bin/python -m benchmarks.dynamic_batching [--json out.json]``.
"""

from __future__ import annotations

import itertools
import math
import time

from benchmarks.common import Report, Row, cli, command_line, emit, lognormal_lengths, uniform_lengths
from engine_api.partition import partition_balanced

SIZES = (32, 256)  # sequences per batch (per DP rank): a small PPO mini-batch and a large one
MAX_TARGET, SLACK_PARTS = 1.05, 1


def _bimodal(n: int, seed: int) -> list[int]:
    """80% short prompts (~64 tokens) and 20% long reasoning traces (~900 tokens)."""
    short = uniform_lengths(n - n // 5, 32, 96, seed)
    long = uniform_lengths(n // 5, 800, 1024, seed + 1)
    mixed = short + long
    # Interleave deterministically so the long ones do not all arrive last.
    return [mixed[(i * 7919) % n] for i in range(n)]


DISTRIBUTIONS = {
    "log-normal, median 128, sigma 1.0": lambda n, seed: lognormal_lengths(n, 128, 1.0, 16, 1024, seed),
    "log-normal, median 256, sigma 0.5": lambda n, seed: lognormal_lengths(n, 256, 0.5, 16, 1024, seed),
    "uniform 16..1024": lambda n, seed: uniform_lengths(n, 16, 1024, seed),
    "bimodal 80% ~64 / 20% ~900": _bimodal,
}
BUDGETS = (2048, 4096)
SEEDS = (0, 1, 2)


def greedy_first_fit(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit in arrival order: the baseline a streaming packer implements."""
    parts: list[list[int]] = []
    loads: list[int] = []
    for i, n in enumerate(lengths):
        j = next((j for j, load in enumerate(loads) if load + n <= max_tokens), None)
        if j is None:
            parts.append([])
            loads.append(0)
            j = len(parts) - 1
        parts[j].append(i)
        loads[j] += n
    return parts


def stats(parts: list[list[int]], lengths: list[int], max_tokens: int) -> tuple[int, float]:
    """(micro-batch count, max/mean load); also checks the partition is complete and in budget."""
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(len(lengths))), "partition lost or duplicated a sequence"
    assert max(loads) <= max_tokens, "partition exceeds the budget"
    return len(parts), max(loads) / (sum(loads) / len(loads))


def _worst_over_seeds(draw, n: int, budget: int) -> tuple[dict, list[int]]:
    """Worst count excess and max/mean over :data:`SEEDS` for both partitioners, the balanced
    partition's slowest run time, and the lower bound of each seed."""
    worst = {"bal_parts_over": 0, "bal_max_mean": 0.0, "greedy_parts_over": 0, "greedy_max_mean": 0.0, "bal_ms": 0.0}
    bounds = []
    for seed in SEEDS:
        lengths = draw(n, seed)
        bounds.append(math.ceil(sum(lengths) / budget))
        t0 = time.perf_counter()
        balanced = partition_balanced(lengths, budget)
        worst["bal_ms"] = max(worst["bal_ms"], 1e3 * (time.perf_counter() - t0))
        for key, parts in (("bal", balanced), ("greedy", greedy_first_fit(lengths, budget))):
            count, max_mean = stats(parts, lengths, budget)
            worst[f"{key}_parts_over"] = max(worst[f"{key}_parts_over"], count - bounds[-1])
            worst[f"{key}_max_mean"] = max(worst[f"{key}_max_mean"], max_mean)
    return worst, bounds


def main(argv=None) -> Report:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    start = time.perf_counter()
    report = Report(
        benchmark="dynamic_batching",
        title="Dynamic batching: balanced partition vs greedy first-fit",
        command=command_line("benchmarks.dynamic_batching", argv),
        setup=(
            f"{' or '.join(map(str, SIZES))} sequences per batch, lengths clipped to 16..1024, seeds {list(SEEDS)}; budgets "
            f"{list(BUDGETS)} tokens per micro-batch; each row is the worst case over the seeds (LB = ceil(total / budget))."
        ),
    )
    for (dist_name, draw), n, budget in itertools.product(DISTRIBUTIONS.items(), SIZES, BUDGETS):
        worst, bounds = _worst_over_seeds(draw, n, budget)
        met = worst["bal_parts_over"] <= SLACK_PARTS and worst["bal_max_mean"] <= MAX_TARGET
        report.rows.append(
            Row(
                case=f"{dist_name}; {n} seqs, budget {budget}",
                values={
                    "lb": f"{min(bounds)}-{max(bounds)}",
                    "balanced_count_over_lb": worst["bal_parts_over"],
                    "balanced_max_mean": worst["bal_max_mean"],
                    "greedy_count_over_lb": worst["greedy_parts_over"],
                    "greedy_max_mean": worst["greedy_max_mean"],
                    "balanced_ms": worst["bal_ms"],
                },
                target=f"balanced max/mean <= {MAX_TARGET}, count <= LB + {SLACK_PARTS}",
                met=met,
                note="" if met else _miss(worst),
            )
        )
    report.notes.append("lb: range of the lower bound over seeds; count_over_lb: the worst (count - its own lower bound) over seeds.")
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


def _miss(worst: dict) -> str:
    parts = []
    if worst["bal_max_mean"] > MAX_TARGET:
        parts.append(f"max/mean {worst['bal_max_mean']:.3f} > {MAX_TARGET}")
    if worst["bal_parts_over"] > SLACK_PARTS:
        parts.append(f"{worst['bal_parts_over']} micro-batches over the bound")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
