"""Megatron -> HF weights for ``export_weights``: gather TP shards, broadcast each PP stage's
tensors to every rank, convert names and layouts (``backends.megatron.convert.to_hf``: the same
table import uses, inverted), one parameter or one bucket of parameters at a time (issue 18,
item 2), with tensor collectives only (the PP broadcast is ``engine_api.dist.broadcast_tensors``:
a JSON header, then flat buffers; nothing is pickled).

LoRA: each adapted weight is exported merged (``W + alpha / r * B A`` per HF projection, computed
on the local shard: ``backends.megatron.lora.LinearAdapter.delta_weight``), the adapters
themselves are not HF weights; :func:`export_adapters` yields them by peft's names.

MoE layers: each layer's experts become HF's two fused tensors (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``; ``convert.hf_experts``), gathered over expert-TP and EP.

Collective over the world: every rank yields every tensor, in the same order (stage by stage,
chunk by chunk, parameter by parameter). One parameter, or one bucket (one MoE layer's
experts), is materialised at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from backends.megatron.convert import ArchInfo, hf_experts, to_hf
from backends.megatron.lora import adapter_of, peft_items
from backends.megatron.model import global_layer
from backends.megatron.precision import unwrap
from engine_api.kit import broadcast_tensors

_EXPERT = ".mlp.experts.local_experts."


def export_hf(model_chunks, arch: ArchInfo, bucket_bytes: int | None = None, value=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` (on CPU) for every weight of the model.

    ``value(param)``: the local tensor to export for a model parameter (under mixed precision
    its fp32 main: ``backends.megatron.precision.main_values``; may be a collective, called in
    the same parameter order on every rank); the parameter itself by default.

    ``bucket_bytes``: gather and move consecutive parameters of one dtype in buckets of about
    this many bytes of full tensors (one TP all-gather and one PP broadcast per bucket; a larger
    parameter is a bucket of its own); ``None``: one parameter at a time. Same names, same
    order, bit-identical tensors either way. Extra memory on the stage that owns a bucket: a few
    times the bucket (the local shards side by side, the gathered buffer, the reassembled full
    tensors and their HF-layout copies), on the compute device until they move to CPU."""
    seen: set[str] = set()
    embedding = None
    value = value or (lambda param: param)
    for hf_name, tensor in _every_stage(lambda: _hf_groups(model_chunks, arch, bucket_bytes, value)):
        if hf_name == "model.embed_tokens.weight":
            embedding = tensor.clone()  # (a view would keep its whole bucket alive)
        if hf_name not in seen:  # tied embeddings: the last stage's copy repeats lm_head
            seen.add(hf_name)
            yield hf_name, tensor
    if arch.tied and "lm_head.weight" not in seen and embedding is not None:
        # HF's own state_dict lists the tied head too; keep the same key set as the FSDP backend.
        yield "lm_head.weight", embedding


def _hf_groups(model_chunks, arch: ArchInfo, bucket_bytes: int | None, value) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """This stage's HF pairs, one list per bucket (one MoE layer's experts are a bucket)."""
    tp = mpu.get_tensor_model_parallel_world_size()
    bucket: list[tuple] = []
    size = 0
    for module, name, param in _export_items(model_chunks):
        if isinstance(param, list):  # one MoE layer's experts
            yield from _convert(bucket, arch, tp, value)
            bucket, size = [], 0
            yield _experts_to_hf(module, name, [(value(w1), value(w2)) for w1, w2 in param], arch)
            continue
        param = value(param)  # read here, a bucket at a time (under mixed precision: the fp32 main)
        nbytes = param.numel() * param.element_size() * (tp if _tp_split(param) else 1)
        if bucket and (bucket_bytes is None or size + nbytes > bucket_bytes or bucket[0][2].dtype != param.dtype):
            yield from _convert(bucket, arch, tp, value)
            bucket, size = [], 0
        bucket.append((module, name, param))
        size += nbytes
    yield from _convert(bucket, arch, tp, value)


def _convert(bucket: list[tuple], arch: ArchInfo, tp: int, value) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """One bucket's HF pairs: its TP-split parameters gathered in one all-gather."""
    if not bucket:
        return
    # LoRA merged here, a bucket at a time (not all up front: a second copy of the model)
    fulls = _gather_tp_bucket([_merged(module, name, param, value) for module, name, param in bucket])
    pairs = []
    for (module, name, _), full in zip(bucket, fulls, strict=True):
        pairs += to_hf(name, full, arch, global_layer(module, name), tp)
    yield pairs


