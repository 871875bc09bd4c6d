"""Where the RL recipe's prompts and rewards come from: the built-in sorting task (token ids,
its own scorer) or the user's prompt files with a reward function (``posttrain.text_data``,
``posttrain.rewards``). Both give the prompts of a step as a pure function of the config and the
step, so a resumed run replays the uninterrupted one."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from posttrain import sort_task as task
from posttrain.data_order import files_order, sort_task_order
from posttrain.dist import rank
from posttrain.rewards import DEFAULT_TIMEOUT_S, RewardConfig, check_reward_columns, compute_rewards, load_reward_fn, sort_task_score
from posttrain.text_data import DataConfig, PromptDataset, StepOrder, load_tokenizer, report_counts, stop_token_ids


class SortTask:
    """The built-in digit-sorting task (no tokenizer; partial-credit reward on token ids)."""

    tokenizer = None
    counts: dict = {}

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.stop_ids = [task.EOS]

    def prompts_at(self, step: int) -> tuple[list[torch.Tensor], list]:
        """``(prompt ids, per-prompt metadata)`` of training step ``step``."""
        return task.prompts_at(self.cfg, step)

    def data_order(self) -> dict[str, Any]:
        """What the prompts of every step depend on (``posttrain.data_order``: checked on resume)."""
        return sort_task_order(self.cfg)

    def val_prompts(self) -> tuple[list[torch.Tensor], list]:
        """Held-out prompts (from a step no run reaches)."""
        return task.prompts_at(self.cfg, task._EVAL_STEP_OFFSET)

    def decode(self, ids: Sequence[int]) -> str:
        """Readable text of token ids (``posttrain.sort_task.render``)."""
        return task.render(ids)

    def score(self, responses: Sequence[torch.Tensor], metas: Sequence) -> torch.Tensor:
        return torch.tensor([sort_task_score(r.tolist(), target) for r, target in zip(responses, metas, strict=True)])


class FileTask:
    """Prompts from ``data.train_files`` / ``data.val_files``, scored by ``reward.function``."""

    def __init__(
        self, cfg: DataConfig, model_path: str, reward_function: str, batched: bool, timeout_s: float | None = DEFAULT_TIMEOUT_S
    ) -> None:
        self.cfg = cfg
        self.reward_spec, self.timeout_s = reward_function, timeout_s
        self.tokenizer = load_tokenizer(model_path)
        self.stop_ids = stop_token_ids(self.tokenizer, model_path, end_of_turn=cfg.apply_chat_template)
        # No reward function: an environment gives the rewards (``env.function``; checked by the recipe).
        self.reward_fn, self.batched = (load_reward_fn(reward_function) if reward_function is not None else None), batched
        self.train = PromptDataset(cfg.train_files, self.tokenizer, cfg, "data.train_files")
        self.order = StepOrder(len(self.train), cfg.batch_size, cfg.seed, cfg.shuffle)
        self.val = PromptDataset(cfg.val_files, self.tokenizer, cfg, "data.val_files") if cfg.val_files else None
        for data in (self.train, self.val):
            if data is not None and self.reward_fn is not None:  # before any model is built: a clash would fail only after a rollout
                check_reward_columns(self.reward_fn, reward_function, {k for s in data.samples for k in s.columns})
        self.counts = report_counts({"train": self.train, "val": self.val}, cfg.overlong, rank() == 0)

    def prompts_at(self, step: int) -> tuple[list[torch.Tensor], list]:
        samples = [self.train.samples[i] for i in self.order.indices(step)]
        return [s.ids for s in samples], samples

    def data_order(self) -> dict[str, Any]:
        """What the prompts of every step depend on (``posttrain.data_order``: checked on resume):
        the order's keys and the training rows as loaded (their number and a SHA-256 of their
        rendered prompts; the sources are recorded for the message, a moved file still matches)."""
        h = hashlib.sha256()
        for s in self.train.samples:
            h.update(s.text.encode())
            h.update(b"\0")
        return files_order(self.cfg, len(self.train.samples), h.hexdigest())

    def val_prompts(self) -> tuple[list[torch.Tensor], list] | None:
        if self.val is None:
            return None
        return [s.ids for s in self.val.samples], list(self.val.samples)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens kept (a logged sample shows where it stopped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def score(self, responses: Sequence[torch.Tensor], metas: Sequence) -> torch.Tensor:
        """The reward function on the decoded text (special tokens, e.g. EOS, left out)."""
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in responses]
        return compute_rewards(
            self.reward_fn,
            self.batched,
            [m.text for m in metas],
            texts,
            [m.columns for m in metas],
            [m.source for m in metas],
            name=self.reward_spec,
            timeout_s=self.timeout_s,
        ).float()


def build_task(data: DataConfig, model_path: str | None, reward: RewardConfig) -> SortTask | FileTask:
    """The task of an RL run from its sections: the sorting task without data files, else the
    files of ``data`` tokenized with ``model_path``'s tokenizer and scored by ``reward``."""
    if not data.from_files:
        return SortTask(data)
    return FileTask(data, model_path, reward.function, reward.batched, reward.timeout_s)
