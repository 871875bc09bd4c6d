"""Mixed precision the megatron way (``model.dtype`` bfloat16 or float16).

What Megatron-LM, Megatron-Bridge, verl and NeMo-RL do, and this engine now does:

* the model's parameters are half precision, wrapped in megatron-core's ``Float16Module`` (it
  casts the module, converts the first stage's float inputs and returns the last stage's
  outputs in fp32); megatron DDP reduces gradients in fp32 (``grad_reduce_in_fp32``);
* megatron's optimizer (plain ``Float16OptimizerWithFloat16Params`` or the distributed one)
  keeps fp32 *main* parameters, steps them, and copies them back into the half parameters;
* tensors the anchors keep in fp32 stay fp32: RoPE's ``inv_freq`` is a plain attribute of
  megatron's rotary embedding (``Module.bfloat16`` does not touch it), and the MoE router's
  ``expert_bias`` is kept fp32 by megatron's router itself.

Two things megatron leaves to its caller, done here:

* HF weights reach the fp32 mains exactly. megatron builds the mains from the (already cast)
  half parameters, which would round an fp32 checkpoint to bf16 before the first step;
  :func:`to_half` keeps each trainable parameter's fp32 storage (no copy: ``Module._apply``
  swaps ``param.data``), and :func:`seed_main_params` writes it into the mains (a slice of it
  for the distributed optimizer's shard) and the half parameters are left as their rounding.
* The weight export reads the mains (:func:`main_values`): ``export_weights`` yields fp32
  tensors equal to the trained weights, as the FSDP engine (fp32 parameters, half compute)
  does; a rollout engine that runs in bf16 rounds them to exactly the parameters the trainer
  computed with. Frozen parameters (a reference model, a LoRA base) have no main: they are
  held in half precision like the anchors hold them and exported upcast.

fp16 runs with a constant loss scale of 1 (no dynamic scaling), as the FSDP engine's fp16 does;
bf16 is the supported half precision for training.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes
from megatron.core.transformer.module import Float16Module


def is_mixed(tconfig) -> bool:
    """Whether the model computes in half precision (bf16 / fp16 parameters, fp32 mains)."""
    return bool(tconfig.bf16 or tconfig.fp16)


def to_half(chunks: list[nn.Module], tconfig) -> tuple[list[nn.Module], dict[nn.Parameter, torch.Tensor]]:
    """Wrap each chunk in ``Float16Module`` (which casts it); return the wrapped chunks and the
    exact fp32 values of the trainable parameters before the cast (their own storage, kept
    alive until :func:`seed_main_params` has copied it)."""
    exact = {p: p.data for chunk in chunks for p in chunk.parameters() if p.requires_grad}
    wrapped = [Float16Module(tconfig, chunk) for chunk in chunks]
    return wrapped, exact


def unwrap(module: nn.Module) -> nn.Module:
    """The ``GPTModel`` under megatron DDP and ``Float16Module`` (either may be absent)."""
    from megatron.core.distributed import DistributedDataParallel

    while isinstance(module, DistributedDataParallel | Float16Module):
        module = module.module
    return module


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer])) if optimizer is not None else []


def _is_sharded(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(opt, DistributedOptimizer) for opt in _optimizers(optimizer))


def _local_range(optimizer, param: nn.Parameter):
    """This rank's slice of ``param`` in the distributed optimizer (None: it holds none)."""
    for opt in _optimizers(optimizer):
        gbuf_map = getattr(opt, "model_param_gbuf_map", None)
        if gbuf_map is not None and param in gbuf_map:
            return opt._get_model_param_range_map(param)["param"]
    return None


def seed_main_params(optimizer, exact: dict[nn.Parameter, torch.Tensor]) -> None:
    """Write the exact fp32 values into megatron's main parameters (``param.main_param``: the
    whole tensor with the plain optimizer, this rank's shard with the distributed one)."""
    sharded = _is_sharded(optimizer)
    with torch.no_grad():
        for param, value in exact.items():
            main = getattr(param, "main_param", None)
            if main is None:
                continue
            value = value.to(device=main.device, dtype=main.dtype)
            if sharded and getattr(param, "main_param_sharded", False):
                r = _local_range(optimizer, param)
                main.copy_(value.reshape(-1)[r.start : r.end])
            else:
                main.copy_(value)


def _dp_group(param: nn.Parameter):
    # megatron DDP (one distributed-optimizer instance) shards dense parameters over DP x CP and
    # expert parameters over the expert-data-parallel group (parameters marked allreduce=False)
    if getattr(param, "allreduce", True):
        return mpu.get_data_parallel_group(with_context_parallel=True)
    return mpu.get_expert_data_parallel_group()


def main_values(optimizer, mixed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """``value(param)``: the tensor the export reads for a model parameter.

    fp32 runs: the parameter itself. Mixed precision: its fp32 main (the whole local tensor; with
    the distributed optimizer each rank's shard placed into zeros and summed over the
    parameter's data-parallel group, exact since every element has one nonzero term: a
    collective, called in the same parameter order on every rank by the export); a parameter
    without a main (frozen) upcast. The result carries megatron's TP attributes."""
    if not mixed:
        return lambda param: param
    sharded = _is_sharded(optimizer)

    def value(param: torch.Tensor) -> torch.Tensor:
        if not getattr(param, "requires_grad", False) or optimizer is None:
            out = param.detach().float()
        elif sharded:
            out = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            main = getattr(param, "main_param", None)
            r = _local_range(optimizer, param) if main is not None else None
            if r is not None:
                out.view(-1)[r.start : r.end] = main.detach().to(out.device)
            group = _dp_group(param)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(out, group=group)
        else:
            out = param.main_param.detach().clone()
        copy_tensor_model_parallel_attributes(out, param)
        return out

    return value
