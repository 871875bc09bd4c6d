"""Reading the sources of ``data.train_files`` / ``data.val_files`` into rows (``read_rows``).

Files are read by their extension: ``.jsonl`` (one JSON object per line), ``.json`` (a JSON array
of objects, or JSON lines) and ``.parquet`` (pyarrow); ``save_to_disk`` directories and ``hf:``
sources through HF ``datasets`` (imported in the function that reads them only: it is an optional
dependency). Their rows (decoded by the dataset's features; null-filled struct keys dropped as for
Parquet) take the same checks as a file's.

A JSON line longer than ``data.max_row_bytes`` is refused before it is parsed (a ``.json``
array's, a Parquet row's or a dataset row's text, after reading), so one runaway row cannot
exhaust memory.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from posttrain.data.config import MAX_ROW_BYTES, DataConfig
from posttrain.data.sources import (
    HF_PREFIX,
    dir_problem,
    expand_files,
    missing_split,
    needs_datasets,
    parse_hf_source,
    saved_dataset_kind,
    script_problem,
)


@dataclass(frozen=True)
class Row:
    """One data row and where it came from: ``file:line`` for JSON lines, ``file[row]`` for a
    ``.json`` array, Parquet and a saved ``Dataset``, ``source[split][row]`` for a split of a
    ``DatasetDict`` (e.g. ``hf:org/name[train][12]``); rows count from 0."""

    values: Mapping[str, object]
    source: str


def read_rows(
    paths: Sequence[str], key: str = "data.train_files", max_row_bytes: int = MAX_ROW_BYTES, split: str | None = None
) -> list[Row]:
    """Every row of the sources ``paths`` (expanded as ``expand_files`` does), in order.

    Args:
        split: the split read from a ``DatasetDict``; None: ``DataConfig``'s default for ``key``
            (``validation`` for ``data.val_files``, else ``train``).

    Raises:
        ValueError: an unreadable file or dataset, a directory with no data file, a missing
            split, a row that is not a JSON object, or a row over ``max_row_bytes``
            (``data.max_row_bytes``), naming it.
    """
    split = split or (DataConfig.val_split if key.endswith("val_files") else DataConfig.train_split)
    rows: list[Row] = []
    for path in expand_files(list(paths)):
        try:
            if path.startswith(HF_PREFIX) or (os.path.isdir(path) and saved_dataset_kind(path)):
                values = _read_dataset(path, key, split)
            elif os.path.isdir(path):  # left by expand_files: no data file, or several splits
                raise _SourceError(dir_problem(key, path) or f"{key}: the directory {path!r} changed while it was read; fix: retry")
            elif path.endswith(".parquet"):
                import pyarrow.parquet as pq

                table = pq.read_table(path).to_pylist()
                values = [(f"{path}[{i}]", _drop_null_struct_keys(r), False) for i, r in enumerate(table)]
            else:
                values = _read_json(path, max_row_bytes, key)
        except (_RowTooLarge, _SourceError):
            raise
        except (OSError, ValueError) as exc:
            raise ValueError(f"{key}: cannot read {path!r}: {exc}; fix: give a valid {os.path.splitext(path)[1]} file") from exc
        for source, value, measured in values:
            if not isinstance(value, dict):
                raise ValueError(f"{key}: row {source} is a {type(value).__name__}, not an object of columns; fix: one JSON object per row")
            if not measured:  # (JSON lines were measured before parsing)
                size = _text_bytes(value)
                if size > max_row_bytes:
                    raise _too_large(key, source, f"about {size} bytes of text", max_row_bytes)
            rows.append(Row(value, source))
    if not rows:
        raise ValueError(f"{key} = {list(paths)}: no rows; fix: give files with at least one row")
    return rows


class _RowTooLarge(ValueError):
    """A row over ``data.max_row_bytes``."""


class _SourceError(ValueError):
    """A source that cannot be read, already worded for the user."""


def _import_datasets(key: str, entry: str):
    try:
        import datasets
    except ImportError as exc:
        raise _SourceError(needs_datasets(key, entry)) from exc
    return datasets


def _read_dataset(entry: str, key: str, split: str) -> list[tuple[str, object, bool]]:
    """``(source, row, measured)`` of a ``save_to_disk`` directory or an ``hf:`` source (of a
    ``DatasetDict``: the split ``split``)."""
    ds = _import_datasets(key, entry)
    path, config = parse_hf_source(entry) if entry.startswith(HF_PREFIX) else (entry, None)
    if os.path.isdir(path) and saved_dataset_kind(path):
        try:
            loaded = ds.load_from_disk(path)
        except Exception as exc:  # noqa: BLE001 (datasets raises many types; the source must be named)
            raise _SourceError(
                f"{key}: cannot read {entry!r} with datasets.load_from_disk: {exc}; fix: save it again (save_to_disk)"
            ) from exc
    else:
        script = script_problem(path) if os.path.isdir(path) else None
        if script:  # (DataConfig refuses it at load; a config built in Python gets here)
            raise _SourceError(f"{key}: {entry!r}: {script}")
        try:
            loaded = ds.load_dataset(path, config)
        except Exception as exc:  # noqa: BLE001 (network, hub, file and format errors alike; the source must be named)
            raise _SourceError(
                f"{key}: {entry!r}: datasets.load_dataset({path!r}, {config!r}) failed: {type(exc).__name__}: {exc}; fix: check the "
                "name and config (a Hub dataset needs the network, or a cached copy with HF_DATASETS_OFFLINE=1; a gated or private "
                "one needs HF_TOKEN), or give a local directory of data files"
            ) from exc
    where = entry
    if isinstance(loaded, Mapping):  # DatasetDict (and IterableDatasetDict): one split
        if split not in loaded:
            raise _SourceError(missing_split(key, entry, split, list(loaded)))
        loaded, where = loaded[split], f"{entry}[{split}]"
    out: list[tuple[str, object, bool]] = []
    # Python rows decoded by the features (datasets 5 stores objects whose keys vary, such as
    # messages of which only some have a `name`, as Json columns: their Arrow form is JSON text),
    # then the Parquet reader's clean-up of null-filled struct keys, so rows equal their JSON lines.
    for batch in loaded.with_format(None).iter(batch_size=1024):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            out.append((f"{where}[{len(out)}]", _drop_null_struct_keys(dict(zip(columns, values, strict=True))), False))
    return out


def _too_large(key: str, source: str, size: str, limit: int) -> _RowTooLarge:
    return _RowTooLarge(
        f"{key}: row {source} is {size}, over data.max_row_bytes = {limit}; it is refused before parsing and tokenizing it "
        "(a row that large is far over any sample length and would take gigabytes of memory); fix: check the file (a missing "
        "line break?), split or shorten the row, or raise data.max_row_bytes"
    )


def _text_bytes(value: object) -> int:
    """Roughly the JSON size of ``value``: its strings' UTF-8 bytes plus a few per item (what
    tokenizing it costs), without serialising it."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) + 2
    if isinstance(value, dict):
        return sum(_text_bytes(k) + _text_bytes(v) for k, v in value.items()) + 2
    if isinstance(value, (list, tuple)):
        return sum(_text_bytes(v) + 1 for v in value) + 2
    return 8


