"""The user's own data for the recipes: data files, HF datasets, the model directory's HF tokenizer
and chat template, and the step -> samples order.

Sources (``data.train_files``, ``data.val_files``; each takes a list, or one entry as a string):
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
Patterns and plain directories are expanded when the config loads, so the config holds what is
read. ``datasets`` is an optional dependency (``pip install 'enginekit[datasets]'``), imported only
for the last two kinds. Their rows (decoded by the dataset's features; null-filled struct keys
dropped as for Parquet) take the same checks as a file's.

A JSON line longer than ``data.max_row_bytes`` is refused before it is parsed (a ``.json``
array's, a Parquet row's or a dataset row's text, after reading), so one runaway row cannot
exhaust memory.

Message content (SFT ``messages`` rows, RL prompts given as messages) must be text: a string, or
a list of text parts (``[{"type": "text", "text": ...}, ...]``, OpenAI style; joined with
newlines, as vLLM joins them). ``null`` (except for an assistant message with ``tool_calls``),
numbers, mappings and non-text parts are refused, naming the row, the message and its role.

SFT rows (``data.format``):
    * ``messages``: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant",
      "content": ...}, ...]}``. Rendered with the chat template and tokenized in one call (HF's
      own ``apply_chat_template(tokenize=True)`` ids); the loss covers each assistant turn
      (``data.loss_on``): the text the template adds for it after the generation prompt (the
      content, the end-of-turn marker and what the template writes after it), nothing of the
      system/user turns or of the generation prompt itself.
    * ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
      "value": ...}, ...]}``, turned into messages (``sharegpt_to_messages``) and then read as
      ``messages`` rows (identical ids and loss masks).
    * ``prompt_response``: ``{"prompt": ..., "response": ...}``. With ``data.apply_chat_template``
      it is the conversation ``[user: prompt, assistant: response]`` (as above); without, the
      raw text ``prompt`` (with the tokenizer's special tokens, e.g. BOS) then ``response`` and
      EOS, the loss on ``response`` + EOS.
RL rows: ``data.prompt_key`` holds a string (wrapped as one user turn when
``data.apply_chat_template``), a list of chat messages, or a list of ShareGPT turns (converted as
above); it is rendered with the generation prompt. Every other column travels with the row to
the reward function.

ShareGPT speakers (``from``, case-insensitive): ``human`` / ``user`` -> user, ``gpt`` /
``assistant`` / ``bot`` / ``chatgpt`` / ``model`` -> assistant, ``system`` -> system. Tool turns
(``tool``, ``function``, ``observation``, ``function_call``) and any other speaker are refused,
naming the row, the turn and the value: templates render tool calls and results each their own
way, so they have no one mapping (give such rows as ``messages`` with ``tool`` messages and
``tool_calls``). A turn with a ``weight`` other than 1 is refused too (per-turn loss weights are
not read; ``data.loss_on`` picks the trained turns).

A chat template that renders an earlier turn differently once later turns follow (e.g. one that
drops past reasoning) cannot give that turn a loss mask: the row is refused, naming the fix
(``data.loss_on=last_turn``).

Order: the samples of step ``s`` are positions ``s * batch_size .. (s + 1) * batch_size - 1`` of
the endless sequence formed by one permutation of the rows per epoch (seeded by ``data.seed``
and the epoch; identity when ``data.shuffle`` is false): a pure function of the config and the
step, so a resumed run sees the samples an uninterrupted run would have seen from its step on.

Every rank reads and tokenizes every file (the rows are needed for rewards and validation on
all ranks); this is cheap next to training for datasets up to a few 100k rows.
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from engine_api import make_batch
from posttrain import sort_task as task

FORMATS = ("messages", "sharegpt", "prompt_response")
OVERLONG = ("truncate", "drop", "error")
LOSS_ON = ("all_turns", "last_turn")
EXTENSIONS = (".jsonl", ".json", ".parquet")
# The default data.max_row_bytes: 8 MiB of JSON is some two million tokens of text, far beyond
# any sample length a recipe trains on, while a runaway row (a whole file on one line) is refused
# before parsing and tokenizing it cost gigabytes of memory and minutes.
MAX_ROW_BYTES = 8 * 2**20
_GLOB_CHARS = "*?["
HF_PREFIX = "hf:"
# The fix for a missing optional dependency, in every message that needs it.
INSTALL_DATASETS = "pip install 'enginekit[datasets]' (or pip install datasets)"
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}
SHAREGPT_TOOL_TURNS = ("tool", "function", "observation", "function_call")
# File-name words that mark a split (those HF datasets uses to split a directory's files by name):
# a plain directory holding files of two splits is refused rather than read as one.
_SPLIT_WORDS = {
    **dict.fromkeys(("train", "training"), "train"),
    **dict.fromkeys(("validation", "valid", "val", "dev"), "validation"),
    **dict.fromkeys(("test", "testing", "eval", "evaluation"), "test"),
}


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DataConfig(task.DataConfig):
    """The ``data`` section of both recipes: the built-in sorting task (``posttrain.sort_task``) when
    ``train_files`` is empty, the user's files otherwise (the task's digit keys are then unused).

    Attributes:
        train_files: data sources (see the module docstring): files (``.jsonl`` / ``.json`` /
            ``.parquet``), glob patterns, directories, ``save_to_disk`` directories and
            ``hf:NAME_OR_DIR[:CONFIG]``; empty: the sorting task.
        val_files: validation sources scored every ``trainer.val_every`` steps and at the end.
        train_split: the split read from a ``DatasetDict`` (a ``save_to_disk`` directory or an
            ``hf:`` source) in ``train_files``.
        val_split: the split read from a ``DatasetDict`` in ``val_files`` (``validation``: the
            name HF datasets use most; set ``test`` for datasets with no validation split).
        format: SFT only: ``messages``, ``sharegpt`` or ``prompt_response`` (see the module
            docstring).
        messages_key: SFT column with the conversation; null: ``messages`` for
            ``format=messages``, ``conversations`` for ``format=sharegpt``.
        prompt_key: the prompt column (SFT ``prompt_response`` and RL).
        response_key: SFT ``prompt_response`` column with the response.
        apply_chat_template: render string prompts (and SFT prompt/response pairs) through the
            tokenizer's chat template as a user turn; false: raw text (base models).
        chat_template_kwargs: extra variables for the template, passed to every
            ``apply_chat_template`` call (e.g. ``{enable_thinking: false}`` for Qwen3).
        loss_on: SFT ``messages``: ``all_turns`` (every assistant turn) or ``last_turn`` (the
            last one; earlier turns are context, rendered as the template renders history).
        max_length: SFT: longest sample in tokens.
        max_prompt_length: RL: longest prompt in tokens.
        max_response_length: RL: the response length limit (tokens); null: ``rollout.max_new_tokens``.
        overlong: what happens to a sample over its limit: ``truncate`` (SFT keeps the first
            ``max_length`` tokens; RL keeps the last ``max_prompt_length`` prompt tokens, where the
            question and the generation prompt are), ``drop`` (left out), ``error`` (the load stops
            naming the row). Counts are printed at load and returned in the run summary.
        shuffle: a new seeded permutation of the rows every epoch; false: file order.
        max_row_bytes: the largest row accepted (a JSON line's bytes, checked before parsing;
            for ``.json`` arrays and Parquet the row's text); a larger row stops the load
            naming the file, the line, the size and this key.

    ``train_files`` / ``val_files`` also take one entry as a string; patterns and plain
    directories are expanded here (sorted), so the config holds the sources actually read.
    """

    # scalar_as_list: the config loader (engine_api.typed_config) turns a single string into a
    # one-element list, so `data.train_files=x.jsonl` works without brackets.
    train_files: list[str] = field(default_factory=list, metadata={"scalar_as_list": True})
    val_files: list[str] = field(default_factory=list, metadata={"scalar_as_list": True})
    train_split: str = "train"
    val_split: str = "validation"
    format: str = "messages"
    messages_key: str | None = None
    prompt_key: str = "prompt"
    response_key: str = "response"
    apply_chat_template: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_on: str = "all_turns"
    max_length: int = 1024
    max_prompt_length: int = 512
    max_response_length: int | None = None
    overlong: str = "error"
    shuffle: bool = True
    max_row_bytes: int = MAX_ROW_BYTES

    def __post_init__(self) -> None:
        # Frozen: the expanded lists are set once, here (a pattern matching nothing is kept, and
        # reported by _problems).
        for key in ("train_files", "val_files"):
            object.__setattr__(self, key, expand_files(getattr(self, key)))

    @property
    def from_files(self) -> bool:
        return bool(self.train_files)

    @property
    def messages_column(self) -> str:
        """The SFT conversation column: ``messages_key``, or by default the format's usual name."""
        return self.messages_key or ("conversations" if self.format == "sharegpt" else "messages")

    def split_for(self, key: str) -> str:
        """The ``DatasetDict`` split read for ``data.train_files`` / ``data.val_files``."""
        return self.val_split if key.endswith("val_files") else self.train_split

    def _problems(self) -> list[str]:
        out = super()._problems()
        if self.format not in FORMATS:
            out.append(f"format = {self.format!r}: unknown; fix: use one of {', '.join(FORMATS)}")
        if self.loss_on not in LOSS_ON:
            out.append(f"loss_on = {self.loss_on!r}: unknown; fix: use one of {', '.join(LOSS_ON)}")
        if self.overlong not in OVERLONG:
            out.append(f"overlong = {self.overlong!r}: unknown; fix: use one of {', '.join(OVERLONG)}")
        for name in ("max_length", "max_prompt_length"):
            if getattr(self, name) < 2:
                out.append(f"{name} = {getattr(self, name)}: must be >= 2; fix: e.g. 1024")
        if self.max_row_bytes < 1:
            out.append(f"max_row_bytes = {self.max_row_bytes}: must be positive; fix: e.g. {MAX_ROW_BYTES} (8 MiB)")
        if self.max_response_length is not None and self.max_response_length < 1:
            out.append(f"max_response_length = {self.max_response_length}: must be >= 1 (or null); fix: e.g. 256")
        if self.val_files and not self.train_files:
            out.append(
                "val_files: given without train_files (the sorting task has its own held-out batches); fix: set data.train_files too"
            )
        for name in ("train_split", "val_split"):
            if not getattr(self, name):
                out.append(
                    f"{name} = {getattr(self, name)!r}: names no split; fix: e.g. {name}={'train' if name == 'train_split' else 'validation'}"
                )
        for key in ("train_files", "val_files"):
            for path in getattr(self, key):
                path = str(path)
                if path.startswith(HF_PREFIX) or os.path.isdir(path):
                    out.extend(_source_problems(key, path, self.split_for(key)))
                elif _is_pattern(path) and not os.path.exists(path):
                    out.append(f"{key}: the pattern {path!r} matches no file (working directory {os.getcwd()}); fix: check the pattern")
                elif not path.endswith(EXTENSIONS):
                    out.append(f"{key}: {path!r} has an unknown extension; fix: use one of {', '.join(EXTENSIONS)}")
                elif not os.path.isfile(path):
                    out.append(f"{key}: {path!r} does not exist (working directory {os.getcwd()}); fix: give an existing file")
        return out


def _is_pattern(path: str) -> bool:
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
        elif _is_pattern(path) and not os.path.exists(path):
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


def _needs_datasets(key: str, entry: str) -> str:
    return f"{key}: {entry!r} is read with the `datasets` package, which is not installed; fix: {INSTALL_DATASETS}"


def _source_problems(key: str, path: str, split: str) -> list[str]:
    """What is wrong with an ``hf:`` source or a directory in ``data.<key>``, found without
    reading any rows (and without the network)."""
    if path.startswith(HF_PREFIX):
        name, _ = parse_hf_source(path)
        if not name:
            return [f"{key}: {path!r} names no dataset; fix: hf:NAME (a Hub dataset, e.g. hf:org/name) or hf:DIR, then :CONFIG if needed"]
        out = [] if importlib.util.find_spec("datasets") else [_needs_datasets(key, path)]
        if os.path.isdir(name):
            if saved_dataset_kind(name):
                return out + _split_problems(key, path, name, split)
            script = _script_problem(name)
            if script:
                out.append(f"{key}: {path!r}: {script}")
        elif name.startswith((".", "/", "~")):  # a path, not a Hub name: it would be looked up online and fail confusingly
            out.append(
                f"{key}: {path!r}: the directory {name!r} does not exist (working directory {os.getcwd()}); fix: give an existing directory"
            )
        return out
    kind = saved_dataset_kind(path)
    if kind:
        return ([] if importlib.util.find_spec("datasets") else [_needs_datasets(key, path)]) + _split_problems(key, path, path, split)
    problem = _dir_problem(key, path)
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
    return [] if split in splits else [_missing_split(key, entry, split, splits)]


def _missing_split(key: str, entry: str, split: str, splits: Sequence[str]) -> str:
    return f"{key}: {entry!r} has no split {split!r} (its splits: {', '.join(map(str, splits))}); fix: set {_split_key(key)} to one of them"


def _dir_problem(key: str, path: str) -> str | None:
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


def _script_problem(path: str) -> str | None:
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


# ---------------------------------------------------------------------------------- files
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
                raise _SourceError(_dir_problem(key, path) or f"{key}: the directory {path!r} changed while it was read; fix: retry")
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
        raise _SourceError(_needs_datasets(key, entry)) from exc
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
        script = _script_problem(path) if os.path.isdir(path) else None
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
            raise _SourceError(_missing_split(key, entry, split, list(loaded)))
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


# ---------------------------------------------------------------------------------- tokenizer
def load_tokenizer(model_path: str):
    """The model directory's own HF tokenizer (``AutoTokenizer.from_pretrained``).

    Raises:
        ValueError: the directory has no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"engine.model.path = {model_path!r}: no HF tokenizer could be loaded from it ({str(exc).splitlines()[0]}); data files "
            "are tokenized with the model directory's own tokenizer; fix: save it there (tokenizer.save_pretrained(path))"
        ) from exc


def stop_token_ids(tokenizer, model_path: str, end_of_turn: bool = True) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS, the model's generation-config EOS
    ids, and (``end_of_turn``, with a chat template) the special token the template puts right
    after an assistant message (e.g. ``<|im_end|>``, which base models' generation configs
    omit)."""
    ids = set()
    turn_end = _template_end_of_turn(tokenizer) if end_of_turn else None
    if turn_end is not None:
        ids.add(turn_end)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    if not ids:
        raise ValueError(
            f"engine.model.path = {model_path!r}: neither the tokenizer nor generation_config.json names an EOS token, so responses "
            "could never end; fix: set eos_token in the tokenizer config"
        )
    return sorted(ids)


def _template_end_of_turn(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant message's content,
    found by rendering a two-message chat; None without a template, when the template needs
    more than that chat, or when what follows the content is not a special token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        start = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # noqa: BLE001 (a template may raise anything on a minimal chat)
        return None
    if not full.startswith(start) or not full[len(start) :].lstrip().startswith("y"):
        return None
    rest = full[len(start) :].lstrip()[1:]
    ids = tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return int(ids[0]) if ids and ids[0] in special else None


class ChatEncoder:
    """Turns rows into token ids with one tokenizer and the recipe's ``data`` settings."""

    def __init__(self, tokenizer, cfg: DataConfig) -> None:
        self.tok, self.cfg = tokenizer, cfg

    def _render(self, messages: list, add_generation_prompt: bool, source: str) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(
                f"row {source}: needs the tokenizer's chat template, but the tokenizer has none; fix: save a chat template with "
                "the tokenizer, or (string prompts only) set data.apply_chat_template=false"
            )
        try:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **dict(self.cfg.chat_template_kwargs)
            )
        except Exception as exc:  # noqa: BLE001 (jinja raises anything; the row must be named)
            raise ValueError(f"row {source}: the chat template failed on it: {exc}; fix: check the row's messages") from exc

    def _ids(self, text: str, special: bool = False) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"]) if text else []

    def conversation(self, messages: object, source: str) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a chat rendered once with the template; the mask is 1 on the
        tokens of what the template adds for each trained assistant turn after its generation
        prompt (``data.loss_on``: every assistant turn, or the last one only).

        A turn's text span runs from the end of ``render(messages[:i], add_generation_prompt)``
        to the end of ``render(messages[:i + 1])``; both must be prefixes of the full rendering.
        The full text is tokenized in one call, and a token is trained when its character span
        overlaps a trained turn's span (tokenizers without offsets: each piece separately)."""
        messages = _check_messages(messages, source)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise ValueError(f"row {source}: no assistant turn, so nothing to learn; fix: add one or drop the row")
        if self.cfg.loss_on == "last_turn":
            turns = turns[-1:]
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and m.get("content") is None:
                self._require_rendered_tool_calls(messages, i, source)
        full = self._render(messages, False, source)
        spans: list[tuple[int, int]] = []
        for i in turns:
            start = self._render(messages[:i], True, source) if i else ""
            end = self._render(messages[: i + 1], False, source)
            if not (
                full.startswith(start) and full.startswith(end) and len(start) <= len(end) and (not spans or spans[-1][1] <= len(start))
            ):
                raise ValueError(
                    f"row {source}: the chat template renders the conversation up to message {i} differently once later messages "
                    "follow (e.g. it drops the reasoning of past turns), so that turn's tokens cannot be told apart; fix: "
                    "data.loss_on=last_turn (earlier turns become context), or one row per assistant turn"
                )
            spans.append((len(start), len(end)))
        return self._tokenize_spans(full, spans)

    def _require_rendered_tool_calls(self, messages: list[dict], i: int, source: str) -> None:
        """An assistant turn with ``content: null`` and ``tool_calls`` is only its calls: the
        template must render them. One that ignores ``tool_calls`` writes the content instead
        (Jinja prints null as ``None``) and drops the call, so the turn would be trained as
        the word None; refused, naming the row."""
        start = self._render(messages[:i], True, source) if i else ""
        text = self._render(messages[: i + 1], False, source)[len(start) :]
        names = [
            str(call.get("function", {}).get("name") or call.get("name") or "")
            for call in messages[i]["tool_calls"]
            if isinstance(call, dict)
        ]
        names = [n for n in names if n]
        if (names and all(n in text for n in names)) or (not names and "None" not in text):
            return
        raise ValueError(
            f"row {source}: message {i} (assistant) has content null and tool_calls {names or messages[i]['tool_calls']}, but the "
            f"chat template does not render tool calls (that turn renders as {text[:80]!r}): the call would be dropped and "
            "the turn trained as the word None; fix: a chat template that renders tool_calls (usually the model's own), "
            "or give the call as the message's text content"
        )

    def _tokenize_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        try:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):
            enc = None  # a tokenizer without offsets (slow, Python-only): tokenize piece by piece
        if enc is not None and "offset_mapping" in enc:
            ids = list(enc["input_ids"])

            def trained(s: int, e: int) -> bool:
                return any((s < b and e > a) if e > s else a <= s < b for a, b in spans)

            mask = [int(trained(s, e)) for s, e in enc["offset_mapping"]]
        else:
            ids, mask, cursor = [], [], 0
            for a, b in spans:
                for piece, train in ((text[cursor:a], 0), (text[a:b], 1)):
                    new = self._ids(piece)
                    ids.extend(new)
                    mask.extend([train] * len(new))
                cursor = b
            tail = self._ids(text[cursor:])
            ids.extend(tail)
            mask.extend([0] * len(tail))
        if mask:
            mask[0] = 0  # nothing predicts the first token
        return ids, mask

    def prompt_response(self, prompt: object, response: object, source: str) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a prompt/response pair (the loss on the response)."""
        for name, value in (("prompt_key", prompt), ("response_key", response)):
            if not isinstance(value, str):
                raise ValueError(f"row {source}: data.{name} column holds a {type(value).__name__}, not text; fix: a string column")
        if self.cfg.apply_chat_template:
            return self.conversation([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], source)
        if self.tok.eos_token_id is None:
            raise ValueError(f"row {source}: the tokenizer has no EOS token to end the response; fix: set eos_token in its config")
        head, tail = self._ids(prompt, special=True), self._ids(response) + [int(self.tok.eos_token_id)]
        return head + tail, [0] * len(head) + [1] * len(tail)

    def prompt(self, value: object, source: str) -> tuple[list[int], str]:
        """``(ids, text)`` of an RL prompt rendered with the generation prompt."""
        messages = self.prompt_messages(value, source)
        if messages is None:
            return self._ids(value, special=True), value
        text = self._render(messages, True, source)
        return self._ids(text), text

    def prompt_messages(self, value: object, source: str) -> list[dict] | None:
        """An RL prompt column's value as checked chat messages (a string is one user turn);
        None for a string prompt with ``apply_chat_template`` off (raw text)."""
        if isinstance(value, str):
            if not self.cfg.apply_chat_template:
                return None
            value = [{"role": "user", "content": value}]
        elif _is_sharegpt(value):
            value = sharegpt_to_messages(value, source)
        value = _check_messages(value, source)
        for i, m in enumerate(value):
            if m["role"] == "assistant" and m.get("content") is None:
                self._require_rendered_tool_calls(value, i, source)
        return value


def sharegpt_to_messages(turns: object, source: str) -> list[dict]:
    """ShareGPT turns (``[{"from": "human", "value": ...}, ...]``) as chat messages
    (``[{"role": "user", "content": ...}, ...]``; the speakers of ``SHAREGPT_ROLES``,
    case-insensitive). A turn without ``value`` becomes a message without content, which
    ``_check_messages`` refuses like any other.

    Raises:
        ValueError: not a non-empty list of turns with a string ``from``, a tool turn or an
            unknown speaker, or a turn with a ``weight`` other than 1; naming the row and the turn.
    """
    ok = isinstance(turns, list) and turns and all(isinstance(t, dict) and isinstance(t.get("from"), str) for t in turns)
    if not ok:
        raise ValueError(
            f"row {source}: expected a non-empty list of ShareGPT turns ({{'from': ..., 'value': ...}}), got {str(turns)[:80]!r}; "
            "fix: check data.messages_key / data.prompt_key and data.format"
        )
    out = []
    for i, turn in enumerate(turns):
        who = turn["from"]
        role = SHAREGPT_ROLES.get(who.strip().lower())
        where = f"row {source}: turn {i} has from = {who!r}"
        if who.strip().lower() in SHAREGPT_TOOL_TURNS:
            raise ValueError(
                f"{where}, a tool turn: tool calls and results have no one mapping to chat messages (each template renders them its "
                "own way); fix: give such rows as data.format=messages with role 'tool' messages and assistant tool_calls, or drop "
                "those turns"
            )
        if role is None:
            raise ValueError(
                f"{where}, not a known speaker ({', '.join(SHAREGPT_ROLES)}); fix: rename it to one of these (human, gpt, system), "
                "or convert the row to data.format=messages"
            )
        if turn.get("weight", 1) not in (1, None):
            raise ValueError(
                f"{where} and weight = {turn['weight']!r}: per-turn loss weights are not read (data.loss_on picks the trained "
                "assistant turns), so it would be trained anyway; fix: drop the weight key, or split the row so no turn needs it"
            )
        out.append({"role": role, "content": turn["value"]} if "value" in turn else {"role": role})
    return out


def _is_sharegpt(value: object) -> bool:
    """A list of ShareGPT turns (dicts with ``from`` and no ``role``)."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, dict) and "from" in t and "role" not in t for t in value)


