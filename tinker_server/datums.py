"""Datums into the engine's batch, and the loss request's checks.

* :func:`check_loss_request`: the loss's config and per-token values, checked the same way
  wherever they come from: ``loss_fn_config`` (one value for every token) or per token in
  ``loss_fn_inputs`` (which then win). The HTTP layer runs it once per request, before the call is
  handed to a run (in process, or fanned out to Ray workers); the runs take the request as
  checked and read the config's defaults with :func:`loss_settings`.
* :func:`datums_to_batch`: the protocol batch of the datums (``input_ids``, ``target_ids`` and
  the loss's inputs), padded to a multiple of the DP size with datums that count 0.
"""

from __future__ import annotations

import torch

from roles.datum_losses import INPUT_FIELDS, LOSSES, DatumLossError, accepted_inputs, check_loss, required_inputs
from tinker_server.contract import DatumIn, UserError

_ALL_INPUTS = {"target_tokens", *INPUT_FIELDS}
_THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")
_FIX = "fix: clip_low_threshold <= 1 <= clip_high_threshold (e.g. 0.8 and 1.2)"


def check_loss_request(loss_fn: str, config: dict | None, datums: list[DatumIn]) -> dict[str, float]:
    """``loss_fn``'s config with its defaults, after checking it and every per-token threshold.

    Raises:
        UserError: what ``roles.datum_losses.check_loss`` refuses (the registry's checks, DRO's
            ``beta`` below 0 among them); per-token thresholds (alone or with the config's other
            bound) that do not hold the ratio 1, naming the datum and position.
    """
    try:
        out = check_loss(loss_fn, config)
    except DatumLossError as exc:
        raise UserError(str(exc)) from None
    if "clip_low_threshold" not in out:
        return out  # the loss reads no thresholds
    for i, d in enumerate(datums):
        _check_thresholds(i, d, out)
    return out


def _check_thresholds(i: int, d: DatumIn, config: dict[str, float]) -> None:
    """Datum ``i``'s per-token clip thresholds (with the config's value for the one not given)."""
    given = {k: d.inputs[k] for k in _THRESHOLDS if k in d.inputs}
    if not given:
        return
    n = int(d.tokens.numel())
    if any(tuple(v.shape) != (n,) for v in given.values()):
        return  # mis-shaped: refused with its shape where the batch is built
    for key, value in given.items():
        if not bool(torch.isfinite(value.float()).all()):
            raise UserError(f"data[{i}].loss_fn_inputs[{key!r}] holds a NaN or inf; fix: finite values only")
    lo = given["clip_low_threshold"].float() if "clip_low_threshold" in given else torch.full((n,), config["clip_low_threshold"])
    hi = given["clip_high_threshold"].float() if "clip_high_threshold" in given else torch.full((n,), config["clip_high_threshold"])
    bad = ((lo > 1) | (hi < 1)).nonzero().flatten()  # the bounds must hold the ratio 1 (roles.objectives)
    if bad.numel():
        t = int(bad[0])
        where = " and ".join(f"loss_fn_inputs[{k!r}]" for k in given)
        raise UserError(
            f"data[{i}].{where} at position {t}: clip thresholds ({float(lo[t])}, {float(hi[t])}) (per token, or the "
            f"loss_fn_config / default value for the one not given); they bound the ratio itself; {_FIX}"
        )


def loss_settings(loss_fn: str, config: dict | None) -> dict[str, float]:
    """``loss_fn``'s config with its defaults, for a request :func:`check_loss_request` passed
    (what it returns then; nothing is checked again)."""
    return {**LOSSES[loss_fn].config, **{key: float(value) for key, value in (config or {}).items()}}


