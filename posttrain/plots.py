"""PNG plots of a run from its metrics JSON-lines file (``posttrain.loggers``' ``jsonl``), drawn
with matplotlib's Agg renderer (no display needed; pyplot and the global backend are not touched).

:func:`plot_run` draws what the run has: ``loss.png`` (``loss``, or ``actor_loss`` and
``critic_loss``), ``val.png`` (every ``val/*`` key at the steps it was measured), ``reward.png``
(``reward`` per step, its running mean, and ``val/reward`` points), ``response_len.png`` and
``kl.png`` (``kl`` and / or ``rollout/kl_k3``). A plot whose keys never hold a finite number is
skipped; missing, None or non-numeric values are gaps; a line that does not parse (one cut by a
crash) is ignored.
"""

from __future__ import annotations

import json
import math
import os

__all__ = ["plot_run", "read_metrics"]

_SMOOTH = 10  # steps in the reward's running mean


def read_metrics(path: str) -> list[dict]:
    """The JSON objects of ``path`` that have a ``step``, in file order (unparsable lines skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by the crash that ended the run
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                rows.append(row)
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) where ``key`` holds a finite number."""
    points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(metrics_path: str, out_dir: str, title: str = "") -> list[str]:
    """Write the PNGs the metrics file at ``metrics_path`` supports into ``out_dir``; return their
    paths (see the module docstring for which)."""
    # A bare Figure draws with Agg and leaves pyplot's global state (and the backend) alone.
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_path)
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "step"))
    val_keys = [k for k in keys if k.startswith("val/")]
    plots = {
        "loss": ["loss"] if "loss" in keys else ["actor_loss", "critic_loss"],
        "val": val_keys,
        "reward": ["reward", "val/reward"],
        "response_len": ["response_len"],
        "kl": ["kl", "rollout/kl_k3"],
    }
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, wanted in plots.items():
        series = {k: _series(rows, k) for k in wanted}
        series = {k: s for k, s in series.items() if s[0]}
        if name == "reward" and "reward" not in series:
            continue  # val/reward alone is in val.png
        if not series:
            continue
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for key, (steps, values) in series.items():
            if key.startswith("val/"):  # sparse: points joined by a line
                ax.plot(steps, values, marker="o", ms=4, lw=1, label=key)
            elif name == "reward":
                ax.plot(steps, values, lw=1, alpha=0.5, label="reward per step")
                smooth = [
                    sum(values[max(0, i - _SMOOTH + 1) : i + 1]) / len(values[max(0, i - _SMOOTH + 1) : i + 1]) for i in range(len(values))
                ]
                ax.plot(steps, smooth, lw=2, label=f"mean of last {_SMOOTH}")
            else:
                ax.plot(steps, values, lw=1.5, label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(name.replace("_", " "))
        ax.set_title(f"{title}: {name}" if title else name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
