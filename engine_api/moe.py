"""Mixture-of-experts routing, one definition for every backend: HF's router load-balancing
loss and the per-expert load of each training call.

A backend builds a :class:`RoutingRecorder` for an MoE model, feeds it every MoE layer's router
logits (``record``) and, per micro-batch, the real-token mask in the router's row order
(``begin``); the shared step loop (``engine_api.step``) does the rest: it adds
:meth:`RoutingRecorder.close`'s weighted loss to the micro-batch's loss before backward and
reports the call's metrics.

The load-balancing loss (on when the HF config sets ``output_router_logits`` and
``router_aux_loss_coef > 0``, the checkpoint's own switch and coefficient) is HF's
``load_balancing_loss_func``, the definition the coefficient was tuned for: over one batch's
real tokens and all MoE layers pooled (R = tokens x MoE layers rows),

    aux = E * sum_e (C_e / R) * (S_e / R)

with C_e the number of top-k assignments to expert e and S_e the sum of its softmax router
probability. It is a product of two batch means, so it is not a sum over tokens and no
definition of it can be exactly invariant to how a batch is split. What this module
guarantees instead:

* A call's aux term is the token-weighted average of the micro-batches' HF losses:
  ``coef * sum_m (R_m / R_call) * aux_m``, over the call's micro-batches on every DP rank
  (R_m: real tokens of micro-batch m; R_call: of the whole call, all DP ranks). The weights
  sum to 1, so the term does not grow with the number of micro-batches or DP ranks; it is
  scaled like the main loss (``backward_scale``), so across the calls of an accumulation
  window it is averaged under deferred normalization and summed per call otherwise, exactly
  as the main loss is.
* It equals HF's loss (times coef) exactly when the call is one micro-batch on one rank.
* It is exactly invariant to splitting the call into micro-batches or DP shards that each
  hold the same routing statistics (e.g. copies of one batch); for other splits it is the
  weighted average above, not HF's loss of the whole batch.

The load metrics count, per MoE layer, the top-k assignments of the call's real tokens to each
expert, summed over micro-batches and ranks: ``moe/expert_load_max`` and
``moe/expert_load_mean`` (tokens per expert, the largest and the mean over layers and
experts) and ``moe/expert_load_imbalance`` (the largest per-layer max / mean; 1 is perfectly
balanced, E / top_k is every token on the same experts). ``ctx["moe_expert_tokens"]`` holds
the full ``[layers][experts]`` counts. Only training calls are counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

AUX_METRIC = "moe/aux_loss"


@dataclass(frozen=True)
class RouterSpec:
    """What the router loss and metrics need from an MoE model's config.

    Attributes:
        num_experts: routed experts per MoE layer (E).
        top_k: experts each token is routed to.
        aux_coef: the load-balancing loss coefficient; 0 when the loss is off.
    """

    num_experts: int
    top_k: int
    aux_coef: float = 0.0

    @classmethod
    def from_hf_config(cls, hf_config) -> RouterSpec | None:
        """The spec of an HF MoE config (``num_experts`` or ``num_local_experts`` and
        ``num_experts_per_tok``), None for a dense model. The loss is on when the config sets
        ``output_router_logits`` and a positive ``router_aux_loss_coef`` (HF's own switch)."""
        experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
        top_k = getattr(hf_config, "num_experts_per_tok", None)
        if not experts or not top_k:
            return None
        on = bool(getattr(hf_config, "output_router_logits", False))
        coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if on else 0.0
        return cls(int(experts), int(top_k), coef)

    @property
    def aux_on(self) -> bool:
        return self.aux_coef > 0


def load_balancing_loss(logits: list[torch.Tensor], mask: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """HF's load-balancing loss of one batch (module docstring): ``logits`` holds each MoE
    layer's router logits ``[rows, E]``, ``mask`` the real rows (bool ``[rows]``)."""
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
    for layer in logits:
        probs = torch.softmax(layer[mask].float(), dim=-1)
        assigned = assigned + _counts(probs.detach(), top_k, num_experts)
        prob_sum = prob_sum + probs.sum(0)
    rows = float(mask.sum()) * len(logits)
    return num_experts * torch.sum((assigned / rows) * (prob_sum / rows))


def _counts(scores: torch.Tensor, top_k: int, num_experts: int) -> torch.Tensor:
    """Top-k assignments per expert of ``scores [rows, E]`` (no gradient)."""
    top = torch.topk(scores, top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(top, minlength=num_experts).float()


class RoutingRecorder:
    """Collects the router logits of one micro-batch at a time and the call's expert load.

    Args:
        spec: the model's router settings.
        num_layers: decoder layers of the model (counts are kept per global layer index).
        reduce_counts: sums a ``[layers, E]`` count tensor over the ranks that hold distinct
            tokens or layers (a backend whose tensor-parallel peers see the same tokens
            divides their duplicate counts out here).
    """

    def __init__(self, spec: RouterSpec, num_layers: int, reduce_counts: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.spec = spec
        self.reduce_counts = reduce_counts
        self.counts = torch.zeros(num_layers, spec.num_experts, dtype=torch.float64)
        self._mask: torch.Tensor | None = None
        self._logits: dict[int, torch.Tensor] = {}
        self._call_tokens = 0.0
        self._aux = 0.0

    # ------------------------------------------------------------------ call (the step loop)
    def start_call(self, call_tokens: float) -> None:
        """A training call starts; ``call_tokens``: its real tokens on every DP rank (R_call)."""
        self.counts.zero_()
        self._call_tokens = float(call_tokens)
        self._aux = 0.0
        self._mask, self._logits = None, {}

    def end_call(self, reduce_sum: Callable[[float], float]) -> tuple[dict[str, list[float]], list[list[float]]]:
        """The call's metrics (``reduce_sum`` sums a float over the DP ranks) and the
        ``[layers][experts]`` token counts, over every rank. Collective."""
        self._mask, self._logits = None, {}
        counts = self.reduce_counts(self.counts.clone())
        moe_rows = counts[counts.sum(1) > 0]
        metrics: dict[str, list[float]] = {}
        if moe_rows.numel():
            mean = moe_rows.mean(1)
            metrics["moe/expert_load_max"] = [float(moe_rows.max())]
            metrics["moe/expert_load_mean"] = [float(mean.mean())]
            metrics["moe/expert_load_imbalance"] = [float((moe_rows.max(1).values / mean).max())]
        if self.spec.aux_on:
            metrics[AUX_METRIC] = [reduce_sum(self._aux)]
        return metrics, counts.tolist()

    # ------------------------------------------------------------------ micro-batch (the backend)
    def begin(self, mask: torch.Tensor) -> None:
        """A training micro-batch's forward starts; ``mask``: its real tokens, flat, in the
        order the router sees its rows."""
        self._mask, self._logits = mask.reshape(-1).bool(), {}

    def record(self, layer: int, logits: torch.Tensor) -> None:
        """Router logits ``[rows, E]`` of MoE layer ``layer`` (global index). Ignored outside
        an open training micro-batch (forward-only calls, activation recomputation)."""
        if self._mask is None or layer in self._logits:
            return
        logits = logits.reshape(-1, self.spec.num_experts)
        with torch.no_grad():
            real = logits[self._mask.to(logits.device)].float()
            self.counts[layer] += _counts(real, self.spec.top_k, self.spec.num_experts).double().cpu()
        self._logits[layer] = logits if self.spec.aux_on else None

    def close(self) -> torch.Tensor | None:
        """End the micro-batch; its weighted aux term ``coef * R_m / R_call * aux_m`` to add to
        its loss before backward (None when the loss is off or no MoE layer ran here)."""
        mask, logits = self._mask, self._logits
        self._mask, self._logits = None, {}
        if mask is None or not self.spec.aux_on or not logits:
            return None
        mask = mask.to(next(iter(logits.values())).device)
        tokens = float(mask.sum())
        if tokens == 0 or self._call_tokens == 0:
            return None
        aux = load_balancing_loss([logits[k] for k in sorted(logits)], mask, self.spec.num_experts, self.spec.top_k)
        weighted = aux * (self.spec.aux_coef * tokens / self._call_tokens)
        value = float(weighted.detach())
        self._aux += value if math.isfinite(value) else float("nan")
        return weighted
