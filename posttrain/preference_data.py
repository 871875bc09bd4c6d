"""Preference pairs (``recipes.dpo``): the user's files, or pairs of the sorting task.

**Files** (``data.train_files`` / ``data.val_files``: JSON lines, JSON, Parquet, saved datasets,
``hf:``; read by ``posttrain.data.rows``). A row has a prompt and two responses, the columns
``data.prompt_key`` / ``data.chosen_key`` / ``data.rejected_key`` (defaults ``prompt``,
``chosen``, ``rejected``: TRL's preference format). Either

* text: ``prompt`` a string, ``chosen`` / ``rejected`` strings (rendered as one user turn and
  one assistant turn with the tokenizer's chat template; ``data.apply_chat_template=false``: raw
  text, the response followed by EOS); or
* chat: ``prompt`` a list of messages (or ShareGPT turns), ``chosen`` / ``rejected`` each an
  assistant message list (TRL's conversational format) or a string; or no prompt column and
  ``chosen`` / ``rejected`` whole conversations that differ only in their last (assistant)
  message (TRL's implicit prompt: everything before it); or
* tinker-cookbook's labeled comparisons (its ``ComparisonBuilderFromJsonl`` rows): ``comparison``
  (``prompt_conversation``, ``completion_A``, ``completion_B``) and ``label`` (``A`` or ``B``:
  the chosen one; ``Tie``: no preference, dropped and counted as ``ties``).

Each side is tokenized as prompt + its response with the loss on that response only (the last
assistant turn: earlier turns are context). Refused naming the row: a missing column, an empty
response, implicit-prompt conversations whose earlier turns differ. A pair whose two responses
are identical teaches nothing: it is dropped, counted and reported (``identical``). Length:
``data.max_length`` per side with ``data.overlong`` (``truncate`` cuts both sides to it and drops
the pair when a response is cut away entirely; ``drop``; ``error``).

**The sorting task** (no files): prompt ``BOS digits SEP``; chosen the sorted digits + EOS;
rejected a worse answer of the same prompt, scored lower by the task's partial-credit reward
(``posttrain.rewards.sort_task_score``): half the pairs a near miss (the digits unsorted, two of
them swapped, or one dropped), half random task tokens as an untrained model writes them, drawn
per pair from the step's seed (a pure function of ``data.seed`` and the step).

A batch holds ``data.batch_size`` pairs as ``2 x batch_size`` rows, chosen then rejected
(``roles.preference``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from engine_api import make_batch
from posttrain import sort_task as task
from posttrain.data.config import DataConfig
from posttrain.data.counts import LoadCounts, overlong_action
from posttrain.data.encoder import ChatEncoder
from posttrain.data.messages import check_messages, is_sharegpt, sharegpt_to_messages
from posttrain.data.order import StepOrder
from posttrain.data.rows import Row, read_rows
from posttrain.data_order import files_order, sort_task_order
from posttrain.rewards import sort_task_score


@dataclass(frozen=True)
class PreferenceDataConfig(DataConfig):
    """``DataConfig`` plus the two response columns (module docstring).

    Attributes:
        chosen_key: the column of the preferred response.
        rejected_key: the column of the other one.
    """

    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


Pair = tuple[list[int], list[int], list[int], list[int]]  # chosen ids, mask, rejected ids, mask


class PreferenceDataset:
    """The tokenized pairs of ``files`` and their sources; ``counts`` as the SFT data's, plus
    ``identical`` (pairs dropped for equal responses)."""

    def __init__(self, files: Sequence[str], tokenizer, cfg: PreferenceDataConfig, key: str = "data.train_files") -> None:
        self.cfg = cfg
        self.enc = ChatEncoder(tokenizer, dataclasses.replace(cfg, loss_on="last_turn"))
        self.pairs: list[Pair] = []
        self.sources: list[str] = []
        self.counts = LoadCounts()
        self.identical = 0
        self.ties = 0
        for row in read_rows(files, key, cfg.max_row_bytes, cfg.split_for(key)):
            self.counts.rows += 1
            sides = self._sides(row)
            if sides is None:  # a tie
                self.ties += 1
                self.counts.dropped += 1
                continue
            chosen, rejected = sides
            if chosen == rejected:
                self.identical += 1
                self.counts.dropped += 1
                continue
            pair = self._fit(row.source, *self._encode(row, chosen), *self._encode(row, rejected))
            if pair is None:
                self.counts.dropped += 1
                continue
            self.pairs.append(pair)
            self.sources.append(row.source)
        self.counts.kept = len(self.pairs)
        if not self.pairs:
            raise ValueError(
                f"{key}: no pair left ({self.counts.line(key)}, {self.identical} with identical responses, {self.ties} ties); fix: check the "
                "chosen / rejected columns, or raise data.max_length"
            )

    def __len__(self) -> int:
        return len(self.pairs)

    def _column(self, row: Row, name: str, setting: str) -> object:
        if name not in row.values:
            raise ValueError(
                f"row {row.source}: no column {name!r} (data.{setting}; columns: {sorted(row.values)}); fix: set data.{setting} "
                "to the column that holds it"
            )
        value = row.values[name]
        if value is None or (isinstance(value, (str, list)) and not value):
            raise ValueError(f"row {row.source}: column {name!r} (data.{setting}) is empty; fix: drop the row or fill it")
        return value

    def _sides(self, row: Row) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
        """``((prompt, chosen response), (prompt, rejected response))`` of a row: the prompt
        as text or messages, each response as text or an assistant message list; None for a
        labeled comparison that is a tie."""
        if "comparison" in row.values and "label" in row.values and self.cfg.chosen_key not in row.values:
            return self._labeled(row)
        c = self._column(row, self.cfg.chosen_key, "chosen_key")
        r = self._column(row, self.cfg.rejected_key, "rejected_key")
        if self.cfg.prompt_key in row.values:
            prompt = self._column(row, self.cfg.prompt_key, "prompt_key")
            return (prompt, c), (prompt, r)
        if not (isinstance(c, list) and isinstance(r, list)):
            raise ValueError(
                f"row {row.source}: no prompt column {self.cfg.prompt_key!r} (data.prompt_key) and the responses are not "
                "conversations, so the prompt cannot be told apart; fix: add the prompt column, or give chosen / rejected as "
                "message lists that share everything but the last assistant turn"
            )
        c, r = self._messages(c, row.source), self._messages(r, row.source)
        if c[:-1] != r[:-1] or c[-1]["role"] != "assistant" or r[-1]["role"] != "assistant":
            raise ValueError(
                f"row {row.source}: chosen and rejected conversations must share every message but the last, an assistant "
                "turn (the implicit prompt); fix: give the prompt column explicitly"
            )
        return (c[:-1], c[-1:]), (r[:-1], r[-1:])

    def _labeled(self, row: Row) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
        """A tinker-cookbook labeled comparison as the two sides (None: a tie)."""
        comparison, label = row.values["comparison"], row.values["label"]
        keys = ("prompt_conversation", "completion_A", "completion_B")
        if not isinstance(comparison, dict) or any(not comparison.get(k) for k in keys):
            raise ValueError(f"row {row.source}: comparison needs non-empty {', '.join(keys)}; fix: drop the row or fill them")
        if label == "Tie":
            return None
        if label not in ("A", "B"):
            raise ValueError(f"row {row.source}: label = {label!r}; fix: A, B or Tie")
        prompt = comparison["prompt_conversation"]
        chosen, rejected = (comparison["completion_A"], comparison["completion_B"])[:: 1 if label == "A" else -1]
        return (prompt, chosen), (prompt, rejected)

    @staticmethod
    def _messages(value: object, source: str) -> list[dict]:
        return check_messages(sharegpt_to_messages(value, source) if is_sharegpt(value) else value, source)

    def _encode(self, row: Row, side: tuple[Any, Any]) -> tuple[list[int], list[int]]:
        prompt, response = side
        if isinstance(prompt, str) and isinstance(response, str):
            return self.enc.prompt_response(prompt, response, row.source)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else self._messages(prompt, row.source)
        reply = [{"role": "assistant", "content": response}] if isinstance(response, str) else self._messages(response, row.source)
        if not reply or reply[-1]["role"] != "assistant":
            raise ValueError(f"row {row.source}: a response must end with an assistant message; fix: check chosen / rejected")
        return self.enc.conversation(messages + reply, row.source)

    def _fit(self, source: str, ci: list[int], cm: list[int], ri: list[int], rm: list[int]) -> Pair | None:
        """The pair within ``data.max_length`` per side (``data.overlong``), or None (dropped)."""
        limit = self.cfg.max_length
        action = overlong_action(self.cfg, source, max(len(ci), len(ri)), limit, "max_length")
        if action == "drop":
            return None
        if action == "truncate":
            ci, cm, ri, rm = ci[:limit], cm[:limit], ri[:limit], rm[:limit]
            if not any(cm) or not any(rm):
                return None
            self.counts.truncated += 1
        return ci, cm, ri, rm

    def batch(self, indices: Sequence[int]) -> TensorDict:
        """The protocol batch of the pairs at ``indices``: rows chosen, rejected, chosen, ..."""
        ids, masks = [], []
        for i in indices:
            ci, cm, ri, rm = self.pairs[i]
            ids += [torch.tensor(ci), torch.tensor(ri)]
            masks += [torch.tensor(cm, dtype=torch.float32), torch.tensor(rm, dtype=torch.float32)]
        return make_batch(ids, loss_mask=masks)

    def digest(self) -> str:
        """SHA-256 of every pair's ids and masks (the data order's fingerprint)."""
        h = hashlib.sha256()
        for pair in self.pairs:
            for part, dtype in zip(pair, (np.int64, np.int8, np.int64, np.int8), strict=True):
                h.update(np.asarray(part, dtype=dtype).tobytes())
            h.update(b"\0")
        return h.hexdigest()


def sort_pairs_at(cfg: DataConfig, step: int) -> TensorDict:
    """The sorting task's preference batch of ``step`` (module docstring): ``data.batch_size``
    pairs, the rejected response always scored lower than the chosen one."""
    prompts, targets = task.prompts_at(cfg, step)
    gen = torch.Generator().manual_seed(task._step_seed(cfg.seed + 7919, step))
    ids, masks = [], []
    for prompt, target in zip(prompts, targets, strict=True):
        if bool(torch.rand((), generator=gen) < 0.5):  # a near miss
            worse = _worse_answers(prompt[1:-1].tolist(), target)
            rejected = worse[int(torch.randint(len(worse), (1,), generator=gen))]
        else:  # what an untrained model writes: any tokens, any length up to the target's
            rejected = _random_answer(target, gen)
        for response in (target, rejected):
            ids.append(torch.cat([prompt, torch.tensor(response)]))
            masks.append(torch.cat([torch.zeros(len(prompt)), torch.ones(len(response))]))
    return make_batch(ids, loss_mask=masks)


def _random_answer(target: list[int], gen: torch.Generator) -> list[int]:
    """Random task tokens (digits, separators, EOS; never BOS / PAD) of 1 to ``len(target)``
    tokens, redrawn until it scores below the target."""
    while True:
        n = int(torch.randint(1, len(target) + 1, (1,), generator=gen))
        answer = torch.randint(task.SEP, task.FIRST_DIGIT + task.NUM_DIGITS, (n,), generator=gen).tolist()
        if sort_task_score(answer, target) < 1.0:
            return answer


def _worse_answers(digits: list[int], target: list[int]) -> list[list[int]]:
    """Answers to the prompt ``digits`` scored strictly below the sorted ``target``: the digits
    as given, each swap of two unequal neighbours of the sorted answer, and each single digit
    dropped (always worse: the EOS moves)."""
    best = sort_task_score(target, target)
    sorted_digits = target[:-1]
    candidates = [[*digits, task.EOS]]
    for i in range(len(sorted_digits) - 1):
        if sorted_digits[i] != sorted_digits[i + 1]:
            swapped = list(sorted_digits)
            swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
            candidates.append([*swapped, task.EOS])
    candidates += [[*sorted_digits[:i], *sorted_digits[i + 1 :], task.EOS] for i in range(len(sorted_digits))]
    return [c for c in candidates if sort_task_score(c, target) < best]


class PreferenceData:
    """The pairs of a run: the sorting task's, or the user's files'."""

    def __init__(self, cfg: PreferenceDataConfig, tokenizer) -> None:
        self.cfg = cfg
        self.train = self.val = None
        self.counts: dict[str, dict[str, int]] = {}
        if not cfg.from_files:
            return
        self.train = PreferenceDataset(cfg.train_files, tokenizer, cfg, "data.train_files")
        self.order = StepOrder(len(self.train), cfg.batch_size, cfg.seed, cfg.shuffle)
        if cfg.val_files:
            self.val = PreferenceDataset(cfg.val_files, tokenizer, cfg, "data.val_files")
        for name, ds in (("train", self.train), ("val", self.val)):
            if ds is not None:
                self.counts[name] = {**dataclasses.asdict(ds.counts), "identical": ds.identical, "ties": ds.ties}

    def data_order(self) -> dict[str, Any]:
        """What every step's batch depends on (``posttrain.data_order``)."""
        if self.train is None:
            return {**sort_task_order(self.cfg), "pairs": "sort_pairs_at"}
        return files_order(self.cfg, len(self.train.pairs), self.train.digest())

    def batch_at(self, step: int) -> TensorDict:
        """The global batch of training step ``step``: ``2 x data.batch_size`` rows."""
        if self.train is None:
            return sort_pairs_at(self.cfg, step)
        return self.train.batch(self.order.indices(step))

    def val_batches(self) -> list[TensorDict]:
        """Every validation pair once, in batches of ``data.batch_size`` pairs (the sorting
        task: ``data.eval_batches`` held-out batches)."""
        if self.train is None:
            return [sort_pairs_at(self.cfg, task._EVAL_STEP_OFFSET + i) for i in range(self.cfg.eval_batches)]
        if self.val is None:
            return []
        n, size = len(self.val), self.cfg.batch_size
        return [self.val.batch(list(range(b, min(n, b + size)))) for b in range(0, n, size)]
