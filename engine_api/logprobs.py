"""Per-token log-probs and entropy from logits, aligned as docs/design.md section 3 says.

``log_probs[i] = log p(input_ids[i] | input_ids[:i])`` comes from the logits at position
``i - 1``; position 0 of every sequence has nothing to predict it and gets 0.

Arbitrary targets (the batch field :data:`TARGETS_FIELD`, ``target_ids``): position ``i`` scores
its own target with the logits computed at ``i``, ``target_log_probs[i] = log p(target_ids[i] |
input_ids[:i + 1])`` (no shift, every position scored, the last one too). ``target_ids`` may be
``[T]`` or ``[T, K]`` per sequence (K candidates per position, e.g. a teacher's top-k); the output
has its shape. This is the Tinker API's ``target_tokens`` convention; the targets need not be the
next input token.

Top-k (the batch metadata :data:`TOPK_META`, ``return_topk: K``): per position, in the targets'
convention, the K most likely tokens of the distribution computed at that position (what follows
``input_ids[:i + 1]``; every position, the last too) and their fp32 log-probs, ``topk_ids`` and
``topk_log_probs`` ``[T, K]`` per sequence, most likely first (``torch.topk``; ties in torch's
order). A teacher's top-k fed back as another model's ``target_ids`` scores the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Aligned log-probs of packed sequences.

    Args:
        logits: ``[total, vocab]`` logits of the packed tokens (position t predicts t + 1).
        input_ids: ``[total]`` packed token ids.
        cu_seqlens: ``[B + 1]`` sequence boundaries.

    Returns:
        ``[total]`` log-probs, 0 at every sequence start.
    """
    return align_to_tokens(next_token_log_probs(logits[:-1], input_ids[1:]), cu_seqlens)


TARGETS_FIELD = "target_ids"
TARGET_LOG_PROBS = "target_log_probs"
TOPK_META = "return_topk"
TOPK_IDS = "topk_ids"
TOPK_LOG_PROBS = "topk_log_probs"


def target_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits[t])[targets[t]]`` per packed position, in fp32 (``logits``
    ``[total, vocab]``; ``targets`` ``[total]`` or ``[total, K]``; the result has ``targets``' shape)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if targets.dim() == 1:
        return logp.gather(-1, targets[:, None].long()).squeeze(-1)
    return logp.gather(-1, targets.long())


def topk_of(micro_batch) -> int:
    """The batch metadata :data:`TOPK_META` (0: no top-k outputs)."""
    return int(micro_batch.get_non_tensor(TOPK_META, 0) or 0)


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [total, k] int64, log-probs [total, k] fp32)``: the ``k`` most likely tokens of
    ``log_softmax(logits[t])`` per packed position (no shift), most likely first."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids, values


def lm_token_outputs(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, micro_batch) -> dict[str, torch.Tensor]:
    """The flat per-token outputs of an LM head for one packed micro-batch, as every backend
    returns them: ``log_probs``; ``entropy`` when the metadata ``calculate_entropy`` is True;
    ``target_log_probs`` when the micro-batch carries :data:`TARGETS_FIELD`; ``topk_ids`` and
    ``topk_log_probs`` when its metadata :data:`TOPK_META` is K >= 1. ``logits`` are
    ``[total, vocab]`` in packed order, already divided by the temperature."""
    out = {"log_probs": token_log_probs(logits, input_ids, cu_seqlens)}
    if micro_batch.get_non_tensor("calculate_entropy", False):
        out["entropy"] = token_entropy(logits, cu_seqlens)
    if TARGETS_FIELD in micro_batch.keys():
        out[TARGET_LOG_PROBS] = target_log_probs(logits, micro_batch[TARGETS_FIELD].values())
    k = topk_of(micro_batch)
    if k:
        with torch.no_grad():  # token ids: nothing to differentiate; the log-probs are a teacher's targets
            out[TOPK_IDS], out[TOPK_LOG_PROBS] = top_log_probs(logits, k)
    return out


def token_entropy(logits: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Entropy of the distribution that predicts each packed token (0 at sequence starts)."""
    return align_to_tokens(next_token_entropy(logits[:-1]), cu_seqlens)


def next_token_log_probs(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """Per position, unaligned: ``log_softmax(logits)[..., next_ids]`` in fp32 (``logits``
    ``[..., vocab]``, ``next_ids`` the token each position predicts, same leading shape)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, next_ids[..., None]).squeeze(-1)


