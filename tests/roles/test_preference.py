"""Preference losses (``roles.preference``): DPO (sigmoid), IPO and SimPO on the engine.

* Values: each pair's loss and implicit rewards equal a hand computation from plain HF forward
  passes of policy and reference, written as TRL documents each loss (its DPOTrainer / CPOTrainer
  formulas), fp64 from fp32 log-probs (rel 1e-6, or 1e-7 of the sums' size times beta where a small difference of sums is compared), on jagged pairs (prompt and response lengths
  differ within and across pairs, masks on the responses only); broken variants (chosen and
  rejected swapped, a per-token mean instead of the sum, the reference dropped) miss it.
* Gradient: one step's gradient (lr 0) equals autograd of the mean pair loss through plain HF
  (FSDP: every parameter to rel 1e-5 of its max; megatron: the gradient norm), and is the same at
  1 and 4 micro-batches, with dynamic batching and on 2 ranks (rows of a pair on different
  micro-batches and ranks: the two-pass surrogate keeps it exact).
* Bad settings: unknown loss, a setting the loss does not have, beta <= 0, another agg mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from roles.preference import PREFERENCE_LOSSES, PairValues, PreferenceConfig, PreferencePolicy, loss_settings, markdown_table
from roles.reference import Reference
from tests.support.hf_utils import engine_for, make_model
from tests.support.launch import run_distributed
from tests.support.pairs import pair_batch


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    return make_model(root / "policy", "llama", seed=0), make_model(root / "ref", "llama", seed=3)


def _hf_sums(model, batch) -> torch.Tensor:
    """Per row: the sum of log p(token) over its response (the loss mask), by a plain HF forward."""
    out = []
    for ids, mask in zip(batch["input_ids"].unbind(), batch["loss_mask"].unbind(), strict=True):
        logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
        out.append((logp * mask[1:]).sum())
    return torch.stack(out)


def trl_formula(loss: str, s, ref, n, beta: float, ls: float = 0.0, gamma: float = 0.5, sft_weight: float = 0.0):
    out, rc, rr = _trl(loss, s, ref, n, beta, ls, gamma)
    return out - sft_weight * s[0::2] / n[0::2], rc, rr  # NeMo-RL's sft_loss_weight: the chosen's token NLL


def _trl(loss: str, s, ref, n, beta: float, ls: float = 0.0, gamma: float = 0.5):
    """TRL's documented losses on per-row sums (rows chosen, rejected, ...): DPOTrainer's
    ``sigmoid`` (with label smoothing) and ``ipo`` (on length-averaged log-probs), CPOTrainer's
    ``simpo`` (average log-probs, ``simpo_gamma``). Returns (losses, chosen rewards, rejected)."""
    pc, pr, rc, rr, nc, nr = s[0::2], s[1::2], ref[0::2], ref[1::2], n[0::2], n[1::2]
    if loss == "sigmoid":
        logits = (pc - pr) - (rc - rr)
        out = -torch.nn.functional.logsigmoid(beta * logits) * (1 - ls) - torch.nn.functional.logsigmoid(-beta * logits) * ls
        return out, beta * (pc - rc), beta * (pr - rr)
    if loss == "ipo":
        logits = (pc / nc - pr / nr) - (rc / nc - rr / nr)
        return (logits - 1 / (2 * beta)) ** 2, beta * (pc - rc) / nc, beta * (pr - rr) / nr
    logits = pc / nc - pr / nr - gamma / beta
    out = -torch.nn.functional.logsigmoid(beta * logits) * (1 - ls) - torch.nn.functional.logsigmoid(-beta * logits) * ls
    return out, beta * pc / nc, beta * pr / nr


CASES = {
    "sigmoid": {"beta": 0.3, "label_smoothing": 0.1, "sft_weight": 0.5},
    "ipo": {"beta": 0.2},
    "simpo": {"beta": 2.0, "gamma": 0.4, "label_smoothing": 0.05},
}


def _config(loss: str, settings: dict) -> PreferenceConfig:
    return PreferenceConfig(
        loss=loss,
        beta=settings["beta"],
        label_smoothing=settings.get("label_smoothing", 0.0),
        gamma=settings.get("gamma"),
        sft_weight=settings.get("sft_weight", 0.0),
    )


def _values(rank, world, policy_dir, ref_dir, strategy):
    """Every loss's pair values on the engine (a rank of a long-lived world)."""
    out = {}
    policy = engine_for(policy_dir, "loss_agg_mode=seq-mean-token-sum", "micro_batch_size=3", strategy=strategy)
    reference = Reference(engine_for(ref_dir, "frozen=true", strategy=strategy))
    for loss, settings in CASES.items():
        role = PreferencePolicy(policy, _config(loss, settings), reference)
        out[loss] = role.pair_values(pair_batch())
    return out


