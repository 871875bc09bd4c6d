"""The one micro-batch loop of ``forward_backward_step``, shared by every backend. A backend
gives its forward function (``StepSpec.forward``); one that runs micro-batches through its
own schedule (megatron's pipeline schedules) plugs it in as a ``runner`` and keeps everything
else: validation, planning, normalization, restore, deferred counts and the global loss.

Order of work, chosen so bad input never changes state: validate the whole call's batch, plan
the micro-batches, build the normalization context (a collective: every rank validates before
it, so all ranks either raise or enter it), then forward/backward each micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_api.batch import loss_mask_of, relayout, to_device, validate_batch
from engine_api.config import EngineConfig
from engine_api.dist import all_gather_objects, all_reduce, comm_device, group_size
from engine_api.logprobs import TARGETS_FIELD, TOPK_META
from engine_api.losses import SUMMED_METRICS, DeferredNormalizer, LossFn, backward_scale, build_norm_context, reduce_summed_metrics
from engine_api.microbatch import make_micro_batches
from engine_api.moe import ROUTING_FIELD, RoutingRecorder, check_routing

ForwardFn = Callable[[TensorDict], TensorDict]
# ``ctx`` key of a training ``forward_backward_step``: False lets the backend skip assembling the
# predictions (returned as None), which ``train_batch`` discards anyway; saves the per-micro-batch
# relayout and the final reorder.
RETURN_PREDICTIONS = "return_predictions"


@dataclass(frozen=True)
class StepSpec:
    """What the loop needs from the engine for one call.

    Attributes:
        config: the engine config (micro-batching, loss mode, deferred flag).
        dp_group: the data-parallel group counts and micro-batch counts are agreed over.
        forward: ``forward(micro_batch) -> outputs`` (jagged per-token fields), used by the
            default runner (a backend with its own runner may leave it None).
        vocab_size: checked against the token ids when known.
        grads_averaged_over_dp: whether the backend's gradient reduction averages over DP.
        grad_reduce_ranks: the ranks that average runs over when they are more than the DP
            group (sequence parallelism: every rank of DP x SP holds part of the gradient);
            None: the DP group.
        device: compute device micro-batches are moved to (None: leave them where they are).
        max_positions: the model's maximum sequence length (e.g. HF ``max_position_embeddings``),
            checked against every sequence when known.
        max_positions_reason: what imposes ``max_positions`` (named in the error).
        validate_over_world: agree on batch validation over the whole world instead of the DP
            group (a model-parallel backend: its TP/PP peers must stop together too).
        router: an MoE model's routing recorder (``engine_api.moe``): the loop starts and
            ends it per training call, adds its load-balancing term to each micro-batch's
            loss (the default runner; a backend's own runner calls ``close`` itself) and
            reports its metrics. None for a dense model.
        scores_targets: whether the forward returns ``target_log_probs`` for a batch with
            ``target_ids`` and the top-k outputs of metadata ``return_topk``
            (``engine_api.logprobs``); a layout that cannot (today: sequences split over ranks,
            Ulysses SP and megatron CP) says False, and such a batch is refused before any
            state changes, naming the setting.
    """

    config: EngineConfig
    dp_group: dist.ProcessGroup | None
    forward: ForwardFn | None = None
    vocab_size: int | None = None
    grads_averaged_over_dp: bool = True
    grad_reduce_ranks: int | None = None
    device: torch.device | None = None
    max_positions: int | None = None
    max_positions_reason: str = "the model's max_position_embeddings"
    validate_over_world: bool = False
    router: RoutingRecorder | None = None
    scores_targets: bool | str = True


def seq_len_limit(
    config: EngineConfig, max_positions: int | None, max_positions_reason: str = "the model's max_position_embeddings"
) -> tuple[int | None, str]:
    """The longest sequence one call may hold, and the setting that imposes it (for the error).

    Two limits apply: the dynamic-batching budget (a longer sequence fits in no micro-batch)
    and the model's maximum positions (positions past it were never trained; absolute-position
    models index out of range). The tighter one is reported.
    """
    limits = [
        (value, name)
        for value, name in (
            (config.max_token_len_per_micro_batch, "engine.max_token_len_per_micro_batch"),
            (max_positions, max_positions_reason),
        )
        if value is not None
    ]
    return min(limits) if limits else (None, "max_seq_len")


def validate_call(
    batch: TensorDict,
    config: EngineConfig,
    vocab_size: int | None,
    max_positions: int | None,
    group: dist.ProcessGroup | None = None,
    max_positions_reason: str = "the model's max_position_embeddings",
    router: RoutingRecorder | None = None,
    scores_targets: bool | str = True,
) -> None:
    """Every per-call input check of ``forward_backward_step`` that reads only the batch and
    the config (``validate_batch`` with the vocabulary and the sequence-length limit), agreed
    over ``group``: if any rank's batch is bad, every rank raises, before any state changes.

    Collective (one all-reduce of a flag; on failure, one gather of the messages). A rank that
    raised alone would leave its peers waiting forever in the call's first collective; here
    every rank raises a ``ValueError`` naming the rank, the field and the value instead.
    """
    limit, field = seq_len_limit(config, max_positions, max_positions_reason)
    error = None
    try:
        validate_batch(batch, vocab_size=vocab_size, max_seq_len=limit, max_seq_len_field=field)
        validate_routing(batch, router)
        if TARGETS_FIELD in batch.keys() and scores_targets is not True:
            raise ValueError(
                f"batch field {TARGETS_FIELD!r}: arbitrary target log-probs are not computed when {scores_targets}; "
                f"fix: drop {TARGETS_FIELD!r} (next-token log_probs are), or train this batch without sequence splitting"
            )
        if TOPK_META in batch.keys() and batch.get_non_tensor(TOPK_META) and scores_targets is not True:
            raise ValueError(
                f"batch metadata {TOPK_META!r}: top-k outputs are not computed when {scores_targets}; fix: set it to 0, or run "
                "this model without sequence splitting"
            )
    except ValueError as exc:
        error = exc
    if group_size(group) == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0.0 if error is None else 1.0], device=comm_device(group))
    if not all_reduce(flag, "max", group).item():
        return
    messages = all_gather_objects(None if error is None else str(error), group)
    if error is not None:
        raise error
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise ValueError(f"rank {rank} got an invalid batch, so every rank stops: {message}")


def validate_routing(batch: TensorDict, router: RoutingRecorder | None) -> None:
    """The routing metadata and field (``engine_api.moe``, "Routing replay") against the
    model: replay needs a recorded routing, both switches need an MoE model, and the field
    must have the model's MoE layers, top-k and experts."""
    replay = "replay_routing" in batch.keys() and batch.get_non_tensor("replay_routing")
    wants = replay or ("return_routing" in batch.keys() and batch.get_non_tensor("return_routing"))
    if wants and router is None:
        switch = "replay_routing" if replay else "return_routing"
        raise ValueError(f"batch metadata {switch} = True: the model has no MoE layers to route; fix: drop it for a dense model")
    if replay and ROUTING_FIELD not in batch.keys():
        raise ValueError(
            f"batch metadata replay_routing = True but the batch has no {ROUTING_FIELD!r} field; fix: add the recorded routing "
            "(a forward's outputs with return_routing=True, or the rollout's routing), or drop replay_routing"
        )
    if router is not None and ROUTING_FIELD in batch.keys():
        spec = router.spec
        check_routing(batch[ROUTING_FIELD], ROUTING_FIELD, router.num_moe_layers, spec.top_k, spec.num_experts)


