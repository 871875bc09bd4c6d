"""The micro-batch loop of ``forward_backward_step``, shared by backends that drive their own
forward passes (FSDP, the test reference engine). Megatron runs micro-batches through its
schedule instead but uses the same planning and normalization pieces.

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

from engine_api.base import RETURN_PREDICTIONS
from engine_api.batch import loss_mask_of, relayout, to_device, validate_batch
from engine_api.config import EngineConfig
from engine_api.dist import all_gather_objects, all_reduce, comm_device, group_size
from engine_api.losses import DeferredNormalizer, LossFn, backward_scale, build_norm_context
from engine_api.microbatch import make_micro_batches

ForwardFn = Callable[[TensorDict], TensorDict]


@dataclass(frozen=True)
class StepSpec:
    """What the loop needs from the engine for one call.

    Attributes:
        config: the engine config (micro-batching, loss mode, deferred flag).
        dp_group: the data-parallel group counts and micro-batch counts are agreed over.
        forward: ``forward(micro_batch) -> outputs`` (jagged per-token fields).
        vocab_size: checked against the token ids when known.
        grads_averaged_over_dp: whether the backend's gradient reduction averages over DP.
        device: compute device micro-batches are moved to (None: leave them where they are).
        max_positions: the model's maximum sequence length (e.g. HF ``max_position_embeddings``),
            checked against every sequence when known.
    """

    config: EngineConfig
    dp_group: dist.ProcessGroup | None
    forward: ForwardFn
    vocab_size: int | None = None
    grads_averaged_over_dp: bool = True
    device: torch.device | None = None
    max_positions: int | None = None


def seq_len_limit(config: EngineConfig, max_positions: int | None) -> tuple[int | None, str]:
    """The longest sequence one call may hold, and the setting that imposes it (for the error).

    Two limits apply: the dynamic-batching budget (a longer sequence fits in no micro-batch)
    and the model's maximum positions (positions past it were never trained; absolute-position
    models index out of range). The tighter one is reported.
    """
    limits = [
        (value, name)
        for value, name in (
            (config.max_token_len_per_micro_batch, "engine.max_token_len_per_micro_batch"),
            (max_positions, "the model's max_position_embeddings"),
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
) -> None:
    """Every per-call input check of ``forward_backward_step`` that reads only the batch and
    the config (``validate_batch`` with the vocabulary and the sequence-length limit), agreed
    over ``group``: if any rank's batch is bad, every rank raises, before any state changes.

    Collective (one all-reduce of a flag; on failure, one gather of the messages). A rank that
    raised alone would leave its peers waiting forever in the call's first collective; here
    every rank raises a ``ValueError`` naming the rank, the field and the value instead.
    """
    limit, field = seq_len_limit(config, max_positions)
    error = None
    try:
        validate_batch(batch, vocab_size=vocab_size, max_seq_len=limit, max_seq_len_field=field)
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


def forward_backward_loop(
    spec: StepSpec,
    batch: TensorDict,
    loss_fn: LossFn | None,
    deferred: DeferredNormalizer,
    ctx: dict | None = None,
    forward_only: bool = False,
    preprocess_fn=None,
    postprocess_fn=None,
):
    """Run one ``forward_backward_step`` call; returns what the contract returns.

    See ``BaseEngine.forward_backward_step`` for the arguments and results. Backward is
    ``(contribution * backward_scale).backward()`` per micro-batch; in deferred mode the
    call's global counts are added to ``deferred`` after the last micro-batch.
    """
    cfg = spec.config
    validate_call(batch, cfg, spec.vocab_size, spec.max_positions, spec.dp_group)
    if not forward_only and loss_fn is None:
        raise ValueError("forward_backward_step(forward_only=False) has no loss function; fix: call engine.set_loss_fn(loss_fn) first")
    ctx = {} if ctx is None else ctx
    plan = make_micro_batches(batch, cfg.micro_batch_size, cfg.max_token_len_per_micro_batch, spec.dp_group)
    if not forward_only:
        norm = build_norm_context(loss_mask_of(batch), cfg.loss_agg_mode, spec.dp_group, cfg.loss_agg_constant)
        ctx["norm"] = norm
        scale = backward_scale(norm, cfg.deferred_normalization, spec.grads_averaged_over_dp)
    outputs = []
    keep = forward_only or ctx.get(RETURN_PREDICTIONS, True)
    total = torch.zeros((), dtype=torch.float64)
    for mb in plan.batches:
        if spec.device is not None:
            mb = to_device(mb, spec.device)
        if preprocess_fn is not None:
            mb = preprocess_fn(mb, ctx)
        with torch.set_grad_enabled(not forward_only):
            out = spec.forward(mb)
            if postprocess_fn is not None:
                out = postprocess_fn(mb, out, ctx)
            if not forward_only:
                loss, metrics = loss_fn(mb, out, norm)
                (loss * scale).backward()
                total += loss.detach().double().cpu()
                for key, value in metrics.items():
                    ctx.setdefault("metrics", {}).setdefault(key, []).append(float(value))
        if keep:
            # Outputs go back to the caller's device, then onto the caller's jagged layout.
            outputs.append(to_device(relayout(out.detach()), batch["input_ids"].device))
    predictions = plan.restore(outputs, like=batch["input_ids"]) if keep else None
    if forward_only:
        return predictions, ctx
    if cfg.deferred_normalization:
        deferred.add(norm.counts)
    # Contributions are normalised by global counts, so the global loss is their sum over DP.
    global_loss = float(all_reduce(total.to(comm_device(spec.dp_group)), "sum", spec.dp_group))
    deferred.note_loss(global_loss)  # a non-finite loss skips the window's optimizer step
    return predictions, global_loss, ctx