def next_token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per position, unaligned: the entropy of ``softmax(logits)`` in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def align_to_tokens(pred_next: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Align per-position predictions about the *next* token with the token they score.

    ``pred_next[t]`` (``[total - 1]``, computed at packed position t) scores token t + 1; it
    is placed at t + 1, and every sequence start is zeroed (which also drops the
    cross-sequence predictions at packed boundaries). Used for log-probs, entropy and values
    (the value of token i is predicted from the prefix before it).
    """
    out = torch.cat([pred_next.new_zeros(1), pred_next])
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[cu_seqlens[:-1].long()] = False
    return out * keep


# ----------------------------------------------------------------------------- chunked head
#: fp32 logits one chunk of :class:`HeadRequest` may hold at once (elements; 2**26 = 256 MiB):
#: tokens per chunk = this // vocab, so a 128k vocabulary runs 512-token chunks.
CHUNK_ELEMENTS = 1 << 26


@dataclass
class HeadRequest:
    """Every LM output of one packed micro-batch (:func:`lm_token_outputs`), computed straight
    from the final hidden states and the LM head's weight in chunks of tokens, so no
    ``[tokens, vocab]`` logits (fp32 or not) exist for the whole micro-batch: each chunk's
    logits, fp32 log-softmax and entropy live only inside that chunk, and backward recomputes
    them chunk by chunk (``torch.utils.checkpoint``) when the micro-batch spans several chunks
    (a micro-batch of one chunk keeps its logits: at most ``CHUNK_ELEMENTS``). The numbers are
    :func:`lm_token_outputs`' up to fp32 summation order.

    Attributes:
        input_ids: ``[total]`` packed token ids.
        cu_seqlens: ``[B + 1]`` sequence boundaries.
        temperature: the logits are divided by it (after the fp32 upcast).
        entropy: also the entropy of each predicting distribution.
        targets: :data:`TARGETS_FIELD` values (``[total]`` or ``[total, K]``), or None.
        index: ``[total]`` place of each packed token in the flattened hidden rows the model
            ran (padding and row layouts), or None when the rows are the packed tokens in order.
        chunk_tokens: tokens per chunk (None: ``CHUNK_ELEMENTS // vocab``).
        topk: also each position's ``topk`` most likely tokens and their log-probs (0: no);
            the ids travel as fp32 columns (exact below 2**24 tokens) and carry no gradient.
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    temperature: float = 1.0
    entropy: bool = False
    targets: torch.Tensor | None = None
    index: torch.Tensor | None = None
    chunk_tokens: int | None = None
    topk: int = 0

    @classmethod
    def of(cls, micro_batch, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, index: torch.Tensor | None = None) -> HeadRequest:
        """The request :func:`lm_token_outputs` would answer for ``micro_batch`` (temperature,
        ``calculate_entropy`` and targets read from it)."""
        targets = micro_batch[TARGETS_FIELD].values() if TARGETS_FIELD in micro_batch.keys() else None
        return cls(
            input_ids=input_ids,
            cu_seqlens=cu_seqlens,
            temperature=float(micro_batch.get_non_tensor("temperature", 1.0)),
            entropy=bool(micro_batch.get_non_tensor("calculate_entropy", False)),
            targets=targets,
            index=index,
            topk=topk_of(micro_batch),
        )

    def columns(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 ``[total, C]``: per packed position its next token's log-prob, then its entropy
        (when asked), then its targets' log-probs (when given), from ``hidden`` ``[..., H]``
        (the rows the model ran) and the head ``weight`` ``[V, H]`` / ``bias``. One tensor, so
        a caller can return it as a module's output (every gradient flows through it)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.index is not None:
            flat = flat[self.index]
        total = flat.shape[0]
        next_ids = torch.cat([self.input_ids[1:], self.input_ids.new_zeros(1)]).long()  # the last predicts nothing (zeroed later)
        targets = None if self.targets is None else self.targets.long().reshape(total, -1)
        step = self.chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
        # One chunk holds the whole micro-batch's logits anyway: recomputing it in backward would
        # only cost a second head matmul (on small micro-batches the head is a large share of
        # the step), so the recompute is kept for micro-batches of several chunks.
        grad = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad) and total > step
        parts = []
        for start in range(0, total, step):
            args = (flat[start : start + step], weight, bias, next_ids[start : start + step])
            args += (None if targets is None else targets[start : start + step],)
            if grad:
                # recompute this chunk's logits in backward instead of keeping them (several chunks)
                parts.append(checkpoint(_chunk_columns, *args, self.temperature, self.entropy, self.topk, use_reentrant=False))
            else:
                parts.append(_chunk_columns(*args, self.temperature, self.entropy, self.topk))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def outputs(self, columns: torch.Tensor) -> dict[str, torch.Tensor]:
        """:func:`lm_token_outputs`' dict from :meth:`columns`' result (aligned, flat)."""
        out = {"log_probs": align_to_tokens(columns[:-1, 0], self.cu_seqlens)}
        col = 1
        if self.entropy:
            out["entropy"] = align_to_tokens(columns[:-1, 1], self.cu_seqlens)
            col = 2
        if self.targets is not None:
            width = 1 if self.targets.dim() == 1 else self.targets.shape[-1]
            picked = columns[:, col : col + width]
            out[TARGET_LOG_PROBS] = picked.squeeze(-1) if self.targets.dim() == 1 else picked
            col += width
        if self.topk:
            out[TOPK_LOG_PROBS] = columns[:, col : col + self.topk].detach()
            out[TOPK_IDS] = columns[:, col + self.topk : col + 2 * self.topk].detach().long()
        return out


def _chunk_columns(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    next_ids: torch.Tensor,
    targets: torch.Tensor | None,
    temperature: float,
    entropy: bool,
    topk: int = 0,
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    cols = [logp.gather(-1, next_ids[:, None])]
    if entropy:
        cols.append(-(logp.exp() * logp).sum(-1, keepdim=True))
    if targets is not None:
        cols.append(logp.gather(-1, targets))
    if topk:
        with torch.no_grad():
            values, ids = logp.topk(topk, dim=-1)
        cols += [values, ids.to(logp.dtype)]
    return torch.cat(cols, dim=-1)
