"""Preference objectives (DPO and its family) and the ``PreferencePolicy`` role that trains them
on ``BaseEngine`` calls only.

A batch holds pairs as consecutive rows: row ``2i`` the chosen response to prompt ``i``, row
``2i + 1`` the rejected one (the same prompt tokens), ``loss_mask`` on the response tokens only.
Per row ``S`` is the policy's summed log-prob of its response, ``R`` the reference's, ``n`` its
response tokens. A loss is a function of one pair's ``(S_c, S_r, R_c, R_r, n_c, n_r)`` with
settings; the batch loss is the mean over pairs.

**Exact under any split.** A pair's loss is not linear in its rows' log-probs, so a micro-batch or
a data-parallel rank holding one row of a pair cannot compute its share alone. The role therefore
takes two passes per optimizer step: a forward-only pass gives every row's ``S`` (eval mode, the
global batch), the pair losses and their derivatives ``g = dL_pair / dS`` (by autograd on those
scalars, so every registered loss gets its exact weights, length normalisation included); then
the training pass minimises the per-token surrogate ``sum_rows g_row * S_row / pairs``, linear in
the log-probs, whose gradient is exactly the DPO loss's. The engine reduces it as any loss
(``engine.loss_agg_mode: seq-mean-token-sum``: the sequence count is twice the pair count), so the
step is the same at any micro-batching, dynamic batching, DP size or split over calls. The cost is
one forward-only pass per step (TRL's DPOTrainer takes one policy forward; the reference pass is
the same in both). Assumption: the margins come from the eval-mode forward, so a model with
dropout trains with dropout-free margins (TRL disables dropout for DPO by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from engine_api import BaseEngine, agg_loss
from engine_api.batch import attach
from roles.common import TrainableRole, infer_global

#: The per-token field of the training pass: each row's ``g`` (``dL_pair / dS_row``) on its tokens.
PAIR_WEIGHTS = "pair_weights"
#: The engine mode the surrogate needs: sum over a row's tokens, mean over rows (2 per pair).
AGG_MODE = "seq-mean-token-sum"


@dataclass(frozen=True)
class PairSums:
    """One batch's pairs: policy sums ``chosen`` / ``rejected`` ``[P]`` (the tensors the loss is
    differentiated in), the reference's (``ref_*``, zeros for a reference-free loss) and the
    response lengths ``n_*`` (float)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    n_chosen: torch.Tensor
    n_rejected: torch.Tensor


