"""Megatron -> HF weights for ``export_weights``: gather TP shards, broadcast each PP stage's
tensors to every rank, convert names and layouts (``backends.megatron.convert.to_hf``).

Collective over the world: every rank yields every tensor, in the same order (stage by stage,
chunk by chunk, parameter by parameter). One parameter is materialised at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from backends.megatron.convert import ArchInfo, to_hf
from backends.megatron.model import global_layer


def export_hf(model_chunks, arch: ArchInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` (on CPU) for every weight of the model."""
    tp = mpu.get_tensor_model_parallel_world_size()
    pp_group = mpu.get_pipeline_model_parallel_group()
    pp, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    mine = [(chunk.module, name, param) for chunk in model_chunks for name, param in chunk.module.named_parameters()]
    seen: set[str] = set()
    embedding = None
    for stage in range(pp):
        owner = dist.get_global_rank(pp_group, stage) if pp > 1 else dist.get_rank()
        count = [len(mine) if stage == pp_rank else None]
        if pp > 1:
            dist.broadcast_object_list(count, src=owner, group=pp_group)
        for i in range(count[0]):
            pairs = None
            if stage == pp_rank:
                module, name, param = mine[i]
                full = _gather_tp(param)
                pairs = to_hf(name.replace("output_layer.linear.", "output_layer."), full.cpu(), arch, global_layer(module, name), tp)
            if pp > 1:
                holder = [pairs]
                dist.broadcast_object_list(holder, src=owner, group=pp_group)
                pairs = holder[0]
            for hf_name, tensor in pairs:
                if hf_name == "model.embed_tokens.weight":
                    embedding = tensor
                if hf_name not in seen:  # tied embeddings: the last stage's copy repeats lm_head
                    seen.add(hf_name)
                    yield hf_name, tensor
    if arch.tied and "lm_head.weight" not in seen and embedding is not None:
        # HF's own state_dict lists the tied head too; keep the same key set as the FSDP backend.
        yield "lm_head.weight", embedding


def _gather_tp(param: torch.Tensor) -> torch.Tensor:
    """Concatenate a TP-split parameter along its partition dim (megatron marks such params)."""
    # Read megatron's attributes on the Parameter itself: detach() would drop them.
    if not getattr(param, "tensor_model_parallel", False) or mpu.get_tensor_model_parallel_world_size() == 1:
        return param.detach()
    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(param.detach()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)
