"""What the conformance checks run on: a tiny HF model directory, a batch, a loss, and the
independent references (HF transformers + torch, one sequence at a time, the loss formula
written out; no engine_api code on the reference path).

The model is a Llama-style decoder (GQA, untied head) built from its config with a fixed seed
(nothing is downloaded); every constant-valued tensor (norms) is perturbed, so a backend that
swaps or drops a tensor cannot match by accident.
"""

from __future__ import annotations

import math
import os

import torch

VOCAB = 64
LENGTHS = (5, 9, 3, 12, 7, 4, 10, 6)  # 8 sequences: shards evenly over 1, 2, 4 or 8 DP ranks
RESPONSE = (3, 5, 2, 4, 6, 3, 5, 2)  # loss on the last R tokens (R < length keeps position 0 out)
CONSTANT = 8.0  # C of seq-mean-token-sum-norm
LR, EPS, WEIGHT_DECAY, CLIP = 0.01, 1e-3, 0.01, 1.0
# The dropout model (``build_model(..., attention_dropout=DROPOUT)``): the same weights with
# HF's attention dropout on, so a training step draws random numbers and a resume that does not
# restore the RNG takes another step. Its directory sits next to the kit's model.
DROPOUT = 0.1
DROPOUT_MODEL = "model_dropout"
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# The kit's model: a Llama-style decoder (GQA, untied head); tests reuse the dimensions.
TINY_DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def build_model(path: str, seed: int = 0, attention_dropout: float = 0.0) -> str:
    """Save the kit's tiny Llama-style model under ``path``; returns ``path``. The weights
    depend on ``seed`` only: ``attention_dropout`` changes the config alone."""
    from transformers import LlamaConfig

    return save_model(LlamaConfig(**TINY_DIMS, rms_norm_eps=1e-6, attention_dropout=attention_dropout), path, seed)


def save_model(config, path, seed: int = 0) -> str:
    """A seeded HF causal LM of ``config`` with :func:`perturb_constants` applied, saved with
    ``save_pretrained`` under ``path``; returns ``path`` as a string."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    perturb_constants(model, seed + 1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return str(path)


def perturb_constants(model: torch.nn.Module, seed: int) -> None:
    """Add seeded noise to every constant-valued tensor (HF initialises norms to 1 and biases
    to 0, which would hide a converter that swaps two norms or drops a bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if bool((p == p.flatten()[0]).all()):
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def make_test_batch(seed: int = 0, lengths=LENGTHS, response=RESPONSE, vocab: int = VOCAB, **meta):
    """The global batch: random sequences of ``lengths``, a mask over the last ``response``
    tokens of each, per-token advantages, and ``meta`` as batch metadata."""
    from engine_api.batch import make_batch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    masks = [torch.cat([torch.zeros(n - r), torch.ones(r)]) for n, r in zip(lengths, response, strict=True)]
    adv = [torch.randn(n, generator=g) for n in lengths]
    return make_batch(seqs, loss_mask=masks, advantages=adv, **meta)


def per_token_loss(log_probs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """A policy-gradient-like term plus a nonlinear one (so the loss is not linear in log-probs)."""
    return -log_probs * advantages + 0.1 * log_probs.pow(2)


def loss_fn(mb, out, norm):
    """The engines' loss: :func:`per_token_loss` aggregated against the global context."""
    from engine_api.losses import agg_loss

    return agg_loss(per_token_loss(out["log_probs"], mb["advantages"]), mb["loss_mask"], norm), {}


def engine_overrides(strategy: str, model_dir: str, mode: str = "token-mean") -> list[str]:
    """The settings every check uses. AdamW eps is 1e-3: Adam's first step is
    lr * g / (|g| + eps); with the usual 1e-8 it is a sign function, so fp32 noise in a gradient
    component that is truly ~0 flips a 2 * lr update and a mis-scaled gradient changes nothing.
    With 1e-3 the update is Lipschitz in g, so comparing weights compares gradients element by
    element."""
    out = [
        f"strategy={strategy}",
        f"model.path={model_dir}",
        f"loss_agg_mode={mode}",
        f"optim.lr={LR}",
        f"optim.eps={EPS}",
        f"optim.weight_decay={WEIGHT_DECAY}",
        f"optim.clip_grad={CLIP}",
    ]
    if mode == "seq-mean-token-sum-norm":
        out.append(f"loss_agg_constant={CONSTANT}")
    return out


def lr_at(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based) under warmup + cosine decay, as
    ``OptimConfig`` documents it (``optim.warmup_steps`` / ``total_steps`` / ``min_lr_ratio``),
    written out here so the check does not trust the engine's scheduler: linear warmup
    ``lr * (step + 1) / warmup``, then a half cosine from ``lr`` down to ``min_ratio * lr`` at
    step ``total``, flat after."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def hf_model(model_dir: str, head: str = "lm", seed: int = 0):
    """The HF model of ``model_dir`` in fp32, eval mode (``head: value``: token
    classification with one label, no classifier dropout, its head seeded by ``seed``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    if head == "value":
        cfg = AutoConfig.from_pretrained(model_dir, num_labels=1)
        cfg.classifier_dropout = 0.0
        torch.manual_seed(seed)
        return AutoModelForTokenClassification.from_pretrained(model_dir, config=cfg, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_token_outputs(model, batch, temperature: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: aligned log-probs (0 at position 0) and entropy of ``logits / temperature``."""
    log_probs, entropy = [], []
    with torch.no_grad():
        for ids in batch["input_ids"].unbind():
            logits = model(ids[None]).logits[0, :-1] / temperature
            logp = torch.log_softmax(logits, -1)
            log_probs.append(torch.cat([torch.zeros(1), logp.gather(-1, ids[1:, None]).squeeze(-1)]))
            entropy.append(torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)]))
    return log_probs, entropy


