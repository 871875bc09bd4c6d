"""Reward shaping applied to a finished batch's scores before training (and before DAPO's dynamic
sampling looks at them): DAPO's overlong penalty (``reward.overlong``).

With ``L`` a trajectory's sampled tokens (single-turn: the response, its EOS included; multi-turn:
every assistant turn), ``L_max`` the length limit and ``B`` the buffer, the penalty added to its
score is ``min(0, -(L - (L_max - B)) / B * factor)``: 0 up to ``L_max - B`` tokens, then falling
linearly to ``-factor`` at ``L_max`` (DAPO, Yu et al. 2025, eq. 13; verl's ``DAPORewardManager``,
whose expression it is, not floored past ``L_max``). Metrics: ``reward/overlong_penalty`` (the mean
penalty) and ``reward/overlong_frac`` (the share of trajectories penalised); the ``reward`` metric
is the shaped score that is trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO's soft overlong penalty (``reward.overlong``; module docstring).

    Attributes:
        buffer: the buffer ``B`` in tokens before the limit where the penalty grows; 0: off.
        penalty_factor: the penalty at the limit (DAPO: 1.0).
        max_len: the limit ``L_max`` in sampled tokens; null: ``rollout.max_new_tokens``
            (single-turn only: a multi-turn run states its own, e.g. its assistant-token budget).
    """

    buffer: int = 0
    penalty_factor: float = 1.0
    max_len: int | None = None

    @property
    def enabled(self) -> bool:
        return self.buffer > 0

    def _problems(self) -> list[str]:
        out = []
        if self.buffer < 0:
            out.append(f"buffer = {self.buffer}: must be >= 0 (0: off); fix: e.g. a quarter of the length limit")
        if self.penalty_factor < 0:
            out.append(f"penalty_factor = {self.penalty_factor}: must be >= 0; fix: e.g. 1.0")
        if self.max_len is not None and self.enabled and not self.buffer < self.max_len:
            out.append(
                f"buffer = {self.buffer} with max_len = {self.max_len}: the buffer must be shorter than the limit; fix: a smaller buffer"
            )
        return out


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """Each trajectory's penalty (<= 0) for its ``lengths`` in sampled tokens (module docstring)."""
    exceed = lengths.double() - (max_len - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def trajectory_lengths(scored) -> torch.Tensor:
    """``[T]`` each trajectory's sampled tokens (over its rows) of a ``ScoredBatch``."""
    mask = scored.batch["loss_mask"]
    per_row = torch.stack([m.sum() for m in mask.unbind()]).double() if len(scored.traj_of_row) else torch.zeros(0)
    return torch.zeros(len(scored.scores), dtype=torch.float64).index_add(0, scored.traj_of_row, per_row)


def shape_overlong(scored, config: OverlongConfig, max_len: int):
    """``scored`` with the overlong penalty added to its scores and its metrics (in place)."""
    penalty = overlong_penalty(trajectory_lengths(scored), max_len, config.buffer, config.penalty_factor)
    scored.scores = (scored.scores.double() + penalty).to(scored.scores.dtype)
    scored.metrics = {
        **scored.metrics,
        "reward/overlong_penalty": float(penalty.mean()) if len(penalty) else 0.0,
        "reward/overlong_frac": float((penalty < 0).double().mean()) if len(penalty) else 0.0,
    }
    return scored
