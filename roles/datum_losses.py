"""The Tinker API's built-in losses, exactly as its documentation defines them: token SUMS over
every position of every datum (no mean anywhere, no hidden clipping, no DP scaling).

Per position ``t`` of a datum, ``lp`` is the trained policy's log-probability of the target token
(``engine_api.logprobs``: ``target_log_probs``, scored at ``t`` without a shift), ``q`` the
sampler's (``loss_fn_inputs["logprobs"]``), ``A`` the advantage and ``w`` the weight;
``r = exp(lp - q)``, ``sg`` stops the gradient:

=======================  ==============================================================  ===================
loss                     per-token term (the loss is the sum of the terms)               config (default)
=======================  ==============================================================  ===================
``cross_entropy``        ``-lp * w``  (``[T, K]`` targets: summed over the K too)        -
``importance_sampling``  ``-r * A``                                                      -
``ppo``                  ``-min(r * A, clip(r, lo, hi) * A)``                            lo 0.8, hi 1.2
``cispo``                ``-sg(clip(r, lo, hi)) * lp * A``                               lo 0.8, hi 1.2
``dro``                  ``-(lp * A - beta / 2 * (lp - q) ** 2)``                        beta 0.05
``gspo``                 ``-min(s_t * A, clip(s_t, lo, hi) * A)``, ``s_t = sg(s) * exp(lp - sg(lp))``,  lo 0.8, hi 1.2
                         ``s = exp(mean over the datum's ratio mask of sg(lp) - q)``
=======================  ==============================================================  ===================

``lo`` / ``hi`` come from ``loss_fn_config`` (``clip_low_threshold`` / ``clip_high_threshold``, on
the ratio itself: 0.8 is 1 - epsilon); a datum may also carry them per token in
``loss_fn_inputs``, which then win. GSPO's ratio mask is ``loss_fn_inputs["sequence_ratio_mask"]``
(non-zero = in the mean); without it, every position of the datum. Assumptions, where the Tinker
docs name no value: the PPO-family default thresholds (0.8, 1.2: the docs' fixed epsilon 0.2) and
DRO's default ``beta`` (0.05, the docs' example).

``stable_reinforce`` (needs the sampler's stability records, which only Tinker's own service
keeps) and server-side custom losses are refused with :class:`DatumLossError`; the SDK's
``forward_backward_custom`` works, because it runs the custom loss on the client over a forward
and a weighted ``cross_entropy``.

The functions work on the flat values of a packed batch (``offsets`` delimit the datums), so the
same code serves one datum, a micro-batch, or a DP shard: the loss is a sum, so any partition of
the datums gives the same total and the same gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from roles.objectives import POLICY_OBJECTIVES, PolicyTerms, objective_settings, policy_terms

REFUSED_LOSSES = {
    "stable_reinforce": "stable_reinforce needs the sampler's per-sequence stability records (record_stability_info), which only Tinker's own "
    "service keeps; fix: loss_fn='importance_sampling' (or ppo, cispo, gspo); with tinker-cookbook's rl_loop, whose default "
    "loss it is: rl_loop loss_fn=importance_sampling",
    "custom": "server-side custom loss graphs (create_custom_loss uploads) are not run here (no code from a request); fix: "
    "forward_backward_custom, which the SDK runs client-side over a forward and a weighted cross_entropy",
}
# loss_fn_inputs name -> the batch field it travels in (``logprobs`` would read as the engine's output).
INPUT_FIELDS = {
    "weights": "weights",
    "advantages": "advantages",
    "logprobs": "sampling_logprobs",
    "sequence_ratio_mask": "sequence_ratio_mask",
    "clip_low_threshold": "clip_low_threshold",
    "clip_high_threshold": "clip_high_threshold",
}


class DatumLossError(ValueError):
    """A loss name, input or config value the loss cannot take; the message names it and the fix."""


def check_loss(name: str, config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss's config with its defaults, after checking the name and every key and value.

    Raises:
        DatumLossError: an unknown or refused loss, an unknown config key, a non-finite value, or
            thresholds with ``lo > hi``.
    """
    if name in REFUSED_LOSSES:
        raise DatumLossError(f"loss_fn = {name!r} is not served: {REFUSED_LOSSES[name]}")
    if name not in LOSSES:
        raise DatumLossError(f"loss_fn = {name!r} is unknown; fix: use one of {', '.join(LOSSES)}")
    out = dict(LOSSES[name].config)
    for key, value in (config or {}).items():
        if key not in out:
            known = ", ".join(out) or "none"
            raise DatumLossError(f"loss_fn_config[{key!r}] is not a setting of {name} (its settings: {known}); fix: drop it")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DatumLossError(f"loss_fn_config[{key!r}] = {value!r}; fix: a finite number")
        out[key] = float(value)
    if name in POLICY_OBJECTIVES:
        try:  # the registry's checks (the ratio bounds hold 1, beta >= 0, ...)
            objective_settings(name, {SETTING_OF.get(k, k): v for k, v in out.items()}, "loss_fn_config", _TINKER_NAME)
        except ValueError as e:
            raise DatumLossError(str(e)) from None
    return out


