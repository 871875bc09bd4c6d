"""roles.datum_losses against the Tinker docs' formulas written out independently: per token in
plain Python floats (values), and each loss's derivative d loss / d lp worked out by hand
(gradients). Three datums of different lengths, with ratios on both sides of the clip range and
advantages of both signs, so every branch of every min / clip is taken."""

from __future__ import annotations

import math

import pytest
import torch

from roles.datum_losses import DatumLossError, check_loss, engine_loss_fn, per_token_terms

LENGTHS = (6, 11, 9)


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    # sampler log-probs within +-0.6 of lp: ratios from 0.55 to 1.8, inside and outside [0.8, 1.2]
    q = lp + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 1.2
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.randn(n, generator=g, dtype=torch.float64)  # any real weights, negative too
    mask = (torch.rand(n, generator=g) > 0.3).double()
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return lp, {"logprobs": q, "advantages": adv, "weights": w, "sequence_ratio_mask": mask}, offsets


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _written_out(name, lp, inp, offsets, cfg):
    """(loss, d loss / d lp per token) from the docs' definitions, token by token."""
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    loss, grad = 0.0, []
    for d in range(len(LENGTHS)):
        a, b = int(offsets[d]), int(offsets[d + 1])
        m = [float(inp["sequence_ratio_mask"][t]) for t in range(a, b)]
        s = math.exp(sum((float(lp[t]) - float(inp["logprobs"][t])) * m[t - a] for t in range(a, b)) / max(sum(m), 1))
        for t in range(a, b):
            x, q, A, w = float(lp[t]), float(inp["logprobs"][t]), float(inp["advantages"][t]), float(inp["weights"][t])
            r = math.exp(x - q)
            if name == "cross_entropy":
                loss, g = loss - x * w, -w
            elif name == "importance_sampling":
                loss, g = loss - r * A, -r * A
            elif name in ("ppo", "gspo"):
                rr = r if name == "ppo" else s  # gspo: the sequence ratio's value, the token's own gradient
                unclipped, clipped = rr * A, _clip(rr, lo, hi) * A
                loss -= min(unclipped, clipped)
                # the min takes the unclipped branch (gradient rr * A) unless the clipped one is smaller
                g = -rr * A if unclipped <= clipped else 0.0
            elif name == "cispo":
                loss, g = loss - _clip(r, lo, hi) * x * A, -_clip(r, lo, hi) * A
            elif name == "dro":
                beta = cfg["beta"]
                loss, g = loss - (x * A - 0.5 * beta * (x - q) ** 2), -(A - beta * (x - q))
            grad.append(g)
    return loss, torch.tensor(grad, dtype=torch.float64)


CASES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", None),
    ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
    ("dro", None),
    ("dro", {"beta": 0.3}),
    ("gspo", None),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}),
]


