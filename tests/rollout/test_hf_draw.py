"""The hf rollout's token draw (``backends.rollout.hf.inverse_cdf_draw``): one vectorized
inverse-CDF draw per position from each sample's own uniforms. Properties: the law of the drawn
token is the given distribution (checked against the exact probabilities with a chi-square
bound), a token of weight 0 (top-k / top-p filtered) is never drawn, even at the uniforms'
extremes, and unnormalised weights give the same draws as their normalised form."""

from __future__ import annotations

import torch

from backends.rollout.hf import inverse_cdf_draw


def test_the_drawn_tokens_follow_the_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    n = 200_000
    u = torch.rand(n, generator=g, dtype=torch.float64)
    tokens = inverse_cdf_draw(probs.expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[1] == 0 and counts[5] == 0
    keep = probs > 0
    expected = probs[keep].double() * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    # 3 degrees of freedom: P(chi2 > 16.3) = 0.001. A draw off by one index (searchsorted
    # without right=True, or the cumulative sum shifted) moves whole masses: chi2 in the thousands.
    assert chi2 < 16.3, (counts.tolist(), chi2)


def test_zero_weight_tokens_are_never_drawn_at_the_extremes():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.3, 0.0, 0.7], [0.6, 0.0, 0.4, 0.0]])
    for u in (0.0, 1e-300, 0.3 - 1e-12, 0.3, 0.6, 1 - 1e-16, 1 - 2**-53):
        tokens = inverse_cdf_draw(probs, torch.full((3,), u, dtype=torch.float64))
        assert all(probs[r, int(t)] > 0 for r, t in enumerate(tokens)), (u, tokens.tolist())


def test_unnormalised_weights_draw_as_their_normalised_form():
    g = torch.Generator().manual_seed(1)
    w = torch.rand(64, 50, generator=g) * (torch.rand(64, 50, generator=g) > 0.5)
    w[:, 0] += 0.01  # every row has some weight
    u = torch.rand(64, generator=g, dtype=torch.float64)
    assert torch.equal(inverse_cdf_draw(w * 7.5, u), inverse_cdf_draw(w, u))
