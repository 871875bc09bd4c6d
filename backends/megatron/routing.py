"""Feed megatron's MoE routers into the shared routing recorder (``engine_api.moe``): HF's
load-balancing loss and the expert-load metrics, with one definition for both backends.

Each ``TopKRouter``'s ``gating`` (the logits, before megatron's own top-k) is wrapped on the
instance to record its output. The router sees ``[s, b]`` tokens flattened sequence-major
(megatron's ``[s, b, h]`` activations), so the real-token mask is handed over transposed; under
sequence parallelism each TP rank routes its own slice of the sequence, so it gets that slice
of the mask and counts are summed over TP; without it every TP rank routes the same tokens and
the duplicate counts are divided out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from engine_api.kit import RouterSpec, RoutingRecorder


def attach_router_recorder(chunks, spec: RouterSpec | None, num_layers: int, sequence_parallel: bool) -> RoutingRecorder | None:
    """A recorder fed by every MoE layer's router of this rank's model chunks (None when the
    model has no experts)."""
    if spec is None:
        return None
    tp = mpu.get_tensor_model_parallel_world_size()

    def reduce_counts(counts: torch.Tensor) -> torch.Tensor:
        if dist.get_world_size() > 1:
            dist.all_reduce(counts)  # distinct layers over PP, distinct tokens over DP (EP is part of DP)
        return counts if sequence_parallel else counts / tp

    recorder = RoutingRecorder(spec, num_layers, reduce_counts)
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.gating = _recording(router.gating, recorder, layer.layer_number - 1)
    return recorder


def router_mask(real: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """The router's row order of a ``[b, s]`` real-token mask (this TP rank's slice under SP)."""
    mask = real.t()
    if sequence_parallel:
        mask = mask.chunk(mpu.get_tensor_model_parallel_world_size())[mpu.get_tensor_model_parallel_rank()]
    return mask.reshape(-1)


def _recording(gating, recorder: RoutingRecorder, layer: int):
    def gating_and_record(input: torch.Tensor) -> torch.Tensor:
        logits = gating(input)
        recorder.record(layer, logits)
        return logits

    return gating_and_record
