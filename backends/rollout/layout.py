"""The weight layout a rollout update carries: the names and shapes of the HF model's
in-memory state dict (what ``BaseEngine.export_weights`` yields), which for some families is
not the checkpoint's (transformers 5 fuses the experts of Qwen3-MoE / Mixtral into
``mlp.experts.gate_up_proj`` / ``down_proj`` when loading; the files keep one tensor per expert)."""

from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def meta_model(model_path: str) -> torch.nn.Module:
    """The HF causal LM of ``model_path`` built on the meta device (no memory, no weights read)."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def state_shapes(model_path: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """``(shapes, optional)``: name -> shape of every tensor of the model's state dict, and the
    names that alias another one (a tied ``lm_head.weight``): an update may carry them or not."""
    model = meta_model(model_path)
    shapes, optional, seen = {}, set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        shapes[name] = tuple(tensor.shape)
        if id(tensor) in seen:
            optional.add(name)
        seen.setdefault(id(tensor), name)
    return shapes, optional


def aliases(model_path: str) -> dict[str, str]:
    """name -> the name it aliases (a tied ``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    model, first, out = meta_model(model_path), {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            out[name] = first[id(tensor)]
        first.setdefault(id(tensor), name)
    return out


def to_checkpoint_layout(model_path: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` (in-memory names) in the checkpoint's layout, through transformers' own
    reverse conversion (what ``save_pretrained`` writes): e.g. fused experts split per expert."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(meta_model(model_path), dict(weights))


class HFLayout:
    """``BaseRollout.weight_shapes`` / ``optional_weights`` from the HF model's in-memory state
    dict (mixed into the backends that serve an HF model directory)."""

    config: object

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The layout ``export_weights`` yields: the HF model's in-memory state dict."""
        return state_shapes(self.config.model_path)[0]

    def optional_weights(self) -> set[str]:
        """Aliases (a tied ``lm_head.weight``): an update may carry them or not."""
        return state_shapes(self.config.model_path)[1]


def refuse_larger_tokenizer(model_path: str, tokenizer_path: str | None, tokenizer=None) -> None:
    """ValueError at load when the tokenizer at ``tokenizer_path`` has more tokens than the
    model at ``model_path`` embeds: its ids past the embedding would reach generation as a raw
    ``IndexError`` (HF) or a device assert (vLLM). ``tokenizer``: the one already loaded."""
    if tokenizer_path is None:
        return
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    rows = meta_model(model_path).get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ValueError(
            f"rollout: the tokenizer at {tokenizer_path} has {len(tokenizer)} tokens (ids up to {len(tokenizer) - 1}) but the model "
            f"at {model_path} embeds {rows} (vocab_size): a prompt or stop string with a larger id cannot be served; fix: save the "
            "model's own tokenizer next to it (engine.model.path), or resize the model's embeddings to the tokenizer"
        )
