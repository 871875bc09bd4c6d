"""Tiny HF MoE models and the independent references the MoE tests compare against."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from engine_api.conformance.fixtures import TINY_DIMS, save_model
from tests.support.hf_utils import EPS, make_test_batch

# Larger weights than HF's 0.02 so routing and attention move the outputs well beyond the
# tolerances (at 0.02 the tiny model's outputs are nearly uniform and the router near a tie).
BASE = {**TINY_DIMS, "initializer_range": 0.3}
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)
COEF = 0.5  # large, so that the load-balancing term moves the gradient far beyond the tolerance


def build_moe_models(root) -> dict[str, str]:
    """Every MoE variant the tests use, saved through ``save_pretrained`` (per-expert tensors on
    disk, as transformers 5 writes them) plus one directory in the fused in-memory layout."""
    out = {
        "qwen3_moe": save_model(Qwen3MoeConfig(**BASE, **QWEN3_MOE, norm_topk_prob=True), root / "qwen3_moe"),
        # 4 layers, an MoE layer every 2nd (decoder_sparse_step) except those in mlp_only_layers:
        # layer 1 only is MoE, 0, 2 and 3 are dense; top-k weights not renormalised.
        "qwen3_moe_mixed": save_model(
            Qwen3MoeConfig(
                **{**BASE, "num_hidden_layers": 4}, **QWEN3_MOE, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3]
            ),
            root / "qwen3_moe_mixed",
        ),
        "mixtral": save_model(
            MixtralConfig(**{**BASE, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=2), root / "mixtral"
        ),
        "qwen3_moe_aux": save_model(
            Qwen3MoeConfig(**BASE, **QWEN3_MOE, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=COEF),
            root / "qwen3_moe_aux",
        ),
        "mixtral_aux": save_model(
            MixtralConfig(
                **{**BASE, "intermediate_size": 16},
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
                router_aux_loss_coef=COEF,
            ),
            root / "mixtral_aux",
        ),
    }
    out["qwen3_moe_fused"] = save_fused(out["qwen3_moe"], root / "qwen3_moe_fused")
    return out


def save_fused(src: str, dst) -> str:
    """The model of ``src`` written in HF's fused in-memory layout (``mlp.experts.gate_up_proj``)."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    os.makedirs(dst, exist_ok=True)
    model.config.save_pretrained(dst)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def hf_router_counts(model_dir: str, batch) -> torch.Tensor:
    """``[layers, E]`` top-k assignments of every token, from HF's own ``router_logits`` output."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    counts = torch.zeros(cfg.num_hidden_layers, experts, dtype=torch.float64)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        for ids in batch["input_ids"].unbind():
            logits = model(ids[None], output_router_logits=True).router_logits
            for layer, lg in zip(moe_layers, logits, strict=True):
                top = lg.topk(cfg.num_experts_per_tok, dim=-1).indices.reshape(-1)
                counts[layer] += torch.bincount(top, minlength=experts).double()
    return counts


def hf_aux_step(model_dir: str) -> dict:
    """The reference for one micro-batch: HF's model on the padded batch (attention mask),
    the tests' policy-gradient token-mean loss plus ``router_aux_loss_coef x`` HF's own
    ``aux_loss`` output, clip 1.0, AdamW as the engines."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_test_batch()
    ids, masks, advs = (
        torch.nn.utils.rnn.pad_sequence(list(batch[k].unbind()), batch_first=True) for k in ("input_ids", "loss_mask", "advantages")
    )
    attention = torch.arange(ids.shape[1])[None] < batch["input_ids"].offsets().diff()[:, None]
    out = model(input_ids=ids, attention_mask=attention.long(), use_cache=False, output_router_logits=True)
    lp = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros(ids.shape[0], 1), lp], 1)
    per_tok = (-lp * advs + 0.1 * lp.pow(2)) * masks
    user = per_tok.sum() / masks.sum()
    aux = out.aux_loss * model.config.router_aux_loss_coef
    (user + aux).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999), eps=EPS, weight_decay=0.01).step()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"loss": float(user.detach()), "aux": float(aux.detach()), "grad_norm": norm, "params": params}