def wants_routing(mb: TensorDict) -> tuple[torch.Tensor | None, bool, bool]:
    """A micro-batch's routing request: ``(recorded routing values or None, replay, record)``."""
    routing = mb[ROUTING_FIELD].values() if ROUTING_FIELD in mb.keys() else None
    replay = bool(mb.get_non_tensor("replay_routing", False)) if "replay_routing" in mb.keys() else False
    record = bool(mb.get_non_tensor("return_routing", False)) if "return_routing" in mb.keys() else False
    return routing, replay, record


@dataclass
class CallState:
    """One ``forward_backward_step`` call after planning, handed to a :data:`MicroBatchRunner`.

    Attributes:
        batch: the call's batch (this rank's shard), as given.
        micro_batches: the planned micro-batches, on ``StepSpec.device`` when set.
        plan: the plan (``MicroBatches``; its ``restore`` puts outputs back in call order).
        ctx: the call's ctx (``norm`` set for training calls; ``metrics`` is filled per micro-batch).
        norm: the call's global ``NormContext`` (None when ``forward_only``).
        scale: the factor every micro-batch loss is multiplied by before backward
            (``backward_scale``); a schedule that divides by the micro-batch count multiplies it back.
        forward_only, keep: no backward; whether the caller wants the predictions.
        loss_fn, preprocess_fn, postprocess_fn: as given to the call.
    """

    batch: TensorDict
    micro_batches: list
    plan: object
    ctx: dict
    norm: object
    scale: float
    forward_only: bool
    keep: bool
    loss_fn: LossFn | None
    preprocess_fn: Callable | None
    postprocess_fn: Callable | None


# ``runner(spec, state) -> (outputs, local_loss)``: run every micro-batch (forward, loss, backward)
# and return the per-micro-batch outputs in plan order (relayout-ed TensorDicts, None when
# ``state.keep`` is False) and this rank's summed loss contributions (a float64 scalar tensor).
MicroBatchRunner = Callable[["StepSpec", CallState], tuple[list | None, torch.Tensor]]


