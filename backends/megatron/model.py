"""Build megatron-core GPTModel chunks from an HF directory.

Order (plain functions): :func:`init_parallel` (process group, CPU compat layer when there is
no CUDA, ``parallel_state``, RNG) -> :func:`build_transformer_config` -> :func:`build_chunks`
(one GPTModel per virtual pipeline stage of this rank; the layer spec gives linear_proj /
linear_fc1 / linear_fc2 a bias exactly where the HF model has one) -> :func:`load_hf_weights`
(each rank converts the HF tensors it owns through ``backends.megatron.convert``'s table; the
load fails unless every HF tensor and every megatron parameter was used) -> megatron DDP (in
the engine).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from safetensors.torch import load_file
from transformers import AutoConfig

from backends.hf import note_once, value_head_state
from backends.megatron import cpu_compat
from backends.megatron.convert import (
    ArchInfo,
    ExpertShard,
    arch_info,
    config_refusals,
    padded_vocab,
    to_megatron,
    transformer_config_kwargs,
    unconsumed_problems,
)
from backends.megatron.lora import lora_problems
from backends.megatron.options import MegatronOptions
from backends.megatron.parallel import ParallelSizes
from engine_api.kit import EngineConfig, RouterSpec, compute_device, ensure_process_group, format_problem, options_of, process_group_timeout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_parallel(config: EngineConfig) -> torch.device:
    """Join the launcher's world (torchrun) or create a 1-rank group for plain python
    (``engine_api.dist.ensure_process_group``), then initialise megatron's
    ``parallel_state`` with the configured TP/PP/VPP/CP sizes; seed megatron's RNG tracker.

    megatron's parallel state is process-global: one layout per process. A second engine in
    the same process must use the same layout (checked).
    """
    device = compute_device()
    if device.type == "cpu":
        # megatron-core hard-codes CUDA on paths the engine uses: the compat layer is switched
        # on here, explicitly, by the engine that needs it (never by an import). The engine's
        # reference is held for the rest of the process (megatron's parallel state and buffers
        # outlive the engine object) and released at interpreter exit (cpu_compat's atexit).
        cpu_compat.enable()
    ensure_process_group("nccl" if device.type == "cuda" else "gloo", config.dist_timeout_s)
    m = options_of(config, MegatronOptions)
    world = dist.get_world_size()
    if world % m.model_parallel_size:
        raise ValueError(
            f"megatron.tensor_model_parallel_size x pipeline x context = {m.model_parallel_size} does not divide the world size {world}; "
            "fix: choose sizes whose product divides the number of processes"
        )
    wanted = ParallelSizes.of(m)
    if mpu.model_parallel_is_initialized():
        current = ParallelSizes.current()
        if current != wanted:
            raise ValueError(
                f"megatron parallel state is already {current.describe()} in this process; "
                f"fix: one layout per process, got {wanted.describe()}"
            )
    else:
        mpu.initialize_model_parallel(
            **wanted.kwargs(),
            # megatron builds its groups with its own 30-minute default, not the world group's
            # timeout: without this a rank that fails but stays alive hangs its peers for 30 min.
            distributed_timeout_minutes=process_group_timeout().total_seconds() / 60,
        )
    model_parallel_cuda_manual_seed(config.seed)
    return device


def megatron_problems(config: EngineConfig) -> list[str]:
    """What megatron-core or this engine would refuse in ``init_model``, found at
    ``build_engine`` from the config and the HF ``config.json`` alone (nothing is built).

    Checked: the model directory is an HF model of a supported family whose every config field
    is converted exactly (``convert.config_refusals``: each refused field is named with its
    value and the fix); TP divides the heads,
    the KV groups and the MLP width (megatron splits each evenly); PP (x VPP) divides the
    layers; context parallelism needs the TE spec (:func:`_cp_problems`); sequence parallelism
    and the TE spec need CUDA + TE; LoRA's limits (``backends.megatron.lora.lora_problems``);
    ``model.attn_implementation`` is an HF setting (only ``auto`` here); ``compile`` is refused
    (megatron-core's layers are not compiled here: its fused kernels come from the TE spec).
    """
    m = options_of(config, MegatronOptions)
    out = []
    if config.compile:
        out.append(
            format_problem(
                "compile",
                True,
                "the megatron engine does not torch.compile its layers (its fast kernels come from the Transformer-Engine spec)",
                "set compile=false with strategy=megatron",
            )
        )
    if config.model.attn_implementation != "auto":
        out.append(
            format_problem(
                "model.attn_implementation",
                config.model.attn_implementation,
                "selects an HF attention kernel; the megatron backend runs megatron-core's own attention (local or TE spec)",
                "leave it at auto with strategy=megatron",
            )
        )
    try:
        te = use_te_spec(config)
    except ValueError as exc:
        out.append(str(exc))
        te = False
    if m.sequence_parallel and not te:
        out.append(
            format_problem(
                "megatron.sequence_parallel",
                True,
                "needs the Transformer-Engine layer spec (the local spec's torch norm cannot shard the sequence)",
                "set megatron.sequence_parallel=false, or layer_spec=te on a GPU machine",
            )
        )
    out += _cp_problems(m, te)
    path = config.model.path
    if path is None:
        return [*out, format_problem("model.path", None, "MegatronEngine loads an HF directory", "set engine.model.path")]
    if not os.path.isdir(path):
        return out  # a general config problem already
    if not os.path.isfile(os.path.join(path, "config.json")):
        return [*out, format_problem("model.path", path, "has no config.json (not an HF model directory)", "save it with save_pretrained")]
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except ValueError as exc:
        return [*out, f"model.path = {path!r}: {exc}"]
    refusals = config_refusals(hf_config)
    if refusals:
        return [*out, *(f"model.path = {path!r} (megatron backend): {r}" for r in refusals)]
    arch = arch_info(hf_config)
    out += _moe_problems(config, m, arch, hf_config)
    out += lora_problems(config, arch, te)
    if m.context_parallel_size > 1 and arch.is_moe:
        out.append(
            format_problem(
                "megatron.context_parallel_size",
                m.context_parallel_size,
                "with an MoE model: the routing recorder and the load-balancing statistics are not split over context-parallel ranks",
                "use 1 for MoE models",
            )
        )
    tp, pp, vpp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    if tp >= 1:
        for name, count in (("num_attention_heads", arch.heads), ("num_key_value_heads", arch.groups), ("intermediate_size", arch.ffn)):
            if count % tp:
                out.append(
                    format_problem(
                        "megatron.tensor_model_parallel_size",
                        tp,
                        f"does not divide the model's {name} = {count}",
                        f"use a TP size that divides {count}",
                    )
                )
    if pp >= 1 and vpp >= 1 and arch.num_layers % (pp * vpp):
        out.append(
            format_problem(
                "megatron.pipeline_model_parallel_size",
                pp,
                f"x virtual_pipeline_model_parallel_size ({vpp}) = {pp * vpp} does not divide the model's num_hidden_layers = {arch.num_layers}",
                "use pipeline sizes whose product divides the layer count",
            )
        )
    return out


def _cp_problems(m: MegatronOptions, te: bool) -> list[str]:
    """Context parallelism runs megatron-core's own CP attention, which only the Transformer-
    Engine spec has: the local spec's ``DotProductAttention`` asserts ``context_parallel_size
    == 1`` (megatron-core 0.16), so a CPU build refuses it here instead of failing there. With TE
    (GPU) the engine splits padded rows over the CP ranks (``MegatronEngine._cp_outputs``);
    pipelining with it is not supported yet."""
    cp = m.context_parallel_size
    if cp <= 1:
        return []
    field = "megatron.context_parallel_size"
    if not te:
        return [
            format_problem(
                field,
                cp,
                "needs the Transformer-Engine layer spec: megatron-core's context-parallel attention is TEDotProductAttention, and "
                "the local spec's attention refuses CP ('Context parallelism is only supported by TEDotProductAttention'), so it "
                "cannot run without CUDA + transformer-engine",
                "use 1 here (for long sequences on CPU: strategy=fsdp with fsdp.ulysses_sequence_parallel_size), or "
                "megatron.layer_spec=te on a GPU machine with transformer-engine",
            )
        ]
    if m.pipeline_model_parallel_size > 1:
        return [format_problem(field, cp, "with pipeline parallelism is not supported yet", "use pipeline_model_parallel_size=1 with CP")]
    return []


def _moe_problems(config: EngineConfig, m: MegatronOptions, arch: ArchInfo, hf_config) -> list[str]:
    """Expert-parallel sizes against the model, and what the load-balancing loss cannot run with."""
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_size
    if not arch.is_moe:
        if ep > 1:
            return [format_problem("megatron.expert_model_parallel_size", ep, "the model has no experts", "use 1 for a dense model")]
        return []
    out = []
    if ep >= 1 and arch.num_experts % ep:
        out.append(
            format_problem(
                "megatron.expert_model_parallel_size",
                ep,
                f"does not divide the model's {arch.num_experts} experts",
                "use a divisor of the expert count",
            )
        )
    if etp >= 1 and arch.moe_ffn % etp:
        out.append(
            format_problem(
                "megatron.expert_tensor_parallel_size",
                etp,
                f"does not divide the model's expert width (moe_intermediate_size) {arch.moe_ffn}",
                "use a divisor of the expert width (it defaults to the TP size)",
            )
        )
    if RouterSpec.from_hf_config(hf_config).aux_on:
        # HF's loss pools every MoE layer of a micro-batch (engine_api.moe): all layers' router
        # logits must be on the rank that adds it, with their autograd graph, over whole sequences.
        why = "the router load-balancing loss (config.json output_router_logits with router_aux_loss_coef > 0) pools every MoE layer's router logits of a micro-batch on one rank"
        fix = "or turn the loss off (output_router_logits: false in config.json)"
        if m.pipeline_model_parallel_size > 1:
            out.append(
                format_problem(
                    "megatron.pipeline_model_parallel_size",
                    m.pipeline_model_parallel_size,
                    why + ", which pipeline stages split",
                    "use 1 " + fix,
                )
            )
        if m.sequence_parallel:
            out.append(format_problem("megatron.sequence_parallel", True, why + " over whole sequences", "set it to false " + fix))
        if config.model.gradient_checkpointing:
            out.append(
                format_problem(
                    "model.gradient_checkpointing",
                    True,
                    why + "; megatron's recomputation runs the first forward without autograd, so the loss would get no gradient",
                    "set it to false " + fix,
                )
            )
    return out


def use_te_spec(config: EngineConfig) -> bool:
    """Transformer-Engine spec when asked (``te``), or on ``auto`` with CUDA and TE installed."""
    spec = options_of(config, MegatronOptions).layer_spec
    te_ok = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    if spec == "te" and not te_ok:
        raise ValueError(
            "megatron.layer_spec = 'te' needs CUDA and transformer_engine; fix: install the te extra on a GPU machine or use 'local'"
        )
    chosen = spec == "te" or (spec == "auto" and te_ok)
    if torch.cuda.is_available() and not chosen:
        note_once(
            "[enginekit] megatron: Transformer-Engine not installed; using the local layer spec (pip install the te extra for the TE spec)"
        )
    return chosen


def build_transformer_config(arch: ArchInfo, config: EngineConfig) -> TransformerConfig:
    """TransformerConfig from the HF architecture and the engine's parallelism / dtype.

    Raises:
        ValueError: sequence parallelism with the local spec (its torch RMSNorm cannot shard
            the sequence; it needs the Transformer-Engine spec).
    """
    m = options_of(config, MegatronOptions)
    if m.sequence_parallel and not use_te_spec(config):
        raise ValueError(
            "megatron.sequence_parallel = True needs the Transformer-Engine layer spec (the local spec's torch norm "
            "does not support it); fix: set megatron.sequence_parallel=false, or layer_spec=te on a GPU machine"
        )
    dtype = DTYPES[config.model.dtype]
    return TransformerConfig(
        **transformer_config_kwargs(arch),
        **ParallelSizes.of(m).kwargs(),
        sequence_parallel=m.sequence_parallel,
        # Pipeline stages exchange fixed-shape tensors: the engine pads every micro-batch of a
        # call to one shape (megatron's interleaved schedule mis-pairs variable shapes).
        variable_seq_lengths=False,
        # Unbatched p2p. With a 2-rank pipeline "previous" and "next" are one peer, and the batched
        # path posts [send_prev, recv_prev, send_next, recv_next] untagged: messages pair in
        # posting order, so the interleaved schedule's two-way steady-state exchange swaps
        # activations and gradients (same shape, no error; measured: grad norm +143%, loss 0.5%
        # off at 6 micro-batches). Unbatched ops order by rank parity and cannot cross.
        batch_p2p_comm=False,
        pipeline_dtype=dtype,
        params_dtype=torch.float32,  # master weights; bf16 compute is megatron's mixed precision
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        recompute_granularity="full" if config.model.gradient_checkpointing else None,
        recompute_method="uniform" if config.model.gradient_checkpointing else None,
        recompute_num_layers=1 if config.model.gradient_checkpointing else None,
        **_NO_CUDA_GRAPH_SCOPE,
    )


# megatron-core 0.16 defaults cuda_graph_scope to the deprecated "full" and warns about its own
# default on every TransformerConfig; [] is the documented equivalent (CUDA graphs stay off).
_NO_CUDA_GRAPH_SCOPE = {"cuda_graph_scope": []} if "cuda_graph_scope" in TransformerConfig.__dataclass_fields__ else {}


class ValueHead(nn.Module):
    """Scalar value per token, replacing GPTModel's ``output_layer`` on the last stage.

    Replicated over TP (one output cannot be split); its input is gathered along the sequence
    first under sequence parallelism, so every TP rank computes the same gradient. Its
    parameters are ``weight`` [1, hidden] and ``bias`` [1] at the top of the module (HF's
    ``score``), the names megatron's language model expects of an ``output_layer`` when it
    builds the checkpoint's sharded state dict (a nested ``linear.weight`` made every critic
    checkpoint fail with ``KeyError: 'output_layer.weight'``). The values are set from the HF
    value head by the loader. Without ``bias`` (``model.value_bias: false``) it is HF sequence
    classification's bias-free head.
    """

    def __init__(self, hidden: int, sequence_parallel: bool, bias: bool = True) -> None:
        super().__init__()
        init = nn.Linear(hidden, 1, bias=bias)  # nn.Linear's initialisation, for a head built without HF weights
        self.weight = nn.Parameter(init.weight.detach().clone())
        self.bias = nn.Parameter(init.bias.detach().clone()) if bias else None
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return nn.functional.linear(hidden, self.weight, self.bias), None


def build_chunks(tconfig: TransformerConfig, arch: ArchInfo, config: EngineConfig) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage held by this rank (one without VPP).

    Logits are gathered over TP (``parallel_output=False``) so log-probs and entropy use the
    same code as the FSDP backend; rows past the HF vocabulary (TP padding) are sliced off.
    """
    te = use_te_spec(config)
    if arch.is_moe:
        spec = None  # per stage below: the MoE / dense layer pattern is sliced per pipeline stage
    elif te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = with_hf_biases(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm), arch)
    else:
        spec = with_hf_biases(get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm), arch)
    vpp = options_of(config, MegatronOptions).virtual_pipeline_model_parallel_size
    value = config.model.head == "value"
    chunks = []
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        pre = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model = GPTModel(
            config=tconfig,
            transformer_layer_spec=spec
            or with_hf_biases(get_gpt_decoder_block_spec(tconfig, use_transformer_engine=te, vp_stage=stage), arch),
            vocab_size=padded_vocab(arch.vocab, tconfig.tensor_model_parallel_size),
            max_sequence_length=arch.max_positions,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=arch.tied and not value,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            parallel_output=False,
            vp_stage=stage,
        )
        if arch.rope_inv_freq is not None:
            # Scaled RoPE: HF's frequencies (backends.megatron.convert.rope_frequencies), set
            # before the first forward (megatron caches the rotary table per length).
            old = model.rotary_pos_emb.inv_freq
            model.rotary_pos_emb.inv_freq = torch.tensor(arch.rope_inv_freq, dtype=old.dtype, device=old.device)
        if value and post:
            model.output_layer = ValueHead(arch.hidden, tconfig.sequence_parallel, config.model.value_bias)
        if pre and arch.pad_token_id is not None:
            model.embedding.word_embeddings.register_forward_hook(_pad_lookup_without_grad(arch.pad_token_id))
        chunks.append(model)
    return chunks


