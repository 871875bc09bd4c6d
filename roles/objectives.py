"""The policy objectives, one registry for the actor (``actor.policy_loss``), the Tinker server's
datum losses (``roles.datum_losses``) and the docs' table (docs/recipes.md).

Each objective is per-token terms to minimise, computed from the trained log-probs ``lp`` (with
gradient), the log-probs the samples were drawn with ``q`` (the old policy's), the advantages
``A`` and the ratio ``r = exp(lp - q)``; ``sg`` stops the gradient. How the terms are summed or
averaged is the caller's: the actor aggregates with ``engine.loss_agg_mode`` over its loss mask,
the Tinker server sums every position of every datum.

=======================  ==========================================================================  ==============================
objective                per-token term                                                              source
=======================  ==========================================================================  ==============================
``ppo``                  ``max(-A r, -A clip(r, lo, hi))``; dual clip ``c``: ``min(that, -c A)``     Schulman et al. 2017; dual
                         for ``A < 0``                                                               clip: Ye et al. 2020
``gspo``                 ``ppo``'s term with ``s_t = sg(s) exp(lp - sg(lp))`` for ``r``, ``s =       Zheng et al. 2025 (GSPO)
                         exp(mean over the sequence's counted tokens of lp - q)``
``cispo``                ``-sg(clip(r, lo, hi)) A lp``: the weight clipped, every token's gradient   MiniMax-M1, 2025 (CISPO)
                         kept
``importance_sampling``  ``-r A``                                                                    REINFORCE with importance
                                                                                                     weights (Tinker)
``dro``                  ``-(lp A - beta / 2 (lp - q)^2)``                                           Tinker's ``dro`` (Richemond
                                                                                                     et al. 2024)
=======================  ==========================================================================  ==============================

One clip convention: ``lo`` and ``hi`` bound the ratio itself. The actor's config gives margins
(``actor.clip_low`` / ``clip_high``, the ratio in ``[1 - clip_low, 1 + clip_high]``, as verl's
``clip_ratio_low`` / ``clip_ratio_high``); the Tinker API gives the bounds (its
``clip_low_threshold`` / ``clip_high_threshold``, 0.8 and 1.2 for a 0.2 margin). Both reach the
same functions here with the bounds, so the same numbers give the same terms bit for bit.

GSPO's sequence is a row of the batch (a datum on the server), its counted tokens the loss mask
(the server: ``sequence_ratio_mask``, else every position); a row with none counted has ratio 1.
Differences from verl's ``core_algos`` (held by tests/roles/test_objectives.py against verl's
values): verl clamps PPO's log-ratio to [-20, 20] and GSPO's to at most 10 before ``exp`` (here:
none; a ratio that large is the rollout-correction's business), and verl's GSPO always averages
``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (here: the caller's mode; the GSPO paper's
is ``seq-mean-token-mean``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

Bound = float | torch.Tensor


@dataclass(frozen=True)
class PolicyTerms:
    """What an objective gets, flat over the tokens of a batch (``[T]``).

    Attributes:
        lp: the trained log-probs (with gradient).
        q: the sampling (old) log-probs.
        adv: the advantages.
        offsets: ``[rows + 1]`` row boundaries in the flat order (GSPO's sequences).
        counted: which tokens count in a sequence's mean (GSPO); None: all.
    """

    lp: torch.Tensor
    q: torch.Tensor
    adv: torch.Tensor
    offsets: torch.Tensor
    counted: torch.Tensor | None = None


@dataclass(frozen=True)
class PolicyObjective:
    """One objective of the registry.

    Attributes:
        terms: ``(inputs, settings) -> (terms [T], clipped [T])``: the per-token terms and a 0/1
            marker of the tokens a clip bound acted on (for ``clipfrac``; zeros where nothing
            clips).
        settings: its settings and their defaults, as the functions read them (``lo`` / ``hi``:
            the ratio bounds; ``dual_clip``: None for off; ``beta``).
        formula: the per-token term, for messages and the docs.
        source: where it is defined.
    """

    terms: Callable[[PolicyTerms, Mapping[str, object]], tuple[torch.Tensor, torch.Tensor]]
    settings: Mapping[str, object] = field(default_factory=dict)
    formula: str = ""
    source: str = ""


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, lo: Bound, hi: Bound, dual_clip: float | None = None):
    """PPO's clipped surrogate per token, ``max(-A r, -A clip(r, lo, hi))`` (capped at ``-c A``
    for ``A < 0`` with a dual clip ``c > 1``), and the 0/1 marker of tokens a bound acted on."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, lo, hi)
    loss = torch.maximum(unclipped, clipped)
    active = (clipped > unclipped).to(ratio.dtype)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip = {dual_clip}: must be > 1; fix: e.g. 3.0, or null to disable")
        capped = torch.minimum(loss, -adv * dual_clip)
        active = torch.where((adv < 0) & (capped < loss), torch.ones_like(active), active)
        loss = torch.where(adv < 0, capped, loss)
    return loss, active


