"""SFT samples of the user's files (``SFTDataset``): each row's token ids and loss mask
(``posttrain.data.encoder``), ``data.max_length`` applied by ``data.overlong``, and the protocol
batch of a step's samples."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from engine_api import make_batch
from posttrain.data.config import DataConfig
from posttrain.data.counts import LoadCounts, overlong_action
from posttrain.data.encoder import ChatEncoder
from posttrain.data.messages import sharegpt_to_messages
from posttrain.data.rows import column, read_rows


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
                chat = column(row, cfg.messages_column, "messages_key", cfg.format)
                ids, mask = enc.conversation(sharegpt_to_messages(chat, row.source) if cfg.format == "sharegpt" else chat, row.source)
            else:
                ids, mask = enc.prompt_response(
                    column(row, cfg.prompt_key, "prompt_key"), column(row, cfg.response_key, "response_key"), row.source
                )
            action = overlong_action(cfg, row.source, len(ids), cfg.max_length, "max_length")
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