def with_hf_biases(spec, arch: ArchInfo):
    """``spec`` (one layer's, or a block's) with a bias on linear_proj where HF has an o_proj
    bias and on a dense MLP's linear_fc1 / linear_fc2 where HF has MLP biases.

    megatron-core 0.16 has one switch for both (``add_bias_linear``, which also reaches the MoE
    router and experts), while HF sets them independently (Llama: ``attention_bias`` and
    ``mlp_bias``; Qwen3: ``attention_bias`` with a bias-free MLP). The converter keeps
    ``add_bias_linear`` off and builds exactly these modules with ``bias=True``, so no module
    carries a bias HF does not have (a zero bias would get gradients and drift from HF).
    """
    if not (arch.o_bias or arch.mlp_bias):
        return spec
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[_layer_with_hf_biases(s, arch) for s in spec.layer_specs])
    return _layer_with_hf_biases(spec, arch)


def _layer_with_hf_biases(layer: ModuleSpec, arch: ArchInfo) -> ModuleSpec:
    sub = layer.submodules
    attention, mlp = sub.self_attention, sub.mlp
    if arch.o_bias:
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, linear_proj=_biased(attention.submodules.linear_proj))
        )
    if arch.mlp_bias and isinstance(mlp, ModuleSpec) and mlp.module is MLP:  # dense MLPs only (no MoE family has mlp_bias)
        mlp = dataclasses.replace(
            mlp,
            submodules=dataclasses.replace(
                mlp.submodules, linear_fc1=_biased(mlp.submodules.linear_fc1), linear_fc2=_biased(mlp.submodules.linear_fc2)
            ),
        )
    return dataclasses.replace(layer, submodules=dataclasses.replace(sub, self_attention=attention, mlp=mlp))