def _check_messages(messages: object, source: str) -> list[dict]:
    """``messages`` with every ``content`` as text: a list of text parts (OpenAI style
    ``[{"type": "text", "text": ...}]``) is joined with newlines (as vLLM joins them).

    Raises:
        ValueError: not a non-empty list of ``{"role": str, ...}`` messages, or a message whose
            content is missing, null (allowed only for an assistant message with ``tool_calls``),
            a number, a mapping or a list with non-text parts; naming the row, the message index
            and its role.
    """
    ok = isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    if not ok:
        hint = " (ShareGPT turns are read with data.format=sharegpt)" if _is_sharegpt(messages) else ""
        raise ValueError(
            f"row {source}: expected a non-empty list of chat messages ({{'role': ..., 'content': ...}}), got {str(messages)[:80]!r}; "
            f"fix: check data.messages_key / data.prompt_key{hint}"
        )
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            out.append(m)
            continue
        where = f"row {source}: message {i} ({m['role']})"
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            out.append(m)  # a tool-call turn: the template renders the calls
            continue
        if content is None:
            raise ValueError(
                f"{where} has {'content null' if 'content' in m else 'no content'}; an empty reply would be trained or shown "
                "silently; fix: give the message's text (an empty string if it is meant to be empty), or drop the message"
            )
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if content and len(texts) == len(content) and all(isinstance(t, str) for t in texts):
                out.append({**m, "content": "\n".join(texts)})
                continue
            kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content})
            raise ValueError(
                f"{where}: its content is a list of parts of type(s) {kinds}; only text parts ({{'type': 'text', 'text': ...}}) "
                "are read (these recipes train on text); fix: give the content as a string, or as text parts only"
            )
        raise ValueError(
            f"{where}: content is a {type(content).__name__} ({str(content)[:40]}), not text; it would be rendered as its "
            "Python text; fix: give the content as a string"
        )
    return out


