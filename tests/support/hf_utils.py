"""Shared pieces of the backend tests: tiny HF models, batches, and direct HF references.

The references use transformers and torch only (no engine_api code), one sequence at a
time, so they are independent of packing, padding and micro-batching.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from engine_api import agg_loss, build_engine, load_config, make_batch
from engine_api.conformance import fixtures
from engine_api.conformance.fixtures import perturb_constants
from posttrain.tiny_model import build_tiny_model

VOCAB = 64
# One optimizer step's variants that must all give the same update: (overrides, calls per step).
MODES = ("token-mean", "seq-mean-token-sum")
VARIANTS = {
    "all": ([], 1),
    "mbs=1": (["micro_batch_size=1"], 1),
    "mbs=2": (["micro_batch_size=2"], 1),
    "dynamic": (["max_token_len_per_micro_batch=16"], 1),
    "padded": (["use_remove_padding=false", "micro_batch_size=2"], 1),
    "split3-deferred": (["deferred_normalization=true", "micro_batch_size=1"], 3),
}
# AdamW eps for parameter comparisons after one step (see engine_api/conformance/fixtures.py, engine_overrides).
EPS = 1e-3
LENGTHS = (5, 9, 3, 12, 7, 4)
RESPONSE = (3, 5, 2, 4, 6, 3)
# Length-1 sequences first, between longer ones, side by side and last: where packed-row
# boundaries read from positions can slip (a lone position 0 followed by another 0 never "drops").
ONE_TOKEN_LENGTHS = (1, 6, 1, 1, 9, 4, 1)


def make_model(path, family: str, seed: int = 0, num_layers: int = 2, pad_token_id: int | None = None) -> str:
    """A tiny HF model saved with save_pretrained (llama: GQA untied; qwen2: qkv bias, tied;
    qwen3: q/k norm, decoupled head_dim). ``pad_token_id`` gives HF's embedding a padding_idx.

    HF initialises norms to 1 and biases to 0, which would hide a converter that swaps two
    norms or drops a bias; every constant-valued tensor gets a seeded perturbation.
    """
    path = build_tiny_model(
        path,
        family=family,
        seed=seed,
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        pad_token_id=pad_token_id,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    perturb_constants(model, seed + 1)
    model.save_pretrained(path)
    return path


def make_test_batch(seed: int = 0, **meta):
    """The backend tests' batch: 6 sequences of :data:`LENGTHS` (see the conformance fixtures)."""
    return fixtures.make_test_batch(seed, LENGTHS, RESPONSE, VOCAB, **meta)


