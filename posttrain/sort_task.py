"""A synthetic, learnable task: sort a few digits (the recipes' default, for SFT and RL).

A sample is ``BOS d1 .. dk SEP s1 .. sk EOS`` where ``d`` are random digits and ``s`` the
same digits sorted ascending. The prompt is ``BOS d1 .. dk SEP``; the response (the loss
tokens) is ``s1 .. sk EOS``. ``k`` varies per sample in ``[min_digits, max_digits]``, so
batches are genuinely jagged. SFT trains on whole samples (:func:`batch_at`); RL samples a
response to each prompt of :func:`prompts_at` and scores it against the target
(``posttrain.rewards.sort_task_score``).

Determinism: the batch of a step depends only on ``(seed, step)`` (its own seeded
``torch.Generator``), never on what came before, so a resumed run sees exactly the batches
an uninterrupted run would have seen from that step on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from engine_api import make_batch

# Token ids of the task's vocabulary. Ids >= FIRST_DIGIT + NUM_DIGITS are never produced;
# VOCAB_SIZE rounds the vocabulary up to a model-friendly size.
PAD = 0
BOS = 1
SEP = 2
EOS = 3
FIRST_DIGIT = 4
NUM_DIGITS = 10
VOCAB_SIZE = 32

# Eval batches use steps from this offset on, far beyond any training run, so they are
# never trained on.
_EVAL_STEP_OFFSET = 10**9


@dataclass(frozen=True)
class DataConfig:
    """The sorting task.

    Attributes:
        batch_size: sequences per global batch (all data-parallel ranks together); must be a
            multiple of the number of ranks.
        min_digits, max_digits: digits per prompt, drawn uniformly in this range.
        seed: seeds every batch together with the step number.
        eval_batches: held-out batches scored at the end of a run (0: no eval).
    """

    batch_size: int = 32
    min_digits: int = 3
    max_digits: int = 6
    seed: int = 1234
    eval_batches: int = 4

    def _problems(self) -> list[str]:
        out = []
        if self.batch_size < 1:
            out.append(f"batch_size = {self.batch_size}: must be positive; fix: e.g. 32")
        if self.min_digits < 1:
            out.append(f"min_digits = {self.min_digits}: must be >= 1; fix: e.g. 3")
        if self.max_digits < self.min_digits:
            out.append(f"max_digits = {self.max_digits}: less than min_digits = {self.min_digits}; fix: use max_digits >= min_digits")
        if self.seed < 0:
            out.append(f"seed = {self.seed}: negative; fix: use a seed >= 0")
        if self.eval_batches < 0:
            out.append(f"eval_batches = {self.eval_batches}: negative; fix: use 0 (no eval) or more")
        return out


def max_seq_len(cfg: DataConfig) -> int:
    """Longest sequence the task produces: BOS + k digits + SEP + k sorted digits + EOS."""
    return 2 * cfg.max_digits + 3


def render(ids: Sequence[int]) -> str:
    """Readable text of task token ids (for logged samples): digits as ``0``-``9``, the
    separator as `` -> ``, BOS / EOS / PAD as ``<bos>`` / ``<eos>`` / ``<pad>``, any other id as ``<id>``."""
    names = {BOS: "<bos>", SEP: " -> ", EOS: "<eos>", PAD: "<pad>"}
    return "".join(
        str(i - FIRST_DIGIT) if FIRST_DIGIT <= i < FIRST_DIGIT + NUM_DIGITS else names.get(i, f"<{i}>") for i in (int(x) for x in ids)
    )


def make_sample(digits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and loss mask of one sample for ``digits`` (values 0-9).

    Returns:
        ``(input_ids, loss_mask)``: the mask is 1 exactly on the response (sorted digits +
        EOS), the last ``len(digits) + 1`` tokens.
    """
    prompt = [BOS, *(FIRST_DIGIT + d for d in digits), SEP]
    response = [*(FIRST_DIGIT + d for d in sorted(digits)), EOS]
    ids = torch.tensor(prompt + response, dtype=torch.long)
    mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(response))])
    return ids, mask


def batch_at(cfg: DataConfig, step: int) -> TensorDict:
    """The global batch of training step ``step`` (a pure function of ``cfg`` and ``step``).

    Returns:
        A protocol batch (``engine_api.make_batch``) with jagged ``input_ids`` and
        ``loss_mask`` (response tokens only; position 0 never set).
    """
    gen = torch.Generator().manual_seed(_step_seed(cfg.seed, step))
    lengths = torch.randint(cfg.min_digits, cfg.max_digits + 1, (cfg.batch_size,), generator=gen)
    ids, masks = [], []
    for k in lengths.tolist():
        digits = torch.randint(0, NUM_DIGITS, (k,), generator=gen).tolist()
        seq, mask = make_sample(digits)
        ids.append(seq)
        masks.append(mask)
    return make_batch(ids, loss_mask=masks)


def iter_batches(cfg: DataConfig, start_step: int = 0, total_steps: int | None = None) -> Iterator[tuple[int, TensorDict]]:
    """``(step, batch)`` from ``start_step`` up to ``total_steps`` (exclusive; None: forever)."""
    step = start_step
    while total_steps is None or step < total_steps:
        yield step, batch_at(cfg, step)
        step += 1


def eval_batch(cfg: DataConfig, index: int) -> TensorDict:
    """Held-out batch ``index`` (drawn from steps no training run reaches)."""
    return batch_at(cfg, _EVAL_STEP_OFFSET + index)


def prompts_at(cfg: DataConfig, step: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The RL prompts of ``step`` and their target responses (sorted digits + EOS), a pure
    function of ``cfg`` and ``step``; held-out prompts use a step past ``_EVAL_STEP_OFFSET``."""
    gen = torch.Generator().manual_seed(_step_seed(cfg.seed, step))
    prompts, targets = [], []
    for _ in range(cfg.batch_size):
        k = int(torch.randint(cfg.min_digits, cfg.max_digits + 1, (1,), generator=gen))
        digits = torch.randint(0, NUM_DIGITS, (k,), generator=gen).tolist()
        prompts.append(torch.tensor([BOS, *(FIRST_DIGIT + d for d in digits), SEP]))
        targets.append([*(FIRST_DIGIT + d for d in sorted(digits)), EOS])
    return prompts, targets


def _step_seed(seed: int, step: int) -> int:
    # A large odd multiplier keeps (seed, step) pairs from colliding for any realistic run;
    # the mask keeps the value inside the generator's 64-bit seed range.
    return (seed * 0x9E3779B97F4A7C15 + step) & 0x7FFF_FFFF_FFFF_FFFF
