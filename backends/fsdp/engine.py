"""``FSDPEngine``: BaseEngine on torch FSDP2 (``fully_shard``) for HF causal LMs and value models.

Parameters are sharded over the whole world (HSDP when ``fsdp.fsdp_size`` divides it). Data
parallelism spans the world too, unless ``fsdp.ulysses_sequence_parallel_size`` (SP) > 1: the
world is then a DP x SP mesh, the SP ranks of one DP rank share its data shard and split each
sequence (``backends.fsdp.ulysses``). The micro-batch loop, normalization and optimizer step
are the shared ``engine_api`` pieces; this module adds the HF forward (packed or padded), FSDP2
wrapping, offload, DCP checkpoints and HF-named weight export.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_step
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from transformers import AutoConfig

from backends.fsdp import checkpoint as ckpt
from backends.fsdp.export import bucketed_full_tensors
from backends.fsdp.forward import hf_forward, packed_rows_exact
from backends.fsdp.lm_head import PROBE_MISMATCH, chunked_head_exact, chunked_head_problem
from backends.fsdp.lora import (
    adapter_weights,
    adapters_off,
    merged_weights,
    reset_adapters,
    tied_target_problems,
    unmatched_target_problems,
)
from backends.fsdp.model import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    build_mesh,
    compile_problems,
    compute_dtype,
    fsdp_problems,
    load_model,
)
from backends.fsdp.options import FSDPOptions
from backends.fsdp.ulysses import apply_ulysses, ulysses_problems
from backends.hf import attach_router_recorder, note_once
from engine_api.kit import (
    ROUTING_FIELD,
    BaseEngine,
    StepSpec,
    all_reduce,
    build_adamw,
    build_lr_scheduler,
    compute_device,
    ensure_process_group,
    loss_mask_of,
    options_of,
    register_engine,
    sum_keep_grad,
    unpack,
    wants_routing,
)


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
        lora = config.model.lora
        out = fsdp_problems(config) + compile_problems(config) + tied_target_problems(lora, config.model.path)
        out += unmatched_target_problems(lora, config.model.path, config.model.head)
        sp = options_of(config, FSDPOptions).ulysses_sequence_parallel_size
        if sp > 1 and not out and os.path.isdir(config.model.path or ""):  # (a missing directory is reported elsewhere)
            out += ulysses_problems(AutoConfig.from_pretrained(config.model.path), sp)
        return out

    def _build_model(self) -> None:
        """Load the HF model, shard it with FSDP2, build AdamW + LR schedule.

        Collective. Joins the launcher's world when there is one (torchrun), else creates a
        1-rank group so one process runs the same FSDP2 code as N
        (``engine_api.dist.ensure_process_group``).
        """
        self.device = compute_device()
        ensure_process_group("nccl" if self.device.type == "cuda" else "gloo", self.config.dist_timeout_s)
        options = options_of(self.config, FSDPOptions)
        world = dist.get_world_size()
        self.mesh = build_mesh(self.device, world, options.fsdp_size)
        # Sequence parallelism: a DP x SP mesh of its own (the FSDP mesh still spans the world:
        # parameters are sharded over every rank, whatever slice of the data it runs).
        sp = options.ulysses_sequence_parallel_size
        self.sp_mesh = None if sp == 1 else init_device_mesh(self.device.type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
        self.sp_group = None if self.sp_mesh is None else self.sp_mesh.get_group("sp")
        model = load_model(self.config, self.device)
        # MoE: HF's load-balancing loss and the expert-load metrics (engine_api.moe). Counts sum
        # over every rank (SP ranks route different tokens); the aux loss's statistics over SP.
        reduce_stats = None if self.sp_group is None else partial(sum_keep_grad, group=self.sp_group)
        self.router = attach_router_recorder(model, lambda counts: all_reduce(counts, "sum", dist.group.WORLD), reduce_stats)
        if self.sp_group is not None:
            apply_ulysses(model)
        if self.config.frozen:
            model.requires_grad_(False)
        if self.config.model.gradient_checkpointing:
            apply_activation_checkpointing(model)
        if self.config.compile:
            apply_compile(model)
        apply_fsdp(model, self.mesh, self.config)
        self.model = model.to(self.device)
        self.vocab_size = model.config.vocab_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        # Only trainable parameters: with LoRA the adapters (the frozen base gets no state).
        self.optimizer = None if self.config.frozen else build_adamw(self._trainable_parameters(), self.config.optim)
        self.scheduler = None if self.config.frozen else build_lr_scheduler(self.optimizer, self.config.optim)
        if self.config.model.lora.enabled and dist.get_rank() == 0:
            trained, total = sum(p.numel() for p in self._trainable_parameters()), sum(p.numel() for p in self.model.parameters())
            print(f"[enginekit] LoRA rank {self.config.model.lora.rank}: {trained:,} of {total:,} parameters trained", flush=True)
        self._forward_ran = False  # see _reset_fsdp_iteration
        # Packed rows only where the model honours them (a family whose attention ignores the
        # position restarts would silently mix sequences): checked once, else padded rows.
        self.remove_padding = self.config.use_remove_padding
        half = compute_dtype(self.config) != torch.float32
        # (Under SP the mask of packed rows is built from their positions by backends.fsdp.ulysses.)
        if self.remove_padding and self.sp_group is None:
            self.remove_padding = packed_rows_exact(self.model, self.vocab_size, self.device, half=half)
            self._forward_ran = True
            self._reset_fsdp_iteration()
            if not self.remove_padding:
                note_once(
                    f"[enginekit] use_remove_padding: {model.config.model_type} does not honour packed rows (its attention "
                    "crosses sequence boundaries), so its micro-batches run padded"
                )
        # Log-probs from the LM head in chunks of tokens (backends.fsdp.lm_head), where the model
        # hands the head's output back untouched (checked once on a probe); else full logits.
        self.chunked_head = False
        if self.config.model.head == "lm" and self.sp_group is None:
            why = chunked_head_problem(self.model)
            if why is None:
                self.chunked_head = chunked_head_exact(self.model, self.vocab_size, self.device, half=half)
                self._forward_ran = True
                self._reset_fsdp_iteration()
                why = None if self.chunked_head else PROBE_MISMATCH
            if why is not None:
                note_once(f"[enginekit] {model.config.model_type}: log-probs from full logits ({why})")

    def _modules(self) -> list[torch.nn.Module]:
        return [self.model]

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        return dist.get_rank() if self.sp_mesh is None else self.sp_mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return dist.get_world_size() if self.sp_mesh is None else self.sp_mesh.size(0)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD if self.sp_mesh is None else self.sp_mesh.get_group("dp")

    @property
    def sp_size(self) -> int:
        """Ranks that split each sequence (``fsdp.ulysses_sequence_parallel_size``)."""
        return 1 if self.sp_mesh is None else self.sp_mesh.size(1)

    # ------------------------------------------------------------------ compute
    def _step_spec(self) -> StepSpec:
        # FSDP2 averages gradients over its whole mesh, DP x SP ranks (the loop compensates).
        return StepSpec(
            config=self.config,
            dp_group=self.dp_group,
            grad_reduce_ranks=dist.get_world_size(),
            # SP peers run one batch together: a bad one on any rank must stop all of them
            validate_over_world=self.sp_group is not None,
            forward=self._forward,
            vocab_size=self.vocab_size,
            device=self.device,
            max_positions=self.max_positions,
            router=self.router,
            scores_targets=True
            if self.sp_group is None
            else "sequences are split over ranks (engine.fsdp.ulysses_sequence_parallel_size > 1)",
        )

    def _forward_backward(self, batch, ctx, forward_only, preprocess_fn, postprocess_fn):
        if self.sp_group is not None:
            self._check_sp_peers(batch)
        try:
            return super()._forward_backward(batch, ctx, forward_only, preprocess_fn, postprocess_fn)
        finally:
            if forward_only:
                # FSDP2 records every forward for backward prefetching and forgets the record
                # only in a backward: forward-only calls (inference, a frozen engine) would
                # grow it forever (measured: +0.18 KiB per call, linear over 1500 calls).
                self._reset_fsdp_iteration()

    def _check_sp_peers(self, batch: TensorDict) -> None:
        """Refuse, on every rank, a call whose SP peers hold different batches (each must pass
        ``shard_data`` of the same global batch): they would split different sequences and
        hang in the first all-to-all. Collective over the world (one all-gather of a few numbers)."""
        try:
            ids = batch["input_ids"].values().double()
            weights = torch.arange(ids.numel(), device=ids.device, dtype=torch.float64) % 1009 + 1  # order matters
            mine = [float(batch.batch_size[0]), float((ids * weights).sum()), float(loss_mask_of(batch).values().double().sum())]
        except (KeyError, AttributeError, TypeError, RuntimeError, ValueError):  # malformed: the step's validation names it
            mine = [math.nan] * 3
        # per DP rank, the largest and the smallest fingerprint of its SP ranks (two all-reduces)
        high = torch.full((self.dp_size, 3), -math.inf, dtype=torch.float64, device=self.device)
        high[self.dp_rank] = torch.tensor(mine, dtype=torch.float64)
        low = -high.clone()
        low[self.dp_rank] = high[self.dp_rank]
        high, low = all_reduce(high, "max", dist.group.WORLD).cpu(), all_reduce(low, "min", dist.group.WORLD).cpu()
        bad = [g for g in range(self.dp_size) if not high[g].isnan().any() and not torch.equal(high[g], low[g])]
        if bad:
            raise ValueError(
                f"fsdp.ulysses_sequence_parallel_size = {self.sp_size}: the SP ranks of DP rank {bad[0]} were given different batches "
                "(they split one batch's sequences between them); fix: pass engine.shard_data(global_batch) of the same global "
                "batch on every rank"
            )

    def _forward(self, mb: TensorDict) -> TensorDict:
        self._forward_ran = True
        # mb is already on the compute device (the loop moved it).
        routing, replay, record = wants_routing(mb)
        rows = None
        if self.router is not None and (torch.is_grad_enabled() or routing is not None or record):
            rows = partial(self.router.begin, routing=routing, replay=replay, record=record)
        base_only = self.config.model.lora.enabled and "disable_adapters" in mb.keys() and mb.get_non_tensor("disable_adapters")
        with adapters_off(self.model) if base_only else contextlib.nullcontext():
            out = hf_forward(
                self.model, mb, self.config.model.head, self.remove_padding, on_rows=rows, sp_group=self.sp_group, chunked=self.chunked_head
            )
        if record:  # the router's own routing of every token (engine_api.moe, "Routing replay")
            recorded = self.router.recorded().to(mb["input_ids"].device)
            if self.sp_group is not None:  # each SP rank routed its own tokens, NOT_ROUTED (-1) elsewhere
                recorded = all_reduce(recorded, "max", self.sp_group)
            out.set(ROUTING_FIELD, unpack(recorded, mb["input_ids"]))
        return out

    def _apply_update(self) -> None:
        """AdamW on each parameter's local shard: FSDP2's parameters, gradients and AdamW moments
        are DTensors of one placement each and AdamW is elementwise, so the DTensor step is
        exactly torch's single-tensor step on every local shard (the same kernels on the same
        tensors, bit for bit), here without a DTensor dispatch per operation (measured on a tiny
        GRPO model on CPU: about 3 of the step's 4 ms). The state stays the optimizer's own (its
        lazy initialization, step counts and DTensor moments), so checkpoints and
        ``set_optim_hparams`` see no difference. Anything else (another optimizer, fused or
        foreach kernels, step hooks, a parameter that is not a DTensor) steps through
        ``optimizer.step()``."""
        opt = self.optimizer
        if not _steps_locally(opt):
            super()._apply_update()
            return
        opt._opt_called = True  # what the LR scheduler's wrapper of optimizer.step records
        with torch.no_grad():
            for group in opt.param_groups:
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
                has_complex = opt._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
                beta1, beta2 = group["betas"]
                adam_step(
                    _locals(params),
                    _locals(grads),
                    _locals(exp_avgs),
                    _locals(exp_avg_sqs),
                    _locals(max_exp_avg_sqs),
                    steps,
                    amsgrad=group["amsgrad"],
                    has_complex=has_complex,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=group["maximize"],
                    foreach=False,  # what torch picks for DTensors (not a foreach type), on any device
                    capturable=group["capturable"],
                    differentiable=group["differentiable"],
                    fused=False,
                    grad_scale=getattr(opt, "grad_scale", None),
                    found_inf=getattr(opt, "found_inf", None),
                    decoupled_weight_decay=group["decoupled_weight_decay"],
                )

    def _zero_grad(self) -> None:
        # Also FSDP2's per-iteration state, which a call that raised part-way (e.g. in the loss
        # function) leaves behind (torch's documented recovery: reset_iter_state on the root).
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_fsdp_iteration()

    def _reset_fsdp_iteration(self) -> None:
        # Waits for in-flight collectives, reshards, clears FSDP2's iteration trackers. Only
        # between iterations (nothing in flight), and only after a forward ran (before FSDP2's
        # lazy init its state has nothing to reset and the reset fails); absent before torch 2.13.
        reset = getattr(self.model, "reset_iter_state", None)
        if reset is not None and self._forward_ran:
            reset()
            self._forward_ran = False

    # ------------------------------------------------------------------ state
    def _save_checkpoint(self, local_path, hdfs_path, global_step, keep, extra) -> None:
        """DCP save of model + optimizer, plus scheduler, RNG and step per rank. Collective."""
        ckpt.save(self.model, self.optimizer, extra, local_path, global_step, keep, hdfs_path, self._lora)

    def _load_checkpoint(self, local_path, hdfs_path, del_local_after_load) -> dict:
        """Restore the newest complete checkpoint under ``local_path`` (or ``hdfs_path``). Collective."""
        return ckpt.load(self.model, self.optimizer, local_path, hdfs_path, del_local_after_load, self.config.checkpoint.verify, self._lora)

    @property
    def _lora(self) -> dict:
        """What a LoRA checkpoint must match ({} without LoRA)."""
        lora = self.config.model.lora
        if not lora.enabled:
            return {}
        return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules), "head": self.config.model.head}

    def _reset_adapters(self, seed: int) -> None:
        reset_adapters(self.model, seed)

    def _export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapters by peft's names (see ``BaseEngine.export_adapter_weights``). Collective."""
        return adapter_weights(self.model)

    def _export_weights(self, size: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` one parameter at a time (each an all-gather), so peak
        memory is one full tensor. FSDP2 keeps HF module names, so names are HF's; tied weights
        appear under both names, as in HF's own ``state_dict``. With LoRA: the merged weights,
        one decoder layer gathered at a time (``backends.fsdp.lora``; the bucket size is then
        ignored: a layer is the unit).

        ``size``: gather in flat buckets of about this many bytes, one collective per bucket
        (``backends.fsdp.export``; same tensors, same order, bit-exact); extra memory is then a
        few times a bucket (the local shards side by side, the gathered buffer, the tensors
        reassembled from it)."""
        if self.config.model.lora.enabled:
            yield from merged_weights(self.model)
            return
        if size is not None:
            yield from bucketed_full_tensors(iter(self.model.state_dict().items()), size)
            return
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach()


def _steps_locally(opt) -> bool:
    """Whether :meth:`FSDPEngine._apply_update` may step ``opt`` shard by shard: torch's Adam or
    AdamW with the single-tensor kernels (no ``fused`` / ``foreach`` asked for, not capturable or
    differentiable), no step hooks, every parameter a DTensor."""
    if type(opt) not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or _global_optimizer_pre_hooks or _global_optimizer_post_hooks:
        return False
    return all(
        not group["fused"]
        and not group["foreach"]
        and not group["capturable"]
        and not group["differentiable"]
        and all(isinstance(p, DTensor) for p in group["params"])
        for group in opt.param_groups
    )


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (the tensor its elementwise operations run on)."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
