"""The values of a loss request checked the same way wherever they come from: ``loss_fn_config``
(one value for every token) or per token in ``loss_fn_inputs`` (which then win). Called by the HTTP
layer before a request is queued and by ``runs.EngineRun`` before the engine is touched."""

from __future__ import annotations

import torch

from roles.datum_losses import DatumLossError, check_loss
from tinker_server.contract import DatumIn, UserError

_THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")
_FIX = "fix: 0 <= clip_low_threshold <= clip_high_threshold (e.g. 0.8 and 1.2)"


def check_loss_request(loss_fn: str, config: dict | None, datums: list[DatumIn]) -> dict[str, float]:
    """``loss_fn``'s config with its defaults, after checking it and every per-token threshold.

    Raises:
        UserError: what ``roles.datum_losses.check_loss`` refuses; DRO's ``beta`` below 0 (the
            penalty would reward moving away from the sampler); per-token thresholds (alone or with
            the config's other bound) that are negative or inverted, naming the datum and position.
    """
    try:
        out = check_loss(loss_fn, config)
    except DatumLossError as exc:
        raise UserError(str(exc)) from None
    if out.get("beta", 0.0) < 0:
        raise UserError(
            f"loss_fn_config['beta'] = {out['beta']!r}: DRO's penalty weight must be >= 0 (a negative beta rewards moving away "
            "from the sampler's log-probs); fix: e.g. 0.05"
        )
    if "clip_low_threshold" not in out:
        return out  # the loss reads no thresholds
    for i, d in enumerate(datums):
        given = {k: d.inputs[k] for k in _THRESHOLDS if k in d.inputs}
        if not given:
            continue
        n = int(d.tokens.numel())
        if any(tuple(v.shape) != (n,) for v in given.values()):
            continue  # mis-shaped: refused with its shape where the batch is built
        for key, value in given.items():
            if not bool(torch.isfinite(value.float()).all()):
                raise UserError(f"data[{i}].loss_fn_inputs[{key!r}] holds a NaN or inf; fix: finite values only")
        lo = given["clip_low_threshold"].float() if "clip_low_threshold" in given else torch.full((n,), out["clip_low_threshold"])
        hi = given["clip_high_threshold"].float() if "clip_high_threshold" in given else torch.full((n,), out["clip_high_threshold"])
        bad = ((lo < 0) | (lo > hi)).nonzero().flatten()
        if bad.numel():
            t = int(bad[0])
            where = " and ".join(f"loss_fn_inputs[{k!r}]" for k in given)
            raise UserError(
                f"data[{i}].{where} at position {t}: clip thresholds ({float(lo[t])}, {float(hi[t])}) (per token, or the "
                f"loss_fn_config / default value for the one not given); they bound the ratio itself; {_FIX}"
            )
    return out
