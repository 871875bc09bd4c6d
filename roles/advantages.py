"""The advantage estimators, one registry for the RL recipes (``algo.advantage``) and the docs'
table (docs/recipes.md).

An estimator turns a batch's per-trajectory scores (and, for GAE, the critic's values) into a
per-token advantage on the sampled tokens (0 elsewhere). A trajectory may span several rows of
the batch (a multi-turn trajectory split at a history mismatch); each row's reward is its
trajectory's score, at the row's last sampled token (GAE, REINFORCE++). ``s_i`` is trajectory
``i``'s score, ``G`` its group (the ``algo.n_samples`` responses of one prompt), ``n = |G|``:

==========================  =============================================================  ==============================
estimator                   advantage of each sampled token of trajectory ``i``            source
==========================  =============================================================  ==============================
``gae``                     GAE(gamma, lambda) over the row's sampled tokens with the       Schulman et al. 2016
                            critic's values, reward ``s_i`` at the last (a critic)
``grpo``                    ``(s_i - mean_G s) / (std_G s + 1e-6)``; ``algo.norm_by_std``   Shao et al. 2024 (GRPO); no
                            false: ``s_i - mean_G s`` (Dr. GRPO)                            std: Liu et al. 2025 (Dr. GRPO)
``rloo``                    ``s_i - mean_{j in G, j != i} s_j``                             Ahmadian et al. 2024 (RLOO)
``reinforce_pp``            ``whiten(gamma^k s_i)``, ``k`` the sampled tokens after this    Hu 2025 (REINFORCE++)
                            one in its row; whitened over every sampled token of the batch
``reinforce_pp_baseline``   ``whiten(s_i - mean_G s)`` over every sampled token of the      Hu 2025 (REINFORCE++ with
                            batch                                                           baseline)
==========================  =============================================================  ==============================

``std`` is the unbiased (n - 1) deviation; ``whiten(x) = (x - mean) / sqrt(var + 1e-8)`` with the
mean and the unbiased variance over the batch's sampled tokens (a batch with fewer than 2
sampled tokens whitens to 0). Every estimator is computed on the global batch, before it is
sharded, so it is the same at any DP size and micro-batching.

Conventions where the papers leave a choice, and where they differ from verl's ``core_algos``
(held by tests/roles/test_advantages.py against verl's values on the same tensors):

* A group of one sample (a group estimator needs ``algo.n_samples >= 2``, so only a group
  thinned by dropped trajectories) has no baseline: its advantage is 0 (verl: the raw score).
* REINFORCE++'s return discounts over the row's *sampled* tokens (an observation between two
  turns neither discounts nor resets it); verl's resets the return at every unsampled position,
  so with one trailing pad block the two agree.
* GAE's advantages are not whitened (verl whitens them over the batch); its returns equal
  verl's on the sampled tokens.
* The KL penalty is a loss term (``actor.kl_coef``), not a reward term (verl's
  ``use_kl_in_reward``, which REINFORCE++ as published uses).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from roles.algos import gae_per_sequence, grpo_advantages

WHITEN_EPS = 1e-8


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator gets.

    Attributes:
        scores: ``[N]`` each trajectory's score.
        groups: ``[N]`` each trajectory's group (prompt).
        row_traj: ``[R]`` the trajectory of each row of the batch.
        mask: flat ``[tokens]`` 1 on the sampled tokens (the loss mask).
        offsets: ``[R + 1]`` the rows' boundaries in the flat order.
        values: flat ``[tokens]`` the critic's values (GAE only).
    """

    scores: torch.Tensor
    groups: torch.Tensor
    row_traj: torch.Tensor
    mask: torch.Tensor
    offsets: torch.Tensor
    values: torch.Tensor | None = None


@dataclass(frozen=True)
class AdvantageEstimator:
    """One estimator of the registry.

    Attributes:
        compute: ``(inputs, settings) -> (advantages, returns or None)``, flat per token, 0 off
            the sampled tokens (``returns``: the critic's targets, GAE only).
        critic: needs a critic (the recipe builds one).
        groups: needs groups of ``>= 2`` samples per prompt (``algo.n_samples``).
        settings: the ``algo.*`` keys it reads.
        formula, source: for the docs' table and messages.
    """

    compute: Callable[[AdvantageInputs, Mapping[str, object]], tuple[torch.Tensor, torch.Tensor | None]]
    critic: bool = False
    groups: bool = False
    settings: tuple[str, ...] = ()
    formula: str = ""
    source: str = ""


def _per_token(per_traj: torch.Tensor, x: AdvantageInputs) -> torch.Tensor:
    """A per-trajectory value on each sampled token of the trajectory's rows."""
    return torch.repeat_interleave(per_traj[x.row_traj], x.offsets.diff()) * x.mask