def hf_values(model, batch) -> list[torch.Tensor]:
    """Per sequence: ``values[i]`` predicted from the prefix before token i (0 at 0)."""
    with torch.no_grad():
        return [torch.cat([torch.zeros(1), model(ids[None]).logits[0, :-1, 0]]) for ids in batch["input_ids"].unbind()]


def reference_step(model_dir: str, mode: str) -> dict:
    """One optimizer step computed independently: per-sequence HF forward, the aggregation
    formula written out, autograd, clipping and torch AdamW. Returns the loss, the pre-clip
    grad norm, and the parameters before and after by HF name."""
    model = hf_model(model_dir)
    model.train()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = make_test_batch()
    seq_terms, token_sum, n_tokens = [], 0.0, 0.0
    for i in range(len(LENGTHS)):
        ids = b["input_ids"][i]
        logits = model(ids[None]).logits[0]
        lp = torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)])
        m = b["loss_mask"][i]
        per_tok = per_token_loss(lp, b["advantages"][i]) * m
        token_sum = token_sum + per_tok.sum()
        n_tokens += float(m.sum())
        seq_terms.append(per_tok.sum() / m.sum() if mode == "seq-mean-token-mean" else per_tok.sum())
    n_seqs = len(seq_terms)
    loss = {
        "token-mean": token_sum / n_tokens,
        "seq-mean-token-mean": sum(seq_terms) / n_seqs,
        "seq-mean-token-sum": sum(seq_terms) / n_seqs,
        "seq-mean-token-sum-norm": token_sum / (n_seqs * CONSTANT),
    }[mode]
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=WEIGHT_DECAY).step()
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"loss": float(loss.detach()), "grad_norm": norm, "before": before, "after": after}


# Arbitrary targets (``target_ids``), the ``sum`` mode and per-step AdamW settings: two steps whose
# hyperparameters all change in between (the second without clipping), as the Tinker API drives them.
STEP_HPARAMS = (
    dict(lr=0.02, betas=(0.8, 0.99), eps=2e-3, weight_decay=0.05, clip_grad=0.5),
    dict(lr=0.005, betas=(0.95, 0.9), eps=1e-3, weight_decay=0.0, clip_grad=None),
)


def make_target_batch(seed: int = 0, k: int | None = None):
    """The test batch with ``target_ids`` (random ids, ``[T]`` or ``[T, k]`` per sequence: not the
    next input token) and real-valued ``weights`` of either sign, one per target."""
    from engine_api.batch import make_batch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    shape = (lambda n: (n,)) if k is None else (lambda n: (n, k))
    targets = [torch.randint(0, VOCAB, shape(n), generator=g) for n in LENGTHS]
    weights = [torch.randn(shape(n), generator=g) for n in LENGTHS]
    return make_batch(seqs, target_ids=targets, weights=weights)


