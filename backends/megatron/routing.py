"""Feed megatron's MoE routers into the shared routing recorder (``engine_api.moe``): HF's
load-balancing loss, the expert-load metrics, and routing replay / recording, with one
definition for both backends.

Each ``TopKRouter``'s ``gating`` (the logits, before megatron's own top-k) is wrapped on the
instance: the recorder sees the logits and answers with the indices to route by, which go to
the router's own ``RouterReplay`` (megatron-core's replay: ``REPLAY_FORWARD`` gathers the
router's scores at given indices, so the gate weights stay the current router's); no answer
leaves it idle. The router sees ``[s, b]`` tokens flattened sequence-major (megatron's
``[s, b, h]`` activations), so each token's row is ``position * b + sequence``; under sequence
parallelism each TP rank routes its own slice of the sequence and counts are summed over TP;
without it every TP rank routes the same tokens and the duplicate counts are divided out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from engine_api.kit import RouterSpec, RoutingRecorder


def attach_router_recorder(
    chunks, spec: RouterSpec | None, num_layers: int, sequence_parallel: bool, moe_layers=None
) -> RoutingRecorder | None:
    """A recorder fed by every MoE layer's router of this rank's model chunks (None when the
    model has no experts); ``moe_layers``: the model's MoE layer indices (all of them, also
    those on other pipeline stages)."""
    if spec is None:
        return None
    tp = mpu.get_tensor_model_parallel_world_size()

    def reduce_counts(counts: torch.Tensor) -> torch.Tensor:
        if dist.get_world_size() > 1:
            dist.all_reduce(counts)  # distinct layers over PP, distinct tokens over DP (EP is part of DP)
        return counts if sequence_parallel else counts / tp

    recorder = RoutingRecorder(spec, num_layers, reduce_counts, moe_layers=moe_layers)
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                replay = router.router_replay
                # megatron lists every RouterReplay in a process-wide registry for its global
                # setters, which the engine does not use: leaving ours there would keep every
                # engine built in this process alive.
                if replay in RouterReplay.global_router_replay_instances:
                    RouterReplay.global_router_replay_instances.remove(replay)
                router.gating = _routing(router.gating, recorder, replay, layer.layer_number - 1)
                router.routing = _measuring(router.routing, recorder, layer.layer_number - 1)
    return recorder


def router_rows(real: torch.Tensor, sequence_parallel: bool) -> tuple[int, torch.Tensor]:
    """The router's row count and each real token's row (packed order; -1: another sequence-
    parallel rank's slice) of a ``[b, s]`` real-token mask (``RoutingRecorder.begin``)."""
    b, s = real.shape
    rows = torch.arange(s, device=real.device)[None, :] * b + torch.arange(b, device=real.device)[:, None]
    token_rows = rows[real]
    total = b * s
    if sequence_parallel:
        tp = mpu.get_tensor_model_parallel_world_size()
        total //= tp  # _row_len pads s to a multiple of tp: the slices are whole positions
        low = mpu.get_tensor_model_parallel_rank() * total
        mine = (token_rows >= low) & (token_rows < low + total)
        token_rows = torch.where(mine, token_rows - low, torch.full_like(token_rows, -1))
    return total, token_rows


def _routing(gating, recorder: RoutingRecorder, replay: RouterReplay, layer: int):
    def gating_and_route(input: torch.Tensor) -> torch.Tensor:
        logits = gating(input)
        routed = recorder.observe(layer, logits)
        if routed is None:
            replay.clear_router_replay_action()
            replay.target_topk_idx = None
        else:
            # Set directly, not by set_target_indices: that also queues the indices for
            # megatron's REPLAY_BACKWARD, which the recorder's own queue does (for every backend).
            replay.target_topk_idx = routed
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return logits

    return gating_and_route


def _measuring(routing, recorder: RoutingRecorder, layer: int):
    """``TopKRouter.routing`` reporting its routing map (after replay: what the token
    dispatcher sends) to the recorder."""

    def routing_and_measure(logits: torch.Tensor, *args, **kwargs):
        probs, routing_map = routing(logits, *args, **kwargs)
        recorder.used(layer, routing_map)
        return probs, routing_map

    return routing_and_measure