def group_baseline(scores: torch.Tensor, groups: torch.Tensor, leave_one_out: bool = False) -> torch.Tensor:
    """``s_i - mean_G s`` (``leave_one_out``: ``s_i - mean_{j != i} s_j = n / (n - 1) (s_i -
    mean_G s)``) per sample; 0 for a group of one (no baseline to subtract)."""
    out = torch.zeros_like(scores, dtype=torch.promote_types(scores.dtype, torch.float32))
    for g in torch.unique(groups):
        idx = (groups == g).nonzero().squeeze(-1)
        n = idx.numel()
        if n < 2:
            continue
        s = scores[idx].to(out.dtype)
        out[idx] = (s - s.mean()) * (n / (n - 1) if leave_one_out else 1.0)
    return out


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with the mean and the unbiased variance over the
    tokens of ``mask``; 0 off the mask, and 0 everywhere with fewer than 2 tokens."""
    keep = mask > 0
    n = int(keep.sum())
    if n < 2:
        return torch.zeros_like(x)
    mean = x[keep].mean()
    var = ((x[keep] - mean) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * keep.to(x.dtype)


def discounted_returns(x: AdvantageInputs, gamma: float) -> torch.Tensor:
    """Each sampled token's return ``gamma^k s``: its trajectory's score discounted by the ``k``
    sampled tokens after it in its row (the reward at the row's last sampled token)."""
    dtype = torch.promote_types(x.scores.dtype, torch.float32)
    keep = (x.mask > 0).to(dtype)
    out = torch.zeros_like(keep)
    for r in range(x.row_traj.numel()):
        a, b = int(x.offsets[r]), int(x.offsets[r + 1])
        after = keep[a:b].flip(0).cumsum(0).flip(0) - keep[a:b]  # sampled tokens after each position
        out[a:b] = x.scores[x.row_traj[r]].to(dtype) * torch.pow(torch.tensor(gamma, dtype=dtype), after) * keep[a:b]
    return out


def _gae(x: AdvantageInputs, s: Mapping[str, object]):
    if x.values is None:
        raise ValueError("algo.advantage = gae needs the critic's values; fix: build the critic (the recipe does for gae)")
    return gae_per_sequence(x.scores[x.row_traj], x.values, x.mask, x.offsets, s["gamma"], s["lam"])


def _grpo(x: AdvantageInputs, s: Mapping[str, object]):
    return _per_token(grpo_advantages(x.scores, x.groups, norm_by_std=bool(s["norm_by_std"])), x), None


def _rloo(x: AdvantageInputs, s: Mapping[str, object]):
    return _per_token(group_baseline(x.scores, x.groups, leave_one_out=True), x), None


def _reinforce_pp(x: AdvantageInputs, s: Mapping[str, object]):
    returns = discounted_returns(x, float(s["gamma"]))
    return whiten(returns, x.mask), returns


def _reinforce_pp_baseline(x: AdvantageInputs, s: Mapping[str, object]):
    return whiten(_per_token(group_baseline(x.scores, x.groups), x), x.mask), None


#: THE registry of advantage estimators (the recipes and the docs' table read it).
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(
        _gae, critic=True, settings=("gamma", "lam"), formula="GAE(gamma, lam) with the critic's values", source="Schulman et al. 2016"
    ),
    "grpo": AdvantageEstimator(
        _grpo,
        groups=True,
        settings=("norm_by_std",),
        formula="(s - mean_G s) / (std_G s + 1e-6); norm_by_std false: s - mean_G s",
        source="Shao et al. 2024 (GRPO); Liu et al. 2025 (Dr. GRPO)",
    ),
    "rloo": AdvantageEstimator(_rloo, groups=True, formula="s_i - mean_{j != i} s_j", source="Ahmadian et al. 2024 (RLOO)"),
    "reinforce_pp": AdvantageEstimator(
        _reinforce_pp, settings=("gamma",), formula="whiten(gamma^k s) over the batch's sampled tokens", source="Hu 2025 (REINFORCE++)"
    ),
    "reinforce_pp_baseline": AdvantageEstimator(
        _reinforce_pp_baseline,
        groups=True,
        formula="whiten(s - mean_G s) over the batch's sampled tokens",
        source="Hu 2025 (REINFORCE++ with baseline)",
    ),
}


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` needs a critic (an unknown name: False; the config check names it)."""
    return name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name].critic


def estimate_advantages(name: str, inputs: AdvantageInputs, settings: Mapping[str, object]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Estimator ``name``'s per-token advantages (and returns, GAE) of the batch; ``settings``
    holds the ``algo.*`` keys the estimator reads."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"algo.advantage = {name!r} is unknown; fix: one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name].compute(inputs, settings)


def markdown_table() -> str:
    """The registry as docs/recipes.md shows it (a test holds the docs to this)."""
    rows = ["| `algo.advantage` | advantage of a sampled token | keys read | needs | source |", "|---|---|---|---|---|"]
    for name, e in ADVANTAGE_ESTIMATORS.items():
        keys = ", ".join(f"`algo.{k}`" for k in e.settings) or "-"
        needs = "; ".join(["a critic (`algo.critic_lr`)"] * e.critic + ["`algo.n_samples` >= 2"] * e.groups) or "-"
        rows.append(f"| `{name}` | `{e.formula}` | {keys} | {needs} | {e.source} |")
    return "\n".join(rows)
