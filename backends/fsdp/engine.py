"""``FSDPEngine``: BaseEngine on torch FSDP2 (``fully_shard``) for HF causal LMs and value models.

Every rank holds a data-parallel replica's shard: DP spans the whole world (HSDP when
``fsdp.fsdp_size`` divides it). The micro-batch loop, normalization and optimizer step are
the shared ``engine_api`` pieces; this module adds the HF forward (packed or padded), FSDP2
wrapping, offload, DCP checkpoints and HF-named weight export.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from backends.fsdp import checkpoint as ckpt
from backends.fsdp.export import bucketed_full_tensors
from backends.fsdp.forward import hf_forward
from backends.fsdp.lora import adapter_weights, adapters_off, merged_weights, tied_target_problems
from backends.fsdp.model import apply_activation_checkpointing, apply_fsdp, build_mesh, fsdp_problems, load_model
from backends.fsdp.options import FSDPOptions
from backends.hf import attach_router_recorder
from engine_api import BaseEngine, ckpt_layout, register_engine
from engine_api.base import bucket_bytes
from engine_api.config import options_of
from engine_api.dist import all_reduce, compute_device, ensure_process_group
from engine_api.losses import DeferredNormalizer
from engine_api.lr_schedule import build_lr_scheduler
from engine_api.optim import build_adamw, clip_and_step
from engine_api.step import StepSpec, forward_backward_loop


@register_engine("fsdp")
class FSDPEngine(BaseEngine):
    """FSDP2 engine. Outputs per micro-batch: ``log_probs`` (and ``entropy`` when the batch's
    metadata ``calculate_entropy`` is True; logits are divided by metadata ``temperature``,
    default 1) for ``head: lm``; ``values`` for ``head: value``, where ``values[i]`` is
    predicted from the prefix before token i (aligned like log-probs; 0 at position 0)."""

    options_class = FSDPOptions
    supports_lora = True

    @classmethod
    def check_config(cls, config) -> list[str]:
        """FSDP-specific problems found at ``build_engine`` (see ``BaseEngine.check_config``)."""
        return fsdp_problems(config) + tied_target_problems(config.model.lora, config.model.path)

    def init_model(self) -> None:
        """Load the HF model, shard it with FSDP2, build AdamW + LR schedule, apply offload.

        Collective. Joins the launcher's world when there is one (torchrun), else creates a
        1-rank group so one process runs the same FSDP2 code as N
        (``engine_api.dist.ensure_process_group``).
        """
        self.device = compute_device()
        ensure_process_group("nccl" if self.device.type == "cuda" else "gloo", self.config.dist_timeout_s)
        self.mesh = build_mesh(self.device, dist.get_world_size(), options_of(self.config, FSDPOptions).fsdp_size)
        model = load_model(self.config, self.device)
        # MoE: HF's load-balancing loss and the expert-load metrics (engine_api.moe).
        self.router = attach_router_recorder(model, lambda counts: all_reduce(counts, "sum", self.dp_group))
        if self.config.frozen:
            model.requires_grad_(False)
        if self.config.model.gradient_checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(model, self.mesh, self.config)
        self.model = model.to(self.device)
        self.vocab_size = model.config.vocab_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        # Only trainable parameters: with LoRA the adapters (the frozen base gets no state).
        self.optimizer = None if self.config.frozen else build_adamw(self._trainable(), self.config.optim)
        self.scheduler = None if self.config.frozen else build_lr_scheduler(self.optimizer, self.config.optim)
        if self.config.model.lora.enabled and dist.get_rank() == 0:
            trained, total = sum(p.numel() for p in self._trainable()), sum(p.numel() for p in self.model.parameters())
            print(f"[enginekit] LoRA rank {self.config.model.lora.rank}: {trained:,} of {total:,} parameters trained", flush=True)
        self.deferred = DeferredNormalizer(self.config.loss_agg_mode, self.config.loss_agg_constant)
        self.global_step = 0
        self._forward_ran = False  # see _reset_fsdp_iteration
        self._offload(model=self.config.offload.param, optimizer=self.config.offload.optimizer)

    # ------------------------------------------------------------------ modes and placement
    def train_mode(self):
        """Params, grads and optimizer state on the compute device; ``train()``; offload on exit."""
        return self._switch_mode([self.model], training=True)

    def eval_mode(self):
        """Params on the compute device; ``eval()``; offload on exit."""
        return self._switch_mode([self.model], training=False)

    def to(self, device, model: bool = True, optimizer: bool = True) -> None:
        """Load (the compute device) or offload (the CPU) params + grads (``model``) and/or
        optimizer state; :attr:`offloaded` records it (``BaseEngine._load_or_offload``: on a
        CPU-only machine ``"cpu"`` is the compute device and loads)."""
        self._load_or_offload(device, model=model, optimizer=optimizer)

    def _move(self, kind: str, load: bool) -> None:
        # Copies (BaseEngine._relocate_*), so the loaded storage is released on a CPU-only
        # machine too, where both directions are "cpu" (module.to would keep the same tensors).
        device = self.device if load else torch.device("cpu")
        if kind == "model":
            self._relocate_module(self.model, device)  # moves .grad with each param; FSDP2 re-registers its shards
        elif self.optimizer is not None:
            self._relocate_state(self.optimizer, device)  # AdamW keeps its step on the CPU
        if not load and torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_size(self) -> int:
        return dist.get_world_size()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    # ------------------------------------------------------------------ compute
    def forward_backward_step(self, batch, ctx=None, forward_only=False, preprocess_fn=None, postprocess_fn=None):
        """See ``BaseEngine.forward_backward_step``. Micro-batches run on the compute device;
        predictions come back on every rank, on ``batch``'s device and jagged layout."""
        if forward_only:
            try:
                return self._forward_backward(batch, ctx, True, preprocess_fn, postprocess_fn)
            finally:
                # FSDP2 records every forward for backward prefetching and forgets the record
                # only in a backward: forward-only calls (inference, a frozen engine) would
                # grow it forever (measured: +0.18 KiB per call, linear over 1500 calls).
                self._reset_fsdp_iteration()
        self._refuse_if_frozen("forward_backward_step(forward_only=False)")
        return self._forward_backward(batch, ctx, False, preprocess_fn, postprocess_fn)

    def _forward_backward(self, batch, ctx, forward_only, preprocess_fn, postprocess_fn):
        self._require_loaded(model=True, optimizer=False)
        spec = StepSpec(
            config=self.config,
            dp_group=self.dp_group,
            forward=self._forward,
            vocab_size=self.vocab_size,
            device=self.device,
            max_positions=self.max_positions,
            router=self.router,
        )
        return forward_backward_loop(spec, batch, self._loss_fn, self.deferred, ctx, forward_only, preprocess_fn, postprocess_fn)

    def _forward(self, mb: TensorDict) -> TensorDict:
        self._forward_ran = True
        # mb is already on the compute device (the loop moved it).
        rows = self.router.begin if self.router is not None and torch.is_grad_enabled() else None
        base_only = self.config.model.lora.enabled and "disable_adapters" in mb.keys() and mb.get_non_tensor("disable_adapters")
        with adapters_off(self.model) if base_only else contextlib.nullcontext():
            return hf_forward(self.model, mb, self.config.model.head, self.config.use_remove_padding, on_rows=rows)

    def optimizer_zero_grad(self) -> None:
        """Clear grads and the accumulation window; also FSDP2's per-iteration state, which a
        call that raised part-way (e.g. in the loss function) leaves behind (torch's documented
        recovery: ``reset_iter_state`` on the root module)."""
        self._refuse_if_frozen("optimizer_zero_grad")
        # As on megatron (whose grad buffers are freed while offloaded): refused before any
        # change, so a train_batch outside the modes leaves the window as it was.
        self._require_loaded(model=True, optimizer=True)
        self.optimizer.zero_grad(set_to_none=True)
        self.deferred.reset()
        self._reset_fsdp_iteration()

    def _reset_fsdp_iteration(self) -> None:
        # Waits for in-flight collectives, reshards, clears FSDP2's iteration trackers. Only
        # between iterations (nothing in flight), and only after a forward ran (before FSDP2's
        # lazy init its state has nothing to reset and the reset fails); absent before torch 2.13.
        reset = getattr(self.model, "reset_iter_state", None)
        if reset is not None and self._forward_ran:
            reset()
            self._forward_ran = False

    def optimizer_step(self) -> float:
        """Deferred normalization, global pre-clip norm (collective), skip decision agreed by
        every rank (non-finite norm or loss), clip, AdamW step."""
        self._refuse_if_frozen("optimizer_step")
        self._require_loaded(model=True, optimizer=True)
        deferred = self.deferred if self.config.deferred_normalization else None
        params = self._trainable()
        grad_norm = clip_and_step(params, self.optimizer, self.config.optim.clip_grad, deferred, window=self.deferred, group=self.dp_group)
        if math.isfinite(grad_norm):
            # only what the step changed (with LoRA, not the whole frozen base every step)
            self._check_update([(n, p) for n, p in self.model.named_parameters() if p.requires_grad])
            self.global_step += 1
        return grad_norm

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def lr_scheduler_step(self) -> float:
        """Advance the schedule; return the new learning rate."""
        return self._step_scheduler()

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None) -> None:
        """DCP save of model + optimizer, plus scheduler, RNG and step per rank. Collective."""
        self._refuse_if_frozen("save_checkpoint (the frozen weights are the HF directory)")
        self._refuse_if_broken("save_checkpoint")
        extra = ckpt_layout.make_extra(self.scheduler, global_step)
        with self._loaded():
            ckpt.save(self.model, self.optimizer, extra, local_path, global_step, self._keep(max_ckpt_to_keep), hdfs_path, self._lora)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True) -> int:
        """Restore the newest complete checkpoint under ``local_path`` (or ``hdfs_path``). Collective."""
        self._refuse_if_frozen("load_checkpoint")
        with self._loaded():
            extra = ckpt.load(
                self.model, self.optimizer, local_path, hdfs_path, del_local_after_load, self.config.checkpoint.verify, self._lora
            )
        self.global_step = ckpt_layout.apply_extra(extra, self.scheduler, self.config.seed)
        self.deferred.reset()
        self._broken = None
        return self.global_step

    @property
    def _lora(self) -> dict:
        """What a LoRA checkpoint must match ({} without LoRA)."""
        lora = self.config.model.lora
        if not lora.enabled:
            return {}
        return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules), "head": self.config.model.head}

    def export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the LoRA adapters by peft's names (see ``BaseEngine.export_adapter_weights``). Collective."""
        if not self.config.model.lora.enabled:
            yield from super().export_adapter_weights()
            return
        self._refuse_if_broken("export_adapter_weights")
        with self._loaded(optimizer=False):
            yield from adapter_weights(self.model)

    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` one parameter at a time (each an all-gather), so
        peak memory is one full tensor. FSDP2 keeps HF module names, so names are HF's;
        tied weights appear under both names, as in HF's own ``state_dict``. With LoRA: the
        merged weights, one decoder layer gathered at a time (``backends.fsdp.lora``;
        ``bucket_mb`` is then ignored: a layer is the unit).

        ``bucket_mb``: gather in flat buckets of about this many MB, one collective per bucket
        (``backends.fsdp.export``; same tensors, same order, bit-exact); extra memory is then a
        few times a bucket (the local shards side by side, the gathered buffer, the tensors
        reassembled from it)."""
        self._refuse_if_broken("export_weights")
        size = bucket_bytes(bucket_mb)  # (here, not in the generator: a bad size raises at the call)
        return self._export(size)

    def _export(self, size: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        with self._loaded(optimizer=False):
            if self.config.model.lora.enabled:
                yield from merged_weights(self.model)
                return
            if size is not None:
                yield from bucketed_full_tensors(iter(self.model.state_dict().items()), size)
                return
            for name, tensor in self.model.state_dict().items():
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                yield name, full.detach()