def _biased(module):
    """A linear module class (or a spec of one) that is always built with ``bias=True``."""
    if isinstance(module, ModuleSpec):
        return dataclasses.replace(module, module=_biased(module.module))
    return _biased_class(module)


@functools.cache
def _biased_class(cls: type) -> type:
    def __init__(self, *args, **kwargs):
        kwargs["bias"] = True  # megatron passes config.add_bias_linear (False) here
        cls.__init__(self, *args, **kwargs)

    return type(f"{cls.__name__}WithBias", (cls,), {"__init__": __init__, "__module__": __name__})


def _pad_lookup_without_grad(pad_id: int):
    """HF's ``nn.Embedding(padding_idx=pad_id)`` semantics, which megatron's embedding lacks: the
    pad row's value is used in the forward, but lookups of it add no gradient to the row (a tied
    output layer's gradient to that row is unaffected). Without it the backends' gradients
    differ whenever the pad id appears as an input token (found through the PPO recipe, whose
    sampler can emit it)."""

    def hook(module, args, out):
        mask = args[0] == pad_id  # [b, s]
        if out.shape[:2] != mask.shape:  # sequence parallel: [s/tp, b, h], already scattered
            mask = mask.t().chunk(mpu.get_tensor_model_parallel_world_size())[mpu.get_tensor_model_parallel_rank()]
        return torch.where(mask[..., None], out.detach(), out) if bool(mask.any()) else out

    return hook