def _ppo(x: PolicyTerms, s: Mapping[str, object]):
    return clipped_surrogate(torch.exp(x.lp - x.q), x.adv, s["lo"], s["hi"], s.get("dual_clip"))


def sequence_ratio(x: PolicyTerms) -> torch.Tensor:
    """GSPO's per-token ratio ``s_t = sg(s) * exp(lp - sg(lp))``: the value of the sequence's
    ratio (the exp of the mean log-ratio over its counted tokens), the gradient of the token's."""
    counted = torch.ones_like(x.lp, dtype=torch.bool) if x.counted is None else x.counted != 0
    rows = x.offsets.numel() - 1
    seq = torch.repeat_interleave(torch.arange(rows, device=x.lp.device), x.offsets[1:] - x.offsets[:-1])
    log_ratio = (x.lp.detach() - x.q) * counted
    per_seq = torch.zeros(rows, dtype=x.lp.dtype, device=x.lp.device).index_add(0, seq, log_ratio)
    count = torch.zeros(rows, dtype=x.lp.dtype, device=x.lp.device).index_add(0, seq, counted.to(x.lp.dtype))
    mean = per_seq / count.clamp(min=1)  # a sequence with nothing counted has ratio 1
    return torch.exp(mean[seq] + x.lp - x.lp.detach())


def _gspo(x: PolicyTerms, s: Mapping[str, object]):
    return clipped_surrogate(sequence_ratio(x), x.adv, s["lo"], s["hi"])


def _cispo(x: PolicyTerms, s: Mapping[str, object]):
    ratio = torch.exp(x.lp - x.q)
    weight = torch.clamp(ratio, s["lo"], s["hi"]).detach()
    return -weight * x.lp * x.adv, (weight != ratio.detach()).to(x.lp.dtype)


def _importance_sampling(x: PolicyTerms, s: Mapping[str, object]):
    return -torch.exp(x.lp - x.q) * x.adv, torch.zeros_like(x.lp)


def _dro(x: PolicyTerms, s: Mapping[str, object]):
    return -(x.lp * x.adv - 0.5 * s["beta"] * (x.lp - x.q) ** 2), torch.zeros_like(x.lp)


_CLIP = {"lo": 0.8, "hi": 1.2}
#: How the two clip conventions meet (for refusals): margins in the actor, bounds in the Tinker API.
BOUNDS_HINT = (
    "the bounds are on the ratio itself (the Tinker API's clip_low_threshold / clip_high_threshold, e.g. 0.8 and 1.2), the "
    "actor's clip_low / clip_high are margins (the ratio in [1 - clip_low, 1 + clip_high], e.g. 0.2 and 0.28)"
)
#: THE registry of policy objectives (the actor, the Tinker server, the docs' table read it).
POLICY_OBJECTIVES: dict[str, PolicyObjective] = {
    "ppo": PolicyObjective(
        _ppo, {**_CLIP, "dual_clip": None}, "max(-A r, -A clip(r, lo, hi)); dual clip c: min(that, -c A) for A < 0", "Schulman et al. 2017"
    ),
    "gspo": PolicyObjective(
        _gspo, dict(_CLIP), "ppo's term with r -> sg(s) exp(lp - sg(lp)), s = exp(mean_seq(lp - q))", "Zheng et al. 2025 (GSPO)"
    ),
    "cispo": PolicyObjective(_cispo, dict(_CLIP), "-sg(clip(r, lo, hi)) A lp", "MiniMax-M1 2025 (CISPO)"),
    "importance_sampling": PolicyObjective(_importance_sampling, {}, "-r A", "REINFORCE with importance weights"),
    "dro": PolicyObjective(_dro, {"beta": 0.05}, "-(lp A - beta/2 (lp - q)^2)", "Richemond et al. 2024 (DRO)"),
}


