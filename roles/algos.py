"""Pure RL algorithm math used by the roles: advantages, KL estimators, PPO policy and value
losses, rollout (off-policy) correction. Plain tensor functions (no engine, no distributed
state), unit-tested against hand-computed cases in ``tests/roles/test_algos.py`` and
``tests/roles/test_rollout_correction.py``.

Conventions: per-token tensors are 1-D flat values of jagged fields (``x.values()``) or any
same-shape tensors; losses are returned *per token* and reduced by the caller with
``engine_api.agg_loss`` under the configured ``loss_agg_mode``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from roles.objectives import clipped_surrogate

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


def gae_per_sequence(
    scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gae` over each sequence's sampled tokens (flat per-token ``values`` and ``mask`` of a
    jagged batch with ``offsets``), the sequence's score as the reward of its last sampled
    token; ``(advantages, returns)`` flat, 0 off the sampled tokens (a sequence with none gets
    nothing)."""
    adv = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    for i in range(len(scores)):
        idx = mask[offsets[i] : offsets[i + 1]].nonzero().squeeze(-1) + offsets[i]
        if idx.numel() == 0:  # an empty response: no token to reward
            continue
        rewards = torch.zeros(len(idx), dtype=values.dtype)
        rewards[-1] = scores[i]
        a, r = gae(rewards, values[idx], gamma, lam)
        adv[idx], returns[idx] = a, r
    return adv, returns


def rollout_parity(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's sampling log-probs are from the trainer's recomputed ones
    over the response tokens (flat per-token values): mean and max of ``|trainer - rollout|``,
    and ``kl_k3`` = mean of ``exp(r) - 1 - r`` with ``r = trainer - rollout``, Schulman's k3
    estimate of KL(rollout || trainer) from the rollout's own samples."""
    keep = mask > 0
    r = (trainer - rollout)[keep].double()
    if r.numel() == 0:
        return {"rollout/logprob_abs_diff_mean": 0.0, "rollout/logprob_abs_diff_max": 0.0, "rollout/kl_k3": 0.0}
    return {
        "rollout/logprob_abs_diff_mean": float(r.abs().mean()),
        "rollout/logprob_abs_diff_max": float(r.abs().max()),
        "rollout/kl_k3": float((torch.expm1(r) - r).mean()),
    }


def no_signal_warning(step: int, n_samples: int, entropy_coef: float = 0.0, kl_coef: float = 0.0) -> str:
    """The one-time warning of a GRPO step where every prompt group had identical rewards. What
    it says about the update is what is true: without an entropy bonus or a KL term the loss and
    the gradient are exactly 0; with either, they are all that moved the policy."""
    terms = [f"the entropy bonus (actor.entropy_coef = {entropy_coef:g})"] * (entropy_coef > 0) + [
        f"the KL penalty (actor.kl_coef = {kl_coef:g})"
    ] * (kl_coef > 0)
    update = (
        f"the policy-gradient term is exactly 0, and only {' and '.join(terms)} moved the policy"
        if terms
        else "the loss and the gradient are exactly 0 and the policy did not change"
    )
    return (
        f"GRPO step {step}: every prompt group's {n_samples} responses got the same reward (frac_reward_zero_std = 1), so "
        f"every advantage is exactly 0: {update}; if this persists (see frac_reward_zero_std in the metrics) the run cannot "
        "learn from the reward: use a denser reward (partial credit), more samples per prompt (algo.n_samples), or prompts "
        "the model can sometimes solve"
    )


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


def group_reward_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """How much learning signal a step's rewards carry, per prompt group (TRL's names):

    * ``frac_reward_zero_std``: the share of groups whose rewards are all equal. Under GRPO such
      a group's advantages are exactly 0, so it adds nothing to the gradient; at 1.0 the whole
      step is a no-op (loss, grad norm and KL 0).
    * ``reward_std``: the mean over groups of the rewards' std (unbiased, as in
      :func:`grpo_advantages`).

    Groups of one sample (PPO with ``n_samples = 1``) have no spread to measure: then both are
    over the whole batch as one group.
    """
    groups = [scores[group_ids == g].double() for g in torch.unique(group_ids)]
    if all(g.numel() < 2 for g in groups):
        groups = [scores.double()]
    groups = [g for g in groups if g.numel() >= 2]
    if not groups:
        return {"frac_reward_zero_std": 1.0, "reward_std": 0.0}
    flat = [bool(g.max() == g.min()) for g in groups]
    return {"frac_reward_zero_std": sum(flat) / len(groups), "reward_std": float(torch.stack([g.std() for g in groups]).mean())}


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
    """Per-token PPO clipped surrogate loss (to minimise) and a clipped-token indicator, with the
    clip as margins (``roles.objectives.clipped_surrogate`` takes the ratio bounds).

    ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = exp(logp - old)``.
    Dual clip (``dual_clip = c > 1``): for ``A < 0`` the loss is also capped at ``-c A``, so a
    huge ratio on a bad action cannot dominate.

    Returns:
        ``(loss, clipped)``: per-token loss and a 0/1 float marking tokens where a clip bound
        was active (for the clip-fraction metric).
    """
    return clipped_surrogate(torch.exp(log_probs - old_log_probs), advantages, 1.0 - clip_low, 1.0 + clip_high, dual_clip)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO value loss ``0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2)`` and a
    clipped-token indicator."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped = (values - returns).pow(2)
    clipped = (clipped_values - returns).pow(2)
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


