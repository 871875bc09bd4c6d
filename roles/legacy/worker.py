"""``FSDPWorker``: one HF model under FSDP2 with its own AdamW, LR schedule and micro-batch
loop; no ``BaseEngine``. The loops mirror what a pre-engine PPO worker did: shard the global
batch by rank, split each shard into fixed-size micro-batches in order, normalise the loss by
the global token/sequence counts, backward, clip, step."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from backends.fsdp import checkpoint as ckpt
from backends.fsdp.export import bucketed_full_tensors
from backends.fsdp.forward import hf_forward
from backends.fsdp.model import apply_activation_checkpointing, apply_fsdp, build_mesh, load_model
from backends.fsdp.options import FSDPOptions
from engine_api import ckpt_layout
from engine_api.base import bucket_bytes
from engine_api.batch import loss_mask_of, shard_batch, split_by_size, to_device, unpack, unshard_batch, validate_batch
from engine_api.config import EngineConfig, options_of
from engine_api.dist import all_reduce, comm_device, ensure_process_group
from engine_api.losses import build_norm_context, reduce_summed_metrics
from engine_api.lr_schedule import build_lr_scheduler
from engine_api.optim import check_update_finite
from roles.legacy_flag import legacy_problems

LossFn = Callable[[TensorDict, TensorDict, object], tuple[torch.Tensor, dict[str, float]]]


class FSDPWorker:
    """The model, optimizer and loops of one legacy role. Collective methods must be called on
    every rank; batches passed in are global (every rank holds the same one)."""

    def __init__(self, config: EngineConfig) -> None:
        problems = legacy_problems("enable", config)
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        ensure_process_group("nccl" if self.device.type == "cuda" else "gloo", config.dist_timeout_s)
        mesh = build_mesh(self.device, dist.get_world_size(), options_of(config, FSDPOptions).fsdp_size)
        model = load_model(config, self.device)
        if config.frozen:
            model.requires_grad_(False)
        if config.model.gradient_checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(model, mesh, config)
        self.model = model.to(self.device)
        self.vocab_size = model.config.vocab_size
        o = config.optim
        self.optimizer = None if config.frozen else torch.optim.AdamW(self.model.parameters(), o.lr, tuple(o.betas), o.eps, o.weight_decay)
        self.scheduler = None if config.frozen else build_lr_scheduler(self.optimizer, o)
        self.global_step = 0

    # ------------------------------------------------------------------ loops
    def infer(self, batch: TensorDict, **meta) -> TensorDict:
        """Forward-only per-token outputs of the global ``batch``, on every rank. ``meta``
        becomes batch metadata (``calculate_entropy``, ``temperature``)."""
        local = self._local(batch, meta)
        self.model.eval()
        outputs: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for mb in self._micro_batches(local):
                for key, value in hf_forward(self.model, mb, self.config.model.head, self.config.use_remove_padding).items():
                    outputs.setdefault(key, []).append(value.values().cpu())
        # FSDP2 records each forward for backward prefetching and clears the record only in a
        # backward: without this reset, forward-only calls grow it forever.
        reset = getattr(self.model, "reset_iter_state", None)
        if reset is not None:
            reset()
        ids = local["input_ids"]
        result = TensorDict({k: unpack(torch.cat(v), ids) for k, v in outputs.items()}, batch_size=local.batch_size)
        return unshard_batch(result, dist.group.WORLD)

    def train_epochs(self, batch: TensorDict, epochs: int, mini_batch_size: int | None, loss_fn: LossFn, **meta) -> list[dict]:
        """``epochs`` passes over the global batch in mini-batches of ``mini_batch_size``
        sequences (None: all), one optimizer step each; one metrics dict per step."""
        if self.optimizer is None:
            raise RuntimeError("this legacy worker is frozen (engine.frozen = true) and cannot train; fix: build it unfrozen")
        size = mini_batch_size or batch.batch_size[0]
        self.model.train()
        return [
            self._train_step(self._local(batch[s : s + size], meta), loss_fn)
            for _ in range(epochs)
            for s in range(0, batch.batch_size[0], size)
        ]

    def _train_step(self, local: TensorDict, loss_fn: LossFn) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        c, group, world = self.config, dist.group.WORLD, dist.get_world_size()
        norm = build_norm_context(loss_mask_of(local), c.loss_agg_mode, group, c.loss_agg_constant)
        total = torch.zeros((), dtype=torch.float64)
        per_mb: dict[str, list[float]] = {}
        for mb in self._micro_batches(local):
            loss, metrics = loss_fn(mb, hf_forward(self.model, mb, c.model.head, c.use_remove_padding), norm)
            # The loss is already divided by global counts; FSDP2 averages gradients over the
            # ranks, so multiply by the world size to get the sum instead.
            (loss * float(world)).backward()
            total += loss.detach().double().cpu()
            for key, value in metrics.items():
                per_mb.setdefault(key, []).append(float(value))
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm_t = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        grad_norm = float(norm_t.full_tensor() if isinstance(norm_t, DTensor) else norm_t)
        out = {"loss": float(all_reduce(total.to(comm_device(group)), "sum", group)), "grad_norm": grad_norm, "step_skipped": 1.0}
        if math.isfinite(grad_norm):  # a non-finite norm is the same on every rank: all skip
            if c.optim.clip_grad is not None:
                torch.nn.utils.clip_grads_with_norm_(params, c.optim.clip_grad, norm_t)
            self.optimizer.step()
            check_update_finite(self.model.named_parameters(), self.global_step + 1)  # same guard as the engines
            self.scheduler.step()
            self.global_step += 1
            out.update(step_skipped=0.0, lr=self.scheduler.get_last_lr()[0])
        reduce_summed_metrics(loss_fn, per_mb, group)  # loss terms: their global values, as the engines report
        out.update({key: sum(values) / len(values) for key, values in per_mb.items()})
        return out

    def _local(self, batch: TensorDict, meta: dict) -> TensorDict:
        local = shard_batch(batch, dist.get_rank(), dist.get_world_size())
        validate_batch(local, vocab_size=self.vocab_size)
        for key, value in meta.items():
            local.set_non_tensor(key, value)
        return to_device(local, self.device)

    def _micro_batches(self, local: TensorDict) -> list[TensorDict]:
        return split_by_size(local, self.config.micro_batch_size or local.batch_size[0])

    # ------------------------------------------------------------------ weights and state
    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` one parameter at a time, or in ``bucket_mb`` buckets (the
        FSDP backend's bucketed gather, ``backends.fsdp.export``). Collective."""
        size = bucket_bytes(bucket_mb)
        if size is not None:
            return bucketed_full_tensors(iter(self.model.state_dict().items()), size)
        return self._export_per_tensor()

    def _export_per_tensor(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach()

    def save_checkpoint(self, path: str, global_step: int) -> None:
        """DCP checkpoint of model + optimizer, plus scheduler, RNG and step. Collective."""
        extra = ckpt_layout.make_extra(self.scheduler, global_step)
        ckpt.save(self.model, self.optimizer, extra, path, global_step, self.config.checkpoint.max_ckpt_to_keep, None)

    def load_checkpoint(self, path: str) -> int:
        """Restore the newest complete checkpoint under ``path``; return its step. Collective."""
        extra = ckpt.load(self.model, self.optimizer, path, None, False, self.config.checkpoint.verify)
        self.global_step = ckpt_layout.apply_extra(extra, self.scheduler, self.config.seed)
        return self.global_step
