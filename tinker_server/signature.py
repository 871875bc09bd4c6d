"""Which engine serves a run: the LoRA modules the Tinker toggles select on a base model, the
checked rank, and the :class:`Signature` that runs sharing one engine agree on.

Assumptions (docs/tinker.md): ``train_attn`` / ``train_mlp`` / ``train_unembed`` select the
attention projections, the MLP projections and ``lm_head`` by their HF module names, separate or
fused (:func:`lora_modules`: those the model has).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tinker_server.contract import LoraIn, UserError

# The projections each Tinker toggle selects, by HF module name: separate (Llama, Qwen, Mistral)
# or fused (Phi-3's qkv_proj and gate_up_proj). A run adapts those its base model has.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


def model_config(model_dir: str) -> dict:
    """The HF ``config.json`` of ``model_dir`` (its text model's part for multimodal configs)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def lora_modules(lora: LoraIn, model_dir: str | None = None) -> list[str]:
    """The HF module names the Tinker toggles put adapters on: the attention and MLP projections
    (fused or not) and the LM head that the model in ``model_dir`` has.

    Raises:
        UserError: every toggle is off, or one that is on selects no layer of this model (its
            projections have other names): named, with the model's linear layers.
    """
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise UserError("lora_config: train_attn, train_mlp and train_unembed are all false, so nothing would train; fix: enable one")
    present = _linear_leaves(model_dir) if model_dir is not None else None
    names = []
    for toggle, on, candidates in (
        ("train_attn", lora.train_attn, ATTN_MODULES),
        ("train_mlp", lora.train_mlp, MLP_MODULES),
        ("train_unembed", lora.train_unembed, UNEMBED_MODULES),
    ):
        if not on:
            continue
        picked = [n for n in candidates if present is None or n in present]
        if not picked:
            raise UserError(
                f"lora_config.{toggle} = true: this base model has none of {', '.join(candidates)} (its linear layers: "
                f"{', '.join(sorted(present or ()))}); fix: set {toggle}=false, or serve a model of a supported family"
            )
        names += picked
    return names


@functools.lru_cache(maxsize=16)
def _linear_leaves(model_dir: str) -> frozenset[str]:
    """The last name component of every linear layer of the HF model in ``model_dir`` (built
    from its config on the meta device: no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return frozenset(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))


def _check_rank(base_model: str, model_dir: str, lora: LoraIn) -> None:
    if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or lora.rank < 1:
        raise UserError(f"lora_config.rank = {lora.rank!r}; fix: a positive integer (e.g. 32)")
    hidden = model_config(model_dir).get("hidden_size")
    if isinstance(hidden, int) and lora.rank > hidden:
        raise UserError(
            f"lora_config.rank = {lora.rank}: larger than {base_model}'s hidden size {hidden} (a rank past the smaller "
            f"side of a projection adds no capacity, only memory); fix: a rank <= {hidden} (e.g. 32)"
        )


@dataclass(frozen=True)
class Signature:
    """What runs must agree on to share one engine: the base model and the LoRA rank and target
    modules the engine's adapters have (the seed need not: a run of another seed starts from the
    adapters ``BaseEngine.reset_adapters`` draws for it, those of an engine built with it; on a
    backend without ``_reset_adapters`` the engine serves its build seed only)."""

    base_model: str
    rank: int
    modules: tuple[str, ...]

    def describe(self) -> str:
        """The engine in words, for refusals: base model, rank and target modules."""
        return f"{self.base_model} rank {self.rank} on {','.join(self.modules)}"


def signature(base_model: str, model_dir: str, lora: LoraIn) -> Signature:
    """The engine a run of ``lora`` on ``base_model`` is served by (checked: a bad rank or toggles
    raise ``UserError`` naming them)."""
    _check_rank(base_model, model_dir, lora)
    return Signature(base_model, lora.rank, tuple(lora_modules(lora, model_dir)))


def run_seed(lora: LoraIn) -> int:
    """The seed a run's adapters are drawn with (Tinker's ``seed``; none: 0, so reruns agree)."""
    return lora.seed if lora.seed is not None else 0
