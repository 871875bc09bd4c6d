"""Per-token log-probs and entropy from logits, aligned as docs/design.md section 3 says.

``log_probs[i] = log p(input_ids[i] | input_ids[:i])`` comes from the logits at position
``i - 1``; position 0 of every sequence has nothing to predict it and gets 0.

Arbitrary targets (the batch field :data:`TARGETS_FIELD`, ``target_ids``): position ``i`` scores
its own target with the logits computed at ``i``, ``target_log_probs[i] = log p(target_ids[i] |
input_ids[:i + 1])`` (no shift, every position scored, the last one too). ``target_ids`` may be
``[T]`` or ``[T, K]`` per sequence (K candidates per position, e.g. a teacher's top-k); the output
has its shape. This is the Tinker API's ``target_tokens`` convention; the targets need not be the
next input token.
"""

from __future__ import annotations

import torch


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


def target_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits[t])[targets[t]]`` per packed position, in fp32 (``logits``
    ``[total, vocab]``; ``targets`` ``[total]`` or ``[total, K]``; the result has ``targets``' shape)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if targets.dim() == 1:
        return logp.gather(-1, targets[:, None].long()).squeeze(-1)
    return logp.gather(-1, targets.long())


def lm_token_outputs(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, micro_batch) -> dict[str, torch.Tensor]:
    """The flat per-token outputs of an LM head for one packed micro-batch, as every backend
    returns them: ``log_probs``; ``entropy`` when the metadata ``calculate_entropy`` is True;
    ``target_log_probs`` when the micro-batch carries :data:`TARGETS_FIELD`. ``logits`` are
    ``[total, vocab]`` in packed order, already divided by the temperature."""
    out = {"log_probs": token_log_probs(logits, input_ids, cu_seqlens)}
    if micro_batch.get_non_tensor("calculate_entropy", False):
        out["entropy"] = token_entropy(logits, cu_seqlens)
    if TARGETS_FIELD in micro_batch.keys():
        out[TARGET_LOG_PROBS] = target_log_probs(logits, micro_batch[TARGETS_FIELD].values())
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