def target_per_token_loss(lp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A weighted cross-entropy plus a nonlinear term (the loss is not linear in log-probs)."""
    return -lp * weights + 0.1 * lp.pow(2)


def target_loss_fn(mb, out, norm):
    """The engines' loss over ``target_log_probs``: a plain sum over every position (no mask: the
    weights select), divided by the call's denominator (1 in the ``sum`` mode)."""
    return target_per_token_loss(out["target_log_probs"].values(), mb["weights"].values()).sum() / norm.denominator, {}


def hf_target_log_probs(model, batch) -> list[torch.Tensor]:
    """Per sequence: ``log_softmax(logits[t])[target_ids[t]]`` at every position (no shift)."""
    out = []
    with torch.no_grad():
        for ids, targets in zip(batch["input_ids"].unbind(), batch["target_ids"].unbind(), strict=True):
            logp = torch.log_softmax(model(ids[None]).logits[0], -1)
            out.append(logp.gather(-1, targets[:, None]).squeeze(-1) if targets.dim() == 1 else logp.gather(-1, targets))
    return out


def reference_target_steps(
    model_dir: str, seeds: tuple[int, ...], lora: tuple[dict, int, float] | None = None, start: dict | None = None
) -> list[dict]:
    """Optimizer steps of :func:`target_loss_fn` summed over the batch of each seed, computed
    independently (per-sequence HF forward, autograd, clipping, torch AdamW whose groups are set
    to :data:`STEP_HPARAMS` before each step). Per step: loss, pre-clip grad norm, parameters.

    ``lora``: ``(adapters, rank, alpha)``: peft's LoRA on the modules ``adapters`` (peft's names)
    sit on, set to them, trains instead; ``after`` then holds the adapters by peft's names.
    ``start``: HF weights to start from (a fresh AdamW on them) instead of ``model_dir``'s."""
    model = hf_model(model_dir)
    if start is not None:
        model.load_state_dict(start)
    if lora is not None:
        import peft

        adapters, rank, alpha = lora
        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=peft_targets(adapters)))
        if peft.set_peft_model_state_dict(model, adapters).unexpected_keys:
            raise ValueError("the adapters are not named as peft names them")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    first = STEP_HPARAMS[0]
    opt = torch.optim.AdamW(params, lr=first["lr"], betas=first["betas"], eps=first["eps"], weight_decay=first["weight_decay"])
    steps = []
    for seed, hp in zip(seeds, STEP_HPARAMS[: len(seeds)], strict=True):
        for group in opt.param_groups:
            group.update(lr=hp["lr"], betas=hp["betas"], eps=hp["eps"], weight_decay=hp["weight_decay"])
        opt.zero_grad()
        b = make_target_batch(seed)
        loss = 0.0
        for ids, targets, w in zip(b["input_ids"].unbind(), b["target_ids"].unbind(), b["weights"].unbind(), strict=True):
            lp = torch.log_softmax(model(ids[None]).logits[0], -1).gather(-1, targets[:, None]).squeeze(-1)
            loss = loss + target_per_token_loss(lp, w).sum()
        loss.backward()
        clip = hp["clip_grad"] if hp["clip_grad"] is not None else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        opt.step()
        if lora is None:
            after = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            import peft

            after = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items() if ".lora_" in k}
        steps.append({"loss": float(loss.detach()), "grad_norm": norm, "after": after})
    return steps


def peft_targets(adapters: dict) -> list[str]:
    """The module names (last component) that adapters by peft's names sit on: the engine's own
    choice of ``model.lora.target_modules``, for peft's ``LoraConfig``."""
    return sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapters})


def rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Relative L2 difference of two tensor sets as one vector (per-tensor ratios of tiny
    tensors would measure fp32 reordering noise, not the property)."""
    a = torch.cat([got[k].flatten().double() for k in want])
    b = torch.cat([v.flatten().double() for v in want.values()])
    return float((a - b).norm() / b.norm())
