"""Pure RL algorithm math used by the roles: advantages, KL estimators, PPO policy and value
losses. Plain tensor functions (no engine, no distributed state), unit-tested against
hand-computed cases in ``tests/roles/test_algos.py``.

Conventions: per-token tensors are 1-D flat values of jagged fields (``x.values()``) or any
same-shape tensors; losses are returned *per token* and reduced by the caller with
``engine_api.agg_loss`` under the configured ``loss_agg_mode``.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one sequence of T steps.

    Args:
        rewards: ``[T]`` reward after each step (typically 0 except the last response token).
        values: ``[T]`` value estimate of each step's state; the state after the last step is
            terminal (value 0).
        gamma, lam: discount and GAE lambda.

    Returns:
        ``(advantages, returns)``, each ``[T]``; ``returns = advantages + values``.
    """
    advantages = torch.zeros_like(rewards)
    last = rewards.new_zeros(())
    for t in reversed(range(rewards.shape[0])):
        next_value = values[t + 1] if t + 1 < rewards.shape[0] else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages, advantages + values


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO: each sample's score minus its group's mean, divided by the group's std (unbiased,
    as in the GRPO paper) when ``norm_by_std``; a group of one gets advantage 0.

    Args:
        scores: ``[B]`` scalar reward per sample.
        group_ids: ``[B]`` integer group (prompt) of each sample.
    """
    advantages = torch.zeros_like(scores, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero().squeeze(-1)
        if idx.numel() < 2:
            continue
        s = scores[idx].float()
        centred = s - s.mean()
        advantages[idx] = centred / (s.std() + eps) if norm_by_std else centred
    return advantages


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's estimators).

    ``k1 = log r``; ``k2 = (log r)^2 / 2``; ``k3 = (r^-1 - 1) - log r^-1 = exp(-log r) - 1 + log r``
    with ``log r = log_probs - ref_log_probs``. All are 0 where the policies agree; k3 is
    unbiased and non-negative.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator = {kind!r} is unknown; fix: use one of {', '.join(KL_ESTIMATORS)}")
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss (to minimise) and a clipped-token indicator.

    ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = exp(logp - old)``.
    Dual clip (``dual_clip = c > 1``): for ``A < 0`` the loss is also capped at ``-c A``, so a
    huge ratio on a bad action cannot dominate.

    Returns:
        ``(loss, clipped)``: per-token loss and a 0/1 float marking tokens where a clip bound
        was active (for the clip-fraction metric).
    """
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    active = (clipped > unclipped).float()
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip = {dual_clip}: must be > 1; fix: e.g. 3.0, or null to disable")
        capped = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, capped, loss)
        active = torch.where((advantages < 0) & (capped < torch.maximum(unclipped, clipped)), torch.ones_like(active), active)
    return loss, active


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO value loss ``0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2)`` and a
    clipped-token indicator."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped = (values - returns).pow(2)
    clipped = (clipped_values - returns).pow(2)
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()