def _broadcast_groups(groups, owner: int, pp_group) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The owner stage's groups on every rank of the PP group, one ``broadcast_tensors`` per
    group (tensor collectives; the header's ``extra`` says whether a group follows)."""
    while True:
        if groups is None:  # not the owner: receive
            pairs, more = broadcast_tensors(None, None, owner, pp_group)
        else:
            pairs = next(groups, None)
            pairs, more = broadcast_tensors(pairs or [], pairs is not None, owner, pp_group)
        if not more:
            return
        yield pairs


def _export_items(model_chunks) -> list[tuple]:
    """``(module, name, param)`` per parameter, except that a MoE layer's expert parameters
    become one item ``(module, first expert name, [(fc1, fc2) per local expert])``."""
    items, experts = [], {}
    for chunk in model_chunks:
        model = unwrap(chunk)
        params = dict(model.named_parameters())
        for name, param in params.items():
            if name.startswith("lora."):
                continue  # merged into the weights they adapt
            if _EXPERT not in name:
                items.append((model, name, param))
                continue
            prefix = name.split(_EXPERT)[0]
            if (id(chunk), prefix) in experts:
                continue
            count = len(model.get_submodule(prefix + ".mlp.experts.local_experts"))
            pairs = [
                (params[f"{prefix}{_EXPERT}{j}.linear_fc1.weight"], params[f"{prefix}{_EXPERT}{j}.linear_fc2.weight"]) for j in range(count)
            ]
            experts[(id(chunk), prefix)] = True
            items.append((model, name, pairs))
    return items


def _merged(module, name: str, param: torch.Tensor, value) -> torch.Tensor:
    """``param`` with its LoRA delta added (a new tensor carrying megatron's TP attributes,
    which the gather reads), or ``param`` itself where no adapter sits."""
    owner, _, leaf = name.rpartition(".")
    adapter = adapter_of(module.get_submodule(owner)) if leaf == "weight" else None
    if adapter is None:
        return param
    merged = param.detach() + adapter.delta_weight(value).to(param.dtype)
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, attr):
            setattr(merged, attr, getattr(param, attr))
    return merged


def export_adapters(model_chunks, value=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(peft_name, full_tensor)`` (on CPU) of every LoRA adapter tensor, named as peft
    saves them: TP-split tensors gathered, each stage's tensors broadcast over PP, TP padding
    rows of an output layer's ``B`` dropped. ``value``: as :func:`export_hf`'s. Collective
    over the world."""
    value = value or (lambda param: param)
    yield from _every_stage(lambda: _adapter_groups(model_chunks, value))


def _every_stage(own_groups) -> Iterator[tuple[str, torch.Tensor]]:
    """Every pipeline stage's ``(name, tensor)`` pairs on every rank, stage by stage, on CPU:
    ``own_groups()`` (this stage's lists of pairs) on the owning stage, broadcast over PP."""
    pp_group = mpu.get_pipeline_model_parallel_group()
    pp, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    for stage in range(pp):
        groups = own_groups() if stage == pp_rank else None
        if pp > 1:
            groups = _broadcast_groups(groups, dist.get_global_rank(pp_group, stage), pp_group)
        for pairs in groups:
            for name, tensor in pairs:
                yield name, tensor.cpu()


def _adapter_groups(model_chunks, value) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """This stage's adapter tensors, one list (one TP gather) per adapted linear."""
    for chunk in model_chunks:
        lora = getattr(unwrap(chunk), "lora", None)
        for adapter in lora.adapters if lora is not None else ():
            items = list(peft_items(adapter))
            fulls = _gather_tp_bucket([value(t) for _, t, _ in items])
            yield [(name, full[:rows].detach().clone()) for (name, _, rows), full in zip(items, fulls, strict=True)]


def _experts_to_hf(module, name: str, local: list, arch: ArchInfo) -> list[tuple[str, torch.Tensor]]:
    """HF's fused expert tensors of one MoE layer: every local expert gathered over expert-TP,
    then every EP rank's experts in EP-rank order (global expert ids, ``convert.to_megatron``)."""
    etp_group, ep_group = mpu.get_expert_tensor_parallel_group(), mpu.get_expert_model_parallel_group()
    # Stacked first, so each group costs one all-gather per layer, not one per expert.
    fc1 = _gather(torch.stack([w1.detach() for w1, _ in local]), etp_group, 1)
    fc2 = _gather(torch.stack([w2.detach() for _, w2 in local]), etp_group, 2)
    fc1, fc2 = _gather(fc1, ep_group, 0), _gather(fc2, ep_group, 0)
    return hf_experts(fc1.cpu(), fc2.cpu(), arch, global_layer(module, name), mpu.get_expert_tensor_parallel_world_size())


def _gather(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate ``tensor`` over ``group`` along ``dim`` (itself for a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor.detach()
    parts = [torch.empty_like(tensor.detach()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _tp_split(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over TP (megatron marks such params; read the attribute on the
    Parameter itself: detach() would drop it)."""
    return bool(getattr(param, "tensor_model_parallel", False)) and mpu.get_tensor_model_parallel_world_size() > 1


def _gather_tp_bucket(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full tensors of ``params``: the TP-split ones concatenated along their partition dim
    from one ``all_gather_into_tensor`` of their flattened local shards (megatron splits evenly,
    so every TP rank's buffer has the same size); the others as they are (replicated over TP)."""
    split = [p for p in params if _tp_split(p)]
    gathered: dict[int, torch.Tensor] = {}
    if split:
        group = mpu.get_tensor_model_parallel_group()
        world = dist.get_world_size(group)
        local = torch.cat([p.detach().reshape(-1) for p in split])
        received = local.new_empty(world * local.numel())
        dist.all_gather_into_tensor(received, local, group=group)
        regions = received.view(world, local.numel())
        offset = 0
        for p in split:
            n = p.numel()
            pieces = [regions[k, offset : offset + n].view(p.shape) for k in range(world)]
            gathered[id(p)] = torch.cat(pieces, dim=p.partition_dim)
            offset += n
    return [gathered.get(id(p), p.detach()) for p in params]
