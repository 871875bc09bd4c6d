"""The ``data`` section of both recipes (``DataConfig``) and its checks.

The keys' meaning is in ``DataConfig``'s docstring; the sources they name are described in
``posttrain.data.sources``, the row formats in ``posttrain.data.encoder`` and the sample order
in ``posttrain.data.order``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from posttrain import sort_task as task
from posttrain.data.sources import EXTENSIONS, HF_PREFIX, expand_files, is_pattern, source_problems

FORMATS = ("messages", "sharegpt", "prompt_response")
OVERLONG = ("truncate", "drop", "error")
LOSS_ON = ("all_turns", "last_turn")
# The default data.max_row_bytes: 8 MiB of JSON is some two million tokens of text, far beyond
# any sample length a recipe trains on, while a runaway row (a whole file on one line) is refused
# before parsing and tokenizing it cost gigabytes of memory and minutes.
MAX_ROW_BYTES = 8 * 2**20


@dataclass(frozen=True)
class DataConfig(task.DataConfig):
    """The ``data`` section of both recipes: the built-in sorting task (``posttrain.sort_task``) when
    ``train_files`` is empty, the user's files otherwise (the task's digit keys are then unused).

    Attributes:
        train_files: data sources (see ``posttrain.data.sources``): files (``.jsonl`` / ``.json`` /
            ``.parquet``), glob patterns, directories, ``save_to_disk`` directories and
            ``hf:NAME_OR_DIR[:CONFIG]``; empty: the sorting task.
        val_files: validation sources scored every ``trainer.val_every`` steps and at the end.
        train_split: the split read from a ``DatasetDict`` (a ``save_to_disk`` directory or an
            ``hf:`` source) in ``train_files``.
        val_split: the split read from a ``DatasetDict`` in ``val_files`` (``validation``: the
            name HF datasets use most; set ``test`` for datasets with no validation split).
        format: SFT only: ``messages``, ``sharegpt`` or ``prompt_response`` (see
            ``posttrain.data.encoder``).
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
                    out.extend(source_problems(key, path, self.split_for(key)))
                elif is_pattern(path) and not os.path.exists(path):
                    out.append(f"{key}: the pattern {path!r} matches no file (working directory {os.getcwd()}); fix: check the pattern")
                elif not path.endswith(EXTENSIONS):
                    out.append(f"{key}: {path!r} has an unknown extension; fix: use one of {', '.join(EXTENSIONS)}")
                elif not os.path.isfile(path):
                    out.append(f"{key}: {path!r} does not exist (working directory {os.getcwd()}); fix: give an existing file")
        return out
