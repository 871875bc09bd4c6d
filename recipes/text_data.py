"""The user's own data for the recipes: data files, the model directory's HF tokenizer and chat
template, and the step -> samples order.

Files (``data.train_files``, ``data.val_files``): ``.jsonl`` (one JSON object per line),
``.json`` (a JSON array of objects, or JSON lines) and ``.parquet`` (read with pyarrow). Each
row is a mapping of column -> value.

SFT rows (``data.format``):
    * ``messages``: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant",
      "content": ...}, ...]}``. Rendered with the chat template; the loss covers every assistant
      turn: the text the template adds for that turn after the generation prompt (the content
      and the template's end-of-turn marker), nothing of the system/user turns or of the
      generation prompt itself.
    * ``prompt_response``: ``{"prompt": ..., "response": ...}``. With ``data.apply_chat_template``
      it is the conversation ``[user: prompt, assistant: response]`` (as above); without, the
      raw text ``prompt`` (with the tokenizer's special tokens, e.g. BOS) then ``response`` and
      EOS, the loss on ``response`` + EOS.
RL rows: ``data.prompt_key`` holds a string (wrapped as one user turn when
``data.apply_chat_template``) or a list of chat messages; it is rendered with the generation
prompt. Every other column travels with the row to the reward function.

Tokenization is per segment (each turn's rendered text is tokenized on its own and the ids are
concatenated), so the prompt a sampler sees at RL time tokenizes exactly as the prompt part of
an SFT sample. A chat template that renders an earlier turn differently once later turns follow
(e.g. one that drops past reasoning) cannot give a per-turn loss mask and is refused with the row
named.

Order: the samples of step ``s`` are positions ``s * batch_size .. (s + 1) * batch_size - 1`` of
the endless sequence formed by one permutation of the rows per epoch (seeded by ``data.seed``
and the epoch; identity when ``data.shuffle`` is false): a pure function of the config and the
step, so a resumed run sees the samples an uninterrupted run would have seen from its step on.

Every rank reads and tokenizes every file (the rows are needed for rewards and validation on
all ranks); this is cheap next to training for datasets up to a few 100k rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from tensordict import TensorDict

from engine_api import make_batch
from recipes import data as task

FORMATS = ("messages", "prompt_response")
OVERLONG = ("truncate", "drop", "error")
EXTENSIONS = (".jsonl", ".json", ".parquet")


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DataConfig(task.DataConfig):
    """The ``data`` section of both recipes: the built-in sorting task (``recipes.data``) when
    ``train_files`` is empty, the user's files otherwise (the task's digit keys are then unused).

    Attributes:
        train_files: data files (``.jsonl`` / ``.json`` / ``.parquet``); empty: the sorting task.
        val_files: validation files scored every ``trainer.val_every`` steps and at the end.
        format: SFT only: ``messages`` or ``prompt_response`` (see the module docstring).
        messages_key: SFT column with the chat messages.
        prompt_key: the prompt column (SFT ``prompt_response`` and RL).
        response_key: SFT ``prompt_response`` column with the response.
        apply_chat_template: render string prompts (and SFT prompt/response pairs) through the
            tokenizer's chat template as a user turn; false: raw text (base models).
        max_length: SFT: longest sample in tokens.
        max_prompt_length: RL: longest prompt in tokens.
        max_response_length: RL: the response length limit (tokens); null: ``rollout.max_new_tokens``.
        overlong: what happens to a sample over its limit: ``truncate`` (SFT keeps the first
            ``max_length`` tokens; RL keeps the last ``max_prompt_length`` prompt tokens, where the
            question and the generation prompt are), ``drop`` (left out), ``error`` (the load stops
            naming the row). Counts are printed at load and returned in the run summary.
        shuffle: a new seeded permutation of the rows every epoch; false: file order.
    """

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    format: str = "messages"
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    apply_chat_template: bool = True
    max_length: int = 1024
    max_prompt_length: int = 512
    max_response_length: int | None = None
    overlong: str = "error"
    shuffle: bool = True

    @property
    def from_files(self) -> bool:
        return bool(self.train_files)

    def _problems(self) -> list[str]:
        out = super()._problems()
        if self.format not in FORMATS:
            out.append(f"format = {self.format!r}: unknown; fix: use one of {', '.join(FORMATS)}")
        if self.overlong not in OVERLONG:
            out.append(f"overlong = {self.overlong!r}: unknown; fix: use one of {', '.join(OVERLONG)}")
        for name in ("max_length", "max_prompt_length"):
            if getattr(self, name) < 2:
                out.append(f"{name} = {getattr(self, name)}: must be >= 2; fix: e.g. 1024")
        if self.max_response_length is not None and self.max_response_length < 1:
            out.append(f"max_response_length = {self.max_response_length}: must be >= 1 (or null); fix: e.g. 256")
        if self.val_files and not self.train_files:
            out.append(
                "val_files: given without train_files (the sorting task has its own held-out batches); fix: set data.train_files too"
            )
        for key in ("train_files", "val_files"):
            for path in getattr(self, key):
                if not str(path).endswith(EXTENSIONS):
                    out.append(f"{key}: {path!r} has an unknown extension; fix: use one of {', '.join(EXTENSIONS)}")
                elif not os.path.isfile(path):
                    out.append(f"{key}: {path!r} does not exist (working directory {os.getcwd()}); fix: give an existing file")
        return out


# ---------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class Row:
    """One data row and where it came from (``file:line`` for JSON lines, ``file[row]`` otherwise)."""

    values: Mapping[str, object]
    source: str


def read_rows(paths: Sequence[str], key: str = "data.train_files") -> list[Row]:
    """Every row of ``paths``, in file order.

    Raises:
        ValueError: an unreadable file or a row that is not a JSON object, naming it.
    """
    rows: list[Row] = []
    for path in paths:
        try:
            if path.endswith(".parquet"):
                import pyarrow.parquet as pq

                values = [(f"{path}[{i}]", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
            else:
                values = _read_json(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{key}: cannot read {path!r}: {exc}; fix: give a valid {os.path.splitext(path)[1]} file") from exc
        for source, value in values:
            if not isinstance(value, dict):
                raise ValueError(f"{key}: row {source} is a {type(value).__name__}, not an object of columns; fix: one JSON object per row")
            rows.append(Row(value, source))
    if not rows:
        raise ValueError(f"{key} = {list(paths)}: no rows; fix: give files with at least one row")
    return rows


def _read_json(path: str) -> list[tuple[str, object]]:
    """A ``.json`` array, or JSON lines (``.jsonl``, or a ``.json`` that is not one document)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None  # maybe JSON lines
        if isinstance(doc, list):
            return [(f"{path}[{i}]", v) for i, v in enumerate(doc)]
        if isinstance(doc, dict):
            return [(f"{path}[0]", doc)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {n}: {exc}") from exc
    return out


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


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS and the model's generation-config EOS
    ids (chat models often list the end-of-turn token there)."""
    ids = set()
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
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 (jinja raises anything; the row must be named)
            raise ValueError(f"row {source}: the chat template failed on it: {exc}; fix: check the row's messages") from exc

    def _ids(self, text: str, special: bool = False) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"]) if text else []

    def conversation(self, messages: object, source: str) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a chat: the mask is 1 on what the template adds for each
        assistant turn after its generation prompt."""
        _check_messages(messages, source)
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"row {source}: no assistant turn, so nothing to learn; fix: add one or drop the row")
        ids: list[int] = []
        mask: list[int] = []
        done = ""

        def extend(full: str, train: bool, what: str) -> None:
            nonlocal done
            if not full.startswith(done):
                raise ValueError(
                    f"row {source}: the chat template renders the conversation before turn {what} differently once that turn "
                    "follows, so the assistant tokens cannot be told apart; fix: one row per assistant turn, or a template "
                    "whose renderings of a conversation's prefixes are prefixes of each other"
                )
            new = self._ids(full[len(done) :])
            ids.extend(new)
            mask.extend([int(train)] * len(new))
            done = full

        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                extend(self._render(messages[:i], True, source) if i else "", False, str(i))
                extend(self._render(messages[: i + 1], False, source), True, str(i))
        extend(self._render(messages, False, source), False, "end")
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
        if isinstance(value, str):
            if not self.cfg.apply_chat_template:
                return self._ids(value, special=True), value
            value = [{"role": "user", "content": value}]
        _check_messages(value, source)
        text = self._render(value, True, source)
        return self._ids(text), text


