"""``MegatronEngine``: BaseEngine on megatron-core (GPTModel, parallel_state, megatron DDP,
megatron optimizer, ``get_forward_backward_func`` schedules, dist_checkpointing).

Normalization with megatron's machinery: the schedule divides each micro-batch loss by the
number of micro-batches and megatron DDP averages gradients over DP, so the loss handed to the
schedule is ``contribution * backward_scale * num_microbatches`` (see ``engine_api.losses``).
Gradients are reduced over DP once per optimizer step (``finalize_model_grads`` in
:meth:`_finish_grads`, not per call), which keeps split calls exact with the distributed
optimizer's reduce-scatter too.

Packed micro-batches (``use_remove_padding``) are one row with a block-diagonal causal attention
mask on the local spec (its attention has no THD path); RoPE only sees relative positions inside
a block, so this equals per-sequence attention. Padded micro-batches use the default causal
mask (right padding never leaks into real tokens). The local spec attends densely over the
whole row, so a packed row of T tokens costs T^2 attention scores per head, against
sum(B * L_max^2) padded: without pipelining each micro-batch takes the layout its estimated cost
(:func:`_packed_is_cheaper`) favours (the outputs are the same either way; e.g. 64 sequences of
~9 tokens: ~300k scores per head packed, ~5k padded). With pipeline parallelism every micro-batch
of a call must have one shape (stages exchange fixed-shape tensors), so micro-batches are
packed and padded to the call's longest row, whatever ``use_remove_padding`` says; outputs are
the same either way. With the Transformer-Engine spec micro-batches run padded for now (THD with
PackedSeqParams awaits a GPU run to be validated), and PP > 1 needs equal-size micro-batches.

Context parallelism (``megatron.context_parallel_size`` > 1, TE spec only; GPU, not yet run):
padded rows, widened to a multiple of 2 x CP, are split by megatron's own
``get_batch_on_this_cp_rank`` (chunks ``i`` and ``2 CP - 1 - i``, its causal load balance);
megatron's RoPE and TE's CP attention handle the rest. Each rank computes its chunks'
per-token predictions, which are gathered (``engine_api.seq_split``) so every CP rank computes
the whole loss. megatron DDP averages gradients over DP x CP and megatron's schedule multiplies
each micro-batch loss by CP (``forward_step_calc_loss``), so only the DP average is left for
the loop to compensate (its default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.utils import get_batch_on_this_cp_rank
from tensordict import TensorDict
from transformers import AutoConfig

from backends.megatron import checkpoint as ckpt
from backends.megatron import lora, precision
from backends.megatron.convert import arch_info
from backends.megatron.export import export_adapters, export_hf
from backends.megatron.model import (
    build_chunks,
    build_transformer_config,
    global_layer,
    init_parallel,
    load_hf_weights,
    megatron_problems,
    read_hf_state,
    use_te_spec,
)
from backends.megatron.offload import StorageOffloader
from backends.megatron.options import MegatronOptions
from backends.megatron.routing import attach_router_recorder, router_rows
from engine_api.kit import (
    ROUTING_FIELD,
    BaseEngine,
    CallState,
    RouterSpec,
    StepSpec,
    align_to_tokens,
    broadcast_tensors,
    build_lr_scheduler,
    ckpt_layout,
    forward_backward_loop,
    gather_dim1,
    lm_token_outputs,
    options_of,
    outputs_from_columns,
    pack,
    pad,
    register_engine,
    relayout,
    to_device,
    unpack,
    wants_routing,
)


@register_engine("megatron")
class MegatronEngine(BaseEngine):
    """megatron-core engine with the FSDP engine's outputs (``log_probs``, ``entropy``,
    ``values``), metadata (``calculate_entropy``, ``temperature``) and contract. Predictions and
    the loss are produced on the last pipeline stage and broadcast to every rank."""

    options_class = MegatronOptions
    supports_lora = True  # dense models on the local spec (backends.megatron.lora)

    @classmethod
    def check_config(cls, config) -> list[str]:
        """Megatron-specific problems found at ``build_engine`` (``backends.megatron.model.megatron_problems``)."""
        return megatron_problems(config)

    def _build_model(self) -> None:
        """Parallel state, GPTModel chunks from the HF directory, megatron DDP and optimizer,
        LR schedule. Collective over the world."""
        cfg = self.config
        if cfg.model.path is None:
            raise ValueError("model.path = None: MegatronEngine loads an HF directory; fix: set engine.model.path")
        self.device = init_parallel(cfg)
        hf_config = AutoConfig.from_pretrained(cfg.model.path)
        self.arch = dataclasses.replace(arch_info(hf_config), value_head=cfg.model.head == "value", value_bias=cfg.model.value_bias)
        self.tconfig = build_transformer_config(self.arch, cfg)
        chunks = build_chunks(self.tconfig, self.arch, cfg)
        # MoE: HF's load-balancing loss and the expert-load metrics (engine_api.moe).
        router_spec = RouterSpec.from_hf_config(hf_config) if self.arch.is_moe else None
        self.router = attach_router_recorder(
            chunks, router_spec, self.arch.num_layers, self.tconfig.sequence_parallel, moe_layers=self.arch.moe_layers
        )
        hf_state = read_hf_state(cfg.model.path, cfg.model.head, cfg.seed, cfg.model.value_bias)
        load_hf_weights(chunks, hf_state, self.arch)
        # LoRA: the base frozen before megatron DDP, which then allocates grad buffers (and the
        # optimizer state) for the adapters alone.
        self.adapters = (
            lora.attach(chunks, self.arch, _shapes(hf_state), cfg.model.lora, cfg.seed, global_layer) if cfg.model.lora.enabled else []
        )
        del hf_state
        if cfg.frozen:
            for chunk in chunks:
                chunk.requires_grad_(False)  # megatron DDP then allocates no grad buffers
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=options_of(cfg, MegatronOptions).use_distributed_optimizer,
        )
        # bf16 / fp16: half parameters in Float16Module, fp32 mains in the optimizer
        # (backends.megatron.precision); the exact fp32 values seed the mains below.
        self.mixed = precision.is_mixed(self.tconfig)
        chunks, exact = precision.to_half(chunks, self.tconfig) if self.mixed else (chunks, {})
        self.model = [
            DistributedDataParallel(self.tconfig, ddp_config, chunk.to(self.device), disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)
        ]
        o = cfg.optim
        self.optimizer = (
            None
            if cfg.frozen
            else get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=o.lr,
                    weight_decay=o.weight_decay,
                    adam_beta1=o.betas[0],
                    adam_beta2=o.betas[1],
                    adam_eps=o.eps,
                    clip_grad=o.clip_grad or 0.0,
                    bf16=self.tconfig.bf16,
                    fp16=self.tconfig.fp16,
                    params_dtype=torch.float32,
                    # fp16: a constant scale of 1 (no dynamic loss scaling), as the FSDP engine's fp16
                    loss_scale=1.0 if self.tconfig.fp16 else None,
                    use_distributed_optimizer=options_of(cfg, MegatronOptions).use_distributed_optimizer,
                ),
                self.model,
            )
        )
        if self.optimizer is not None:
            precision.seed_main_params(self.optimizer, exact)
        del exact
        self.scheduler = None if cfg.frozen else build_lr_scheduler(_TorchOptimizerView(self.optimizer), o)
        pipelined = options_of(cfg, MegatronOptions).pipeline_model_parallel_size > 1
        self.packed = (cfg.use_remove_padding or pipelined) and not use_te_spec(cfg)
        self.fixed_shape = pipelined
        self.cp = options_of(cfg, MegatronOptions).context_parallel_size
        self._call_len = 0
        self._offloaders = {"model": StorageOffloader(), "optimizer": StorageOffloader()}

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        return mpu.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return mpu.get_data_parallel_world_size()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return mpu.get_data_parallel_group()

    # ------------------------------------------------------------------ placement
    def _modules(self) -> list[torch.nn.Module]:
        return list(self.model)

    def _move(self, kind: str, load: bool) -> None:
        if load:
            self._offloaders[kind].restore()
        elif kind == "optimizer":
            # Keep the storages the optimizer shares with the model (parameters without a
            # distributed-optimizer copy): they are the model's to free (the Offloader
            # offloads the optimizer first, so they are still allocated here).
            keep = {t.untyped_storage().data_ptr() for t in self._model_tensors()}
            self._offloaders["optimizer"].offload(self._optimizer_tensors(), keep=keep)
        else:
            self._offloaders["model"].offload(self._model_tensors())

    def state_tensors(self, kind: str):
        """What an offload frees (``BaseEngine.state_tensors``): the DDP param / grad buffers
        and the parameters viewing them; the optimizer's state (and distributed-optimizer
        shards)."""
        if kind not in ("model", "optimizer"):
            return super().state_tensors(kind)
        return self._model_tensors() if kind == "model" else self._optimizer_tensors()

    def _model_tensors(self):
        for chunk in self.model:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                yield buffer.grad_data
                if buffer.param_data is not None:
                    yield buffer.param_data
            yield from chunk.module.parameters()

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        # megatron's optimizer wraps one torch optimizer, or chains several (one per group kind)
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer]) if self.optimizer is not None else []
        return [opt.optimizer for opt in chained]

    def _reset_adapters(self, seed: int) -> None:
        for adapter in self.adapters:
            adapter.reset(seed)
        if self.optimizer is not None and hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()  # the fp32 mains (mixed precision) follow the new adapters

    def _grad_buffers(self) -> list[torch.Tensor]:
        # megatron DDP accumulates into main_grad views of its grad buffers, not .grad
        return [p.main_grad for p in self._trainable_parameters() if getattr(p, "main_grad", None) is not None]

    def _optimizer_tensors(self):
        for opt in self._torch_optimizers():
            for group in opt.param_groups:
                yield from group["params"]  # distributed-optimizer shards; model params are kept
            for state in opt.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    # ------------------------------------------------------------------ compute
    def _step_spec(self) -> StepSpec:
        limit, reason = self.arch.length_limit()
        return StepSpec(
            config=self.config,
            dp_group=self.dp_group,
            vocab_size=self.arch.vocab,
            device=self.device,
            max_positions=limit,
            max_positions_reason=reason,
            # Model-parallel peers hold the same shard, and all must stop together.
            validate_over_world=True,
            router=self.router,
            scores_targets=True if self.cp == 1 else "sequences are split over ranks (engine.megatron.context_parallel_size > 1)",
            # (CP: megatron DDP averages over DP x CP, and megatron's schedule multiplies every
            # micro-batch loss by the CP size, forward_step_calc_loss: the CP part cancels there)
        )

    def _forward_backward(self, batch, ctx, forward_only, preprocess_fn, postprocess_fn):
        """The shared loop (``engine_api.step``) with megatron's schedule (no pipelining, 1F1B,
        or interleaved with VPP) as its micro-batch runner. Collective over the world."""
        return forward_backward_loop(
            self._step_spec(),
            batch,
            self._loss_fn,
            self.deferred,
            ctx,
            forward_only,
            preprocess_fn,
            postprocess_fn,
            runner=self._run_schedule,
        )

    def _run_schedule(self, spec: StepSpec, state: CallState):
        """The micro-batch runner: every micro-batch through megatron's forward-backward
        schedule; outputs and loss are produced on the last pipeline stage and broadcast."""
        micro = state.micro_batches
        if self.fixed_shape and len({mb.batch_size[0] for mb in micro}) > 1 and not self.packed:
            raise ValueError(
                "pipeline parallelism with the TE spec needs equal-size micro-batches; fix: make the local batch a multiple of micro_batch_size"
            )
        self._call_len = max(self._row_len(mb) for mb in micro) if self.fixed_shape else 0
        if state.preprocess_fn is not None:
            micro = [state.preprocess_fn(mb, state.ctx) for mb in micro]
        # disable_adapters (forward-only calls of a LoRA engine): the base weights for the call.
        base_only = bool(self.adapters) and "disable_adapters" in micro[0].keys() and bool(micro[0].get_non_tensor("disable_adapters"))
        for adapter in self.adapters:
            adapter.enabled = not base_only
        try:
            return self._scheduled(state, micro)
        finally:
            for adapter in self.adapters:
                adapter.enabled = True

    def _scheduled(self, state: CallState, micro: list):
        """:meth:`_run_schedule` past the layout checks: megatron's schedule over ``micro``."""
        step = partial(
            self._forward_step,
            ctx=state.ctx,
            norm=state.norm,
            # The schedule divides every micro-batch loss by the micro-batch count: undo it.
            scale=state.scale * len(micro),
            forward_only=state.forward_only,
            postprocess_fn=state.postprocess_fn,
            keep=state.keep,
        )
        n_chunks = len(self.model)
        store = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(micro) for _ in range(n_chunks)] if n_chunks > 1 else iter(micro),
            model=self.model if n_chunks > 1 else self.model[0],
            num_microbatches=len(micro),
            seq_length=max(self._padded_len(mb) for mb in micro),
            # Unused without pipelining (where micro-batches may differ in layout: _packs).
            micro_batch_size=1 if self.packed else max(mb.batch_size[0] for mb in micro),
            forward_only=state.forward_only,
        )
        outputs, local = self._collect(store, state.ctx, keep=state.keep)
        if outputs is not None and self.router is not None and wants_routing(micro[0])[2]:
            self._attach_routing(outputs, micro)
        return outputs, local

    def _attach_routing(self, outputs: list, micro: list) -> None:
        """Add each micro-batch's recorded routing (``return_routing``) to its outputs: every
        rank recorded the layers and tokens it routes (its pipeline stage, its sequence-
        parallel slice; -1 elsewhere), so one max all-reduce over the model-parallel group
        gives every rank the whole routing."""
        parts = [self.router.recorded(key=id(mb)) for mb in micro]
        flat = torch.cat(parts).to(self.device)
        if dist.get_world_size(mpu.get_model_parallel_group()) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
        for out, values in zip(outputs, flat.cpu().split([p.shape[0] for p in parts]), strict=True):
            offsets = out.get(next(k for k in out.keys() if isinstance(out.get(k), torch.Tensor) and out.get(k).is_nested)).offsets()
            out.set(ROUTING_FIELD, torch.nested.nested_tensor_from_jagged(values, offsets))

    def _packs(self, mb: TensorDict) -> bool:
        """Whether ``mb`` runs as one packed row (else padded rows). Under PP the call's layout
        (stages exchange one shape); otherwise the cheaper one by :func:`_packed_is_cheaper`."""
        if not self.packed or self.fixed_shape:
            return self.packed
        return _packed_is_cheaper(mb["input_ids"].offsets().diff().tolist(), self.arch)

    def _row_len(self, mb: TensorDict) -> int:
        lengths = mb["input_ids"].offsets().diff()
        n = int(lengths.sum()) if self._packs(mb) else int(lengths.max())
        # sequence parallelism splits each CP rank's tokens over TP; CP splits rows into 2 x CP chunks
        multiple = (self.tconfig.tensor_model_parallel_size if self.tconfig.sequence_parallel else 1) * (2 * self.cp if self.cp > 1 else 1)
        return -(-n // multiple) * multiple

    def _padded_len(self, mb: TensorDict) -> int:
        """Row length a micro-batch runs at: its own, or the call's longest under PP."""
        return max(self._row_len(mb), self._call_len)

    def _inputs(self, mb: TensorDict):
        """(input_ids [b, s], position_ids [b, s], attention_mask or None, real-token mask [b, s])."""
        ids = mb["input_ids"]
        s = self._padded_len(mb)
        if self._packs(mb):
            p = pack(ids)
            total = p.input_ids.shape[0]
            tokens = torch.zeros(1, s, dtype=torch.long, device=self.device)
            tokens[0, :total] = p.input_ids
            positions = torch.zeros(1, s, dtype=torch.long, device=self.device)
            positions[0, :total] = p.position_ids
            segment = torch.full((s,), -1, dtype=torch.long, device=self.device)
            segment[:total] = torch.repeat_interleave(torch.arange(ids.shape[0], device=self.device), ids.offsets().diff())
            allowed = (segment[:, None] == segment[None, :]) & torch.ones(s, s, dtype=torch.bool, device=self.device).tril()
            allowed |= torch.eye(s, dtype=torch.bool, device=self.device)  # padding attends to itself: no NaN
            real = torch.zeros(1, s, dtype=torch.bool, device=self.device)
            real[0, :total] = True
            return tokens, positions, ~allowed[None, None], real  # megatron masks where True
        padded, real = _pad_rows(ids, s)
        positions = torch.arange(s, device=self.device).expand_as(padded)
        if self.cp > 1:  # this CP rank's chunks (real stays whole: the outputs are gathered back)
            local = get_batch_on_this_cp_rank({"tokens": padded.contiguous(), "position_ids": positions.contiguous()})
            return local["tokens"], local["position_ids"], None, real
        return padded, positions, None, real

    def _forward_step(self, data_iterator, model, ctx, norm, scale, forward_only, postprocess_fn, keep):
        mb = next(data_iterator)
        tokens, positions, mask, real = self._inputs(mb)
        routing, replay, record = wants_routing(mb)
        if self.router is not None and (not forward_only or routing is not None or record):
            rows, token_rows = router_rows(real, self.tconfig.sequence_parallel)
            # keyed by the micro-batch: with virtual pipelining its forward comes in chunks
            self.router.begin(rows, token_rows, routing, replay, record, key=id(mb))
        output = model(tokens, positions, attention_mask=mask)
        return output, partial(
            self._loss_func,
            mb=mb,
            real=real,
            ctx=ctx,
            norm=norm,
            scale=scale,
            forward_only=forward_only,
            postprocess_fn=postprocess_fn,
            keep=keep,
        )

    def _loss_func(self, output, mb, real, ctx, norm, scale, forward_only, postprocess_fn, keep):
        """Last stage: logits/values -> jagged outputs -> the user's loss (scaled for the schedule).
        ``keep``: store the detached outputs for the caller (skipped when predictions are not
        returned: detaching every jagged field costs a dispatch each)."""
        out = self._outputs(output, mb, real)
        if postprocess_fn is not None:
            out = postprocess_fn(mb, out, ctx)
        if forward_only:
            return output.new_zeros(()), {"outputs": out.detach()}
        loss, metrics = self._loss_fn(mb, out, norm)
        stored = {"loss": loss.detach().double(), "metrics": metrics}
        if keep:
            stored["outputs"] = out.detach()
        aux = self.router.close() if self.router is not None else None  # MoE load balancing (engine_api.moe)
        return (loss if aux is None else loss + aux) * scale, stored

    def _outputs(self, output: torch.Tensor, mb: TensorDict, real: torch.Tensor) -> TensorDict:
        if self.cp > 1:
            return self._cp_outputs(output, mb, real)
        ids = mb["input_ids"]
        cu = ids.offsets()
        flat = output[real]  # [total, vocab_padded or 1] in packed order
        if self.config.model.head == "value":
            return TensorDict({"values": unpack(align_to_tokens(flat[:-1, 0].float(), cu), ids)}, batch_size=mb.batch_size)
        logits = flat[:, : self.arch.vocab]  # drop TP vocab padding
        temperature = float(mb.get_non_tensor("temperature", 1.0))
        if temperature != 1.0:
            logits = logits / temperature
        out = lm_token_outputs(logits, ids.values(), cu, mb)
        return TensorDict({k: unpack(v, ids) for k, v in out.items()}, batch_size=mb.batch_size)

    def _cp_outputs(self, output: torch.Tensor, mb: TensorDict, real: torch.Tensor) -> TensorDict:
        """:meth:`_outputs` under context parallelism: ``output`` holds this rank's two chunks of
        every padded row; each column's prediction about the next token of its row is computed
        here, gathered over the CP group (``engine_api.seq_split``), put back in row order and
        aligned as without CP."""
        s = real.shape[1]
        padded, _ = _pad_rows(mb["input_ids"], s)
        following = get_batch_on_this_cp_rank({"f": torch.nn.functional.pad(padded[:, 1:], (0, 1)).contiguous()})["f"]
        group = mpu.get_context_parallel_group()

        def whole(local: torch.Tensor) -> torch.Tensor:
            # [b, 2 chunks] per rank -> rows in order: rank r holds chunks r and 2 CP - 1 - r
            parts = gather_dim1(local, group).reshape(local.shape[0], self.cp, 2, -1)
            order = torch.cat([parts[:, :, 0], parts[:, :, 1].flip(1)], dim=1)
            return order.reshape(local.shape[0], s)[real][:-1]

        head = self.config.model.head
        return outputs_from_columns(mb, output if head == "value" else output[..., : self.arch.vocab], following, whole, head)

    def _collect(self, store: list, ctx: dict, keep: bool = True):
        """The per-micro-batch outputs (``keep``: else None) and this rank's loss contributions,
        from the last stage, broadcast over the PP group with tensor collectives
        (``_broadcast_outputs``); metrics go into ``ctx``."""
        payload = None
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            outputs = [to_device(relayout(item["outputs"]), "cpu") for item in store] if keep else None
            local = float(sum(item["loss"] for item in store if "loss" in item)) if store and "loss" in store[0] else 0.0
            for item in store:
                for key, value in item.get("metrics", {}).items():
                    ctx.setdefault("metrics", {}).setdefault(key, []).append(float(value))
            payload = (outputs, ctx.get("metrics", {}), local)
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            payload = _broadcast_outputs(payload, mpu.get_pipeline_model_parallel_last_rank(), mpu.get_pipeline_model_parallel_group())
            ctx["metrics"] = payload[1]
        outputs, _, local = payload
        return outputs, torch.tensor(local, dtype=torch.float64)

    # ------------------------------------------------------------------ the optimizer hooks
    def _zero_grad(self) -> None:
        # The grad buffers are the model's storage and the optimizer's shards its own (both
        # freed while offloaded: BaseEngine refuses this call then).
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _finish_grads(self) -> None:
        # Gradients are reduced over DP once per optimizer step, not per call: split calls
        # stay exact with the distributed optimizer's reduce-scatter too.
        finalize_model_grads(self.model)

    def _scale_grads(self, scale: float) -> None:
        for chunk in self.model:
            chunk.scale_gradients(scale)

    def _grad_norm(self) -> float:
        self.optimizer.prepare_grads()
        return float(self.optimizer.get_grad_norm())

    def _clip_grads(self, max_norm: float, total: float) -> None:
        # Clip with the norm measured in _grad_norm: megatron's clip_grad_norm() would compute it
        # again (one more pass over every grad, and a collective over the DP/MP groups).
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm, total, opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    def _apply_update(self) -> None:
        self.optimizer.step_with_ready_grads()

    def _updated_parameters(self):
        # Every trained shard this rank holds (other TP/PP shards live on other ranks: the check
        # is collective over the world, so all stop together); with LoRA the adapters alone.
        return ((n, p) for chunk in self.model for n, p in precision.unwrap(chunk).named_parameters() if p.requires_grad)

    # ------------------------------------------------------------------ state
    def _checkpoint_extra(self, global_step: int) -> dict:
        # megatron's RNG tracker (per-TP-rank model-parallel streams) rides along.
        return ckpt_layout.make_extra(self.scheduler, global_step, tracker=get_cuda_rng_tracker().get_states())

    def _save_checkpoint(self, local_path, hdfs_path, global_step, keep, extra) -> None:
        """megatron dist_checkpointing of model chunks + optimizer, plus per-rank scheduler/RNG/step."""
        if self.global_step == 0 and not ckpt.has_optimizer_state(self.optimizer):
            # megatron's optimizer creates its state in the first step and its sharded state
            # dict then simply omits it: such a checkpoint would save fine and never load.
            raise ValueError(
                "save_checkpoint before the first optimizer step: megatron's optimizer has no state to save yet, so the "
                "checkpoint could not be loaded; fix: save after a step (the initial weights are the HF directory)"
            )
        ckpt.save(self.model, self.optimizer, extra, local_path, global_step, keep, hdfs_path, self._lora, self._optimizer_layout)

    def _load_checkpoint(self, local_path, hdfs_path, del_local_after_load) -> dict:
        """Restore the newest complete checkpoint under ``local_path`` (or ``hdfs_path``)."""
        verify = self.config.checkpoint.verify
        return ckpt.load(
            self.model, self.optimizer, local_path, hdfs_path, del_local_after_load, verify, self._lora, self._optimizer_layout
        )

    @property
    def _optimizer_layout(self) -> dict:
        """What this engine's optimizer state is laid out by, recorded with a checkpoint and
        checked at load (``backends.megatron.checkpoint.optimizer_record``)."""
        return ckpt.optimizer_record(self.config.model.dtype, options_of(self.config, MegatronOptions).use_distributed_optimizer)

    @property
    def _lora(self) -> dict:
        """The LoRA settings a checkpoint records and a load must match (empty without LoRA)."""
        cfg = self.config.model.lora
        # (the targets as a set: the same modules named in another order are the same adapters)
        return {"rank": cfg.rank, "alpha": cfg.alpha, "target_modules": sorted(cfg.target_modules)} if cfg.enabled else {}

    def _restore_extra(self, extra: dict) -> int:
        # One RNG stream per (pipeline stage, DP replica): tensor-parallel peers draw alike.
        stream = mpu.get_pipeline_model_parallel_rank() * self.dp_size + self.dp_rank
        if extra["rng"] is None:
            # A data-parallel resize: megatron's RNG tracker is re-derived like the host RNGs
            # (ckpt_layout.apply_extra); it offsets the tensor-parallel stream per TP rank itself.
            model_parallel_cuda_manual_seed(ckpt_layout.derived_seed(self.config.seed, int(extra["global_step"]), stream))
        else:
            get_cuda_rng_tracker().set_states(extra["tracker"])
        return ckpt_layout.apply_extra(extra, self.scheduler, self.config.seed, stream)

    def _export_weights(self, size: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (on CPU): TP shards gathered, PP stages broadcast, with tensor
        collectives. ``size``: move consecutive parameters in buckets of about this many bytes
        (one TP all-gather and one PP broadcast per bucket; ``backends.megatron.export``; extra
        memory a few times one bucket); ``None``: one parameter at a time. Collective."""
        return export_hf(self.model, self.arch, size, precision.main_values(self.optimizer, self.mixed))

    def _export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters by peft's names, full tensors on CPU (TP gathered, PP broadcast). Collective."""
        return export_adapters(self.model, precision.main_values(self.optimizer, self.mixed))


# Cost of one attention score per head and layer (QK^T and PV: 2 x head_dim multiply-adds, plus
# the dense softmax / mask / copy passes of the local spec's attention, forward and backward),
# in units of one multiply-add of a linear layer. Measured on CPU (tiny GRPO demo, 64 x ~9
# tokens): the elementwise passes over the [heads, T, T] scores dominate; only the order of
# magnitude matters here (the two layouts differ by orders of magnitude where it matters).
_SCORE_OVERHEAD = 32


def _packed_is_cheaper(lengths: list[int], arch) -> bool:
    """Whether one packed row of these sequences costs less than right-padded rows on the local
    spec: packed runs sum(L) token rows through the linear layers and sum(L)^2 attention scores;
    padded runs B * max(L) rows and B * max(L)^2 scores. Per row: the layers' linear
    multiply-adds (q/o, k/v, the MLP; MoE: the routed experts) and the output layer."""
    b, total, longest = len(lengths), sum(lengths), max(lengths, default=0)
    ffn = arch.moe_topk * arch.moe_ffn if arch.num_experts else arch.ffn
    q, kv = arch.heads * arch.head_dim, arch.groups * arch.head_dim
    per_row = arch.num_layers * arch.hidden * (2 * q + 2 * kv + 3 * ffn) + arch.hidden * arch.vocab
    per_score = arch.num_layers * arch.heads * (2 * arch.head_dim + _SCORE_OVERHEAD)
    packed = total * per_row + total * total * per_score
    padded = b * longest * per_row + b * longest * longest * per_score
    return packed <= padded


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _pad_rows(ids: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged ``ids`` right-padded to exactly ``s`` columns, and the real-token mask."""
    padded, real = pad(ids)
    # pad() pads to the jagged tensor's cached max length, which a micro-batch split off a
    # larger batch can inherit from it (wider than its own longest row): cut to the row length.
    padded, real = padded[:, :s], real[:, :s]
    if padded.shape[1] < s:
        extra = s - padded.shape[1]
        padded = torch.nn.functional.pad(padded, (0, extra))
        real = torch.nn.functional.pad(real, (0, extra))
    return padded, real


def _broadcast_outputs(payload: tuple | None, src: int, group) -> tuple:
    """The last stage's ``(outputs, metrics, local_loss)`` on every stage: the outputs' fields
    as tensors (a jagged field as its values and offsets), the metrics, the loss (floats, exact
    through JSON) and any non-tensor field a ``postprocess_fn`` set (it must be JSON-able, else
    every stage raises) in the header of one ``broadcast_tensors``. No pickling."""
    named, extra = None, None
    if payload is not None:
        outputs, metrics, local = payload
        named, fields = [], []
        meta = {}
        for i, out in enumerate(outputs or []):
            for key in out.keys():
                value = out.get(key)
                if not isinstance(value, torch.Tensor):  # metadata a postprocess_fn set: in the header
                    meta[f"{i}/{key}"] = out.get_non_tensor(key)
                    fields.append([i, key, "meta"])
                    continue
                if value.is_nested:
                    named += [(f"{i}/{key}/values", value.values()), (f"{i}/{key}/offsets", value.offsets())]
                else:
                    named.append((f"{i}/{key}", value))
                fields.append([i, key, "jagged" if value.is_nested else "dense"])
        rows = None if outputs is None else [out.batch_size[0] for out in outputs]
        extra = {"rows": rows, "fields": fields, "meta": meta, "metrics": metrics, "local": local}
    named, extra = broadcast_tensors(named, extra, src, group)
    tensors = dict(named)
    if extra["rows"] is None:
        return None, extra["metrics"], extra["local"]
    parts: list[dict] = [{} for _ in extra["rows"]]
    metas: list[dict] = [{} for _ in extra["rows"]]
    for i, key, kind in extra["fields"]:
        if kind == "jagged":
            parts[i][key] = torch.nested.nested_tensor_from_jagged(tensors[f"{i}/{key}/values"], tensors[f"{i}/{key}/offsets"])
        elif kind == "dense":
            parts[i][key] = tensors[f"{i}/{key}"]
        else:
            metas[i][key] = extra["meta"][f"{i}/{key}"]
    outputs = []
    for fields, meta, rows in zip(parts, metas, extra["rows"], strict=True):
        out = TensorDict(fields, batch_size=[rows])
        for key, value in meta.items():
            out.set_non_tensor(key, value)
        outputs.append(relayout(out))
    return outputs, extra["metrics"], extra["local"]


class _TorchOptimizerView(torch.optim.Optimizer):
    """Lets ``torch.optim.lr_scheduler`` drive a megatron optimizer. Schedulers only need
    ``param_groups``; it reads through to megatron's *current* groups, because megatron's
    ``load_state_dict`` replaces the group dicts (a stored list would go stale on resume)."""

    def __init__(self, megatron_optimizer) -> None:  # no torch.optim init on purpose
        self._megatron = megatron_optimizer
        self.defaults = {}
        self.state = {}
        self._opt_called = True  # steps happen in the megatron optimizer; silences torch's order warning

    @property
    def param_groups(self):
        return self._megatron.param_groups

    def step(self, closure=None):  # pragma: no cover - never called; schedulers only read groups
        raise RuntimeError("the megatron optimizer steps through MegatronEngine.optimizer_step")