# A loss: (pairs, settings) -> (per-pair loss, chosen reward, rejected reward), differentiable in the
# policy sums; the rewards are the implicit rewards TRL logs (beta times the policy's log-ratio).
LossFormula = Callable[[PairSums, dict[str, float]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PreferenceLoss:
    """A registry entry: the formula, whether it reads a reference model, its settings with
    defaults, and where it comes from."""

    formula: LossFormula
    uses_reference: bool
    settings: dict[str, float]
    math: str
    source: str


def _sigmoid(p: PairSums, s: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rc, rr = s["beta"] * (p.chosen - p.ref_chosen), s["beta"] * (p.rejected - p.ref_rejected)
    eps = s["label_smoothing"]
    loss = -(1 - eps) * F.logsigmoid(rc - rr) - eps * F.logsigmoid(rr - rc)
    return loss, rc, rr


def _ipo(p: PairSums, s: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # TRL's IPO: per-token mean log-ratios (its concatenated_forward divides by the lengths for ipo).
    hc, hr = (p.chosen - p.ref_chosen) / p.n_chosen, (p.rejected - p.ref_rejected) / p.n_rejected
    loss = (hc - hr - 1 / (2 * s["beta"])) ** 2
    return loss, s["beta"] * hc, s["beta"] * hr


def _simpo(p: PairSums, s: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rc, rr = s["beta"] * p.chosen / p.n_chosen, s["beta"] * p.rejected / p.n_rejected
    eps = s["label_smoothing"]
    margin = rc - rr - s["gamma"]
    loss = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
    return loss, rc, rr


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": PreferenceLoss(
        _sigmoid,
        True,
        {"beta": 0.1, "label_smoothing": 0.0},
        "-(1-e) log s(b((S_c-R_c)-(S_r-R_r))) - e log s(-b(...))",
        "DPO, Rafailov et al. 2023 (label smoothing: cDPO); TRL DPOTrainer loss_type sigmoid",
    ),
    "ipo": PreferenceLoss(
        _ipo,
        True,
        {"beta": 0.1},
        "((S_c-R_c)/n_c - (S_r-R_r)/n_r - 1/(2b))^2",
        "IPO, Azar et al. 2023; TRL DPOTrainer loss_type ipo (per-token mean log-ratios)",
    ),
    "simpo": PreferenceLoss(
        _simpo,
        False,
        {"beta": 2.0, "gamma": 0.5, "label_smoothing": 0.0},
        "-log s(b S_c/n_c - b S_r/n_r - gamma) (no reference)",
        "SimPO, Meng et al. 2024; TRL CPOTrainer loss_type simpo (simpo_gamma = gamma)",
    ),
}


def loss_settings(name: str, given: dict[str, Any], owner: str = "dpo") -> dict[str, float]:
    """The registry's defaults for loss ``name`` updated by ``given``, checked.

    Raises:
        ValueError: an unknown loss or setting, or a value out of range, naming the key."""
    if name not in PREFERENCE_LOSSES:
        raise ValueError(f"{owner}.loss = {name!r}: unknown; fix: use one of {', '.join(PREFERENCE_LOSSES)}")
    defaults = PREFERENCE_LOSSES[name].settings
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{owner}: {unknown} are not settings of loss {name!r} (it has {sorted(defaults)}); fix: drop them")
    out = {**defaults, **{k: float(v) for k, v in given.items()}}
    if not out["beta"] > 0:
        raise ValueError(f"{owner}.beta = {out['beta']}: must be > 0; fix: e.g. {defaults['beta']}")
    if "label_smoothing" in out and not 0 <= out["label_smoothing"] < 0.5:
        raise ValueError(f"{owner}.label_smoothing = {out['label_smoothing']}: must be in [0, 0.5); fix: 0 (plain DPO)")
    return out


def pair_sums(log_probs: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a packed batch: the masked log-prob sum and the response length, float64."""
    rows = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff())
    n = offsets.numel() - 1
    sums = torch.zeros(n, dtype=torch.float64).index_add(0, rows, (log_probs.double() * mask.double()))
    lengths = torch.zeros(n, dtype=torch.float64).index_add(0, rows, mask.double())
    return sums, lengths


@dataclass(frozen=True)
class PairValues:
    """Per pair of a batch: the loss and the implicit rewards of both sides ``[P]`` (float64)."""

    loss: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor


def pair_objective(
    name: str,
    settings: dict[str, float],
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    lengths: torch.Tensor,
    sft_weight: float = 0.0,
) -> tuple[PairValues, torch.Tensor]:
    """The batch's pair values and the per-row weights of the training pass.

    Args:
        policy, reference: per-row response sums ``[2P]`` (rows ``2i`` chosen, ``2i + 1``
            rejected); ``reference`` None for a reference-free loss.
        lengths: per-row response token counts ``[2P]``.
        sft_weight: adds ``sft_weight * (-S_c / n_c)`` to each pair's loss (the chosen
            response's mean token NLL; NeMo-RL's ``sft_loss_weight``, TRL's ``rpo_alpha`` with a
            per-pair mean); 0: none.

    Returns:
        ``(values, weights [2P])``: ``weights[row] = 2 dL_pair / dS_row`` (the engine's mean over
        rows is then the mean over pairs: module docstring)."""
    entry = PREFERENCE_LOSSES[name]
    s = policy.detach().double().clone().requires_grad_(True)
    ref = reference.double() if entry.uses_reference else torch.zeros_like(s)
    sums = PairSums(s[0::2], s[1::2], ref[0::2], ref[1::2], lengths[0::2].double(), lengths[1::2].double())
    loss, rc, rr = entry.formula(sums, settings)
    if sft_weight:  # NeMo-RL's sft_loss_weight: the chosen response's per-token NLL, per pair
        loss = loss - sft_weight * sums.chosen / sums.n_chosen
    (grad,) = torch.autograd.grad(loss.sum(), s)
    return PairValues(loss.detach(), rc.detach(), rr.detach()), 2.0 * grad


@dataclass
class PairTotals:
    """Sums of :class:`PairValues` over batches, for exact means over every pair."""

    pairs: int = 0
    loss: float = 0.0
    chosen: float = 0.0
    rejected: float = 0.0
    correct: float = 0.0

    def add(self, v: PairValues) -> PairTotals:
        self.pairs += int(v.loss.numel())
        self.loss += float(v.loss.sum())
        self.chosen += float(v.chosen.sum())
        self.rejected += float(v.rejected.sum())
        self.correct += float((v.chosen > v.rejected).double().sum())
        return self

    def metrics(self) -> dict[str, float]:
        """``dpo/loss``, ``dpo/rewards_chosen``, ``dpo/rewards_rejected``, ``dpo/margin`` (their
        difference) and ``dpo/accuracy`` (the share of pairs whose chosen reward is higher)."""
        n = max(self.pairs, 1)
        return {
            "dpo/loss": self.loss / n,
            "dpo/rewards_chosen": self.chosen / n,
            "dpo/rewards_rejected": self.rejected / n,
            "dpo/margin": (self.chosen - self.rejected) / n,
            "dpo/accuracy": self.correct / n,
        }


def surrogate_loss(mb: TensorDict, out: TensorDict, norm) -> tuple[torch.Tensor, dict[str, float]]:
    """The training pass's loss: ``sum_t g_row * log_prob_t`` over response tokens, aggregated by
    the engine's ``seq-mean-token-sum`` (a sum per row, a mean over rows): its gradient is the
    pair losses' mean (module docstring). Its value is not the DPO loss (``dpo/loss`` is)."""
    mask = mb["loss_mask"]
    per_token = mb[PAIR_WEIGHTS].values() * out["log_probs"].values()
    return agg_loss(per_token, mask, norm), {}


@dataclass(frozen=True)
class PreferenceConfig:
    """The ``dpo`` section.

    Attributes:
        loss: a name of :data:`PREFERENCE_LOSSES` (``sigmoid``: DPO; ``ipo``; ``simpo``).
        beta: the loss's temperature (null: the registry's default for the loss).
        label_smoothing: cDPO's / SimPO's label noise in [0, 0.5) (``sigmoid`` and ``simpo``).
        gamma: SimPO's target margin (``simpo`` only; null: 0.5).
        sft_weight: the weight of an NLL term on the chosen response (its per-token mean, per
            pair; NeMo-RL's ``sft_loss_weight``), which keeps the chosen likelihood from falling
            with the rejected one; 0: none.
    """

    loss: str = "sigmoid"
    beta: float | None = None
    label_smoothing: float = 0.0
    gamma: float | None = None
    sft_weight: float = 0.0

    def settings(self) -> dict[str, float]:
        """The checked settings of the loss (``loss_settings``).

        Raises:
            ValueError: a setting the loss does not have (``gamma`` outside ``simpo``, label
                smoothing for ``ipo``) or a value out of range."""
        given: dict[str, Any] = {}
        if self.beta is not None:
            given["beta"] = self.beta
        if self.label_smoothing:
            given["label_smoothing"] = self.label_smoothing
        if self.gamma is not None:
            given["gamma"] = self.gamma
        return loss_settings(self.loss, given)

    def _problems(self) -> list[str]:
        out = [] if self.sft_weight >= 0 else [f"sft_weight = {self.sft_weight}: must be >= 0; fix: 0 (none) or e.g. 1.0"]
        try:
            self.settings()
        except ValueError as exc:
            out.append(str(exc).removeprefix("dpo: ").removeprefix("dpo."))
        return out

    @property
    def uses_reference(self) -> bool:
        return self.loss in PREFERENCE_LOSSES and PREFERENCE_LOSSES[self.loss].uses_reference


class PreferencePolicy(TrainableRole):
    """The policy a preference loss trains: an engine plus :class:`PreferenceConfig`.

    Args:
        engine: the policy's engine (``loss_agg_mode`` must be ``seq-mean-token-sum``).
        config: the loss.
        reference: the reference's log-probs (``roles.reference.Reference``), or None for a
            reference-free loss.
    """

    def __init__(self, engine: BaseEngine, config: PreferenceConfig, reference=None) -> None:
        if engine.config.loss_agg_mode != AGG_MODE:
            raise ValueError(
                f"engine.loss_agg_mode = {engine.config.loss_agg_mode}: a preference loss is a mean over pairs, taken as the mean "
                f"over rows of each row's token sum; fix: engine.loss_agg_mode={AGG_MODE}"
            )
        if config.uses_reference and reference is None:
            raise ValueError(f"dpo.loss = {config.loss} reads a reference model and none was given; fix: pass the Reference")
        self.engine, self.config, self.reference = engine, config, reference
        self.settings = config.settings()
        engine.set_loss_fn(surrogate_loss)

    def reference_sums(self, batch: TensorDict) -> torch.Tensor | None:
        """Per-row reference sums of the global ``batch`` (None for a reference-free loss)."""
        if not self.config.uses_reference:
            return None
        out = self.reference.compute_log_probs(batch)["log_probs"]
        return pair_sums(out.values(), batch["loss_mask"].values(), batch["input_ids"].offsets())[0]

    def _pairs(self, batch: TensorDict, reference: torch.Tensor | None) -> tuple[PairValues, torch.Tensor]:
        if batch.batch_size[0] % 2:
            raise ValueError(f"a preference batch has {batch.batch_size[0]} rows; fix: pairs as consecutive rows (chosen, rejected)")
        mask, offsets = batch["loss_mask"].values(), batch["input_ids"].offsets()
        policy, lengths = pair_sums(infer_global(self.engine, batch)["log_probs"].values(), mask, offsets)
        if reference is None:
            reference = self.reference_sums(batch)
        return pair_objective(self.config.loss, self.settings, policy, reference, lengths, self.config.sft_weight)

    def pair_values(self, batch: TensorDict, reference: torch.Tensor | None = None) -> PairValues:
        """The pairs' losses and rewards of the global ``batch`` under the current weights (one
        forward-only pass; ``reference``: precomputed :meth:`reference_sums`). Collective."""
        return self._pairs(batch, reference)[0]

    def update(self, batch: TensorDict, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """One optimizer step on the global ``batch``: the forward-only pass for the weights,
        then ``train_batch`` on the surrogate. Returns the engine's step metrics (``grad_norm``,
        ``lr``, ``step_skipped``) with the pairs' ``dpo/*`` (before the step). Collective."""
        values, weights = self._pairs(batch, reference)
        rows = batch["input_ids"].offsets().diff()
        train = attach(batch.copy(), **{PAIR_WEIGHTS: torch.repeat_interleave(weights.float(), rows)})
        with self.engine.train_mode():
            step = self.engine.train_batch(self.engine.shard_data(train))
        step.pop("loss", None)  # the surrogate's value, not a loss anyone reads
        return {**step, **PairTotals().add(values).metrics()}


def markdown_table() -> str:
    """The docs' table of the registry (docs/recipes.md holds it; a test keeps them equal)."""
    lines = ["| `dpo.loss` | loss per pair | settings (defaults) | reference | source |", "|---|---|---|---|---|"]
    for name, e in PREFERENCE_LOSSES.items():
        settings = ", ".join(f"`{k}` {v:g}" for k, v in e.settings.items())
        lines.append(f"| `{name}` | `{e.math}` | {settings} | {'yes' if e.uses_reference else 'no'} | {e.source} |")
    return "\n".join(lines)
