"""roles.algos against hand-computed cases (the numbers are worked out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from roles.algos import clipped_value_loss, gae, grpo_advantages, kl_estimate, ppo_policy_loss


def test_gae_hand_computed():
    # gamma = 0.5, lam = 0.5, rewards [0, 0, 1], values [0.2, 0.4, 0.6], terminal value 0.
    # deltas: d2 = 1 - 0.6 = 0.4; d1 = 0 + 0.5*0.6 - 0.4 = -0.1; d0 = 0 + 0.5*0.4 - 0.2 = 0.0
    # A2 = 0.4; A1 = -0.1 + 0.25*0.4 = 0.0; A0 = 0.0 + 0.25*0.0 = 0.0
    adv, ret = gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.2, 0.4, 0.6]), gamma=0.5, lam=0.5)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, 0.4]), atol=1e-7)
    assert torch.allclose(ret, torch.tensor([0.2, 0.4, 1.0]), atol=1e-7)


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    rewards, values = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, -1.0, 2.0])
    adv, ret = gae(rewards, values, gamma=0.9, lam=1.0)
    # Monte-Carlo returns: G2 = 3, G1 = 2 + 0.9*3 = 4.7, G0 = 1 + 0.9*4.7 = 5.23
    assert torch.allclose(ret, torch.tensor([5.23, 4.7, 3.0]), atol=1e-6)
    assert torch.allclose(adv, ret - values, atol=1e-6)


def test_grpo_advantages_hand_computed():
    # group 0: scores [1, 3] -> mean 2, unbiased std sqrt(2) -> [-1/sqrt2, 1/sqrt2]
    # group 1: scores [2, 2, 5] -> mean 3, std sqrt(((1+1+4)/2)) = sqrt(3) -> [-1, -1, 2]/sqrt3
    # group 2: a single sample -> 0
    adv = grpo_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, 7.0]), torch.tensor([0, 0, 1, 1, 1, 2]), eps=0.0)
    s2, s3 = math.sqrt(2), math.sqrt(3)
    assert torch.allclose(adv, torch.tensor([-1 / s2, 1 / s2, -1 / s3, -1 / s3, 2 / s3, 0.0]), atol=1e-6)
    centred = grpo_advantages(torch.tensor([1.0, 3.0]), torch.tensor([4, 4]), norm_by_std=False)
    assert centred.tolist() == [-1.0, 1.0]


def test_kl_estimators_hand_computed_and_zero_when_equal():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log r = 0.5
    assert math.isclose(float(kl_estimate(lp, ref, "k1")), 0.5)
    assert math.isclose(float(kl_estimate(lp, ref, "k2")), 0.125)
    assert math.isclose(float(kl_estimate(lp, ref, "k3")), math.exp(-0.5) - 1 + 0.5, rel_tol=1e-6)
    same = torch.randn(10)
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(same, same, kind), torch.zeros(10))
    assert (kl_estimate(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(same, same, "k4")


def test_ppo_loss_hand_computed():
    # ratios: exp(log 1.5) = 1.5, exp(log 0.5) = 0.5, 1.0; advantages 1, 1, -2; clip 0.2
    lp = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -2.0])
    loss, clipped = ppo_policy_loss(lp, old, adv)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5; token 2: max(2, 2) = 2
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, 2.0]), atol=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 0.0]


def test_asymmetric_clip_uses_each_bound_on_its_side():
    """clip_low = 0.1, clip_high = 0.3: the ratio is clipped to [0.9, 1.3] (DAPO's clip-higher).
    Swapping the bounds ([0.7, 1.1]) changes every token below, so a swapped clamp fails."""
    ratios = torch.tensor([1.25, 0.85, 1.4, 0.6])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = ppo_policy_loss(torch.log(ratios), torch.zeros(4), adv, clip_low=0.1, clip_high=0.3)
    # token 0: r = 1.25 inside [0.9, 1.3]: max(-1.25, -1.25) = -1.25, not clipped (swapped: -1.1)
    # token 1: A < 0, r = 0.85 below 0.9: max(0.85, 0.9) = 0.9, clipped (swapped: 0.85)
    # token 2: A > 0, r = 1.4 above 1.3: max(-1.4, -1.3) = -1.3, clipped (swapped: -1.1)
    # token 3: A < 0, r = 0.6: max(0.6, 0.9) = 0.9, clipped (swapped: 0.7)
    assert torch.allclose(loss, torch.tensor([-1.25, 0.9, -1.3, 0.9]), atol=1e-6)
    assert clipped.tolist() == [0.0, 1.0, 1.0, 1.0]


def test_ppo_ratio_one_gives_minus_advantage_and_no_clipping():
    adv = torch.randn(20)
    lp = torch.randn(20)
    loss, clipped = ppo_policy_loss(lp, lp.clone(), adv)
    assert torch.allclose(loss, -adv) and clipped.sum() == 0


def test_dual_clip_caps_negative_advantage_losses():
    # ratio 10 with A = -1: standard loss max(10, 1.2) = 10; dual clip c = 3 caps it at 3.
    loss, clipped = ppo_policy_loss(torch.log(torch.tensor([10.0, 10.0])), torch.zeros(2), torch.tensor([-1.0, 1.0]), dual_clip=3.0)
    # A = +1: max(-10, -1.2) = -1.2, unaffected by the dual clip
    assert torch.allclose(loss, torch.tensor([3.0, -1.2]), atol=1e-6)
    assert clipped.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="dual_clip = 0.5"):
        ppo_policy_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), dual_clip=0.5)


def test_clipped_value_loss_hand_computed():
    # v = [1.0, 0.0], v_old = [0.0, 0.0], R = [2.0, 1.0], clip 0.5
    # token 0: unclipped (1-2)^2 = 1, clipped v = 0.5 -> (0.5-2)^2 = 2.25 -> 0.5*2.25 = 1.125
    # token 1: v == v_old -> (0-1)^2 = 1 both -> 0.5
    loss, clipped = clipped_value_loss(torch.tensor([1.0, 0.0]), torch.zeros(2), torch.tensor([2.0, 1.0]), clip=0.5)
    assert torch.allclose(loss, torch.tensor([1.125, 0.5]))
    assert clipped.tolist() == [1.0, 0.0]


def test_entropy_bonus_enters_the_actor_loss_with_minus_its_coefficient():
    """policy_objective = pg - entropy_coef * entropy (each token-mean over the loss mask): worked
    by hand on 2 sequences, 5 loss tokens. With log_probs == old_log_probs the ratio is 1, so
    pg = mean(-A); a flipped sign (+ coef * entropy) or a lost coefficient changes the value and
    the gradient the entropy receives."""
    from tensordict import TensorDict

    from engine_api.batch import make_batch
    from engine_api.losses import build_norm_context
    from roles.actor import ActorConfig, policy_objective

    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7])]
    mask = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])]
    adv = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, -2.0, -2.0, -2.0])]
    lp = [torch.tensor([0.0, -1.0, -0.5]), torch.tensor([0.0, -2.0, -0.1, -0.3])]
    mb = make_batch(seqs, loss_mask=mask, advantages=adv, old_log_probs=lp)
    entropy = torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0, 4.0, 5.0], requires_grad=True)  # 9: outside the mask
    offsets = mb["input_ids"].offsets()
    out = TensorDict(
        {
            "log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(lp), offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(entropy, offsets),
        },
        batch_size=[2],
    )
    norm = build_norm_context(mb["loss_mask"], "token-mean", None)
    loss, metrics = policy_objective(ActorConfig(entropy_coef=0.5), mb, out, norm)
    # pg = mean(-A) over the 5 loss tokens = -(1 + 1 - 2 - 2 - 2) / 5 = 0.8
    # entropy = (1 + 2 + 3 + 4 + 5) / 5 = 3.0; loss = 0.8 - 0.5 * 3.0 = -0.7
    assert math.isclose(float(loss), -0.7, abs_tol=1e-6)
    assert math.isclose(metrics["entropy"], 3.0, abs_tol=1e-6)
    loss.backward()
    # d loss / d entropy_t = -0.5 / 5 on the loss tokens, 0 elsewhere: the bonus raises entropy
    assert torch.allclose(entropy.grad, torch.tensor([0.0, -0.1, -0.1, 0.0, -0.1, -0.1, -0.1]), atol=1e-7)


# ----------------------------------------------------------------------------- found by make mutate
# (docs/mutation.md): cases the tests above left open, each worked by hand.


def test_ppo_defaults_are_the_symmetric_0_2_clip():
    # r = 1.25 with A = +1: the default clip [0.8, 1.2] caps it at 1.2; r = 0.7 with A = -1: 0.8.
    loss, _ = ppo_policy_loss(torch.log(torch.tensor([1.25, 0.7])), torch.zeros(2), torch.tensor([1.0, -1.0]))
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8]), atol=1e-6)


def test_dual_clip_boundaries_and_zero_or_positive_advantages():
    lp, old = torch.log(torch.tensor([10.0, 10.0, 10.0])), torch.zeros(3)
    adv = torch.tensor([-1.0, 0.0, 0.5])
    loss, clipped = ppo_policy_loss(lp, old, adv, dual_clip=1.5)  # 1.5 is a legal c (> 1)
    # A = -1: max(10, 1.2) = 10, capped at 1.5 (active); A = 0: 0, the cap does not apply (0 * anything);
    # A = 0.5 > 0: max(-5, -0.6) = -0.6 (clipped by the ordinary bound), untouched by the dual clip
    assert torch.allclose(loss, torch.tensor([1.5, 0.0, -0.6]), atol=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="dual_clip = 1.0: must be > 1"):
        ppo_policy_loss(lp, old, adv, dual_clip=1.0)
    # A = -1 with ratio 2: max(2, 1.2) = 2 < cap 3: the dual clip is not active there; A = 0.5
    # with ratio 1: -0.5, no bound active (the dual clip is for A < 0 only)
    loss, clipped = ppo_policy_loss(torch.log(torch.tensor([2.0, 1.0])), torch.zeros(2), torch.tensor([-1.0, 0.5]), dual_clip=3.0)
    assert torch.allclose(loss, torch.tensor([2.0, -0.5])) and clipped.tolist() == [0.0, 0.0]


def test_value_clip_bounds_both_sides():
    # old 0, clip 0.5: v = -2 clips to -0.5, v = 2 to 0.5. Returns 3 / -3: unclipped (5)^2 = 25 >
    # clipped (3.5)^2, max keeps 25, clip not active; returns -3 / 3: clipped (2.5)^2 = 6.25 >
    # unclipped (1)^2: the clip is active (with either bound missing, that token's clip is lost)
    values, old = torch.tensor([-2.0, 2.0]), torch.zeros(2)
    loss, clipped = clipped_value_loss(values, old, torch.tensor([3.0, -3.0]), clip=0.5)
    assert torch.allclose(loss, 0.5 * torch.tensor([25.0, 25.0])) and clipped.tolist() == [0.0, 0.0]
    loss, clipped = clipped_value_loss(values, old, torch.tensor([-3.0, 3.0]), clip=0.5)
    assert torch.allclose(loss, 0.5 * torch.tensor([2.5**2, 2.5**2])) and clipped.tolist() == [1.0, 1.0]


def test_grpo_singleton_groups_anywhere_and_the_default_eps():
    # groups in sorted order: 1 (one sample), 3 = {1, 3}, 8 (one sample); the first singleton must
    # not stop the loop
    scores = torch.tensor([5.0, 1.0, 9.0, 3.0])
    ids = torch.tensor([1, 3, 8, 3])
    adv = grpo_advantages(scores, ids)
    # group 3: mean 2, std (unbiased) sqrt(2): (1 - 2) / (sqrt(2) + 1e-6), (3 - 2) / (sqrt(2) + 1e-6)
    want = torch.tensor([0.0, -1 / (math.sqrt(2) + 1e-6), 0.0, 1 / (math.sqrt(2) + 1e-6)])
    assert torch.allclose(adv, want, rtol=0, atol=2e-7) and adv.dtype == torch.float32  # eps added, not subtracted
    assert grpo_advantages(scores.double(), ids).dtype == torch.float32  # float32 advantages whatever the scores
    # equal scores: std 0, so eps alone keeps it finite (0 / eps = 0)
    assert torch.equal(grpo_advantages(torch.tensor([2.0, 2.0]), torch.tensor([0, 0])), torch.zeros(2))


def test_actor_config_problems_name_each_field():
    from roles.actor import ActorConfig

    assert ActorConfig()._problems() == []
    assert ActorConfig(dual_clip=1.5, mini_batch_size=1, ppo_epochs=1)._problems() == []
    problems = ActorConfig(kl_estimator="k9", dual_clip=1.0, ppo_epochs=0, mini_batch_size=0)._problems()
    assert problems == [
        "kl_estimator = 'k9': unknown; fix: use one of k1, k2, k3",
        "dual_clip = 1.0: must be > 1; fix: e.g. 3.0, or null",
        "ppo_epochs = 0: must be >= 1; fix: use 1 or more",
        "mini_batch_size = 0: must be positive; fix: use a positive size or null",
    ]


def test_kl_penalty_and_metrics_enter_the_actor_loss_as_worked_by_hand():
    """policy_objective with kl_coef = 0.25 (k1: log p - log p_ref) and dual clip 3: the loss is
    pg + 0.25 * kl; clipfrac is the share of loss tokens with a clip active."""
    from tensordict import TensorDict

    from engine_api.batch import make_batch
    from engine_api.losses import build_norm_context
    from roles.actor import ActorConfig, policy_objective

    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    mask = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0])]
    adv = [torch.tensor([0.0, -1.0, 1.0]), torch.tensor([0.0, -1.0])]
    old = [torch.zeros(3), torch.zeros(2)]
    ref = [torch.zeros(3), torch.tensor([0.0, -1.0])]
    # ratios on the loss tokens: 10 (A = -1), 1 (A = 1), 1 (A = -1)
    lp = torch.tensor([0.0, math.log(10.0), 0.0, 0.0, 0.0], requires_grad=True)
    mb = make_batch(seqs, loss_mask=mask, advantages=adv, old_log_probs=old, ref_log_probs=ref)
    out = TensorDict({"log_probs": torch.nested.nested_tensor_from_jagged(lp, mb["input_ids"].offsets())}, batch_size=[2])
    norm = build_norm_context(mb["loss_mask"], "token-mean", None)
    loss, metrics = policy_objective(ActorConfig(kl_coef=0.25, kl_estimator="k1", dual_clip=3.0), mb, out, norm)
    # pg: token 1: max(10, 1.2) = 10, dual-capped at 3; token 2: -1; token 4: +1 -> mean (3 - 1 + 1) / 3 = 1
    # kl (k1): log(10) - 0, 0 - 0, 0 - (-1) -> mean (log 10 + 1) / 3
    kl = (math.log(10.0) + 1.0) / 3
    assert math.isclose(float(loss), 1.0 + 0.25 * kl, abs_tol=1e-6)
    assert math.isclose(metrics["pg_loss"], 1.0, abs_tol=1e-6) and math.isclose(metrics["kl"], kl, abs_tol=1e-6)
    assert math.isclose(metrics["clipfrac"], 1 / 3, abs_tol=1e-6)  # only token 1 (dual clip) of 3
    assert math.isclose(metrics["ratio_mean"], 4.0, abs_tol=1e-5)  # (10 + 1 + 1) / 3


def test_group_reward_stats_count_the_groups_without_spread():
    from roles.algos import group_reward_stats

    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 2.0, 2.0])
    groups = torch.arange(9) // 3  # [1, 1, 1] flat, [0, 1, 0.5] spread, [2, 2, 2] flat
    stats = group_reward_stats(scores, groups)
    assert stats["frac_reward_zero_std"] == pytest.approx(2 / 3)
    assert stats["reward_std"] == pytest.approx(float(torch.tensor([0.0, 1.0, 0.5]).std()) / 3)
    flat = group_reward_stats(torch.zeros(8), torch.arange(8) // 4)
    assert flat == {"frac_reward_zero_std": 1.0, "reward_std": 0.0}
    # Groups of one (PPO, n_samples = 1): the batch is the one group whose spread is measured.
    alone = group_reward_stats(torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.arange(4))
    assert alone == {"frac_reward_zero_std": 0.0, "reward_std": pytest.approx(float(torch.tensor([0.0, 1.0, 1.0, 0.0]).std()))}
