"""Megatron -> HF weights for ``export_weights``: gather TP shards, broadcast each PP stage's
tensors to every rank, convert names and layouts (``backends.megatron.convert.to_hf``).

MoE layers: each layer's experts become HF's two fused tensors (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``; ``convert.hf_experts``), gathered over expert-TP and EP.

Collective over the world: every rank yields every tensor, in the same order (stage by stage,
chunk by chunk, parameter by parameter). One parameter (one MoE layer's experts) is
materialised at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from backends.megatron.convert import ArchInfo, hf_experts, to_hf
from backends.megatron.model import global_layer

_EXPERT = ".mlp.experts.local_experts."


def export_hf(model_chunks, arch: ArchInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` (on CPU) for every weight of the model."""
    tp = mpu.get_tensor_model_parallel_world_size()
    pp_group = mpu.get_pipeline_model_parallel_group()
    pp, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    mine = _export_items(model_chunks)
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
                if isinstance(param, list):  # one MoE layer's experts
                    pairs = _experts_to_hf(module, name, param, arch)
                else:
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


def _export_items(model_chunks) -> list[tuple]:
    """``(module, name, param)`` per parameter, except that a MoE layer's expert parameters
    become one item ``(module, first expert name, [(fc1, fc2) per local expert])``."""
    items, experts = [], {}
    for chunk in model_chunks:
        params = dict(chunk.module.named_parameters())
        for name, param in params.items():
            if _EXPERT not in name:
                items.append((chunk.module, name, param))
                continue
            prefix = name.split(_EXPERT)[0]
            if (id(chunk), prefix) in experts:
                continue
            count = len(chunk.module.get_submodule(prefix + ".mlp.experts.local_experts"))
            pairs = [
                (params[f"{prefix}{_EXPERT}{j}.linear_fc1.weight"], params[f"{prefix}{_EXPERT}{j}.linear_fc2.weight"]) for j in range(count)
            ]
            experts[(id(chunk), prefix)] = True
            items.append((chunk.module, name, pairs))
    return items


def _experts_to_hf(module, name: str, local: list, arch: ArchInfo) -> list[tuple[str, torch.Tensor]]:
    """HF's fused expert tensors of one MoE layer: every local expert gathered over expert-TP,
    then every EP rank's experts in EP-rank order (global expert ids, ``convert.to_megatron``)."""
    etp_group, ep_group = mpu.get_expert_tensor_parallel_group(), mpu.get_expert_model_parallel_group()
    fc1 = torch.stack([_gather(w1, etp_group, 0) for w1, _ in local])
    fc2 = torch.stack([_gather(w2, etp_group, 1) for _, w2 in local])
    fc1, fc2 = _gather(fc1, ep_group, 0), _gather(fc2, ep_group, 0)
    return hf_experts(fc1.cpu(), fc2.cpu(), arch, global_layer(module, name), mpu.get_expert_tensor_parallel_world_size())


def _gather(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate ``tensor`` over ``group`` along ``dim`` (itself for a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor.detach()
    parts = [torch.empty_like(tensor.detach()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gather_tp(param: torch.Tensor) -> torch.Tensor:
    """Concatenate a TP-split parameter along its partition dim (megatron marks such params)."""
    # Read megatron's attributes on the Parameter itself: detach() would drop them.
    if not getattr(param, "tensor_model_parallel", False) or mpu.get_tensor_model_parallel_world_size() == 1:
        return param.detach()
    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(param.detach()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)
