"""Per-token log-probs and entropy from logits, aligned as docs/design.md section 3 says.

``log_probs[i] = log p(input_ids[i] | input_ids[:i])`` comes from the logits at position
``i - 1``; position 0 of every sequence has nothing to predict it and gets 0.
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