def run_eagerly(spec: StepSpec, state: CallState) -> tuple[list | None, torch.Tensor]:
    """The default :data:`MicroBatchRunner`: each micro-batch forward, loss and
    ``(contribution * scale).backward()`` in turn, in this process."""
    outputs = [] if state.keep else None
    total = torch.zeros((), dtype=torch.float64)
    for mb in state.micro_batches:
        if state.preprocess_fn is not None:
            mb = state.preprocess_fn(mb, state.ctx)
        with torch.set_grad_enabled(not state.forward_only):
            out = spec.forward(mb)
            if state.postprocess_fn is not None:
                out = state.postprocess_fn(mb, out, state.ctx)
            if not state.forward_only:
                loss, metrics = state.loss_fn(mb, out, state.norm)
                aux = spec.router.close() if spec.router is not None else None
                ((loss if aux is None else loss + aux) * state.scale).backward()
                total += loss.detach().double().cpu()
                for key, value in metrics.items():
                    state.ctx.setdefault("metrics", {}).setdefault(key, []).append(float(value))
        if state.keep:
            outputs.append(relayout(out.detach()))
    return outputs, total


def forward_backward_loop(
    spec: StepSpec,
    batch: TensorDict,
    loss_fn: LossFn | None,
    deferred: DeferredNormalizer,
    ctx: dict | None = None,
    forward_only: bool = False,
    preprocess_fn=None,
    postprocess_fn=None,
    runner: MicroBatchRunner = run_eagerly,
):
    """Run one ``forward_backward_step`` call; returns what the contract returns.

    See ``BaseEngine.forward_backward_step`` for the arguments and results. The steps every
    backend shares happen here, in this order: validation agreed over the ranks, the loss
    function check, micro-batch planning, the call's normalization context and backward scale,
    then ``runner`` (the default runs micro-batches eagerly; megatron plugs its pipeline
    schedule in), output restore onto the caller's layout and device, the deferred counts,
    the global values of the loss function's summed metrics (``engine_api.losses.LossFn``) and the
    global loss (the sum of every rank's contributions over DP).
    """
    cfg = spec.config
    validate_call(
        batch,
        cfg,
        spec.vocab_size,
        spec.max_positions,
        None if spec.validate_over_world else spec.dp_group,
        spec.max_positions_reason,
        spec.router,
        spec.scores_targets,
    )
    if not forward_only and "disable_adapters" in batch.keys() and batch.get_non_tensor("disable_adapters"):
        raise ValueError(
            "batch metadata disable_adapters = True in a training call: it selects the base weights for forward-only calls "
            "(a LoRA reference); fix: drop it from batches passed to train_batch / forward_backward_step(forward_only=False)"
        )
    if not forward_only and loss_fn is None:
        raise ValueError("forward_backward_step(forward_only=False) has no loss function; fix: call engine.set_loss_fn(loss_fn) first")
    ctx = {} if ctx is None else ctx
    plan = make_micro_batches(batch, cfg.micro_batch_size, cfg.max_token_len_per_micro_batch, spec.dp_group)
    norm, scale = None, 0.0
    if not forward_only:
        norm = build_norm_context(loss_mask_of(batch), cfg.loss_agg_mode, spec.dp_group, cfg.loss_agg_constant)
        ctx["norm"] = norm
        scale = backward_scale(norm, cfg.deferred_normalization, spec.grads_averaged_over_dp, spec.grad_reduce_ranks)
    micro = plan.batches if spec.device is None else [to_device(mb, spec.device) for mb in plan.batches]
    keep = forward_only or ctx.get(RETURN_PREDICTIONS, True)
    state = CallState(batch, micro, plan, ctx, norm, scale, forward_only, keep, loss_fn, preprocess_fn, postprocess_fn)
    routed = spec.router is not None and not forward_only
    if routed:
        tokens = torch.tensor([float(batch["input_ids"].offsets()[-1])], dtype=torch.float64, device=comm_device(spec.dp_group))
        spec.router.start_call(float(all_reduce(tokens, "sum", spec.dp_group)))
    elif spec.router is not None:
        spec.router.start_call(0.0, training=False)  # replay / recording only: nothing counted
    outputs, total = runner(spec, state)
    if spec.router is not None and not routed:
        spec.router.end_call(lambda x: x)
    if routed:
        metrics, counts = spec.router.end_call(
            lambda x: float(all_reduce(torch.tensor([x], dtype=torch.float64, device=comm_device(spec.dp_group)), "sum", spec.dp_group))
        )
        ctx.setdefault("metrics", {}).update(metrics)
        ctx["moe_expert_tokens"] = counts
    predictions = None
    if keep and outputs is not None:
        # Outputs go back to the caller's device, then onto the caller's jagged layout.
        device = batch["input_ids"].device
        predictions = plan.restore([to_device(out, device) for out in outputs], like=batch["input_ids"])
    if forward_only:
        return predictions, ctx
    if cfg.deferred_normalization:
        deferred.add(norm.counts)
    # The loss function's summed metrics are contributions like the loss: their global values.
    if getattr(loss_fn, SUMMED_METRICS, None):
        reduce_summed_metrics(loss_fn, ctx.setdefault("metrics", {}), spec.dp_group)
    # Contributions are normalised by global counts, so the global loss is their sum over DP.
    global_loss = float(all_reduce(total.to(comm_device(spec.dp_group)), "sum", spec.dp_group))
    deferred.note_loss(global_loss)  # a non-finite loss skips the window's optimizer step
    return predictions, global_loss, ctx
