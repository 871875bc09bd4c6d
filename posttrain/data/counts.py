"""What ``data.overlong`` does to a sample over its length limit (``overlong_action``), and the
counts of a load (``LoadCounts``), printed at load and returned in the run summary
(``report_counts``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

from posttrain.data.config import DataConfig


@dataclass
class LoadCounts:
    """What the overlong policy did at load."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0

    def line(self, what: str) -> str:
        """The counts as one console line about ``what`` (e.g. ``data.train_files``)."""
        return f"{what}: {self.rows} rows, {self.kept} kept, {self.truncated} truncated, {self.dropped} dropped"


class Counted(Protocol):
    """A loaded dataset (``SFTDataset``, ``PromptDataset``): its load counts."""

    counts: LoadCounts


def report_counts(datasets: Mapping[str, Counted | None], overlong: str, rank0: bool) -> dict[str, dict[str, int]]:
    """The load counts of ``{"train": ..., "val": ...}`` (None entries skipped) as plain dicts,
    printed once (on rank 0)."""
    out = {}
    for name, data in datasets.items():
        if data is not None:
            out[name] = asdict(data.counts)
            if rank0:
                print(f"{data.counts.line(f'data.{name}_files')} (data.overlong = {overlong})", flush=True)
    return out


def overlong_action(cfg: DataConfig, source: str, n: int, limit: int, key: str) -> str:
    """``keep`` / ``truncate`` / ``drop`` for a sample of ``n`` tokens against ``limit``
    (``data.<key>``); with ``data.overlong = error`` an overlong sample raises, naming the row.

    Raises:
        ValueError: ``n > limit`` under ``data.overlong = error``.
    """
    if n <= limit:
        return "keep"
    if cfg.overlong == "error":
        raise ValueError(
            f"row {source}: {n} tokens > data.{key} = {limit} (data.overlong = error); fix: raise data.{key}, or set "
            "data.overlong to truncate or drop"
        )
    return cfg.overlong
