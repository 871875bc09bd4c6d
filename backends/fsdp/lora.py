"""LoRA on the FSDP backend, through peft.

``apply_lora`` wraps the HF model with ``peft.get_peft_model`` before ``fully_shard``: peft
freezes the base weights and adds ``lora_A`` / ``lora_B`` to the target modules (for a value
head, peft's token-classification task also trains a copy of the ``score`` head). FSDP2 shards
frozen and trainable parameters in the same units; only the trainable ones reach the optimizer.

Export gathers one FSDP unit (a decoder layer, then the root) at a time with FSDP2's own
``unshard`` and merges each adapter with peft's ``get_delta_weight``, so the merge is peft's
(fan-in/fan-out layout, scaling). Under a mixed-precision policy the gathered weights are in the
compute dtype (``param_dtype``), so a bf16 run exports bf16 merged weights.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engine_api.kit import LoraConfig

ADAPTER = "default"  # peft's name for the one adapter


def apply_lora(model: nn.Module, cfg: LoraConfig, head: str, seed: int) -> nn.Module:
    """``model`` wrapped by peft with adapters on ``cfg.target_modules``; the adapters are
    initialised under ``torch.manual_seed(seed)`` (the same on every rank: FSDP shards each
    rank's copy).

    Raises:
        ValueError: no module of the model matches ``cfg.target_modules``.
    """
    import peft

    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            # peft reads transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning
            # per engine that says nothing about this run).
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, cfg.to_peft(head))
    except ValueError as exc:
        raise ValueError(
            f"model.lora.target_modules = {list(cfg.target_modules)}: {str(exc).splitlines()[0]}; fix: name modules of "
            f"{type(model).__name__} (e.g. q_proj, v_proj) or use [all-linear]"
        ) from exc


@torch.no_grad()
def reset_adapters(model: nn.Module, seed: int) -> None:
    """Draw every adapter as :func:`apply_lora` with ``seed`` drew it, on a model already sharded:
    peft creates ``lora_A`` / ``lora_B`` as ``nn.Linear`` (each construction draws its default
    init from the global RNG), then gives ``lora_A`` a kaiming-uniform draw and zeroes ``lora_B``,
    layer after layer in module order, under ``torch.manual_seed(seed)``. The same draws are
    replayed on the host and each rank keeps its shard (no communication). Assumption: peft's
    default init (``init_lora_weights=True``), which the engine's LoRA config always asks for;
    held by a test against an engine built with the seed.

    Raises:
        ValueError: the model trains a copy of a whole module (a value head), not only adapters.
    """
    import math

    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    if any(isinstance(m, ModulesToSaveWrapper) for m in model.modules()):
        raise ValueError("reset_adapters: this model trains a copy of a whole module (a value head), which is not drawn from the seed")
    devices = [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # the caller's RNG streams are not this draw's
        torch.manual_seed(seed)
        for module in model.modules():
            if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
                continue
            lora_a, lora_b = module.lora_A[ADAPTER], module.lora_B[ADAPTER]
            fresh_a = nn.Linear(lora_a.in_features, lora_a.out_features, bias=False)
            nn.Linear(lora_b.in_features, lora_b.out_features, bias=lora_b.bias is not None)
            nn.init.kaiming_uniform_(fresh_a.weight, a=math.sqrt(5))
            _set_full(lora_a.weight, fresh_a.weight)
            for param in lora_b.parameters():
                param.zero_()


def _set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write ``full`` into ``param`` (a DTensor: this rank's shard of it)."""
    if isinstance(param, DTensor):
        local = torch.distributed.tensor.distribute_tensor(
            full.to(device=param.device, dtype=param.dtype), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(device=param.device, dtype=param.dtype))


def hf_name(peft_name: str) -> str | None:
    """The HF name of a peft-wrapped parameter, or None for adapter-only tensors (``lora_*``,
    the untrained ``original_module`` copy of a trained head)."""
    name = peft_name.removeprefix("base_model.model.")
    if ".lora_" in name or ".original_module." in name:
        return None
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every weight of the peft-wrapped, FSDP2-sharded ``model`` with
    the adapters merged in (peft's ``get_delta_weight``), one FSDP unit gathered at a time.
    Tied parameters appear under every name, as in HF's ``state_dict``. Collective."""
    from peft.tuners.lora import LoraLayer

    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model]
    prefixes = tuple(f"{name}." for name, _ in units)
    for name, unit in [*units, ("", model)]:
        with _unsharded(unit):
            lora = {mname: m for mname, m in unit.named_modules(prefix=name) if isinstance(m, LoraLayer)}
            for pname, param in unit.named_parameters(prefix=name, remove_duplicate=False):
                if unit is model and pname.startswith(prefixes):
                    continue  # a decoder layer's own unit yields it
                target = hf_name(pname)
                if target is None:
                    continue
                tensor = param.full_tensor() if isinstance(param, DTensor) else param
                owner = pname.rsplit(".base_layer.", 1)[0] if ".base_layer." in pname else None
                if owner in lora and pname.endswith(".base_layer.weight"):
                    tensor = tensor + lora[owner].get_delta_weight(ADAPTER).to(tensor.dtype)
                yield target, tensor.detach().clone()


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Forward with the base weights: every adapter layer bypassed for the block.

    Only the layers' ``_disable_adapters`` flag is switched (what their forward reads). peft's own
    ``disable_adapter()`` also turns the adapters' ``requires_grad`` off and back on; under FSDP2
    with ``reshard_after_forward=false`` the units are still unsharded when it switches them back
    on, so the sharded parameters would stay frozen for good (found in review).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    saved = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, saved, strict=True):
            m._disable_adapters = flag