def objective_settings(name: str, given: Mapping[str, object], where: str, names: Mapping[str, str] | None = None) -> dict[str, object]:
    """``name``'s settings: its defaults with ``given`` over them, every key and value checked.

    ``names`` maps a setting to what the caller calls it (the Tinker API: ``lo`` ->
    ``clip_low_threshold``), for the messages. A lower bound <= 0 means no lower clip (the
    ratio is positive; verl's CISPO example uses a margin of 10).

    Raises:
        ValueError: an unknown objective or key, a non-finite number, bounds that do not hold
            the ratio 1 (``lo <= 1 <= hi``: a margin given where a bound is meant, or the
            reverse, fails here), a dual clip <= 1, a negative ``beta``; the message names
            ``where`` (the config key), the value and the fix.
    """
    names = names or {}
    if name not in POLICY_OBJECTIVES:
        raise ValueError(f"{where} = {name!r} is unknown; fix: one of {', '.join(POLICY_OBJECTIVES)}")
    out = dict(POLICY_OBJECTIVES[name].settings)
    for key, value in given.items():
        if key not in out:
            known = ", ".join(names.get(k, k) for k in out) or "none"
            raise ValueError(f"{where}: {names.get(key, key)!r} is not a setting of {name} (its settings: {known}); fix: drop it")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ValueError(f"{where}: {names.get(key, key)} = {value!r}; fix: a finite number")
        out[key] = None if value is None else float(value)
    if "lo" in out and not out["lo"] <= 1.0 <= out["hi"]:
        lo, hi = names.get("lo", "lower bound"), names.get("hi", "upper bound")
        raise ValueError(
            f"{where}: the ratio bounds ({lo} {out['lo']:g}, {hi} {out['hi']:g}) do not hold the ratio 1 (an on-policy token "
            f"would be clipped); fix: {lo} <= 1 <= {hi}; {BOUNDS_HINT}"
        )
    if out.get("dual_clip") is not None and out["dual_clip"] <= 1.0:
        raise ValueError(f"{where}: dual_clip = {out['dual_clip']!r}: must be > 1; fix: e.g. 3.0, or null")
    if out.get("beta") is not None and out["beta"] < 0:
        raise ValueError(
            f"{where}: beta = {out['beta']:g}: DRO's penalty weight must be >= 0 (a negative beta rewards moving away from the "
            "sampler's log-probs); fix: e.g. 0.05"
        )
    return out


def policy_terms(name: str, inputs: PolicyTerms, settings: Mapping[str, object]) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token terms of objective ``name`` and its clip marker (``settings`` from
    :func:`objective_settings`)."""
    return POLICY_OBJECTIVES[name].terms(inputs, settings)


def markdown_table() -> str:
    """The registry as docs/recipes.md shows it (a test holds the docs to this)."""

    def setting(key: str, value: object) -> str:
        actor = {"lo": "`actor.clip_low`", "hi": "`actor.clip_high`", "dual_clip": "`actor.dual_clip`"}
        shown = {"lo": 0.2, "hi": 0.2}.get(key, value)  # the actor's margins, not the bounds
        return f"{actor.get(key, f'`actor.policy_loss_config.{key}`')} ({'null' if shown is None else f'{shown:g}'})"

    rows = ["| `actor.policy_loss` | per-token term (to minimise) | settings (default) | source |", "|---|---|---|---|"]
    for name, o in POLICY_OBJECTIVES.items():
        settings = ", ".join(setting(k, v) for k, v in o.settings.items()) or "-"
        rows.append(f"| `{name}` | `{o.formula}` | {settings} | {o.source} |")
    return "\n".join(rows)