def _drop_null_struct_keys(row: dict) -> dict:
    """Parquet stores a list of messages as a list of structs with the union of all keys, so a
    message without e.g. ``tool_calls`` comes back with ``tool_calls: None``; templates test
    ``'tool_calls' in message``. Drop those None keys inside lists of dicts, as JSON lines would
    not have them (top-level None values are kept: they are the column's value)."""
    out = {}
    for key, value in row.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            value = [{k: v for k, v in item.items() if v is not None} for item in value]
        out[key] = value
    return out


def _read_json(path: str, max_row_bytes: int = MAX_ROW_BYTES, key: str = "data.train_files") -> list[tuple[str, object, bool]]:
    """``(source, row, measured)`` of a ``.json`` array, or of JSON lines (``.jsonl``, or a
    ``.json`` that is not one document); ``measured``: the row's size was already checked. A
    JSON line's length is read before the line is: one over ``max_row_bytes`` is refused
    without holding more than ``max_row_bytes`` of it in memory."""
    if path.endswith(".json"):
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of the data
            text = f.read()
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None  # maybe JSON lines
        del text
        if isinstance(doc, list):
            return [(f"{path}[{i}]", v, False) for i, v in enumerate(doc)]
        if isinstance(doc, dict):
            return [(f"{path}[0]", doc, False)]
    out = []
    # Binary lines split on b"\n" only: str.splitlines would also split inside strings on
    # U+2028, U+0085, ...
    with open(path, "rb") as f:
        for n in itertools.count(1):
            line = f.readline(max_row_bytes + 1)
            if not line:
                break
            if len(line) > max_row_bytes and not (len(line) == max_row_bytes + 1 and line.endswith(b"\n")):
                size = len(line) + _skip_line(f)
                raise _too_large(key, f"{path}:{n}", f"{size} bytes", max_row_bytes)
            try:
                text = line.decode("utf-8-sig" if n == 1 else "utf-8")  # -sig: a byte-order mark is not part of the data
                if text.strip():
                    out.append((f"{path}:{n}", json.loads(text), True))
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"line {n}: {exc}") from exc
    return out


def _skip_line(f) -> int:
    """Read to the end of the current line in 1 MiB pieces; return how many bytes were read."""
    size = 0
    while True:
        piece = f.readline(2**20)
        size += len(piece)
        if not piece or piece.endswith(b"\n"):
            return size


def column(row: Row, key: str, name: str, fmt: str | None = None) -> object:
    """The value of ``row``'s column ``key``, which the config key ``data.<name>`` names.

    Raises:
        ValueError: no such column, naming the row, its columns and the fix (for ShareGPT rows
            read with the ``messages`` settings, or the other way round, the keys to set).
    """
    if key not in row.values:
        fix = f"set data.{name} to one of the columns"
        if name == "messages_key" and fmt == "sharegpt" and "conversations" in row.values:
            # data.format=sharegpt is set; a messages_key left over from a messages config
            # (e.g. the examples' `messages: messages`) is what points elsewhere.
            fix = "set data.messages_key=conversations, or null (each format's usual column)"
        elif name == "messages_key" and "conversations" in row.values:
            fix = "for ShareGPT rows set data.format=sharegpt and data.messages_key=null (or conversations)"
        raise ValueError(f"row {row.source}: no column {key!r} (data.{name}); columns: {sorted(row.values)}; fix: {fix}")
    return row.values[key]