def datums_to_batch(datums: list[DatumIn], loss_fn: str, multiple_of: int = 1):
    """The protocol batch of ``datums`` for ``loss_fn``: ``input_ids``, ``target_ids`` and the loss's
    inputs (under :data:`roles.datum_losses.INPUT_FIELDS`). Checks everything first.

    ``multiple_of`` (the DP size): one-token padding datums are appended until the count divides
    it (DP shards are equal-sized); the per-token field ``counted`` is 1 on real datums and 0 on
    padding, and the datum loss multiplies its terms by it, so padding adds exactly nothing.

    Raises:
        UserError: no datums, an empty or mis-shaped datum, a missing input, or an unknown one,
            naming the datum and the field.
    """
    from engine_api.batch import make_batch

    if not datums:
        raise UserError("data: no datums; fix: pass at least one Datum")
    wanted = accepted_inputs(loss_fn)
    fields: dict[str, list[torch.Tensor]] = {INPUT_FIELDS[k]: [] for k in wanted}
    present = None
    seqs, targets = [], []
    for i, d in enumerate(datums):
        mine = _inputs_of(i, d, loss_fn, wanted)
        if present is not None and mine != present:
            raise UserError(
                f"data[{i}].loss_fn_inputs: {sorted(mine)} but data[0] has {sorted(present)}; fix: the same inputs in every datum"
            )
        present = mine
        _check_shapes(i, d, loss_fn, mine)
        seqs.append(d.tokens.long())
        targets.append(d.inputs["target_tokens"].long())
        for key in mine:
            fields[INPUT_FIELDS[key]].append(d.inputs[key].float())
    fields = {k: v for k, v in fields.items() if v}
    counted = [torch.ones(len(t)) for t in seqs]
    while len(seqs) % multiple_of:
        seqs.append(torch.zeros(1, dtype=torch.long))
        targets.append(torch.zeros((1, *targets[0].shape[1:]), dtype=torch.long))
        for rows in fields.values():
            rows.append(torch.zeros((1, *rows[0].shape[1:])))
        counted.append(torch.zeros(1))
    return make_batch(seqs, target_ids=targets, counted=counted, **fields)


def _inputs_of(i: int, d: DatumIn, loss_fn: str, wanted: tuple[str, ...]) -> set[str]:
    """The inputs datum ``i`` gives of those ``loss_fn`` reads (``wanted``), after checking it has
    tokens, a target and the loss's required inputs, and no unknown one."""
    if int(d.tokens.numel()) == 0:
        raise UserError(f"data[{i}].model_input: empty; fix: give every datum at least one token")
    unknown = sorted(set(d.inputs) - _ALL_INPUTS)
    if unknown:
        raise UserError(f"data[{i}].loss_fn_inputs: {unknown} are not inputs of any loss; fix: drop them")
    if "target_tokens" not in d.inputs:
        raise UserError(f"data[{i}].loss_fn_inputs['target_tokens'] is missing; fix: one target token per input position")
    for key in required_inputs(loss_fn):
        if key not in d.inputs:
            raise UserError(f"data[{i}].loss_fn_inputs[{key!r}] is missing; {loss_fn} needs {list(required_inputs(loss_fn))}")
    return {k for k in wanted if k in d.inputs}


def _check_shapes(i: int, d: DatumIn, loss_fn: str, mine: set[str]) -> None:
    """Datum ``i``'s target and its inputs ``mine``: one per input position, finite."""
    n = int(d.tokens.numel())
    target = d.inputs["target_tokens"]
    k_targets = target.dim() == 2
    if target.shape[0] != n or target.dim() not in (1, 2) or (k_targets and loss_fn != "cross_entropy"):
        raise UserError(
            f"data[{i}].loss_fn_inputs['target_tokens'] has shape {list(target.shape)} for {n} input tokens; fix: [{n}]"
            + (" or [N, K] (cross_entropy only)" if loss_fn == "cross_entropy" else "")
        )
    for key in mine:
        value = d.inputs[key]
        ok = value.shape[0] == n and (value.dim() == 1 or (key == "weights" and k_targets and tuple(value.shape) == tuple(target.shape)))
        if not ok:
            raise UserError(f"data[{i}].loss_fn_inputs[{key!r}] has shape {list(value.shape)}; fix: one value per input position ([{n}])")
        if not bool(torch.isfinite(value.float()).all()):
            raise UserError(f"data[{i}].loss_fn_inputs[{key!r}] holds a NaN or inf; fix: finite values only")