def required_inputs(name: str) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` (besides ``target_tokens``) that ``name`` needs."""
    return LOSSES[name].required


def accepted_inputs(name: str) -> tuple[str, ...]:
    """Every ``loss_fn_inputs`` name ``name`` reads (besides ``target_tokens``)."""
    return LOSSES[name].required + LOSSES[name].optional


def per_token_terms(
    name: str, lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], offsets: torch.Tensor, config: Mapping[str, float]
) -> torch.Tensor:
    """The per-token loss terms of ``name`` (their sum is the loss), differentiable in ``lp``.

    Args:
        name: a loss of :data:`LOSSES` (checked with :func:`check_loss` first).
        lp: the target log-probs, flat ``[tokens]`` (``[tokens, K]`` for ``cross_entropy``).
        inputs: ``loss_fn_inputs`` by their Tinker names, flat in ``lp``'s token order.
        offsets: ``[datums + 1]`` boundaries of the datums in the flat order (GSPO's mean is per datum).
        config: :func:`check_loss`'s result.
    """
    if name not in LOSSES:
        raise DatumLossError(f"loss_fn = {name!r} is unknown; fix: use one of {', '.join(LOSSES)}")
    return LOSSES[name].terms(lp, inputs, offsets, config)


def _cross_entropy(lp, inputs, offsets, config) -> torch.Tensor:
    w = inputs["weights"].to(lp.dtype)
    if w.dim() < lp.dim():
        w = w[:, None]  # one weight per position for all K targets
    return -lp * w


def _objective(name: str) -> Callable[..., torch.Tensor]:
    """The datum loss of registry objective ``name`` (``roles.objectives``): its terms on the
    datum's inputs, the clip thresholds per token from the datum when given, else the config's;
    GSPO's sequences are the datums, their counted tokens ``sequence_ratio_mask`` (else all)."""

    def terms(lp, inputs, offsets, config) -> torch.Tensor:
        settings = {SETTING_OF.get(key, key): value for key, value in config.items()}
        for key in _CLIPS:
            if key in inputs:
                settings[SETTING_OF[key]] = inputs[key].to(lp.dtype)
        counted = inputs.get("sequence_ratio_mask")
        x = PolicyTerms(lp, inputs["logprobs"].to(lp.dtype), inputs["advantages"].to(lp.dtype), offsets, counted)
        return policy_terms(name, x, settings)[0]

    return terms


@dataclass(frozen=True)
class DatumLoss:
    """One loss of the registry: how its per-token terms are computed from the target log-probs
    and the datum's inputs, and what it reads.

    Attributes:
        terms: ``(lp, inputs, offsets, config) -> [tokens]`` terms (see :func:`per_token_terms`).
        required: the ``loss_fn_inputs`` it needs besides ``target_tokens``.
        optional: the ones it reads when given (per-token overrides of config values).
        config: its ``loss_fn_config`` keys and their defaults (float).
    """

    terms: Callable[..., torch.Tensor]
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: Mapping[str, float] = field(default_factory=dict)


_CLIPS = ("clip_low_threshold", "clip_high_threshold")
#: The Tinker API's config names -> the registry's setting names (``roles.objectives``).
SETTING_OF = {"clip_low_threshold": "lo", "clip_high_threshold": "hi"}
_TINKER_NAME = {setting: key for key, setting in SETTING_OF.items()}


def _from_registry(name: str, optional: tuple[str, ...] = ()) -> DatumLoss:
    """A datum loss built from the policy-objective registry: same terms, same defaults."""
    defaults = {_TINKER_NAME.get(k, k): v for k, v in POLICY_OBJECTIVES[name].settings.items() if v is not None}
    return DatumLoss(_objective(name), ("logprobs", "advantages"), optional, defaults)


# THE registry: the engine's loss (engine_loss_fn), the datum checks and the Tinker server's wire
# layer all read it, so a loss added here is served everywhere. The policy-gradient losses are
# the policy-objective registry's (roles.objectives), so the actor and the server compute the
# same terms; the PPO-family clip thresholds may come per token from the datum.
LOSSES: dict[str, DatumLoss] = {
    "cross_entropy": DatumLoss(_cross_entropy, ("weights",)),
    "importance_sampling": _from_registry("importance_sampling"),
    "ppo": _from_registry("ppo", _CLIPS),
    "cispo": _from_registry("cispo", _CLIPS),
    "dro": _from_registry("dro"),
    "gspo": _from_registry("gspo", (*_CLIPS, "sequence_ratio_mask")),
}
DATUM_LOSSES = tuple(LOSSES)  # the built-in six, in the documented order


def engine_loss_fn(name: str, config: Mapping[str, float]):
    """The engine ``LossFn`` of ``name`` for a batch built from datums (``target_ids`` and the
    :data:`INPUT_FIELDS`): the micro-batch's sum of terms, over the call's denominator (1 in the
    engine's ``sum`` mode, which a datum engine runs in). Metric ``loss:sum`` per micro-batch. A
    per-token field ``counted`` (0 on padding datums, 1 elsewhere) multiplies the terms."""

    def loss_fn(mb, out, norm):
        total = batch_loss(name, out["target_log_probs"].values(), mb, config)
        return total / norm.denominator, {"loss:sum": float(total.detach())}

    return loss_fn


def batch_loss(name: str, lp: torch.Tensor, batch, config: Mapping[str, float]) -> torch.Tensor:
    """The loss of a batch built from datums (its :data:`INPUT_FIELDS`) given its flat target
    log-probs ``lp``: the sum of :func:`per_token_terms`, each datum's terms times its per-token
    field ``counted`` when present (0 on padding datums, 1 elsewhere)."""
    inputs = {key: batch[field].values() for key, field in INPUT_FIELDS.items() if field in batch.keys()}
    terms = per_token_terms(name, lp, inputs, batch["input_ids"].offsets(), config)
    if "counted" in batch.keys():  # padding datums (DP shards of equal size) count 0
        counted = batch["counted"].values().to(terms.dtype)
        terms = terms * (counted if terms.dim() == 1 else counted[:, None])
    return terms.sum()
