"""``Actor``: policy log-probs and the policy update (PPO-clip, GSPO, CISPO, ...: the objectives of
``roles.objectives``), on ``BaseEngine`` calls only.

Batches passed to the role are *global* (every rank holds the same one, as in a colocated
recipe); the role shards them with ``engine.shard_data`` and gathers outputs with
``engine.unshard_data``. Per-token fields follow the batch protocol (jagged, aligned with
``input_ids``; the loss covers ``loss_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from engine_api import BaseEngine, agg_loss
from engine_api.batch import unpack
from engine_api.logprobs import TARGET_LOG_PROBS, TARGETS_FIELD
from engine_api.losses import with_summed_metrics
from engine_api.moe import ROLLOUT_ROUTING_FIELD, ROUTING_FIELD, routing_disagreement
from roles.algos import KL_ESTIMATORS, RolloutCorrectionConfig, kl_estimate, rollout_correction
from roles.common import TrainableRole, infer_global, require_fields, train_epochs
from roles.objectives import POLICY_OBJECTIVES, PolicyTerms, objective_settings, policy_terms
from roles.teacher import topk_forward_kl

ROUTER_REPLAY = ("off", "r2", "r3")
# On-policy distillation's top-k term (roles.teacher.topk_forward_kl): the global batch's metadata
# TOPK_KL_COEF > 0 with the per-token fields TEACHER_TOPK ([T, K], the teacher's top-k log-probs)
# and target_ids ([T, K], their ids) adds TOPK_KL_COEF * the forward KL to the policy loss.
TOPK_KL_COEF = "topk_kl_coef"
TEACHER_TOPK = "teacher_topk_log_probs"
# The loss terms' metrics: contributions to the global loss, so the engine reports their global
# values (summed over micro-batches and ranks); clipfrac and ratio_mean are per-micro-batch means.
SUMMED = ("pg_loss", "kl", "entropy", "distill/topk_forward_kl")
# Batch metadata: the policy loss takes the old-policy log-probs from its own forward (detached).
OLD_FROM_FORWARD = "old_log_probs_from_forward"


@dataclass(frozen=True)
class ActorConfig:
    """The policy update.

    Attributes:
        policy_loss: the policy objective, a name of ``roles.objectives.POLICY_OBJECTIVES``:
            ``ppo`` (PPO-clip, default), ``gspo`` (the sequence-level ratio), ``cispo`` (the
            clipped importance weight as a constant), ``importance_sampling``, ``dro``.
        clip_low, clip_high: the clip margins of the PPO family (``ppo``, ``gspo``, ``cispo``):
            the ratio (GSPO: the sequence ratio; CISPO: the weight) is clipped to
            ``[1 - clip_low, 1 + clip_high]`` (verl's ``clip_ratio_low`` / ``clip_ratio_high``;
            DAPO's clip-higher is ``clip_high > clip_low``; ``clip_low >= 1``: no lower clip).
        dual_clip: dual-clip constant c > 1 for negative advantages (``ppo`` only; None: off).
        policy_loss_config: the objective's other settings by their registry names (``dro``:
            ``beta``); the clip bounds are never given here (``clip_low`` / ``clip_high``).
        kl_coef: weight of the KL(pi || pi_ref) penalty in the loss (0: off; then
            ``ref_log_probs`` is not needed).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (see ``roles.algos.kl_estimate``).
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        ppo_epochs: passes over the batch per update.
        mini_batch_size: global sequences per optimizer step (None: the whole batch).
        rollout_correction: truncated / masked importance sampling for the mismatch between
            the rollout's sampling log-probs and ``old_log_probs``
            (:class:`roles.algos.RolloutCorrectionConfig`; off by default).
        router_replay: MoE routing replay (``engine_api.moe``, "Routing replay"; an MoE model
            only): ``off``, the update routes by the current router; ``r2``, the update's
            forwards route every token as the old-policy forward (``compute_log_probs``) did;
            ``r3``, the old-policy forward and the update's forwards route as the rollout
            engine did (its ``rollout_routed_experts``), so old, rollout and update share one
            routing. Every mode reports ``moe/router_disagreement``.
        recompute_old_log_probs: always compute the old-policy log-probs in a separate
            forward-only pass. False (default): where they provably equal the update's own
            forward's (:meth:`Actor.reuses_update_log_probs`), the recipe takes them from that
            forward instead and saves one forward per step; the metrics and weights are the
            same either way (tested bit for bit).
    """

    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    policy_loss_config: dict[str, Any] = field(default_factory=dict)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_size: int | None = None
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    router_replay: str = "off"
    recompute_old_log_probs: bool = False

    def __post_init__(self) -> None:
        # YAML reads a bare ``off`` (``actor.router_replay=off``) as false, which a str field
        # receives as "False": that is ``off`` too.
        if self.router_replay is False or self.router_replay == "False":
            object.__setattr__(self, "router_replay", "off")

    def _problems(self) -> list[str]:
        out = []
        if self.router_replay not in ROUTER_REPLAY:
            out.append(f"router_replay = {self.router_replay!r}: unknown; fix: use one of {', '.join(ROUTER_REPLAY)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            out.append(f"kl_estimator = {self.kl_estimator!r}: unknown; fix: use one of {', '.join(KL_ESTIMATORS)}")
        if self.policy_loss not in POLICY_OBJECTIVES:
            out.append(f"policy_loss = {self.policy_loss!r}: unknown; fix: use one of {', '.join(POLICY_OBJECTIVES)}")
        else:
            try:
                self.objective_settings()
            except ValueError as e:
                out.append(str(e).removeprefix("actor: "))
        if self.ppo_epochs < 1:
            out.append(f"ppo_epochs = {self.ppo_epochs}: must be >= 1; fix: use 1 or more")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            out.append(f"mini_batch_size = {self.mini_batch_size}: must be positive; fix: use a positive size or null")
        return out

    def objective_settings(self) -> dict[str, Any]:
        """The settings :func:`roles.objectives.policy_terms` gets: the registry's defaults, the
        clip margins as ratio bounds, ``dual_clip`` and ``policy_loss_config``.

        Computed and checked once per config (the update reads it every micro-batch).

        Raises:
            ValueError: a setting the objective does not have (a ``dual_clip`` outside ``ppo``,
                bounds in ``policy_loss_config``) or a value the registry refuses."""
        cached = self.__dict__.get("_objective_settings")
        if cached is None:
            cached = self._checked_settings()
            object.__setattr__(self, "_objective_settings", cached)  # frozen: not a field, so eq / replace ignore it
        return dict(cached)

    def _checked_settings(self) -> dict[str, Any]:
        defaults = POLICY_OBJECTIVES[self.policy_loss].settings
        for key in ("lo", "hi"):
            if key in self.policy_loss_config:
                raise ValueError(
                    f"actor: policy_loss_config.{key} is not set here; fix: actor.clip_low / actor.clip_high (margins: the "
                    "ratio in [1 - clip_low, 1 + clip_high])"
                )
        given: dict[str, Any] = dict(self.policy_loss_config)
        if "lo" in defaults:
            given.update(lo=1.0 - self.clip_low, hi=1.0 + self.clip_high)
        if self.dual_clip is not None:
            if "dual_clip" not in defaults:
                raise ValueError(
                    f"actor: dual_clip = {self.dual_clip:g} applies to policy_loss ppo only (not {self.policy_loss}); fix: "
                    "actor.dual_clip=null"
                )
            given["dual_clip"] = self.dual_clip
        names = {"lo": "1 - clip_low", "hi": "1 + clip_high"}
        return objective_settings(self.policy_loss, given, "actor", names)


def objective_warnings(c: ActorConfig, loss_agg_mode: str) -> list[str]:
    """What a run with this objective should hear once: GSPO under a token-weighted aggregation
    (the paper averages per sequence, verl forces it; here the mode is the user's)."""
    if c.policy_loss == "gspo" and loss_agg_mode != "seq-mean-token-mean":
        return [
            f"actor.policy_loss = gspo with engine.loss_agg_mode = {loss_agg_mode}: GSPO as published averages each sequence's "
            "terms, then the sequences (seq-mean-token-mean; verl always uses it for GSPO); this run weights sequences by their "
            "token counts instead; for the paper's objective set engine.loss_agg_mode=seq-mean-token-mean"
        ]
    return []


class Actor(TrainableRole):
    """The policy: an engine plus the policy objective. Owns no backend-specific code."""

    def __init__(self, engine: BaseEngine, config: ActorConfig) -> None:
        if config.router_replay != "off" and not engine.is_moe:
            raise ValueError(
                f"actor.router_replay = {config.router_replay!r}: the model has no MoE layers, so there is no routing to replay; "
                "fix: actor.router_replay=off"
            )
        self.engine = engine
        self.config = config
        engine.set_loss_fn(with_summed_metrics(self.loss, *SUMMED))

    def compute_log_probs(self, batch: TensorDict, calculate_entropy: bool = False) -> TensorDict:
        """Log-probs (and entropy) of the global batch under the current weights, on every rank.

        With an MoE model the outputs also hold ``routed_experts``, the router's own routing of
        every token (what ``r2`` replays); under ``r3`` this forward routes as the rollout did
        (``rollout_routed_experts``, required), so the old log-probs are the rollout's policy."""
        meta: dict = {"calculate_entropy": calculate_entropy}
        if self.engine.is_moe:
            meta["return_routing"] = True
            if self.config.router_replay == "r3":
                require_fields(batch, [ROLLOUT_ROUTING_FIELD], "Actor.compute_log_probs (router_replay = r3)")
                batch = batch.copy()
                batch.set(ROUTING_FIELD, batch[ROLLOUT_ROUTING_FIELD])
                meta["replay_routing"] = True
        return infer_global(self.engine, batch, **meta)

    def update(self, batch: TensorDict) -> list[dict]:
        """PPO update over ``ppo_epochs`` x mini-batches; one metrics dict per optimizer step.

        Needs ``old_log_probs`` and ``advantages`` (and ``ref_log_probs`` when ``kl_coef > 0``,
        ``rollout_log_probs`` when ``rollout_correction.mode`` is not ``off``) as jagged
        per-token fields of ``batch``. With a rollout correction on, it is computed once on the
        global batch (:func:`apply_rollout_correction`) and its metrics are added to every
        returned dict; ``batch`` itself is not modified.

        A batch with the metadata ``topk_kl_coef`` > 0 also trains toward a teacher's top-k
        candidates (fields ``teacher_topk_log_probs`` and ``target_ids``, ``[T, K]``;
        :func:`roles.teacher.topk_forward_kl`), weighted by it: on-policy distillation's
        ``distill.topk``.
        """
        require_fields(batch, update_fields(self.config), "Actor.update")
        topk_coef = topk_kl_coef_of(batch)
        batch, correction = apply_rollout_correction(self.config, batch)
        entropy = self.config.entropy_coef > 0
        replay = self.config.router_replay != "off"
        if replay:
            require_fields(batch, [ROUTING_FIELD], f"Actor.update (router_replay = {self.config.router_replay})")

        def prepare(local: TensorDict) -> None:
            local.set_non_tensor("calculate_entropy", entropy)
            if topk_coef:
                local.set_non_tensor(TOPK_KL_COEF, topk_coef)
            if replay:
                local.set_non_tensor("replay_routing", True)

        metrics = train_epochs(self.engine, batch, self.config.ppo_epochs, self.config.mini_batch_size, prepare)
        for m in metrics:
            m.update(correction)
        return metrics

    def reuses_update_log_probs(self, rows: int) -> bool:
        """Whether, for a batch of ``rows`` sequences, the old-policy log-probs equal the
        log-probs of the update's own forward, so :meth:`update_on_policy` may replace
        :meth:`compute_log_probs` + :meth:`update`. It holds when the update is one optimizer
        step whose only forward runs on the weights that sampled nothing since (``ppo_epochs``
        1 and one mini-batch: ``mini_batch_size`` null or >= ``rows``), that forward equals the
        eval-mode one (no dropout in the model: ``BaseEngine.trains_with_dropout``; the same
        micro-batching, as both read one engine config), nothing needs the old log-probs before
        the update (no rollout correction) and no routing is replayed or measured (a dense
        model), and ``recompute_old_log_probs`` is off. TRL's GRPOTrainer makes the same reuse
        for one iteration."""
        c = self.config
        return (
            not c.recompute_old_log_probs
            and c.ppo_epochs == 1
            and (c.mini_batch_size is None or c.mini_batch_size >= rows)
            and c.rollout_correction.mode == "off"
            and c.router_replay == "off"
            and not self.engine.is_moe
            and not self.engine.trains_with_dropout
        )

    def update_on_policy(self, batch: TensorDict) -> tuple[list[dict], TensorDict]:
        """The policy update of :meth:`update` in one forward: the old-policy log-probs are that
        forward's own, detached (the ratio is exactly 1 and its gradient the log-probs'), so no
        separate old-policy forward runs. Only where :meth:`reuses_update_log_probs` holds.

        Needs ``advantages`` (and ``ref_log_probs`` when ``kl_coef > 0``); ``old_log_probs``
        must be absent (they are what this computes). Returns the one optimizer step's metrics
        (as a one-element list, like :meth:`update`) and the global outputs of the forward
        (``log_probs``, ``entropy``), what :meth:`compute_log_probs` with
        ``calculate_entropy=True`` would have returned before the update. Collective.

        Raises:
            ValueError: the reuse does not hold for this batch, or a field is missing or
                present when it must not be; before any weight changes.
        """
        rows = batch.batch_size[0]
        if not self.reuses_update_log_probs(rows):
            raise ValueError(
                f"Actor.update_on_policy: the old-policy log-probs of this batch ({rows} rows) are not the update's own "
                "(see Actor.reuses_update_log_probs); fix: compute_log_probs, then update"
            )
        if "old_log_probs" in batch.keys():
            raise ValueError("Actor.update_on_policy batch holds old_log_probs; fix: drop them (this computes them), or call update")
        require_fields(batch, [f for f in update_fields(self.config) if f != "old_log_probs"], "Actor.update_on_policy")
        local = self.engine.shard_data(batch)
        local.set_non_tensor("calculate_entropy", True)
        local.set_non_tensor(OLD_FROM_FORWARD, True)
        with self.engine.train_mode():
            metrics, outputs = self.engine.train_batch_with_outputs(local)
        return [metrics], self.engine.unshard_data(outputs)

    def loss(self, mb: TensorDict, out: TensorDict, norm) -> tuple[torch.Tensor, dict[str, float]]:
        """The engine's loss function: :func:`policy_objective`."""
        return policy_objective(self.config, mb, out, norm)


def routing_for_update(config: ActorConfig, batch: TensorDict, old: TensorDict) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The routing the policy update carries (``routed_experts``: replayed under r2 / r3,
    measured against under off), from the rollout batch and the old-policy forward's outputs
    ``old`` (:meth:`Actor.compute_log_probs`), and the boundary metric
    ``rollout/router_disagreement``: the share of the rollout's recorded top-k choices that the
    trainer's router, recomputing the same tokens, does not make (``engine_api.moe``). None and
    no metrics for a dense model (``old`` has no routing)."""
    if ROUTING_FIELD not in old.keys():
        return None, {}
    metrics = {}
    recorded = batch[ROLLOUT_ROUTING_FIELD] if ROLLOUT_ROUTING_FIELD in batch.keys() else None
    if recorded is not None:
        metrics["rollout/router_disagreement"] = routing_disagreement(recorded.values(), old[ROUTING_FIELD].values())
    chosen = recorded if config.router_replay == "r3" else old[ROUTING_FIELD]
    return unpack(chosen.values(), batch["input_ids"]), metrics


def topk_kl_coef_of(batch: TensorDict) -> float:
    """The batch's ``topk_kl_coef`` (0: none), checked with the fields it needs.

    Raises:
        ValueError: a negative or non-finite coefficient, or a missing / misshapen field."""
    coef = float(batch.get_non_tensor(TOPK_KL_COEF)) if TOPK_KL_COEF in batch.keys() else 0.0
    if not (coef >= 0 and coef < float("inf")):
        raise ValueError(f"batch metadata {TOPK_KL_COEF} = {coef}: must be a finite number >= 0; fix: e.g. 1.0, or 0 (off)")
    if coef:
        require_fields(batch, [TEACHER_TOPK, TARGETS_FIELD], f"Actor.update ({TOPK_KL_COEF} = {coef:g})")
        teacher, ids = batch[TEACHER_TOPK].values(), batch[TARGETS_FIELD].values()
        if teacher.dim() != 2 or teacher.shape != ids.shape:
            raise ValueError(
                f"{TEACHER_TOPK} has shape {tuple(teacher.shape)} and {TARGETS_FIELD} {tuple(ids.shape)}: the top-k term needs "
                "both [T, K] with one K; fix: the teacher's topk_log_probs and topk_ids of one call"
            )
    return coef


def update_fields(config: ActorConfig) -> list[str]:
    """The per-token fields a policy update needs."""
    fields = ["old_log_probs", "advantages"] + (["ref_log_probs"] if config.kl_coef else [])
    return fields + (["rollout_log_probs"] if config.rollout_correction.mode != "off" else [])


def apply_rollout_correction(config: ActorConfig, batch: TensorDict) -> tuple[TensorDict, dict[str, float]]:
    """The global ``batch`` prepared for the policy update under ``config.rollout_correction``,
    and the correction's metrics (``roles.algos.rollout_correction``).

    Off: ``batch`` itself and no metrics. TIS: a shallow copy with the per-token field
    ``rollout_is_weights`` (``min(w, threshold)``, read by :func:`policy_objective`). MIS: a
    shallow copy whose ``loss_mask`` no longer holds the removed tokens (so they leave the
    loss normalization's counts too). Deterministic, so every rank computes the same result
    from the same global batch.

    Raises:
        ValueError: MIS removed every response token of the batch (the loss would be 0/0).
    """
    rc = config.rollout_correction
    if rc.mode == "off":
        return batch, {}
    ids, mask = batch["input_ids"], batch["loss_mask"]
    weights, new_mask, metrics = rollout_correction(
        batch["old_log_probs"].values(), batch["rollout_log_probs"].values(), mask.values(), ids.offsets(), rc
    )
    out = batch.copy()
    if rc.mode == "tis":
        out.set("rollout_is_weights", unpack(weights, ids))
    else:
        if not bool((new_mask > 0).any()):
            raise ValueError(
                f"rollout_correction (mode = mis, level = {rc.level}) removed every response token of the batch: no weight "
                f"lies in [{rc.lower_bound():g}, {rc.threshold:g}] (raw_weight_max = {metrics['rollout_correction/raw_weight_max']:g}); "
                f"fix: widen threshold / threshold_lower{', or use level token' if rc.level == 'sequence' else ''}, or check that "
                "rollout_log_probs match the sampled tokens"
            )
        out.set("loss_mask", unpack(new_mask, ids))
    return out, metrics


def policy_objective(c: ActorConfig, mb: TensorDict, out: TensorDict, norm) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy objective ``c.policy_loss`` (``roles.objectives``) + KL penalty - entropy bonus
    of one micro-batch, each aggregated with ``norm`` (an ``engine_api.NormContext``); returns
    the loss and its metrics. GSPO's sequences are the micro-batch's rows (a row is never split
    between micro-batches), their counted tokens the loss mask.

    When ``mb`` holds the per-token field ``rollout_is_weights`` (TIS, set by
    :func:`apply_rollout_correction`), the per-token policy loss is multiplied by it (a constant:
    no gradient flows through it) before aggregation, so ``pg_loss`` is the weighted loss; the
    KL penalty and the entropy bonus are not reweighted."""
    mask = mb["loss_mask"]
    log_probs = out["log_probs"].values()
    # Actor.update_on_policy: this forward's own log-probs are the old policy's (ratio 1).
    from_forward = OLD_FROM_FORWARD in mb.keys() and mb.get_non_tensor(OLD_FROM_FORWARD)
    old = log_probs.detach() if from_forward else mb["old_log_probs"].values()
    terms = PolicyTerms(log_probs, old, mb["advantages"].values(), mb["input_ids"].offsets(), mask.values())
    pg, clipped = policy_terms(c.policy_loss, terms, c.objective_settings())
    if "rollout_is_weights" in mb.keys():
        pg = pg * mb["rollout_is_weights"].values().detach()
    total = agg_loss(pg, mask, norm)
    with torch.no_grad():
        tokens = mask.values().sum().clamp(min=1)
        ratio = torch.exp(log_probs - old)
        metrics = {
            "pg_loss": float(agg_loss(pg.detach(), mask, norm)),
            "clipfrac": float((clipped * mask.values()).sum() / tokens),
            "ratio_mean": float((ratio * mask.values()).sum() / tokens),
        }
    if c.kl_coef:
        kl = agg_loss(kl_estimate(log_probs, mb["ref_log_probs"].values(), c.kl_estimator), mask, norm)
        total = total + c.kl_coef * kl
        metrics["kl"] = float(kl.detach())
    if c.entropy_coef:
        entropy = agg_loss(out["entropy"].values(), mask, norm)
        total = total - c.entropy_coef * entropy
        metrics["entropy"] = float(entropy.detach())
    topk_coef = float(mb.get_non_tensor(TOPK_KL_COEF)) if TOPK_KL_COEF in mb.keys() else 0.0
    if topk_coef:
        forward_kl = topk_forward_kl(out[TARGET_LOG_PROBS].values(), mb[TEACHER_TOPK].values(), mb["input_ids"].offsets())
        kl = agg_loss(forward_kl, mask, norm)
        total = total + topk_coef * kl
        metrics["distill/topk_forward_kl"] = float(kl.detach())
    return total, metrics
