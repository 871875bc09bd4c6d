"""What a ``data.train_files`` / ``data.val_files`` entry names, and what is wrong with it, found
without reading a row (and without the network).

Sources (each key takes a list, or one entry as a string):
    * a file: ``.jsonl`` (one JSON object per line), ``.json`` (a JSON array of objects, or JSON
      lines) and ``.parquet`` (read with pyarrow). Each row is a mapping of column -> value.
    * a glob pattern (``data/*.jsonl``; ``**`` recursive): its matching files, sorted (directories
      it matches are skipped); a pattern matching nothing is an error.
    * a directory: every data file (``.jsonl`` / ``.json`` / ``.parquet``) directly in it, sorted
      by name; sub-directories and hidden files are not read. One with no data file, or with files
      of several splits (``train.jsonl`` beside ``test.jsonl``, which reading all would mix), is
      an error naming the path and the fix.
    * a directory written by HF ``datasets``' ``save_to_disk``: read with
      ``datasets.load_from_disk``; of a ``DatasetDict`` the split ``data.train_split`` /
      ``data.val_split``.
    * ``hf:NAME_OR_DIR[:CONFIG]``: ``datasets.load_dataset(NAME_OR_DIR, CONFIG)``, a Hub dataset
      or a local dataset directory (data files, a README card), then the split as above. Dataset
      loading scripts are never executed (``datasets`` >= 4 refuses them; a directory holding
      one is refused when the config loads).
Patterns and plain directories are expanded when the config loads (``DataConfig``), so the config
holds what is read. ``datasets`` is an optional dependency (``pip install 'enginekit[datasets]'``),
imported only by the reader of the last two kinds (``posttrain.data.rows``), never here.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
from collections.abc import Sequence

EXTENSIONS = (".jsonl", ".json", ".parquet")
_GLOB_CHARS = "*?["
HF_PREFIX = "hf:"
# The fix for a missing optional dependency, in every message that needs it.
INSTALL_DATASETS = "pip install 'enginekit[datasets]' (or pip install datasets)"
# File-name words that mark a split (those HF datasets uses to split a directory's files by name):
# a plain directory holding files of two splits is refused rather than read as one.
_SPLIT_WORDS = {
    **dict.fromkeys(("train", "training"), "train"),
    **dict.fromkeys(("validation", "valid", "val", "dev"), "validation"),
    **dict.fromkeys(("test", "testing", "eval", "evaluation"), "test"),
}


def is_pattern(path: str) -> bool:
    """Whether ``path`` holds a glob character (``*``, ``?``, ``[``)."""
    return any(c in path for c in _GLOB_CHARS)


def expand_files(files: str | Sequence[str]) -> list[str]:
    """``files`` as a list of sources: a single string becomes a one-element list; a glob
    pattern (``*``, ``?``, ``[...]``; ``**`` recursive) is replaced by the files it matches,
    sorted (the directories it matches are skipped: ``data/**`` would otherwise read each file
    twice); a plain directory by its data files, sorted. A path that exists as written is kept
    even if it contains such characters. Kept as is, for ``DataConfig`` or the reader to report
    or read: ``hf:`` sources, ``save_to_disk`` directories, a pattern matching nothing, and a
    directory with no data file or with files of several splits."""
    out: list[str] = []
    for path in [files] if isinstance(files, str) else list(files):
        path = str(path)
        if path.startswith(HF_PREFIX):
            out.append(path)
        elif is_pattern(path) and not os.path.exists(path):
            out.extend(sorted(p for p in glob.glob(path, recursive=True) if not os.path.isdir(p)) or [path])
        elif os.path.isdir(path) and not saved_dataset_kind(path):
            found = _dir_data_files(path)
            out.extend(found if found and len(_split_groups(found)) < 2 else [path])
        else:
            out.append(path)
    return out


def saved_dataset_kind(path: str) -> str | None:
    """``Dataset`` or ``DatasetDict`` when ``path`` is a directory HF ``datasets`` wrote with
    ``save_to_disk`` (told by the metadata files it writes), else None."""
    if os.path.isfile(os.path.join(path, "dataset_info.json")) and os.path.isfile(os.path.join(path, "state.json")):
        return "Dataset"
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return "DatasetDict"
    return None


def parse_hf_source(entry: str) -> tuple[str, str | None]:
    """``(name_or_dir, config)`` of ``hf:NAME_OR_DIR[:CONFIG]``. An existing directory is taken
    whole, so a directory whose name holds a colon still works (without a config)."""
    rest = entry[len(HF_PREFIX) :]
    if os.path.isdir(rest) or ":" not in rest:
        return rest, None
    name, config = rest.rsplit(":", 1)
    return name, config or None


def _dir_data_files(path: str) -> list[str]:
    """The data files directly in ``path`` (not in sub-directories; hidden files skipped), sorted."""
    names = sorted(n for n in os.listdir(path) if n.endswith(EXTENSIONS) and not n.startswith("."))
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]


def _split_groups(files: Sequence[str]) -> dict[str, list[str]]:
    """The files' names grouped by the one split word each holds (``train``, ``val``, ``test``,
    ..., delimited by ``-._`` or digits); names with none, or with several, are left out."""
    groups: dict[str, list[str]] = {}
    for path in files:
        name = os.path.basename(path)
        found = {_SPLIT_WORDS[w] for w in re.split(r"[-._ 0-9]+", name.lower()) if w in _SPLIT_WORDS}
        if len(found) == 1:
            groups.setdefault(found.pop(), []).append(name)
    return groups


def _split_key(key: str) -> str:
    return "data.val_split" if key.endswith("val_files") else "data.train_split"


def needs_datasets(key: str, entry: str) -> str:
    """The message for ``entry`` of ``key`` when the optional ``datasets`` package is missing."""
    return f"{key}: {entry!r} is read with the `datasets` package, which is not installed; fix: {INSTALL_DATASETS}"


def source_problems(key: str, path: str, split: str) -> list[str]:
    """What is wrong with an ``hf:`` source or a directory in ``data.<key>``, found without
    reading any rows (and without the network)."""
    if path.startswith(HF_PREFIX):
        name, _ = parse_hf_source(path)
        if not name:
            return [f"{key}: {path!r} names no dataset; fix: hf:NAME (a Hub dataset, e.g. hf:org/name) or hf:DIR, then :CONFIG if needed"]
        out = [] if importlib.util.find_spec("datasets") else [needs_datasets(key, path)]
        if os.path.isdir(name):
            if saved_dataset_kind(name):
                return out + _split_problems(key, path, name, split)
            script = script_problem(name)
            if script:
                out.append(f"{key}: {path!r}: {script}")
        elif name.startswith((".", "/", "~")):  # a path, not a Hub name: it would be looked up online and fail confusingly
            out.append(
                f"{key}: {path!r}: the directory {name!r} does not exist (working directory {os.getcwd()}); fix: give an existing directory"
            )
        return out
    kind = saved_dataset_kind(path)
    if kind:
        return ([] if importlib.util.find_spec("datasets") else [needs_datasets(key, path)]) + _split_problems(key, path, path, split)
    problem = dir_problem(key, path)
    return [problem] if problem else []


def _split_problems(key: str, entry: str, path: str, split: str) -> list[str]:
    """A saved ``DatasetDict`` at ``path`` without ``split`` (its ``dataset_dict.json`` lists the splits)."""
    if saved_dataset_kind(path) != "DatasetDict":
        return []
    try:
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = list(json.load(f)["splits"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{key}: {entry!r}: its dataset_dict.json is unreadable ({exc}); fix: save the DatasetDict again (save_to_disk)"]
    return [] if split in splits else [missing_split(key, entry, split, splits)]


def missing_split(key: str, entry: str, split: str, splits: Sequence[str]) -> str:
    """The message for a ``DatasetDict`` ``entry`` without ``split`` (``splits``: the ones it has)."""
    return f"{key}: {entry!r} has no split {split!r} (its splits: {', '.join(map(str, splits))}); fix: set {_split_key(key)} to one of them"


def dir_problem(key: str, path: str) -> str | None:
    """Why the plain directory ``path`` cannot be expanded to its files (None: it can)."""
    found = _dir_data_files(path)
    if found:
        if len(_split_groups(found)) < 2:
            return None
        groups = "; ".join(f"{split}: {', '.join(names)}" for split, names in _split_groups(found).items())
        return (
            f"{key}: the directory {path!r} holds files of several splits ({groups}), and reading all of them would mix them; fix: "
            f"name the files (e.g. {key}={os.path.join(path, 'train*.jsonl')!r}), or give {key}=hf:{path} (HF datasets picks splits "
            "by file name; data.train_split / data.val_split choose them)"
        )
    entries = os.listdir(path)
    hints = []
    if any(n.endswith(".py") for n in entries):
        hints.append("its .py files are not run (dataset loading scripts are never executed)")
    if any(os.path.isdir(os.path.join(path, n)) and not n.startswith(".") for n in entries) or "README.md" in entries:
        hints.append(f"sub-directories are not read: for an HF dataset directory (a README card, data/ files) give hf:{path}")
    return (
        f"{key}: the directory {path!r} holds no data file ({', '.join(EXTENSIONS)}) directly in it"
        + "".join(f"; {h}" for h in hints)
        + f"; fix: put data files in it, name them (e.g. {key}={os.path.join(path, '**', '*.jsonl')!r}), or use hf:DIR for an HF dataset"
    )


def script_problem(path: str) -> str | None:
    """Why the local ``hf:`` directory ``path`` is refused for a dataset loading script: one named
    after the directory (``datasets`` 5 refuses it even beside data files), or Python files and
    no data at all. Other ``.py`` files beside data files are ignored by ``datasets`` (never run)."""
    scripts = sorted(n for n in os.listdir(path) if n.endswith(".py"))
    if not scripts:
        return None
    own = os.path.basename(os.path.normpath(path)) + ".py"
    has_data = False
    for _, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .git, .cache: not data
        has_data = has_data or any(not n.startswith(".") and not n.endswith((".py", ".md")) for n in names)
    if own not in scripts and has_data:
        return None
    return (
        f"{path!r} holds a dataset loading script ({', '.join(scripts)}){'' if has_data else ' and no data files'}; loading scripts "
        "are never executed (datasets >= 4 no longer runs them, and these recipes run no code from data); fix: convert the "
        "dataset to data files (run the script yourself once and save_to_disk or to_parquet the result) and give those"
    )
