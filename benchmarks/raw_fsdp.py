"""The baseline a user would write without Enginekit: an HF model, FSDP2, AdamW, a packed step.

Same model directory, same ``fully_shard`` layout (each decoder layer, then the root), same
AdamW hyper-parameters, gradient clipping and constant LR schedule as the engine. The step
packs the batch with per-sequence positions into the rows ``backends.fsdp.forward.packed_rows``
lays out (HF's remove-padding input, exactly what the engine feeds the model: the same rows,
so both sides do the same attention work; that layout helper is the only shared code), computes the token-mean NLL of the loss-mask tokens with
a plain log-softmax, and steps; with ``micro_batches > 1`` it accumulates gradients over
consecutive slices of the batch, each scaled by the batch's token count. No engine_api code
runs inside the timed step.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from backends.fsdp.forward import packed_rows
from benchmarks.common import micro_batch_rows


class RawFSDPTrainer:
    """Hand-written FSDP2 training step on the 1-rank gloo group the engine already created."""

    def __init__(self, path: str, lr: float = 1e-4, weight_decay: float = 0.01, clip: float = 1.0) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.clip = clip

    def step(self, batch, micro_batches=1) -> tuple[float, float]:
        """One optimizer step on ``batch`` (a protocol batch, read through its flat values and
        offsets) in ``micro_batches`` (a count, or row-index lists:
        ``benchmarks.common.micro_batch_rows``); returns (loss, pre-clip grad norm)."""
        total_tokens = batch["loss_mask"].values().sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb_ids, mb_mask, mb_offsets in micro_batch_rows(batch, micro_batches):
            lengths = mb_offsets[1:] - mb_offsets[:-1]
            positions = torch.arange(mb_ids.numel()) - torch.repeat_interleave(mb_offsets[:-1], lengths)
            rows, row_pos, index = packed_rows(mb_ids, positions, mb_offsets, self.model.config)
            logits = self.model(input_ids=rows, position_ids=row_pos, use_cache=False).logits.flatten(0, 1)
            logits = logits if index is None else logits[index]
            # Position t predicts t + 1; predictions across a sequence boundary land on a sequence
            # start, where the loss mask is 0.
            logp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, mb_ids[1:, None]).squeeze(-1)
            loss = -(logp * mb_mask[1:]).sum() / total_tokens
            loss.backward()
            loss_sum += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.scheduler.step()
        return loss_sum, norm
