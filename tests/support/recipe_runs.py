"""Running the PPO / GRPO recipe as a user does (``python -m recipes.ppo``) for the recipe tests,
with the console checked for library noise."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import launch

ROOT = Path(__file__).resolve().parents[2]
# Small batches for the tests that only need a few quick steps.
FAST = ["data.batch_size=8", "algo.n_samples=4"]


# HF's load report of the critic (lm_head UNEXPECTED, score MISSING), megatron-core's import-time
# Transformer-Engine / Apex fallbacks and its deprecated default cuda_graph_scope, HF's progress bars.
NOISE = (
    "LOAD REPORT",
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "Loading weights",
)


def run_ppo(out: Path, config: str, steps: int, *extra: str, fast: bool = True, fresh: bool = False) -> list[dict]:
    """``steps`` steps of ``config`` in a new process (with :data:`FAST`'s small batches
    unless ``fast`` is False); returns the metrics rows.

    The process is forked from the preloaded server (``launch.run_script``) unless ``fresh``:
    a new interpreter, whose console then also shows what the libraries print while they are
    imported (the runs that check the console for it pass ``fresh=True``)."""
    cmd = [
        "-m",
        "recipes.ppo",
        "--config",
        str(ROOT / "configs" / config),
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.progress_bar=false",
        *(FAST if fast else ()),
        *extra,
    ]
    proc = launch.run_script(cmd, timeout=600, fresh=fresh)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Issue 13: what libraries print although nothing is wrong stays off the console; the
    # expected value-head init is said once, in one line.
    for noise in NOISE:
        assert noise not in proc.stderr, f"{noise!r} on the console:\n{proc.stderr[-3000:]}"
    assert proc.stderr.count("[enginekit] value model") <= 1
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
