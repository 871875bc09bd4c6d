"""The user's own data for the recipes: data files, the model directory's HF tokenizer and chat
template, and the step -> samples order.

Files (``data.train_files``, ``data.val_files``): ``.jsonl`` (one JSON object per line),
``.json`` (a JSON array of objects, or JSON lines) and ``.parquet`` (read with pyarrow). Each
row is a mapping of column -> value. Each key takes a list of paths, one path or a glob pattern
(``data/*.jsonl``; expanded sorted, and a pattern matching nothing is an error). A JSON line
longer than ``data.max_row_bytes`` is refused before it is parsed (a ``.json`` array's or a
Parquet row's text, after reading), so one runaway row cannot exhaust memory.

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
    * ``prompt_response``: ``{"prompt": ..., "response": ...}``. With ``data.apply_chat_template``
      it is the conversation ``[user: prompt, assistant: response]`` (as above); without, the
      raw text ``prompt`` (with the tokenizer's special tokens, e.g. BOS) then ``response`` and
      EOS, the loss on ``response`` + EOS.
RL rows: ``data.prompt_key`` holds a string (wrapped as one user turn when
``data.apply_chat_template``) or a list of chat messages; it is rendered with the generation
prompt. Every other column travels with the row to the reward function.

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
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from engine_api import make_batch
from posttrain import sort_task as task

FORMATS = ("messages", "prompt_response")
OVERLONG = ("truncate", "drop", "error")
LOSS_ON = ("all_turns", "last_turn")
EXTENSIONS = (".jsonl", ".json", ".parquet")
# The default data.max_row_bytes: 8 MiB of JSON is some two million tokens of text, far beyond
# any sample length a recipe trains on, while a runaway row (a whole file on one line) is refused
# before parsing and tokenizing it cost gigabytes of memory and minutes.
MAX_ROW_BYTES = 8 * 2**20
_GLOB_CHARS = "*?["


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DataConfig(task.DataConfig):
    """The ``data`` section of both recipes: the built-in sorting task (``posttrain.sort_task``) when
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

    ``train_files`` / ``val_files`` also take one path or a glob pattern as a string; patterns
    are expanded here (sorted), so the config holds the files actually read.
    """

    # scalar_as_list: the config loader (engine_api.typed_config) turns a single string into a
    # one-element list, so `data.train_files=x.jsonl` works without brackets.
    train_files: list[str] = field(default_factory=list, metadata={"scalar_as_list": True})
    val_files: list[str] = field(default_factory=list, metadata={"scalar_as_list": True})
    format: str = "messages"
    messages_key: str = "messages"
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
        for key in ("train_files", "val_files"):
            for path in getattr(self, key):
                path = str(path)
                if os.path.isdir(path):
                    out.append(
                        f"{key}: {path!r} is a directory, not a data file; fix: name its files, e.g. "
                        f"{key}={os.path.join(path, '*.jsonl')!r} (a glob pattern)"
                    )
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
    """``files`` as a list of paths: a single string becomes a one-element list, and a glob
    pattern (``*``, ``?``, ``[...]``; ``**`` recursive) is replaced by its matches, sorted. A path
    that exists as written is kept even if it contains such characters; a pattern matching
    nothing is kept as is (``DataConfig`` reports it)."""
    out: list[str] = []
    for path in [files] if isinstance(files, str) else list(files):
        path = str(path)
        matches = sorted(glob.glob(path, recursive=True)) if _is_pattern(path) and not os.path.exists(path) else []
        out.extend(matches or [path])
    return out


# ---------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class Row:
    """One data row and where it came from (``file:line`` for JSON lines, ``file[row]`` otherwise)."""

    values: Mapping[str, object]
    source: str


def read_rows(paths: Sequence[str], key: str = "data.train_files", max_row_bytes: int = MAX_ROW_BYTES) -> list[Row]:
    """Every row of ``paths``, in file order.

    Raises:
        ValueError: an unreadable file, a row that is not a JSON object, or a row over
            ``max_row_bytes`` (``data.max_row_bytes``), naming it.
    """
    rows: list[Row] = []
    for path in paths:
        if os.path.isdir(path):  # a config built in Python skips DataConfig's check
            raise ValueError(f"{key}: {path!r} is a directory, not a data file; fix: name its files (a glob pattern works)")
        try:
            if path.endswith(".parquet"):
                import pyarrow.parquet as pq

                table = pq.read_table(path).to_pylist()
                values = [(f"{path}[{i}]", _drop_null_struct_keys(r), False) for i, r in enumerate(table)]
            else:
                values = _read_json(path, max_row_bytes, key)
        except _RowTooLarge:
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
        if isinstance(value, str):
            if not self.cfg.apply_chat_template:
                return self._ids(value, special=True), value
            value = [{"role": "user", "content": value}]
        value = _check_messages(value, source)
        text = self._render(value, True, source)
        return self._ids(text), text


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
        raise ValueError(
            f"row {source}: expected a non-empty list of chat messages ({{'role': ..., 'content': ...}}), got {str(messages)[:80]!r}; "
            "fix: check data.messages_key / data.prompt_key"
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
        for row in read_rows(files, key, cfg.max_row_bytes):
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
        for row in read_rows(files, key, cfg.max_row_bytes):
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