def tied_target_problems(cfg: LoraConfig, model_path: str | None) -> list[str]:
    """Adapters on a tied embedding / LM head would give the one shared weight two different
    deltas (peft only warns), so the merged export could not be one HF model: refused."""
    names = set(cfg.target_modules) & {"embed_tokens", "lm_head", "wte", "word_embeddings"}
    if not cfg.enabled or not names or model_path is None:
        return []
    try:
        from transformers import AutoConfig

        tied = bool(getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False))
    except (OSError, ValueError):
        return []  # the model path problem is reported elsewhere
    if not tied:
        return []
    return [
        f"model.lora.target_modules = {list(cfg.target_modules)}: {sorted(names)} share the tied input/output embedding of "
        f"{model_path!r}, and adapters on it cannot merge into one weight; fix: drop {sorted(names)} from target_modules"
    ]


def unmatched_target_problems(cfg: LoraConfig, model_path: str | None, head: str = "lm") -> list[str]:
    """Targets in ``model.lora.target_modules`` that name no layer peft can adapt in this
    model: peft adapts the ones that match and says nothing about the rest (a list written for
    Llama's ``q_proj`` ... ``down_proj`` adapts only ``o_proj`` and ``down_proj`` of Phi-3,
    whose attention and MLP are the fused ``qkv_proj`` and ``gate_up_proj``). Found from the
    model's config alone (its modules built on the meta device: no weights are read)."""
    targets = [t for t in cfg.target_modules if t != "all-linear"]
    if not cfg.enabled or not targets or model_path is None:
        return []
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

        hf_config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            cls = AutoModelForTokenClassification if head == "value" else AutoModelForCausalLM
            model = cls.from_config(hf_config)
    except (OSError, ValueError, KeyError):
        return []  # the model path problem is reported elsewhere
    adaptable = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding | nn.Conv1d) or type(m).__name__ == "Conv1D"]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in adaptable)]
    if not unmatched:
        return []
    leaves = sorted({n.rsplit(".", 1)[-1] for n in adaptable})
    return [
        f"model.lora.target_modules = {list(cfg.target_modules)}: {unmatched} name no layer of {type(model).__name__} "
        f"(its adaptable layers: {', '.join(leaves)}), so those adapters would silently not exist; fix: name the model's own "
        "layers (fused projections such as qkv_proj / gate_up_proj included) or use [all-linear]"
    ]


@contextlib.contextmanager
def _unsharded(unit: nn.Module):
    """The unit's own parameters gathered in full for the block (FSDP2 ``unshard``)."""
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()


def adapter_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(peft_name, full_tensor)`` of the trainable adapter tensors, named by peft's own
    ``get_peft_model_state_dict`` (as in ``adapter_model.safetensors``). Collective."""
    from peft import get_peft_model_state_dict

    full = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name or f".modules_to_save.{ADAPTER}." in name:
            full[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
    yield from get_peft_model_state_dict(model, state_dict=full).items()
