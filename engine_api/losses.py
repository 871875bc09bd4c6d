"""Loss aggregation and normalization (docs/design.md, section 4).

A loss function computes a per-token loss ``l`` and reduces it with :func:`agg_loss`, which
divides the micro-batch's *numerator* by a *global* denominator carried in a
:class:`NormContext`. The engine builds that context once per ``forward_backward_step`` from
the whole call's loss mask, all-reduced over the data-parallel group, so the sum of the
micro-batch contributions over all micro-batches and all DP ranks is exactly the loss of the
global batch, whatever the micro-batching. Modes over a global batch ``B`` with mask ``m``:

=============================  ============================================  ================
mode                           loss                                          denominator
=============================  ============================================  ================
``token-mean``                 sum(m*l) / sum(m)                             tokens
``seq-mean-token-mean``        mean over sequences of sum_t(m*l) / sum_t(m)  sequences
``seq-mean-token-sum``         mean over sequences of sum_t(m*l)             sequences
``seq-mean-token-sum-norm``    sum(m*l) / (|B| * C)                          sequences * C
``sum``                        sum(m*l)                                      1
=============================  ============================================  ================

``sum`` is the Tinker API's reduction (every loss there is a sum over tokens and datums, no
mean anywhere): the gradient of a step is the gradient of the plain sum, so it grows with the
batch, and a batch whose mask selects nothing is a valid zero loss rather than 0/0.

Assumption (documented in docs/design.md, section 10): ``|B|`` counts the sequences that have at least one
token in the loss mask; a sequence with an empty mask contributes nothing to any mode.

Two engine-side corrections turn these contributions into the right gradient:

* DP averaging: DDP and FSDP *average* gradients over the DP group, but the contributions
  are already normalised globally, so the engine multiplies the backward loss by
  :func:`dp_grad_compensation` to turn the average back into a sum.
* Deferred mode (``engine.deferred_normalization``): the global batch may arrive over several
  ``forward_backward_step`` calls. The loss function still sees the call's own context (its
  metrics stay meaningful), the engine multiplies the backward loss by the call's denominator
  (leaving unnormalised sums in the gradient) and accumulates the counts in a
  :class:`DeferredNormalizer`; ``optimizer_step`` scales the gradient by
  ``1 / accumulated denominator``. Denominators are linear in the counts, so any split of the
  global batch gives the same gradient.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from engine_api.dist import all_reduce, comm_device, group_size

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum")


@dataclass(frozen=True)
class NormCounts:
    """Counts that the denominators are built from.

    Attributes:
        tokens: number of tokens in the loss mask.
        seqs: number of sequences with at least one token in the loss mask.
    """

    tokens: float
    seqs: float

    def __add__(self, other: NormCounts) -> NormCounts:
        return NormCounts(self.tokens + other.tokens, self.seqs + other.seqs)

    @classmethod
    def from_mask(cls, loss_mask: torch.Tensor) -> NormCounts:
        """Local counts of a jagged ``loss_mask`` (one row per sequence)."""
        values, offsets = _flat(loss_mask)
        per_seq = _segment_sum(values.to(torch.float64), offsets)
        return cls(tokens=float(per_seq.sum()), seqs=float((per_seq > 0).sum()))

    def all_reduce(self, group: dist.ProcessGroup | None) -> NormCounts:
        """Sum the counts over ``group``: every rank gets the global counts.

        One float64 all-reduce of two numbers; float64 keeps token counts exact far beyond
        any realistic global batch.
        """
        if group_size(group) == 1:
            return self
        buf = torch.tensor([self.tokens, self.seqs], dtype=torch.float64, device=comm_device(group))
        all_reduce(buf, "sum", group)
        return NormCounts(tokens=float(buf[0]), seqs=float(buf[1]))


def denominator(mode: str, counts: NormCounts, constant: float | None = None) -> float:
    """The global denominator of ``mode`` for ``counts`` (``constant`` is C of the -norm mode)."""
    _check_mode(mode)
    if mode == "sum":
        return 1.0
    if mode == "token-mean":
        return counts.tokens
    if mode == "seq-mean-token-sum-norm":
        if constant is None or constant <= 0:
            raise ValueError(
                f"loss_agg_constant = {constant!r}: seq-mean-token-sum-norm needs a positive "
                "constant C; fix: set engine.loss_agg_constant (e.g. the max response length)"
            )
        return counts.seqs * constant
    return counts.seqs


@dataclass(frozen=True)
class NormContext:
    """What a loss function needs to turn its micro-batch into a global-batch contribution.

    Attributes:
        mode: one of :data:`AGG_MODES`.
        counts: global counts of the ``forward_backward_step`` call (all DP ranks).
        denominator: ``denominator(mode, counts, constant)``; never zero.
        dp_size: size of the data-parallel group the counts were reduced over.
        constant: C of ``seq-mean-token-sum-norm`` (None for the other modes).
    """

    mode: str
    counts: NormCounts
    denominator: float
    dp_size: int
    constant: float | None = None


def build_norm_context(
    loss_mask: torch.Tensor,
    mode: str,
    group: dist.ProcessGroup | None,
    constant: float | None = None,
) -> NormContext:
    """Build the context for one ``forward_backward_step`` call from its (local) loss mask.

    Collective over ``group``: every DP rank must call it once per call, with its own shard.

    Raises:
        ValueError: the mask selects no token on any rank (the loss would be 0/0). Every
            rank sees the same global counts, so every rank raises, before any backward.
    """
    counts = NormCounts.from_mask(loss_mask).all_reduce(group)
    denom = denominator(mode, counts, constant)
    if denom <= 0:
        raise ValueError(
            f"loss_mask selects no token in the global batch (all ranks): sum(loss_mask) = {counts.tokens:g}, "
            f"{counts.seqs:g} sequences with a loss token, so the loss would be 0/0; "
            "fix: drop fully masked batches before training or set loss_mask on the response tokens"
        )
    return NormContext(mode=mode, counts=counts, denominator=denom, dp_size=group_size(group), constant=constant)


def agg_numerator(loss: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Sum of ``mode``'s per-unit terms over one micro-batch (differentiable in ``loss``).

    ``loss`` and ``loss_mask`` are jagged (or flat values sharing ``loss_mask``'s layout).
    For ``seq-mean-token-mean`` the unit is a sequence's masked token mean; otherwise the
    masked token sum.
    """
    _check_mode(mode)
    mask, mask_offsets = _flat(loss_mask)
    if not loss.is_nested and loss_mask.is_nested:
        # Flat per-token values in the mask's layout: no jagged op on the autograd path (each
        # costs a Python-level dispatch in forward and in backward). A wrong shape fails below.
        values, offsets = loss, mask_offsets
    else:
        values, offsets = _flat(loss)
    # Fields that share one offsets tensor need no comparison (torch.equal syncs on GPU).
    if values.shape != mask.shape or (offsets is not mask_offsets and not torch.equal(offsets, mask_offsets)):
        raise ValueError(
            f"loss has layout {tuple(values.shape)} / offsets {offsets.tolist()} but loss_mask has "
            f"{tuple(mask.shape)} / {mask_offsets.tolist()}; fix: compute the loss on the micro-batch's tokens"
        )
    weighted = values * mask.to(values.dtype)
    if mode != "seq-mean-token-mean":
        return weighted.sum()
    seq_sums = _segment_sum(weighted, offsets)
    seq_tokens = _segment_sum(mask.to(values.dtype), offsets)
    # Sequences with an empty mask contribute 0 (their sum is 0; clamp avoids 0/0).
    return (seq_sums / seq_tokens.clamp(min=1)).sum()


