"""The hand-written FSDP2 loop ``benchmarks.gpu_throughput`` measures the engine against (issue 52).

What a user would write in ~100 lines without Enginekit, and what the engine must match:

* the HF ``LlamaForCausalLM`` of the same model directory, fp32 master weights, bf16 compute:
  ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))`` on
  each decoder layer, then the root; with ``compiled``, ``layer.compile()`` on each decoder
  layer before it is sharded (FSDP2's hooks stay outside the compiled graphs);
* packed rows: one row per micro-batch, ``position_ids`` restarting at every sequence, and torch's
  own ``torch.nn.attention.varlen.varlen_attn`` registered as an HF attention function through
  transformers' ``AttentionInterface`` (name :data:`ATTN`), fed ``cu_seqlens`` from the lengths;
* the engine's micro-batches: the same real-token budget partition
  (``engine_api.partition.partition_balanced``, what ``make_micro_batches`` runs on one rank)
  and the same rows in the same order;
* loss = summed token NLL of the loss-mask tokens / the batch's loss-mask token count (the
  engine's token-mean), torch AdamW (fused on CUDA, as the engine), clipping at 1.0, no
  activation checkpointing.

The micro-batches go to the device before the timed steps, as a prefetching data loader would
deliver them; the engine's own micro-batching runs inside its step and counts against it.

CPU (``benchmarks.gpu_throughput --smoke``): ``varlen_attn`` needs CUDA, so the same attention
function runs causal SDPA per sequence instead (exact, slow; plumbing only), in fp32.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

ATTN = "enginekit_loop_varlen"


def _varlen_kwargs(varlen_attn, num_heads: int, num_kv_heads: int) -> dict:
    """Causal (and GQA where the signature asks for it) in the spelling of this torch version:
    ``window_size=(-1, 0)`` (newer) or ``is_causal=True`` (older); without ``enable_gqa`` the
    flash kernel takes fewer K/V heads as they are."""
    params = inspect.signature(varlen_attn).parameters
    out = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params and num_heads != num_kv_heads:
        out["enable_gqa"] = True
    return out


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, varlen, varlen_kwargs: dict, **kwargs):
    """HF attention function over packed rows: ``query`` [1, H, T, D], ``key``/``value``
    [1, H_kv, T, D]; ``cu_seq_lens_q`` / ``max_length_q`` from the model call's kwargs. Returns
    [1, T, H, D] (what HF's attention functions return)."""
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    if query.is_cuda:
        return packed_varlen(query, key, value, cu, max_len, scaling, varlen, varlen_kwargs), None
    bounds = cu.tolist()  # CPU: causal SDPA per sequence
    parts = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=True)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2), None


def packed_varlen(query, key, value, cu, max_len: int, scaling, varlen, varlen_kwargs: dict) -> torch.Tensor:
    """HF's [1, H, T, D] layout to ``varlen``'s [T, H, D] and back to [1, T, H, D]."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    return varlen(q, k, v, cu, cu, max_len, max_len, scale=scaling, **varlen_kwargs).unsqueeze(0)


def register_attention(num_heads: int, num_kv_heads: int) -> str:
    """Register :func:`attention` with transformers under :data:`ATTN`, with torch's
    ``varlen_attn`` and its arguments bound here (resolved once, not inside a compiled graph)."""
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.9
    from transformers import AttentionInterface

    bound = functools.partial(attention, varlen=varlen_attn, varlen_kwargs=_varlen_kwargs(varlen_attn, num_heads, num_kv_heads))
    AttentionInterface.register(ATTN, bound)
    return ATTN


def device_micro_batches(batch, parts: list[list[int]], device: torch.device) -> tuple[list[dict], int]:
    """The model inputs of each micro-batch (rows ``parts`` of the protocol ``batch``), on ``device``:
    one packed row, per-sequence positions, next-token labels (-100 where the loss mask is 0, at
    sequence starts and after each sequence's last token), ``cu_seqlens`` and the longest length;
    and the batch's loss-token count (the loss denominator)."""
    from benchmarks.common import micro_batch_rows

    out, total = [], 0
    for ids, mask, offsets in micro_batch_rows(batch, [torch.tensor(p) for p in parts]):
        lengths = offsets.diff()
        positions = torch.arange(ids.numel()) - torch.repeat_interleave(offsets[:-1], lengths)
        labels = torch.full_like(ids, -100)
        labels[:-1] = torch.where(mask[1:].bool(), ids[1:], -100)
        total += int((labels != -100).sum())
        out.append(
            {
                "input_ids": ids[None].to(device),
                "position_ids": positions[None].to(device),
                "labels": labels.to(device),
                "cu_seq_lens_q": offsets.to(device=device, dtype=torch.int32),
                "max_length_q": int(lengths.max()),
            }
        )
    return out, total


class LoopTrainer:
    """The loop's model, optimizer and step on the 1-rank process group the caller created."""

    def __init__(self, path: str, device: torch.device, bf16: bool, compiled: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(path)
        attn = register_attention(cfg.num_attention_heads, cfg.num_key_value_heads)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).to(device)
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for layer in model.model.layers:
            if compiled:
                layer.compile()
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=device.type == "cuda" or None)

    def step(self, micro_batches: list[dict], total: int) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` with ``total`` loss tokens
        (:func:`device_micro_batches`); returns the loss (on the device: no sync here)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=micro_batches[0]["labels"].device)
        for mb in micro_batches:
            inputs = {k: v for k, v in mb.items() if k != "labels"}
            logits = self.model(**inputs, cu_seq_lens_k=mb["cu_seq_lens_q"], max_length_k=mb["max_length_q"], use_cache=False).logits
            loss = F.cross_entropy(logits[0].float(), mb["labels"], ignore_index=-100, reduction="sum") / total
            loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss_sum
