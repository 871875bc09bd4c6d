"""Per-token log-probs and entropy from logits, aligned as DESIGN.md section 3 says.

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
    logp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, input_ids[1:, None]).squeeze(-1)
    return _shift_in(logp, cu_seqlens)


def token_entropy(logits: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Entropy of the distribution that predicts each packed token (0 at sequence starts)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return _shift_in(ent, cu_seqlens)


def _shift_in(pred_next: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``pred_next[t]`` scores token t + 1; place it at t + 1 and zero every sequence start
    (which also drops the cross-sequence predictions at packed boundaries)."""
    out = torch.cat([pred_next.new_zeros(1), pred_next])
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[cu_seqlens[:-1].long()] = False
    return out * keep