def _column(row: Row, key: str, name: str, fmt: str | None = None) -> object:
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


# ---------------------------------------------------------------------------------- datasets
@dataclass
class LoadCounts:
    """What the overlong policy did at load."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0

    def line(self, what: str) -> str:
        return f"{what}: {self.rows} rows, {self.kept} kept, {self.truncated} truncated, {self.dropped} dropped"


def report_counts(datasets: Mapping[str, SFTDataset | PromptDataset | None], overlong: str, rank0: bool) -> dict[str, dict[str, int]]:
    """The load counts of ``{"train": ..., "val": ...}`` (None entries skipped) as plain dicts,
    printed once (on rank 0)."""
    out = {}
    for name, data in datasets.items():
        if data is not None:
            out[name] = asdict(data.counts)
            if rank0:
                print(f"{data.counts.line(f'data.{name}_files')} (data.overlong = {overlong})", flush=True)
    return out


def _overlong(cfg: DataConfig, source: str, n: int, limit: int, key: str) -> str:
    """``keep`` / ``truncate`` / ``drop`` for a sample of ``n`` tokens against ``limit``."""
    if n <= limit:
        return "keep"
    if cfg.overlong == "error":
        raise ValueError(
            f"row {source}: {n} tokens > data.{key} = {limit} (data.overlong = error); fix: raise data.{key}, or set "
            "data.overlong to truncate or drop"
        )
    return cfg.overlong


class SFTDataset:
    """Tokenized SFT samples of ``files`` (``ids``, ``loss_mask`` lists) and their sources."""

    def __init__(self, files: Sequence[str], tokenizer, cfg: DataConfig, key: str = "data.train_files") -> None:
        enc = ChatEncoder(tokenizer, cfg)
        self.samples: list[tuple[list[int], list[int]]] = []
        self.sources: list[str] = []
        self.counts = LoadCounts()
        for row in read_rows(files, key, cfg.max_row_bytes, cfg.split_for(key)):
            self.counts.rows += 1
            if cfg.format in ("messages", "sharegpt"):
                chat = _column(row, cfg.messages_column, "messages_key", cfg.format)
                ids, mask = enc.conversation(sharegpt_to_messages(chat, row.source) if cfg.format == "sharegpt" else chat, row.source)
            else:
                ids, mask = enc.prompt_response(
                    _column(row, cfg.prompt_key, "prompt_key"), _column(row, cfg.response_key, "response_key"), row.source
                )
            action = _overlong(cfg, row.source, len(ids), cfg.max_length, "max_length")
            if action == "truncate":
                ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
                if not any(mask):  # nothing left to learn from
                    action = "drop"
                else:
                    self.counts.truncated += 1
            if action == "drop":
                self.counts.dropped += 1
                continue
            self.samples.append((ids, mask))
            self.sources.append(row.source)
        self.counts.kept = len(self.samples)
        if not self.samples:
            raise ValueError(f"{key}: every row was dropped ({self.counts.line(key)}); fix: raise data.max_length")

    def __len__(self) -> int:
        return len(self.samples)

    def batch(self, indices: Sequence[int]) -> TensorDict:
        """A protocol batch (jagged ``input_ids``, ``loss_mask``) of the samples at ``indices``."""
        picked = [self.samples[i] for i in indices]
        return make_batch([torch.tensor(ids) for ids, _ in picked], loss_mask=[torch.tensor(m, dtype=torch.float32) for _, m in picked])


@dataclass(frozen=True)
class PromptSample:
    """One RL prompt: its token ids, the rendered text, the other columns of its row and its
    chat messages (None: a raw-text prompt; multi-turn rollouts re-render them every turn)."""

    ids: torch.Tensor
    text: str
    columns: Mapping[str, object]
    source: str
    messages: tuple | None = None


class PromptDataset:
    """Tokenized RL prompts of ``files``."""

    def __init__(self, files: Sequence[str], tokenizer, cfg: DataConfig, key: str = "data.train_files") -> None:
        enc = ChatEncoder(tokenizer, cfg)
        self.samples: list[PromptSample] = []
        self.counts = LoadCounts()
        for row in read_rows(files, key, cfg.max_row_bytes, cfg.split_for(key)):
            self.counts.rows += 1
            value = _column(row, cfg.prompt_key, "prompt_key")
            ids, text = enc.prompt(value, row.source)
            messages = enc.prompt_messages(value, row.source)
            action = _overlong(cfg, row.source, len(ids), cfg.max_prompt_length, "max_prompt_length")
            if action == "drop":
                self.counts.dropped += 1
                continue
            if action == "truncate":
                self.counts.truncated += 1
                ids = ids[-cfg.max_prompt_length :]
                text = tokenizer.decode(ids)
            columns = {k: v for k, v in row.values.items() if k != cfg.prompt_key}
            self.samples.append(
                PromptSample(torch.tensor(ids, dtype=torch.long), text, columns, row.source, None if messages is None else tuple(messages))
            )
        self.counts.kept = len(self.samples)
        if not self.samples:
            raise ValueError(f"{key}: every row was dropped ({self.counts.line(key)}); fix: raise data.max_prompt_length")

    def __len__(self) -> int:
        return len(self.samples)


# ---------------------------------------------------------------------------------- order
class StepOrder:
    """Which sample indices step ``s`` takes (see the module docstring): a pure function of
    ``(n, batch_size, seed, shuffle, s)``."""

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool) -> None:
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self._epoch, self._perm = -1, torch.arange(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(task._step_seed(self.seed, epoch))
            self._perm = torch.randperm(self.n, generator=gen) if self.shuffle else torch.arange(self.n)
            self._epoch = epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        out = []
        for pos in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, i = divmod(pos, self.n)
            out.append(int(self._permutation(epoch)[i]))
        return out

    def epoch(self, step: int) -> float:
        """Epochs completed after step ``step`` (0-based), for logging."""
        return (step + 1) * self.batch_size / self.n
