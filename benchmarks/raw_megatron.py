"""The baseline a megatron-core user would write: GPTModel, megatron DDP, the megatron optimizer,
and ``get_forward_backward_func()``, with no Enginekit code in the timed step.

The GPTModel is built and loaded exactly as the engine builds its own (``backends.megatron.model``:
same TransformerConfig, local layer spec, HF weights), so both sides run the same network; the
step is megatron's standard one: zero the grad buffers, run the schedule (which finalizes the
grads through ``config.finalize_model_grads_func``), ``optimizer.step()``. Micro-batches are
packed the way the local spec needs (one row per micro-batch with a block-diagonal causal mask,
built here with plain torch), and the loss is the token-mean NLL of the loss-mask tokens,
multiplied by the micro-batch count because the schedule divides by it.

megatron's parallel state is process-global, so everything here runs in a spawned process
(:func:`run_cases`), after the engine has initialised that state (and, without CUDA, the
CPU compat layer of ``backends.megatron.cpu_compat``, which both sides then run under).
"""

from __future__ import annotations

from functools import partial

import torch


class RawMegatronTrainer:
    """Hand-written megatron-core training step (TP = PP = DP = 1 here; the code is megatron's own)."""

    def __init__(self, engine_config) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from transformers import AutoConfig

        from backends.megatron.convert import arch_info
        from backends.megatron.model import build_chunks, build_transformer_config, load_hf_weights, read_hf_state

        cfg = engine_config
        self.arch = arch_info(AutoConfig.from_pretrained(cfg.model.path))
        tconfig = build_transformer_config(self.arch, cfg)
        # megatron's standard wiring: the schedule reduces grads over DP when it finishes.
        tconfig.finalize_model_grads_func = finalize_model_grads
        (chunk,) = build_chunks(tconfig, self.arch, cfg)
        load_hf_weights([chunk], read_hf_state(cfg.model.path), self.arch)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
        self.model = DistributedDataParallel(tconfig, ddp, chunk)
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.betas[0],
                adam_beta2=o.betas[1],
                adam_eps=o.eps,
                clip_grad=o.clip_grad or 0.0,
                params_dtype=torch.float32,
            ),
            [self.model],
        )
        self.model.train()

    def step(self, batch, micro_batches=1) -> tuple[float, float]:
        """One optimizer step in ``micro_batches`` (a count, or row-index lists:
        ``benchmarks.common.micro_batch_rows``); returns (loss, pre-clip grad norm)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from benchmarks.common import micro_batch_rows

        mask = batch["loss_mask"].values()
        micro = [_packed_inputs(*rows) for rows in micro_batch_rows(batch, micro_batches)]
        micro_batches = len(micro)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, n=micro_batches, tokens=float(mask.sum())),
            data_iterator=iter(micro),
            model=self.model,
            num_microbatches=micro_batches,
            seq_length=max(m[0].shape[1] for m in micro),
            micro_batch_size=1,
            forward_only=False,
        )
        _, grad_norm, _ = self.optimizer.step()
        return float(sum(item["loss"] for item in store)), float(grad_norm)

    def _forward_step(self, data_iterator, model, n, tokens):
        ids, positions, attn_mask, labels, loss_mask = next(data_iterator)
        logits = model(ids, positions, attention_mask=attn_mask)
        return logits, partial(self._loss, labels, loss_mask, n, tokens)

    def _loss(self, labels, loss_mask, n, tokens, logits):
        logp = torch.log_softmax(logits[0, :-1, : self.arch.vocab].float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        contribution = -(logp * loss_mask).sum() / tokens  # token-mean over the whole batch
        # The schedule divides each micro-batch's loss by the micro-batch count: multiply it back.
        return contribution * n, {"loss": contribution.detach()}


def _packed_inputs(ids, mask, offsets):
    """One micro-batch's flat ``ids``, ``mask`` and ``offsets`` as (tokens [1, s], positions
    [1, s], mask [1, 1, s, s] True = masked, labels, loss mask)."""
    s = ids.numel()
    lengths = offsets[1:] - offsets[:-1]
    positions = torch.arange(s) - torch.repeat_interleave(offsets[:-1], lengths)
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    return ids[None], positions[None], ~allowed[None, None], ids[1:], mask[1:]
