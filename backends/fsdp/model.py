"""Build an HF model from a local directory and parallelize it with FSDP2.

Order (each step a plain function): :func:`load_model` (CPU, fp32 master weights, the
head the config asks for, the attention kernel of ``backends.fsdp.attention``) ->
:func:`apply_activation_checkpointing` (when asked) -> :func:`apply_compile` (when asked) ->
:func:`apply_fsdp` (``fully_shard`` every decoder layer, then the root, over a DeviceMesh).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig

from backends.fsdp.attention import attention_problems, select_attention
from backends.fsdp.lora import apply_lora
from backends.fsdp.options import FSDPOptions
from backends.hf import attn_problems, load_hf_model
from engine_api.kit import EngineConfig, format_problem, options_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fsdp_problems(config: EngineConfig) -> list[str]:
    """What ``load_model`` would refuse, found at ``build_engine``: no model directory, or a
    directory that is not an HF model (no ``config.json``). A missing directory is already a
    general config problem."""
    path = config.model.path
    if path is None:
        return [format_problem("model.path", None, "FSDPEngine loads an HF directory", "set engine.model.path")]
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        return [format_problem("model.path", path, "has no config.json (not an HF model directory)", "save the model with save_pretrained")]
    if config.model.attn_implementation != "auto" and os.path.isdir(path):
        hf_config, requested, device = AutoConfig.from_pretrained(path), config.model.attn_implementation, _device_type()
        sp = options_of(config, FSDPOptions).ulysses_sequence_parallel_size
        return attn_problems(hf_config, requested, device) + attention_problems(hf_config, requested, device, compute_dtype(config), sp)
    return []


def compute_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype the model computes in: ``fsdp.param_dtype``, else ``model.dtype``."""
    return DTYPES[options_of(config, FSDPOptions).param_dtype or config.model.dtype]


def _device_type() -> str:
    # The device the engine will pick (``FSDPEngine`` trains on CUDA whenever it is available).
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(config: EngineConfig, device: torch.device) -> nn.Module:
    """The HF model of ``config.model`` (see ``backends.hf.load_hf_model``), fp32 master weights
    on CPU; ``model.dtype`` is the compute dtype (FSDP mixed precision). With ``model.lora``
    the model comes wrapped by peft, the base frozen (``backends.fsdp.lora``)."""
    if config.model.path is None:
        raise ValueError("model.path = None: FSDPEngine loads an HF directory; fix: set engine.model.path")
    # Every attention implementation used here honours packed rows: HF's detect sequence starts
    # from ``position_ids`` when no attention mask and no KV cache are passed; the packed
    # kernels of backends.fsdp.attention take them from the batch (see select_attention).
    sp = options_of(config, FSDPOptions).ulysses_sequence_parallel_size
    hf_config = AutoConfig.from_pretrained(config.model.path)
    attn = select_attention(hf_config, config.model.attn_implementation, device.type, compute_dtype(config), sp)
    model = load_hf_model(config.model.path, config.model.head, config.seed, attn, config.model.value_bias)
    if config.model.lora.enabled:
        model = apply_lora(model, config.model.lora, config.model.head, config.seed)
    return model


def compile_problems(config: EngineConfig) -> list[str]:
    """Why ``engine.compile = true`` cannot apply to this FSDP config (empty when it can)."""
    if not config.compile:
        return []
    sp = options_of(config, FSDPOptions).ulysses_sequence_parallel_size
    if sp > 1:
        return [
            format_problem(
                "compile",
                True,
                f"Ulysses (fsdp.ulysses_sequence_parallel_size = {sp}) runs collectives inside each layer's attention, "
                "which per-layer compilation would split into graph pieces (not supported here)",
                "set compile=false, or fsdp.ulysses_sequence_parallel_size=1",
            )
        ]
    return []


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (``module.compile()``, before
    ``fully_shard``: FSDP2's hooks stay outside the compiled graphs, as torchtitan orders
    them). Layers compile on their first forward; a new micro-batch length may recompile
    (dynamic shapes after the second)."""
    for layer in decoder_layers(model):
        layer.compile()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: modules of the classes HF lists in ``_no_split_modules``."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"found no decoder layers ({sorted(layer_classes)}) in {type(model).__name__}; FSDPEngine supports HF decoder-only models"
        )
    return layers


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (HF's non-reentrant checkpointing)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_mesh(device: torch.device, world_size: int, fsdp_size: int) -> DeviceMesh:
    """1-D ``("fsdp",)`` mesh over the world, or a 2-D ``("replicate", "shard")`` HSDP mesh
    when ``fsdp_size`` is a proper divisor of the world size."""
    if fsdp_size in (-1, world_size):
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device.type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, config: EngineConfig) -> None:
    """``fully_shard`` each decoder layer (the classes HF lists in ``_no_split_modules``),
    then the root, which also owns embeddings, final norm and head (tied embeddings stay one
    parameter in one group). Gradients are reduce-scattered *averaged* over the mesh; the
    engine compensates (``engine_api.losses.dp_grad_compensation``)."""
    fsdp = options_of(config, FSDPOptions)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[fsdp.param_dtype or config.model.dtype], reduce_dtype=DTYPES[fsdp.reduce_dtype])
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward)
