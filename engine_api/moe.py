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
the full ``[layers][experts]`` counts. Only training calls are counted. Both describe the
router's own choice (its top-k of the logits), with or without replay, as Megatron-LM's
``compute_routing_scores_for_aux_loss`` does under its router replay.

Routing replay
--------------
A routing is a per-token field (``ROUTING_FIELD``, ``routed_experts``): int64
``[tokens, L, k]``, the experts each of the model's ``L`` MoE layers (in layer order; dense
layers have no column) routed each token to, ``k`` the model's top-k; row ``t`` routes the
hidden state at position ``t`` (the one that predicts token ``t + 1``); ``NOT_ROUTED`` (-1)
marks a token-layer nobody routed (a rollout's last token). Being a per-token field, it
travels through micro-batching, dynamic batching, packing and DP sharding like ``loss_mask``.

Batch metadata switches it on, per call (``engine_api.batch.METADATA_RULES``):

* ``return_routing=True``: the outputs get ``routed_experts``, the router's own top-k
  (what it routes by when nothing is replayed);
* ``replay_routing=True``: every MoE layer routes each token to the experts the batch's
  ``routed_experts`` names (the router's own choice where it holds -1). The top-k *indices*
  come from the recording; the gate *weights* are the current router's probabilities at
  those indices (renormalised over them when the model renormalises its top-k), so the
  router still gets a gradient and the update stays on-policy for the router. This is what
  Megatron-LM's ``RouterReplay`` (``scores.gather(replayed indices)``) and verl's R2/R3 do;
  the alternative, replaying the recorded weights too, would freeze the router.

In a training call whose batch carries ``routed_experts`` (replayed or not), the engine reports
``moe/router_disagreement``: over the real tokens and MoE layers that carry a recorded
routing, the fraction of recorded top-k choices that the routing this forward's experts
actually received (the router's final output, read after any replay) does not contain: 0 when
replay reproduced the recording, the share where training routes differently from it
without replay. With replay, ``moe/router_replay_override`` is the same fraction against the
router's own top-k: how far the router has drifted from the recording. Activation
recomputation replays what its forward routed by (a per-layer queue in forward order, as
Megatron-LM's ``REPLAY_BACKWARD``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

AUX_METRIC = "moe/aux_loss"
DISAGREEMENT_METRIC = "moe/router_disagreement"
OVERRIDE_METRIC = "moe/router_replay_override"
#: The per-token field of a batch that holds a recorded routing, and of a forward's outputs
#: (metadata ``return_routing``): int ``[tokens, MoE layers, top-k]``.
ROUTING_FIELD = "routed_experts"
#: The same, as the rollout engine recorded it (``roles.rollout``).
ROLLOUT_ROUTING_FIELD = "rollout_routed_experts"
#: A token-layer the engine did not route (no forward ran on that token there).
NOT_ROUTED = -1


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


def load_balancing_loss(
    logits: list[torch.Tensor],
    mask: torch.Tensor,
    num_experts: int,
    top_k: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """HF's load-balancing loss of one batch (module docstring): ``logits`` holds each MoE
    layer's router logits ``[rows, E]``, ``mask`` the real rows (bool ``[rows]``).

    ``reduce`` sums the batch's statistics (assignments, probability sums, real rows) over
    ranks that each route a part of its tokens (sequence parallelism), so every one of them
    gets the loss of the whole batch; None: this rank routes all of it."""
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
    for layer in logits:
        probs = torch.softmax(layer[mask].float(), dim=-1)
        assigned = assigned + _counts(probs.detach(), top_k, num_experts)
        prob_sum = prob_sum + probs.sum(0)
    rows = mask.sum().float().reshape(1) * len(logits)
    if reduce is not None:
        assigned, prob_sum, rows = reduce(torch.cat([assigned, prob_sum, rows])).split([num_experts, num_experts, 1])
    return num_experts * torch.sum((assigned / rows) * (prob_sum / rows))


def _counts(scores: torch.Tensor, top_k: int, num_experts: int) -> torch.Tensor:
    """Top-k assignments per expert of ``scores [rows, E]`` (no gradient)."""
    top = torch.topk(scores, top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(top, minlength=num_experts).float()


class RoutingRecorder:
    """Watches every MoE router of one model: the call's expert load and load-balancing loss
    (training calls), and routing replay, recording and disagreement (module docstring,
    "Routing replay").

    A backend calls :meth:`begin` before each micro-batch forward (and, with pipelining,
    before each model chunk's forward of it), :meth:`observe` from every MoE layer's router
    with its logits, routing by the indices it returns, and :meth:`close` after the forward
    (before backward: it returns the weighted aux term). The shared step loop brackets each
    call with :meth:`start_call` and :meth:`end_call`.

    Args:
        spec: the model's router settings.
        num_layers: decoder layers of the model (counts are kept per global layer index).
        reduce_counts: sums a tensor of per-rank counts over the ranks that hold distinct
            tokens or layers (a backend whose tensor-parallel peers see the same tokens
            divides their duplicate counts out here).
        moe_layers: the global indices of the MoE layers, in order: column ``j`` of a routing
            field is layer ``moe_layers[j]`` (default: every layer).
        reduce_stats: sums a tensor over the ranks that split one micro-batch's tokens
            (sequence parallelism), its backward keeping each rank's own part: the aux loss is
            then the whole micro-batch's on each of them. None: a rank routes whole micro-batches.
    """

    def __init__(
        self,
        spec: RouterSpec,
        num_layers: int,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor],
        moe_layers: Sequence[int] | None = None,
        reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.spec = spec
        self.reduce_counts = reduce_counts
        self.reduce_stats = reduce_stats
        self.moe_layers = tuple(range(num_layers) if moe_layers is None else moe_layers)
        self._column = {layer: j for j, layer in enumerate(self.moe_layers)}
        self.counts = torch.zeros(num_layers, spec.num_experts, dtype=torch.float64)
        self._training = False
        self._mb: _MicroBatch | None = None
        self._mbs: dict[object, _MicroBatch] = {}
        # Per layer: the indices a forward routed by, in forward order, for the recomputation
        # of that forward in backward (activation checkpointing; 1F1B backwards run in order).
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._call_tokens = 0.0
        self._aux = 0.0
        # [differing, compared] recorded choices: against the routing used, against the router's own
        self._disagree = torch.zeros(2, 2, dtype=torch.float64)

    @property
    def num_moe_layers(self) -> int:
        """``L`` of a routing field: the model's MoE layers."""
        return len(self.moe_layers)

    # ------------------------------------------------------------------ call (the step loop)
    def start_call(self, call_tokens: float, training: bool = True) -> None:
        """A call starts; ``call_tokens``: its real tokens on every DP rank (R_call); only a
        ``training`` call counts load, adds the aux loss and measures disagreement."""
        self.counts.zero_()
        self._call_tokens = float(call_tokens)
        self._training = training
        self._aux = 0.0
        self._disagree.zero_()
        self._mb, self._mbs, self._pending = None, {}, {}

    def end_call(self, reduce_sum: Callable[[float], float]) -> tuple[dict[str, list[float]], list[list[float]]]:
        """The call's metrics (``reduce_sum`` sums a float over the DP ranks) and the
        ``[layers][experts]`` token counts, over every rank. Collective (a training call)."""
        self._mb, self._mbs, self._pending = None, {}, {}
        if not self._training:
            return {}, []
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
        (differ, compared), (overridden, replayed) = self.reduce_counts(self._disagree.clone()).tolist()
        if compared > 0:  # the call's batch carried a recorded routing to compare with
            metrics[DISAGREEMENT_METRIC] = [differ / compared]
        if replayed > 0:
            metrics[OVERRIDE_METRIC] = [overridden / replayed]
        return metrics, counts.tolist()

    # ------------------------------------------------------------------ micro-batch (the backend)
    def begin(
        self,
        rows: int,
        token_rows: torch.Tensor,
        routing: torch.Tensor | None = None,
        replay: bool = False,
        record: bool = False,
        key: object = None,
    ) -> None:
        """A micro-batch's forward (or one model chunk's part of it) starts.

        Args:
            rows: how many rows the router sees (tokens of the padded / packed layout).
            token_rows: int64 ``[T]``, for each real token of the micro-batch in packed order,
                its row in the router's row order; -1 for a token this rank does not route
                (another sequence-parallel rank's slice).
            routing: the recorded routing of the micro-batch's tokens, ``[T, L, k]`` in packed
                order (the batch's ``routed_experts`` field), or None.
            replay: route by ``routing`` (where it is not ``NOT_ROUTED``).
            record: keep the router's own top-k for :meth:`recorded`.
            key: identifies the micro-batch when its forward comes in parts (pipeline
                chunks); a known key resumes its state.
        """
        known = key is not None and key in self._mbs
        if known:
            self._mb = self._mbs[key]
            return
        token_rows = token_rows.to(torch.long)
        mine = token_rows >= 0
        mask = torch.zeros(rows, dtype=torch.bool, device=token_rows.device)
        mask[token_rows[mine]] = True
        target = None
        if routing is not None:
            target = torch.full((rows, *routing.shape[1:]), NOT_ROUTED, dtype=torch.long, device=token_rows.device)
            target[token_rows[mine]] = routing.to(token_rows.device, torch.long)[mine]
        out = None
        if record:
            out = torch.full((token_rows.numel(), self.num_moe_layers, self.spec.top_k), NOT_ROUTED, dtype=torch.long)
        self._mb = _MicroBatch(mask, token_rows, target, replay and routing is not None, out)
        if key is not None:
            self._mbs[key] = self._mb

    def observe(self, layer: int, logits: torch.Tensor, natural: torch.Tensor | None = None) -> torch.Tensor | None:
        """Router logits ``[rows, E]`` of MoE layer ``layer`` (global index), and the router's
        own top-k indices ``natural`` ``[rows, k]`` when the router computed them (default:
        top-k of the logits, the choice of every softmax router). Returns the indices to route
        by, ``[rows, k]`` (the recorded routing, the router's own where none is recorded), or
        None to route as the router chose. Outside an open micro-batch (a recomputation in
        backward, a forward the loop did not announce) it only replays what the forward it
        recomputes routed by."""
        mb = self._mb
        in_backward = torch._C._current_graph_task_id() != -1
        if mb is None or in_backward:
            pending = self._pending.get(layer)
            return pending.pop(0) if in_backward and pending else None
        logits = logits.reshape(-1, self.spec.num_experts)
        with torch.no_grad():
            if natural is None:
                natural = torch.topk(logits.detach(), self.spec.top_k, dim=-1).indices
            natural = natural.reshape(-1, self.spec.top_k).to(torch.long)
            column = self._column.get(layer)
            target = None if mb.target is None or column is None else mb.target[:, column].to(natural.device)
            if self._training and layer not in mb.counted:
                mb.counted.add(layer)
                real = logits.detach()[mb.mask.to(logits.device)].float()
                self.counts[layer] += _counts(real, self.spec.top_k, self.spec.num_experts).double().cpu()
                if target is not None and mb.replay:
                    self._disagree[1] += _disagreement(target, self._as_map(natural), mb.mask.to(natural.device))
            if mb.recorded is not None and column is not None:
                mine = mb.token_rows >= 0
                mb.recorded[mine.cpu(), column] = natural[mb.token_rows[mine].to(natural.device)].cpu()
            routed = None
            if mb.replay and target is not None:
                routed = torch.where(target >= 0, target, natural)
        if self._training and self.spec.aux_on and layer not in mb.logits:
            mb.logits[layer] = logits
        if routed is not None and self._training:
            # For activation recomputation (megatron's checkpointed forward runs without grad).
            self._pending.setdefault(layer, []).append(routed)
        return routed

    @property
    def routing_requested(self) -> bool:
        """Whether the open micro-batch replays, records or measures a routing (a backend that
        cannot route by given indices must refuse then, not ignore it)."""
        mb = self._mb
        return mb is not None and (mb.target is not None or mb.recorded is not None)

    def used(self, layer: int, routing_map: torch.Tensor) -> None:
        """What MoE layer ``layer`` routed by in the open micro-batch: ``routing_map`` bool
        ``[rows, E]`` (the router's final output, after any replay), for
        ``moe/router_disagreement`` (a training micro-batch with a recorded routing; once per
        layer, not again in a recomputation)."""
        mb = self._mb
        column = self._column.get(layer)
        if mb is None or mb.target is None or column is None or not self._training or layer in mb.measured:
            return
        if torch._C._current_graph_task_id() != -1:
            return
        mb.measured.add(layer)
        with torch.no_grad():
            routing_map = routing_map.detach().reshape(-1, self.spec.num_experts).bool()
            self._disagree[0] += _disagreement(mb.target[:, column].to(routing_map.device), routing_map, mb.mask.to(routing_map.device))

    def _as_map(self, indices: torch.Tensor) -> torch.Tensor:
        """Top-k ``indices`` ``[rows, k]`` as a bool ``[rows, E]`` routing map."""
        return torch.zeros(indices.shape[0], self.spec.num_experts, dtype=torch.bool, device=indices.device).scatter_(1, indices, True)

    def recorded(self, key: object = None) -> torch.Tensor | None:
        """The router's own routing of the micro-batch (``record``): ``[T, L, k]`` in packed
        order, ``NOT_ROUTED`` for layers or tokens this rank did not route."""
        mb = self._mbs.get(key) if key is not None else self._mb
        return None if mb is None else mb.recorded

    def close(self) -> torch.Tensor | None:
        """End the micro-batch; its weighted aux term ``coef * R_m / R_call * aux_m`` to add to
        its loss before backward (None when the loss is off or no MoE layer ran here)."""
        mb, self._mb = self._mb, None
        if mb is None or not self._training or not self.spec.aux_on or not mb.logits:
            return None
        logits = mb.logits
        mask = mb.mask.to(next(iter(logits.values())).device)
        tokens = mask.sum().double().reshape(1)
        if self.reduce_stats is not None:  # every rank of the split takes part, whatever its share
            tokens = self.reduce_stats(tokens)
        if float(tokens) == 0 or self._call_tokens == 0:
            return None
        aux = load_balancing_loss([logits[k] for k in sorted(logits)], mask, self.spec.num_experts, self.spec.top_k, self.reduce_stats)
        weighted = aux * (self.spec.aux_coef * float(tokens) / self._call_tokens)
        value = float(weighted.detach())
        self._aux += value if math.isfinite(value) else float("nan")
        return weighted


@dataclass
class _MicroBatch:
    """What the recorder holds for one micro-batch: the real rows, each token's row, the
    recorded routing in row order, whether to replay it, and the recording being made."""

    mask: torch.Tensor
    token_rows: torch.Tensor
    target: torch.Tensor | None
    replay: bool
    recorded: torch.Tensor | None
    counted: set[int] = field(default_factory=set)
    measured: set[int] = field(default_factory=set)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)


def _disagreement(target: torch.Tensor, routing_map: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[differing choices, compared choices]`` of the real rows that carry a recorded
    routing ``target`` ``[rows, k]``: a recorded expert that ``routing_map`` (bool
    ``[rows, E]``, the other routing) does not hold is one differing choice (sets: the order
    within the top-k does not matter)."""
    rows = mask & (target[:, 0] >= 0)
    held = routing_map[rows].gather(1, target[rows])
    return torch.tensor([float((~held).sum()), float(held.numel())], dtype=torch.float64)


def routing_disagreement(recorded: torch.Tensor, natural: torch.Tensor) -> float:
    """The share of ``recorded`` top-k choices (``[tokens, L, k]``; -1 rows skipped) that
    ``natural`` (the same tokens' routing by another forward) does not make; 0 when nothing
    was recorded. The definition of ``moe/router_disagreement``, for two whole routings."""
    rec, nat = recorded.reshape(-1, recorded.shape[-1]).long(), natural.reshape(-1, natural.shape[-1]).long().to(recorded.device)
    valid = nat >= 0
    experts = int(max(rec.max(), nat.max())) + 1 if rec.numel() else 1
    routing_map = torch.zeros(nat.shape[0], experts + 1, dtype=torch.bool, device=rec.device)
    routing_map.scatter_(1, torch.where(valid, nat, torch.full_like(nat, experts)), True)  # -1 rows hold nothing
    differ, compared = _disagreement(rec, routing_map, torch.ones(rec.shape[0], dtype=torch.bool, device=rec.device)).tolist()
    return differ / compared if compared else 0.0


def check_routing(routing: torch.Tensor, field: str, num_moe_layers: int, top_k: int, num_experts: int) -> None:
    """Raise a ``ValueError`` naming ``field`` unless ``routing`` (a batch's jagged routing
    field) is integer ``[tokens, num_moe_layers, top_k]`` with experts in ``[0, num_experts)``
    or ``NOT_ROUTED`` for a whole token-layer, and no expert twice in one token-layer."""
    values = routing.values() if routing.is_nested else routing
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValueError(f"{field} has dtype {values.dtype}; fix: expert indices are integers (torch.long)")
    want = (num_moe_layers, top_k)
    if values.dim() != 3 or tuple(values.shape[1:]) != want:
        got = tuple(values.shape[1:]) if values.dim() == 3 else f"{values.dim() - 1} trailing dims, shape {tuple(values.shape)}"
        raise ValueError(
            f"{field} has per-token shape {got}, the model routes [MoE layers, top-k] = {list(want)} "
            f"({num_moe_layers} MoE layers, top-{top_k}); fix: record the routing with this model "
            "(a rollout or forward of another model cannot be replayed)"
        )
    if values.numel() == 0:
        return
    bad = (values < NOT_ROUTED) | (values >= num_experts)
    unrouted = values == NOT_ROUTED
    partial = unrouted.any(-1) & ~unrouted.all(-1)
    if bool(bad.any()) or bool(partial.any()):
        value = int(values[bad][0]) if bool(bad.any()) else "a mix of -1 and experts in one token-layer"
        raise ValueError(
            f"{field} holds {value}: experts must lie in [0, {num_experts}), or be -1 for a whole token-layer that was not routed; "
            "fix: pass the routing recorded by this model's rollout or forward"
        )
    if top_k > 1:
        ordered = values.sort(-1).values
        twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
        if bool(twice.any()):
            raise ValueError(f"{field} routes a token twice to one expert in one layer; fix: pass a top-k routing (distinct experts)")