def _hand(policy_dir, ref_dir):
    batch = pair_batch()
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        s, r = _hf_sums(policy, batch).double(), _hf_sums(ref, batch).double()
    n = torch.stack([m.sum() for m in batch["loss_mask"].unbind()]).double()
    return s, r, n


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def test_each_loss_equals_trl_formula_on_plain_hf_log_probs(dirs):
    policy_dir, ref_dir = dirs
    got = run_distributed(_values, 1, policy_dir, ref_dir, "fsdp", timeout=300)[0]
    s, r, n = _hand(policy_dir, ref_dir)
    for loss, settings in CASES.items():
        want = trl_formula(loss, s, r, n, **{"ls" if k == "label_smoothing" else k: v for k, v in settings.items()})
        v: PairValues = got[loss]
        # The rewards and losses are differences of fp32 sums of O(10): exact to that noise
        # (1e-7 relative of the sums, times beta), not to 1e-6 of the small differences.
        tol = 1e-7 * settings["beta"] * float(s.abs().max() + r.abs().max())
        for a, b in zip((v.loss, v.chosen, v.rejected), want, strict=True):
            assert float((a - b).abs().max()) <= max(tol, 1e-6 * float(b.abs().max())), (loss, a, b, tol)
        # Broken variants miss the hand value: sides swapped, per-token means, no reference.
        swapped = trl_formula(
            loss, torch.stack([s[1::2], s[0::2]], 1).flatten(), torch.stack([r[1::2], r[0::2]], 1).flatten(), n, settings["beta"]
        )
        assert _rel(swapped[0], want[0]) > 1e-2, loss
        if loss == "sigmoid":
            assert _rel(trl_formula(loss, s / n, r / n, n, settings["beta"], settings["label_smoothing"])[0], want[0]) > 1e-2
            assert _rel(trl_formula(loss, s, torch.zeros_like(r), n, settings["beta"], settings["label_smoothing"])[0], want[0]) > 1e-2


def _step(rank, world, policy_dir, ref_dir, strategy, overrides, loss):
    """One step (lr 0) of ``loss``: the pair values and, per parameter, the gradient (FSDP) or
    the gradient norm."""
    settings = CASES[loss]
    policy = engine_for(
        policy_dir, "loss_agg_mode=seq-mean-token-sum", "optim.lr=0.0", "optim.clip_grad=1e9", *overrides, strategy=strategy
    )
    reference = Reference(engine_for(ref_dir, "frozen=true", strategy=strategy))
    role = PreferencePolicy(policy, _config(loss, settings), reference)
    batch = pair_batch()
    metrics = role.update(batch)
    grads = {}
    if strategy == "fsdp":
        for name, p in policy.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("_orig_mod.")] = g.clone()
    return metrics, grads


def _hf_grads(policy_dir, ref_dir, loss):
    settings = CASES[loss]
    batch = pair_batch()
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        r = _hf_sums(ref, batch).double()
    s = _hf_sums(policy, batch).double()
    n = torch.stack([m.sum() for m in batch["loss_mask"].unbind()]).double()
    losses = trl_formula(loss, s, r, n, **{"ls" if k == "label_smoothing" else k: v for k, v in settings.items()})[0]
    losses.mean().backward()
    return {name: p.grad for name, p in policy.named_parameters()}


LAYOUTS = {
    "one micro-batch": (1, ["micro_batch_size=8"]),
    "mbs=1": (1, ["micro_batch_size=1"]),
    "mbs=3 (pairs split)": (1, ["micro_batch_size=3"]),
    "dynamic": (1, ["max_token_len_per_micro_batch=20"]),
    "2 ranks, mbs=1": (2, ["micro_batch_size=1"]),
}


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_the_step_follows_the_mean_pair_loss_at_any_micro_batching_and_dp(dirs, loss):
    """The gradient of one step equals autograd of the mean pair loss through plain HF at every
    layout (SimPO: the two that split a pair's rows), including micro-batches and ranks that split
    a pair's two rows (rel 1e-5 of each tensor's max: fp32 sums of the two passes)."""
    policy_dir, ref_dir = dirs
    want = _hf_grads(policy_dir, ref_dir, loss)
    layouts = LAYOUTS if loss == "sigmoid" else {k: LAYOUTS[k] for k in ("mbs=3 (pairs split)", "2 ranks, mbs=1")}
    for label, (world, overrides) in layouts.items():
        metrics, grads = run_distributed(_step, world, policy_dir, ref_dir, "fsdp", overrides, loss, timeout=300)[0]
        for name, g in want.items():
            err = float((grads[name] - g).abs().max() / g.abs().max())
            assert err <= 1e-5, (label, name, err)
        assert math.isfinite(metrics["grad_norm"]) and 0 <= metrics["dpo/accuracy"] <= 1


def test_megatron_takes_the_same_step(dirs):
    """Megatron's gradient norm and pair values equal FSDP's (the HF-checked one) to 1e-5."""
    policy_dir, ref_dir = dirs
    fsdp, _ = run_distributed(_step, 1, policy_dir, ref_dir, "fsdp", ["micro_batch_size=3"], "sigmoid", timeout=300)[0]
    mega, _ = run_distributed(_step, 1, policy_dir, ref_dir, "megatron", ["micro_batch_size=3"], "sigmoid", timeout=300)[0]
    for key in ("grad_norm", "dpo/loss", "dpo/rewards_chosen", "dpo/rewards_rejected"):
        assert mega[key] == pytest.approx(fsdp[key], rel=1e-5, abs=1e-7), key


def test_bad_settings_are_refused_naming_the_key():
    assert "unknown" in PreferenceConfig(loss="kto")._problems()[0]
    assert "gamma" in PreferenceConfig(loss="sigmoid", gamma=0.3)._problems()[0]
    assert "beta = -1.0" in PreferenceConfig(beta=-1.0)._problems()[0]
    assert "label_smoothing" in PreferenceConfig(loss="ipo", label_smoothing=0.1)._problems()[0]
    assert PreferenceConfig(loss="simpo")._problems() == []
    assert loss_settings("simpo", {})["gamma"] == 0.5
    from types import SimpleNamespace

    engine = SimpleNamespace(config=SimpleNamespace(loss_agg_mode="token-mean"))
    with pytest.raises(ValueError, match="engine.loss_agg_mode = token-mean.*fix: engine.loss_agg_mode=seq-mean-token-sum"):
        PreferencePolicy(engine, PreferenceConfig(loss="simpo"))


def test_the_docs_table_is_the_registry():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    assert markdown_table() in text
    assert set(PREFERENCE_LOSSES) == {"sigmoid", "ipo", "simpo"}