@pytest.mark.parametrize(("name", "config"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_each_loss_equals_its_written_out_formula_values_and_gradients(name, config):
    lp, inputs, offsets = _case()
    cfg = check_loss(name, config)
    x = lp.clone().requires_grad_(True)
    total = per_token_terms(name, x, inputs, offsets, cfg).sum()
    total.backward()
    want, want_grad = _written_out(name, lp, inputs, offsets, cfg)
    assert math.isclose(float(total), want, rel_tol=1e-12, abs_tol=1e-12)
    assert torch.allclose(x.grad, want_grad, rtol=1e-12, atol=1e-12), (x.grad - want_grad).abs().max()


def test_the_cases_cross_both_clip_bounds_with_both_advantage_signs():
    """The loss cases above reach every branch: ratios below 0.8 and above 1.2, each with A > 0 and A < 0."""
    lp, inputs, _ = _case()
    r = torch.exp(lp - inputs["logprobs"])
    adv = inputs["advantages"]
    for side in (r < 0.8, r > 1.2):
        assert bool((side & (adv > 0)).any()) and bool((side & (adv < 0)).any())


def test_cross_entropy_sums_k_targets_with_per_position_or_per_target_weights():
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(6, 3, generator=g, dtype=torch.float64)
    offsets = torch.tensor([0, 2, 6])
    per_target = torch.randn(6, 3, generator=g, dtype=torch.float64)
    per_position = torch.randn(6, generator=g, dtype=torch.float64)
    got_t = per_token_terms("cross_entropy", lp, {"weights": per_target}, offsets, {}).sum()
    got_p = per_token_terms("cross_entropy", lp, {"weights": per_position}, offsets, {}).sum()
    want_t = -sum(float(lp[i, k]) * float(per_target[i, k]) for i in range(6) for k in range(3))
    want_p = -sum(float(lp[i, k]) * float(per_position[i]) for i in range(6) for k in range(3))
    assert math.isclose(float(got_t), want_t, rel_tol=1e-12) and math.isclose(float(got_p), want_p, rel_tol=1e-12)


def test_per_token_thresholds_in_the_inputs_win_over_the_config():
    lp, inputs, offsets = _case()
    n = lp.numel()
    tight = {
        **inputs,
        "clip_low_threshold": torch.full((n,), 0.99, dtype=torch.float64),
        "clip_high_threshold": torch.full((n,), 1.01, dtype=torch.float64),
    }
    got = per_token_terms("ppo", lp, tight, offsets, check_loss("ppo", None)).sum()
    want, _ = _written_out("ppo", lp, inputs, offsets, check_loss("ppo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}))
    assert math.isclose(float(got), want, rel_tol=1e-12)


def test_the_loss_is_a_sum_so_any_partition_of_the_datums_adds_up():
    """Per datum or all at once: the same total (GSPO's per-datum mean included)."""
    lp, inputs, offsets = _case()
    for name in ("cross_entropy", "ppo", "gspo", "dro"):
        cfg = check_loss(name, None)
        whole = per_token_terms(name, lp, inputs, offsets, cfg).sum()
        parts = 0.0
        for d in range(len(LENGTHS)):
            a, b = int(offsets[d]), int(offsets[d + 1])
            parts += float(per_token_terms(name, lp[a:b], {k: v[a:b] for k, v in inputs.items()}, torch.tensor([0, b - a]), cfg).sum())
        assert math.isclose(float(whole), parts, rel_tol=1e-12), name


@pytest.mark.parametrize(
    ("name", "config", "needle"),
    [
        ("stable_reinforce", None, "stability records"),
        ("custom", None, "forward_backward_custom"),
        ("mse", None, "unknown"),
        ("ppo", {"beta": 0.1}, "loss_fn_config['beta'] is not a setting of ppo"),
        ("ppo", {"clip_low_threshold": 1.3}, "clip_low_threshold <= 1 <= clip_high_threshold"),
        ("ppo", {"clip_low_threshold": 0.2, "clip_high_threshold": 0.2}, "the actor's clip_low / clip_high are margins"),
        ("dro", {"beta": float("nan")}, "a finite number"),
    ],
)
def test_refused_losses_and_configs_name_the_field_and_the_fix(name, config, needle):
    with pytest.raises(DatumLossError, match="fix") as err:
        check_loss(name, config)
    assert needle in str(err.value)


def test_the_engine_loss_reads_the_batch_fields_and_reports_the_sum():
    from engine_api.batch import make_batch
    from engine_api.losses import NormContext, NormCounts

    lp, inputs, offsets = _case()
    rows = [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    batch = make_batch(
        [torch.zeros(s.stop - s.start, dtype=torch.long) for s in rows],
        sampling_logprobs=[inputs["logprobs"][s] for s in rows],
        advantages=[inputs["advantages"][s] for s in rows],
    )
    out = {"target_log_probs": torch.nested.nested_tensor_from_jagged(lp, batch["input_ids"].offsets())}
    norm = NormContext(mode="sum", counts=NormCounts(0, 0), denominator=1.0, dp_size=1)
    contribution, metrics = engine_loss_fn("importance_sampling", check_loss("importance_sampling", None))(batch, out, norm)
    want, _ = _written_out("importance_sampling", lp, inputs, offsets, {})
    assert math.isclose(float(contribution), want, rel_tol=1e-12) and math.isclose(metrics["loss:sum"], want, rel_tol=1e-12)


def test_a_loss_added_to_the_registry_is_served_by_the_engine_loss_and_the_wire_layer(monkeypatch):
    """Issue 55, item 5: one registry (``roles.datum_losses.LOSSES``) that the engine loss, the
    datum checks and the Tinker server's wire layer read: a new entry there is accepted by name
    everywhere, with its inputs and config, and nothing else is edited."""
    from roles import datum_losses as dl
    from tinker_server import wire

    def doubled(lp, inputs, offsets, config):
        return -2.0 * config["scale"] * lp * inputs["weights"]

    monkeypatch.setitem(dl.LOSSES, "doubled_ce", dl.DatumLoss(doubled, ("weights",), (), {"scale": 1.0}))
    assert wire.check_loss_fn("doubled_ce") == "doubled_ce"
    assert dl.check_loss("doubled_ce", {"scale": 3.0}) == {"scale": 3.0}
    assert dl.required_inputs("doubled_ce") == ("weights",)
    lp = torch.tensor([-1.0, -2.0, -0.5])
    terms = dl.per_token_terms("doubled_ce", lp, {"weights": torch.tensor([1.0, 0.0, 1.0])}, torch.tensor([0, 3]), {"scale": 3.0})
    assert terms.tolist() == [6.0, 0.0, 3.0]
    monkeypatch.delitem(dl.LOSSES, "doubled_ce")
    with pytest.raises(wire.UserError, match="'doubled_ce' is unknown"):
        wire.check_loss_fn("doubled_ce")