def agg_loss(loss: torch.Tensor, loss_mask: torch.Tensor, norm: NormContext) -> torch.Tensor:
    """The micro-batch's contribution to the global-batch loss: numerator / global denominator."""
    return agg_numerator(loss, loss_mask, norm.mode) / norm.denominator


def dp_grad_compensation(dp_size: int) -> float:
    """Factor that undoes DDP/FSDP gradient *averaging* over ``dp_size`` ranks.

    Contributions are already divided by the global denominator, so the DP reduction must
    be a sum; backends that average multiply the backward loss by this factor.
    """
    return float(dp_size)


def backward_scale(norm: NormContext, deferred: bool, grads_averaged_over_dp: bool = True, reduce_ranks: int | None = None) -> float:
    """Factor an engine multiplies a micro-batch's contribution by before ``backward()``.

    Args:
        norm: the call's context.
        deferred: deferred mode keeps unnormalised sums in the gradient (multiply back the
            call's denominator); :class:`DeferredNormalizer` divides at ``optimizer_step``.
        grads_averaged_over_dp: whether the backend's gradient reduction averages over DP.
        reduce_ranks: how many ranks that average runs over, when not the DP group's size
            (sequence parallelism: each rank of an SP group holds part of its DP shard's
            gradient, and the reduction averages over DP x SP ranks).
    """
    scale = dp_grad_compensation(reduce_ranks or norm.dp_size) if grads_averaged_over_dp else 1.0
    return scale * norm.denominator if deferred else scale