def _check_messages(messages: object, source: str) -> None:
    ok = isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    if not ok:
        raise ValueError(
            f"row {source}: expected a non-empty list of chat messages ({{'role': ..., 'content': ...}}), got {str(messages)[:80]!r}; "
            "fix: check data.messages_key / data.prompt_key"
        )


def _column(row: Row, key: str, name: str) -> object:
    if key not in row.values:
        raise ValueError(f"row {row.source}: no column {key!r} (data.{name}); columns: {sorted(row.values)}; fix: set data.{name}")
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
        for row in read_rows(files, key):
            self.counts.rows += 1
            if cfg.format == "messages":
                ids, mask = enc.conversation(_column(row, cfg.messages_key, "messages_key"), row.source)
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
    """One RL prompt: its token ids, the rendered text and the other columns of its row."""

    ids: torch.Tensor
    text: str
    columns: Mapping[str, object]
    source: str


class PromptDataset:
    """Tokenized RL prompts of ``files``."""

    def __init__(self, files: Sequence[str], tokenizer, cfg: DataConfig, key: str = "data.train_files") -> None:
        enc = ChatEncoder(tokenizer, cfg)
        self.samples: list[PromptSample] = []
        self.counts = LoadCounts()
        for row in read_rows(files, key):
            self.counts.rows += 1
            ids, text = enc.prompt(_column(row, cfg.prompt_key, "prompt_key"), row.source)
            action = _overlong(cfg, row.source, len(ids), cfg.max_prompt_length, "max_prompt_length")
            if action == "drop":
                self.counts.dropped += 1
                continue
            if action == "truncate":
                self.counts.truncated += 1
                ids = ids[-cfg.max_prompt_length :]
                text = tokenizer.decode(ids)
            columns = {k: v for k, v in row.values.items() if k != cfg.prompt_key}
            self.samples.append(PromptSample(torch.tensor(ids, dtype=torch.long), text, columns, row.source))
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