def make_one_token_batch(seed: int = 0, **meta):
    """A batch of :data:`ONE_TOKEN_LENGTHS`: four one-token sequences (no loss tokens) among
    three longer ones (the last ``n // 2`` tokens in the loss)."""
    return fixtures.make_test_batch(seed, ONE_TOKEN_LENGTHS, tuple(n // 2 for n in ONE_TOKEN_LENGTHS), VOCAB, **meta)


def make_pad_batch(seed: int = 0):
    """:func:`make_test_batch` with token 0 (the pad id of ``make_model(..., pad_token_id=0)``)
    as the second token of every sequence, where later tokens attend to it."""
    base = make_test_batch(seed)
    seqs = [torch.cat([ids[:1], torch.zeros(1, dtype=ids.dtype), ids[2:]]) for ids in base["input_ids"].unbind()]
    return make_batch(seqs, loss_mask=list(base["loss_mask"].unbind()), advantages=list(base["advantages"].unbind()))


def pg_loss(mb, out, norm):
    """Policy-gradient-like loss with a nonlinear term."""
    per_token = -out["log_probs"] * mb["advantages"] + 0.1 * out["log_probs"].pow(2)
    return agg_loss(per_token, mb["loss_mask"], norm), {}


def engine_for(model_dir: str, *overrides: str, strategy: str = "fsdp"):
    engine = build_engine(load_config(None, [f"strategy={strategy}", f"model.path={model_dir}", "optim.lr=0.01", *overrides]))
    engine.init_model()
    engine.set_loss_fn(pg_loss)
    return engine


def one_step(model_dir: str, mode: str, extra=(), calls: int = 1, strategy: str = "fsdp", batch_fn=make_test_batch) -> dict:
    """One optimizer step on this rank's shard of ``batch_fn()``, split into ``calls``
    forward_backward calls (AdamW eps = :data:`EPS`). Returns the first call's loss (None when
    split), the pre-clip grad norm and the full updated params."""
    engine = engine_for(model_dir, f"loss_agg_mode={mode}", f"optim.eps={EPS}", *extra, strategy=strategy)
    local = engine.shard_data(batch_fn())
    n = local.batch_size[0]
    with engine.train_mode():
        engine.optimizer_zero_grad()
        losses = [engine.forward_backward_step(local[i * n // calls : (i + 1) * n // calls])[1] for i in range(calls)]
        grad_norm = engine.optimizer_step()
    return {"loss": losses[0] if calls == 1 else None, "grad_norm": grad_norm, "params": full_params(engine)}


def hf_log_probs(model_dir: str, batch) -> list[torch.Tensor]:
    """Per-sequence aligned log-probs straight from the HF model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_log_probs_of(model, batch)


def hf_log_probs_of(model, batch) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids in batch["input_ids"].unbind():
            logits = model(ids[None]).logits[0]
            out.append(torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)]))
    return out


def hf_values(model_dir: str, batch, seed: int) -> list[torch.Tensor]:
    """Per-sequence values from HF's token-classification head (seeded like the engine)."""
    cfg = AutoConfig.from_pretrained(model_dir, num_labels=1)
    cfg.classifier_dropout = 0.0
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_pretrained(model_dir, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.cat([torch.zeros(1), model(ids[None]).logits[0, :-1, 0]]) for ids in batch["input_ids"].unbind()]


def max_abs_diff(jagged: torch.Tensor, rows: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(jagged.unbind(), rows, strict=True))


def full_params(engine) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters by HF name. Collective."""
    return {k: v.clone().cpu() for k, v in engine.export_weights()}


def rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    a = torch.cat([got[k].flatten().double() for k in want])
    b = torch.cat([v.flatten().double() for v in want.values()])
    return float((a - b).norm() / b.norm())


def raw_step(model_dir, mode):
    """The independent baseline: plain HF + torch, one sequence at a time (``token-mean`` or
    ``seq-mean-token-sum``), clip 1.0, AdamW with eps :data:`EPS`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_test_batch()
    token_sum, tokens, seq_terms = 0.0, 0.0, []
    for ids, mask, adv in zip(batch["input_ids"].unbind(), batch["loss_mask"].unbind(), batch["advantages"].unbind(), strict=True):
        logits = model(ids[None], use_cache=False).logits[0]
        lp = torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)])
        per_tok = (-lp * adv + 0.1 * lp.pow(2)) * mask
        token_sum, tokens = token_sum + per_tok.sum(), tokens + float(mask.sum())
        seq_terms.append(per_tok.sum())
    loss = token_sum / tokens if mode == "token-mean" else sum(seq_terms) / len(seq_terms)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999), eps=EPS, weight_decay=0.01).step()
    return {"loss": float(loss.detach()), "grad_norm": norm, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def assert_same(got, want, label, rtol: float = 1e-6):
    if got["loss"] is not None:
        assert math.isclose(got["loss"], want["loss"], rel_tol=rtol), f"{label}: loss {got['loss']} vs {want['loss']}"
    assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=rtol), f"{label}: grad norm {got['grad_norm']} vs {want['grad_norm']}"
    assert rel(got["params"], want["params"]) <= rtol, f"{label}: params differ by {rel(got['params'], want['params']):.2e}"