class DeferredNormalizer:
    """The bookkeeping of one accumulation window (the calls between two optimizer steps).

    * Deferred mode: the engine calls :meth:`add` once per ``forward_backward_step`` with the
      call's global counts and :meth:`grad_scale` in ``optimizer_step``.
    * Every mode: :meth:`note_loss` records each training call's global loss, so
      ``optimizer_step`` can skip a window whose loss was not finite even when its gradient is
      (e.g. a NaN in a masked-out position of a per-token loss).

    :meth:`reset` starts a new window (``optimizer_step`` and ``optimizer_zero_grad``, so an
    aborted window leaves no counts behind).
    """

    def __init__(self, mode: str, constant: float | None = None) -> None:
        _check_mode(mode)
        self.mode = mode
        self.constant = constant
        self.counts = NormCounts(0.0, 0.0)
        self.calls = 0
        self.nonfinite_loss = False

    def add(self, counts: NormCounts) -> None:
        """Add one call's global counts to the window."""
        self.counts = self.counts + counts
        self.calls += 1

    def note_loss(self, loss: float) -> None:
        """Record one training call's loss; a non-finite one marks the window for skipping."""
        if not math.isfinite(loss):
            self.nonfinite_loss = True

    def grad_scale(self) -> float:
        """``1 / denominator`` of the window; raises if nothing was accumulated."""
        denom = denominator(self.mode, self.counts, self.constant)
        # ``sum`` has no count in its denominator: the window is empty when no call was added.
        if denom <= 0 or not self.calls:
            raise RuntimeError(
                "optimizer_step in deferred mode with no loss tokens accumulated since the last "
                "step; fix: call forward_backward_step (not forward_only) before optimizer_step"
            )
        return 1.0 / denom

    def reset(self) -> None:
        """Start a new accumulation window."""
        self.counts = NormCounts(0.0, 0.0)
        self.calls = 0
        self.nonfinite_loss = False


class LossFn(Protocol):
    """Signature of a loss function set with ``BaseEngine.set_loss_fn``.

    Args:
        micro_batch: the micro-batch TensorDict (jagged per-token fields).
        outputs: the model outputs for it (jagged ``log_probs`` / ``entropy`` / ``values``),
            sharing the micro-batch's jagged layout.
        norm: the call's normalization context; reduce with :func:`agg_loss`.

    Returns:
        ``(contribution, metrics)``: a scalar tensor (this micro-batch's share of the global
        loss) and a dict of float metrics for this micro-batch. A metric named in the
        function's :data:`SUMMED_METRICS` attribute (:func:`with_summed_metrics`) is a
        contribution like the loss (reduced with :func:`agg_loss`): the engine reports the
        call's global value, its sum over micro-batches and DP ranks, independent of how the
        batch was split. Any other metric is reported as the mean over this rank's micro-batches.
    """

    def __call__(self, micro_batch, outputs, norm: NormContext) -> tuple[torch.Tensor, dict[str, float]]: ...


#: The attribute of a loss function naming its metrics that are contributions (see :class:`LossFn`).
SUMMED_METRICS = "summed_metrics"


def with_summed_metrics(loss_fn: LossFn, *keys: str) -> LossFn:
    """``loss_fn`` with ``keys`` declared contributions: each such metric a micro-batch returns
    is its share of a global value, normalised by the call's global denominator as
    :func:`agg_loss` does, so the engine sums it over micro-batches and DP ranks (what it does
    for the loss) and reports that sum. The function itself is unchanged."""
    wrapped = functools.partial(loss_fn)
    setattr(wrapped, SUMMED_METRICS, frozenset(keys))
    return wrapped


def reduce_summed_metrics(loss_fn: LossFn | None, metrics: dict[str, list[float]], group: dist.ProcessGroup | None) -> None:
    """Replace, in ``metrics`` (per key, one value per micro-batch of this rank), each metric
    ``loss_fn`` declares summed by its global value (the sum over micro-batches, all-reduced
    over ``group``). Collective over ``group`` when ``loss_fn`` declares any: every rank sends
    every declared key (0 where its micro-batches gave none), so the ranks agree even when a
    metric appears on some only; a key no rank reported stays absent."""
    keys = sorted(getattr(loss_fn, SUMMED_METRICS, ()))
    if not keys:
        return
    local = [float(sum(metrics.get(k, []))) for k in keys] + [float(k in metrics) for k in keys]
    both = all_reduce(torch.tensor(local, dtype=torch.float64, device=comm_device(group)), "sum", group).cpu()
    for i, key in enumerate(keys):
        if both[len(keys) + i] > 0:
            metrics[key] = [float(both[i])]


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode = {mode!r} is unknown; fix: use one of {', '.join(AGG_MODES)}")


def _flat(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets) of a jagged tensor; a plain 1-D tensor is one sequence."""
    if x.is_nested:
        return x.values(), x.offsets()
    if x.dim() != 1:
        raise ValueError(f"expected a jagged or 1-D per-token tensor, got shape {tuple(x.shape)}")
    return x, torch.tensor([0, x.shape[0]], device=x.device)


def _segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums of flat ``values`` delimited by ``offsets`` (differentiable)."""
    lengths = (offsets[1:] - offsets[:-1]).to(values.device)
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
    return torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device).index_add(0, seg, values)
