"""RL prompts of the user's files (``PromptDataset``): each row's prompt rendered with the
generation prompt (``posttrain.data.encoder``), ``data.max_prompt_length`` applied by
``data.overlong``, and the row's other columns kept for the reward function."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from posttrain.data.config import DataConfig
from posttrain.data.counts import LoadCounts, overlong_action
from posttrain.data.encoder import ChatEncoder
from posttrain.data.rows import column, read_rows


@dataclass(frozen=True)
class PromptSample:
    """One RL prompt: its token ids, the rendered text, the other columns of its row, its chat
    messages (None: a raw-text prompt; multi-turn rollouts re-render them every turn) and the
    prompt column's value as the file has it (what an external agent gets, ``posttrain.gateway``)."""

    ids: torch.Tensor
    text: str
    columns: Mapping[str, object]
    source: str
    messages: tuple | None = None
    prompt: object = None


class PromptDataset:
    """Tokenized RL prompts of ``files``."""

    def __init__(self, files: Sequence[str], tokenizer, cfg: DataConfig, key: str = "data.train_files") -> None:
        enc = ChatEncoder(tokenizer, cfg)
        self.samples: list[PromptSample] = []
        self.counts = LoadCounts()
        for row in read_rows(files, key, cfg.max_row_bytes, cfg.split_for(key)):
            self.counts.rows += 1
            value = column(row, cfg.prompt_key, "prompt_key")
            ids, text = enc.prompt(value, row.source)
            messages = enc.prompt_messages(value, row.source)
            action = overlong_action(cfg, row.source, len(ids), cfg.max_prompt_length, "max_prompt_length")
            if action == "drop":
                self.counts.dropped += 1
                continue
            if action == "truncate":
                self.counts.truncated += 1
                ids = ids[-cfg.max_prompt_length :]
                text = tokenizer.decode(ids)
            columns = {k: v for k, v in row.values.items() if k != cfg.prompt_key}
            messages = None if messages is None else tuple(messages)
            self.samples.append(PromptSample(torch.tensor(ids, dtype=torch.long), text, columns, row.source, messages, value))
        self.counts.kept = len(self.samples)
        if not self.samples:
            raise ValueError(f"{key}: every row was dropped ({self.counts.line(key)}); fix: raise data.max_prompt_length")

    def __len__(self) -> int:
        return len(self.samples)