def read_hf_state(path: str, head: str = "lm", seed: int = 0, value_bias: bool = True) -> dict[str, torch.Tensor]:
    """All safetensors of an HF directory (single or sharded files), on CPU; for a value head,
    plus ``score.*`` initialised exactly as the FSDP backend's HF token-classification model
    (without ``score.bias`` when ``value_bias`` is False: a stored one is zero, or refused)."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model.path = {path!r} has no *.safetensors; fix: save the model with save_pretrained (safetensors)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(os.path.join(path, f)))
    if head == "value":
        state.update(value_head_state(path, seed, value_bias))
        if not value_bias:
            state.pop("score.bias", None)
    return state


def load_hf_weights(chunks: list[GPTModel], hf_state: dict[str, torch.Tensor], arch: ArchInfo) -> None:
    """Copy every parameter this rank owns from the HF tensors (TP shard of its stage), through
    the conversion table (``backends.megatron.convert``). Collective over the world.

    Raises:
        ValueError: on every rank, when any rank has a parameter without an HF source (or of
            the wrong shape), or when an HF tensor was consumed by no rank; each is named, with
            the config field likely responsible.
    """
    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    experts = expert_shard()
    used: set[str] = set()
    problems = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            try:
                value = to_megatron(name, hf_state, arch, global_layer(chunk, name), rank, tp, experts, used)
            except (KeyError, ValueError) as exc:
                problems.append(str(exc.args[0]))
                continue
            if value.shape != param.shape:  # copy_ would broadcast a wrong shape silently
                problems.append(f"megatron parameter {name!r} is {list(param.shape)} but its HF tensors give {list(value.shape)}")
                continue
            with torch.no_grad():
                param.copy_(value)
    problems, others = _agree_on_load(hf_state, used, problems, arch)
    if problems or others:
        more = f" (and {others} problem(s) on other ranks)" if others else ""
        raise ValueError(f"model.path: the HF checkpoint does not convert exactly{more}: " + "; ".join(problems))


def _agree_on_load(hf_state: dict[str, torch.Tensor], used: set[str], problems: list[str], arch: ArchInfo) -> tuple[list[str], int]:
    """This rank's problems plus the HF tensors no rank consumed, and how many problems the
    other ranks had (one tensor all-reduce, so every rank raises or none does)."""
    names = sorted(hf_state)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    counts = torch.tensor([int(n in used) for n in names] + [len(problems)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    counts = counts.cpu()
    consumed = {n for n, c in zip(names, counts[:-1].tolist(), strict=True) if c}
    out = problems + unconsumed_problems(hf_state, consumed, arch, value_head="score.weight" in hf_state)
    return out, int(counts[-1]) - len(problems)


def expert_shard() -> ExpertShard:
    """This rank's place in megatron's expert layout (EP and expert-TP rank and size)."""
    return ExpertShard(
        ep_rank=mpu.get_expert_model_parallel_rank(),
        ep=mpu.get_expert_model_parallel_world_size(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        etp=mpu.get_expert_tensor_parallel_world_size(),
    )


def global_layer(chunk: GPTModel, name: str) -> int | None:
    """Global (0-based) decoder layer index of a chunk-local parameter name, else None."""
    if not name.startswith("decoder.layers."):
        return None
    return chunk.decoder.layers[int(name.split(".")[2])].layer_number - 1
