"""Where the PPO recipe puts the score before GAE (issue 28, item 9).

The sequence-level score is the reward of the LAST response token (the last token the loss
mask keeps), and GAE runs over the response tokens only: prompt tokens, and tokens after the
response that the mask drops, get advantage and return 0. Putting the score on the first
response token, on the last prompt token or on a dropped trailing token, or running GAE over
the whole sequence, changes every advantage the actor is trained with. ``rl_step`` calls
``roles.algos.gae_per_sequence`` with the flat per-token values, mask and the batch offsets;
the expected numbers are worked by hand below (gamma = lam = 0.5, so gamma * lam = 0.25).
"""

from __future__ import annotations

import pytest
import torch

from roles.algos import gae_per_sequence

# Sequence A: 2 prompt tokens, 3 response tokens, score 1.0, response values 0.1 0.2 0.3.
#   t=2: delta = 1 + 0 - 0.3 = 0.7                        A = 0.7
#   t=1: delta = 0 + 0.5 * 0.3 - 0.2 = -0.05              A = -0.05 + 0.25 * 0.7 = 0.125
#   t=0: delta = 0 + 0.5 * 0.2 - 0.1 = 0.0                A = 0.25 * 0.125 = 0.03125
#   returns = A + V = 0.13125, 0.325, 1.0
# Sequence B: 1 prompt token, 2 response tokens, 1 trailing token the mask drops, score -2.0,
# response values 0.4 -0.2.
#   t=1: delta = -2 + 0 + 0.2 = -1.8                      A = -1.8
#   t=0: delta = 0 + 0.5 * -0.2 - 0.4 = -0.5              A = -0.5 + 0.25 * -1.8 = -0.95
#   returns = -0.55, -2.0
MASK = [0, 0, 1, 1, 1] + [0, 1, 1, 0]
VALUES = [0, 0, 0.1, 0.2, 0.3] + [0, 0.4, -0.2, 0]  # rl_step passes values * mask
OFFSETS = [0, 5, 9]
SCORES = [1.0, -2.0]
WANT_ADV = [0, 0, 0.03125, 0.125, 0.7] + [0, -0.95, -1.8, 0]
WANT_RET = [0, 0, 0.13125, 0.325, 1.0] + [0, -0.55, -2.0, 0]


def _run(scores, values, mask, offsets, gamma=0.5, lam=0.5):
    return gae_per_sequence(
        torch.tensor(scores),
        torch.tensor(values, dtype=torch.float32),
        torch.tensor(mask, dtype=torch.float32),
        torch.tensor(offsets),
        gamma,
        lam,
    )


def test_the_score_is_the_reward_of_the_last_response_token():
    adv, ret = _run(SCORES, VALUES, MASK, OFFSETS)
    assert adv.tolist() == pytest.approx(WANT_ADV, abs=1e-6)
    assert ret.tolist() == pytest.approx(WANT_RET, abs=1e-6)


def test_with_gamma_and_lambda_one_every_response_token_gets_score_minus_its_value():
    """The undiscounted case, by definition of GAE: A_t = (sum of later rewards) - V_t = score - V_t;
    the return of every response token is the score itself."""
    adv, ret = _run(SCORES, VALUES, MASK, OFFSETS, gamma=1.0, lam=1.0)
    want = [0, 0, 1 - 0.1, 1 - 0.2, 1 - 0.3] + [0, -2 - 0.4, -2 + 0.2, 0]
    assert adv.tolist() == pytest.approx(want, abs=1e-6)
    assert ret.tolist() == pytest.approx([0, 0, 1, 1, 1] + [0, -2, -2, 0], abs=1e-6)


def test_a_one_token_response_and_the_order_of_sequences():
    """A response of one token gets the score minus its value; the second sequence's numbers do
    not depend on what precedes it in the batch (its offsets select it)."""
    adv, _ = _run([3.0, 1.0], [0, 0.5] + [0, 0, 0.25], [0, 1] + [0, 0, 1], [0, 2, 5])
    assert adv.tolist() == pytest.approx([0, 2.5] + [0, 0, 0.75], abs=1e-6)
    adv_b, _ = _run([1.0], [0, 0, 0.25], [0, 0, 1], [0, 3])
    assert adv_b.tolist() == pytest.approx([0, 0, 0.75], abs=1e-6)


def test_gamma_discounts_and_lambda_only_mixes():
    """gamma = 0.5, lam = 1: GAE is then the discounted return minus the value,
    A_t = 0.5 ** (T - 1 - t) * score - V_t (sequence A: 0.25 - 0.1, 0.5 - 0.2, 1 - 0.3).
    Swapping gamma and lambda would give 0.45 at t = 1."""
    adv, _ = _run(SCORES[:1], VALUES[:5], MASK[:5], OFFSETS[:2], gamma=0.5, lam=1.0)
    assert adv.tolist() == pytest.approx([0, 0, 0.15, 0.3, 0.7], abs=1e-6)