# ----------------------------------------------------------------------------- rollout correction
# Off-policy correction for the mismatch between the rollout engine's sampling log-probs and the
# trainer's recomputed old log-probs (docs/rollout-correction.md).

ROLLOUT_CORRECTION_MODES = ("off", "tis", "mis")
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
# Log weights are clamped to +-this before exp so a weight is always finite (exp(20) ~ 4.9e8; verl's
# SAFETY_BOUND). Truncation and masking are decided on the unclamped log weights.
_LOG_WEIGHT_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance-sampling correction of the rollout/trainer mismatch (``actor.rollout_correction``).

    With ``d_t = old_log_probs_t - rollout_log_probs_t`` on the response tokens, the weight is
    ``w_t = exp(d_t)`` (``level = token``) or, for every token of sequence ``s``,
    ``w_s = exp(sum_{t in s} d_t)`` (``level = sequence``).

    Attributes:
        mode: ``off`` (also YAML's bare ``off``, read as false); ``tis`` (truncated IS: the per-token policy-gradient loss is multiplied by
            the constant ``min(w, threshold)``; nothing is masked); ``mis`` (masked IS: tokens, or
            whole sequences at ``level = sequence``, whose weight lies outside
            ``[threshold_lower, threshold]`` leave the loss mask, also leaving the loss
            normalization's counts; kept tokens have weight 1).
        level: ``token`` or ``sequence``.
        threshold: the upper bound (TIS cap, MIS upper bound); > 0. Default 2.0 (verl's).
        threshold_lower: MIS only (ignored otherwise): the lower bound, >= 0 and below
            ``threshold``; None means ``1 / threshold`` (verl's rejection-sampling default).
            TRL's masked mode removes only weights above the cap: ``threshold_lower = 0``.
    """

    mode: str = "off"
    level: str = "token"
    threshold: float = 2.0
    threshold_lower: float | None = None

    def __post_init__(self) -> None:
        # YAML reads a bare ``off`` (in a file or a ``key=off`` override) as false, which a str
        # field receives as "False": that is ``off`` too.
        if self.mode is False or self.mode == "False":
            object.__setattr__(self, "mode", "off")

    def _problems(self) -> list[str]:
        out = []
        if self.mode not in ROLLOUT_CORRECTION_MODES:
            out.append(f"mode = {self.mode!r}: unknown; fix: use one of {', '.join(ROLLOUT_CORRECTION_MODES)}")
        if self.level not in ROLLOUT_CORRECTION_LEVELS:
            out.append(f"level = {self.level!r}: unknown; fix: use one of {', '.join(ROLLOUT_CORRECTION_LEVELS)}")
        if not self.threshold > 0:
            out.append(f"threshold = {self.threshold}: must be > 0; fix: e.g. 2.0")
            return out
        lower = self.threshold_lower
        if lower is not None:
            if not lower >= 0:
                out.append(f"threshold_lower = {lower}: must be >= 0; fix: e.g. 0 (mask only above threshold), or null for 1/threshold")
            elif lower >= self.threshold:
                out.append(
                    f"threshold_lower = {lower}: must be below threshold = {self.threshold}; fix: a smaller value, or null for 1/threshold"
                )
        elif self.mode == "mis" and self.threshold <= 1:
            out.append(
                f"threshold = {self.threshold}: with threshold_lower = null the MIS lower bound 1/threshold = {1 / self.threshold:g} "
                "is not below it; fix: use a threshold > 1, or set threshold_lower below threshold"
            )
        return out

    def lower_bound(self) -> float:
        """The MIS lower bound: ``threshold_lower``, or ``1 / threshold`` when it is None."""
        return 1.0 / self.threshold if self.threshold_lower is None else self.threshold_lower

    def verl_keys(self) -> dict[str, Any]:
        """The same correction in verl 0.9.1's ``algorithm.rollout_correction`` keys (decoupled
        mode, ``bypass_mode: false``), for a user moving a config between the two.

        TIS is ``rollout_is: token | sequence`` with ``rollout_is_threshold`` the cap (a single
        number: verl's ``"L_U"`` string there is IcePop, which zeroes weights outside the band but
        keeps the raw weights inside it: neither TIS nor MIS). MIS is verl's rejection sampling
        with the k1 statistic, ``token_k1`` / ``seq_sum_k1``, whose threshold ``"L_U"`` bounds
        ``-d = log(pi_rollout / pi_old)``, the inverse of ``w`` here: ``[threshold_lower,
        threshold]`` on ``w`` is ``"{1/threshold}_{1/threshold_lower}"`` in verl (so a band
        ported digit for digit masks other tokens). verl 0.9.1 has no
        ``rollout_rs_threshold_lower`` key; ``threshold_lower = 0`` (TRL's mask above the cap
        only) is ``"{1/threshold}_inf"``."""
        if self.mode == "off":
            return {"rollout_is": None, "rollout_rs": None}
        if self.mode == "tis":
            return {
                "rollout_is": self.level,
                "rollout_is_threshold": float(self.threshold),
                "rollout_is_batch_normalize": False,
                "rollout_rs": None,
            }
        lower = self.lower_bound()
        upper_k1 = math.inf if lower == 0 else 1.0 / lower
        return {
            "rollout_is": None,
            "rollout_rs": "token_k1" if self.level == "token" else "seq_sum_k1",
            "rollout_rs_threshold": f"{1.0 / self.threshold!r}_{upper_k1!r}",
        }


def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    offsets: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rollout-correction weights and loss mask of a batch (see :class:`RolloutCorrectionConfig`).

    Args:
        old_log_probs, rollout_log_probs, mask: flat per-token values (``x.values()`` of the
            batch's jagged fields); ``mask > 0`` marks the response tokens.
        offsets: ``[B + 1]`` sequence offsets into the flat values (``input_ids.offsets()``).
        config: mode, level and bounds.

    Returns:
        ``(weights, new_mask, metrics)``, all detached (the weights are constants of the loss):

        - ``weights``: the applied per-token multiplier, 0 off the response tokens. TIS:
          ``min(w, threshold)``; MIS: 1 on kept tokens, 0 on removed ones; off: 1 on the
          response tokens.
        - ``new_mask``: ``mask`` with the MIS-removed tokens set to 0 (``mask`` itself otherwise).
        - ``metrics`` (floats over the response tokens of ``mask``; empty when off):
          ``rollout_correction/weight_mean`` and ``weight_max`` of the applied weights (under
          TIS, ``weight_mean`` is verl 0.9.1's ``rollout_is_mean``: the mean of the truncated weights),
          ``raw_weight_mean`` and ``raw_weight_max`` of ``w`` before truncation or masking (its
          log clamped at +-20), ``truncated_frac`` (TIS: share with ``w > threshold``; else 0),
          ``masked_frac`` (MIS: share removed; else 0).

    Raises:
        ValueError: an invalid ``config`` (its ``_problems``), or a non-finite old or rollout
            log-prob on a response token: its weight would be NaN, which MIS's bounds cannot
            see (every comparison with NaN is false, so the token would be kept) and TIS would
            turn into a NaN loss.
    """
    problems = config._problems()
    if problems:
        raise ValueError("rollout correction: " + "; ".join(problems))
    response = mask.detach() > 0
    if config.mode == "off":
        return response.to(torch.float32), mask, {}
    for field, values in (("rollout_log_probs", rollout_log_probs), ("old_log_probs", old_log_probs)):
        bad = response & ~torch.isfinite(values.detach())
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            sequence = int(torch.searchsorted(offsets.to(bad.device), torch.tensor(first, device=bad.device), right=True)) - 1
            raise ValueError(
                f"rollout correction (mode = {config.mode}): {field} has {int(bad.sum())} non-finite value(s) on response tokens "
                f"(first: sequence {sequence}, value {float(values[first])}); the importance weights would be NaN; fix: "
                + (
                    "check the rollout engine: NaN log-probs come from non-finite weights or logits"
                    if field == "rollout_log_probs"
                    else "the policy's own log-probs are non-finite: check the trainer's weights"
                )
            )
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    log_w = torch.where(response, old_log_probs.detach().to(dtype) - rollout_log_probs.detach().to(dtype), 0.0)
    if config.level == "sequence":
        lengths = (offsets[1:] - offsets[:-1]).to(log_w.device)
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=log_w.device), lengths)
        log_w = torch.zeros(lengths.numel(), dtype=dtype, device=log_w.device).index_add(0, seq, log_w)[seq]
    raw = torch.where(response, torch.exp(log_w.clamp(-_LOG_WEIGHT_BOUND, _LOG_WEIGHT_BOUND)), 0.0)
    zero = torch.zeros((), dtype=dtype, device=log_w.device)
    if config.mode == "tis":
        weights = raw.clamp(max=config.threshold)
        above = response & (log_w > math.log(config.threshold))
        new_mask, truncated, removed = mask, above, zero
    else:
        # The band in verl 0.9.1's terms (``verl_keys``: ``token_k1`` / ``seq_sum_k1``) and in its
        # precision: ``k1 = -log_w`` in the log weights' dtype against the bounds' logs taken in
        # Python floats (double), ``lower_k1 <= k1 <= upper_k1``, inclusive. A log of the bound in
        # fp32 (``torch.tensor(2 / 3).log()``) is one ulp off fp32(log(2/3)) and removed a token
        # sitting exactly on the bound that verl keeps.
        lower = config.lower_bound()
        k1 = -log_w
        keep = (k1 >= math.log(1.0 / config.threshold)) & (k1 <= (math.inf if lower == 0 else math.log(1.0 / lower)))
        outside = response & ~keep
        new_mask = mask * (~outside).to(mask.dtype)
        weights = (response & ~outside).to(dtype)
        truncated, removed = zero, outside
    count = response.sum().clamp(min=1).to(dtype)
    none = zero.new_full((), -1.0)  # max over no token: reported as 0 below
    stats = torch.stack(
        [
            weights.sum() / count,
            torch.where(response, weights, none).max() if weights.numel() else none,
            raw.sum() / count,
            torch.where(response, raw, none).max() if raw.numel() else none,
            truncated.sum() / count,
            removed.sum() / count,
        ]
    ).tolist()
    names = ("weight_mean", "weight_max", "raw_weight_mean", "raw_weight_max", "truncated_frac", "masked_frac")
    metrics = {f"rollout_correction/{n}": max(v, 0.0) for n, v in zip(names, stats, strict=True)}
    return weights, new_mask, metrics
