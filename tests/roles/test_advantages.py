"""The advantage-estimator registry (``roles.advantages``): each estimator against verl's
``core_algos`` on the same tensors (``verl_values``) and against its formula written out in plain
Python, on jagged rows with masked positions, a group of one, a group of equal rewards, a
zero-length response and a trajectory split over two rows; the stated differences from verl
held as values; a broken estimator fails; the recipe's config refuses what cannot run.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from roles import advantages as adv_mod
from roles.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, estimate_advantages
from tests.roles import verl_values as V

SETTINGS = {"gamma": 1.0, "lam": 1.0, "norm_by_std": True}


def _verl_inputs(lengths, groups, scores, values=None, prompt=None):
    """verl's padded case as our flat rows: row ``b`` holds ``prompt[b]`` unsampled positions then
    its ``lengths[b]`` sampled tokens; one row per trajectory."""
    prompt = prompt or [1 + b % 2 for b in range(len(lengths))]
    mask, vals, offsets = [], [], [0]
    for b, n in enumerate(lengths):
        mask += [0.0] * prompt[b] + [1.0] * n
        vals += [0.0] * prompt[b] + (list(values[b][:n]) if values else [0.0] * n)
        offsets.append(len(mask))
    return (
        AdvantageInputs(
            torch.tensor(scores, dtype=torch.float64),
            torch.tensor(groups),
            torch.arange(len(lengths)),
            torch.tensor(mask, dtype=torch.float64),
            torch.tensor(offsets),
            torch.tensor(vals, dtype=torch.float64) if values else None,
        ),
        prompt,
    )


def _padded(flat, lengths, prompt, T=V.T):
    """Our flat per-token values as verl's padded [B, T] (0 where there is no sampled token), and
    a check that nothing is written off the sampled tokens."""
    out, at = [], 0
    for b, n in enumerate(lengths):
        assert not flat[at : at + prompt[b]].any()
        row = flat[at + prompt[b] : at + prompt[b] + n].tolist()
        out.append(row + [0.0] * (T - n))
        at += prompt[b] + n
    return out


def _close(a, b, rel=1e-6, abs_=1e-7):
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=abs_) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _masked(padded, lengths):
    return [[x if t < lengths[b] else 0.0 for t, x in enumerate(row)] for b, row in enumerate(padded)]


MAIN = dict(lengths=V.RESPONSE_LENGTHS, groups=V.GROUP_INDEX, scores=V.SCORES)


def check_against_verl(name: str, settings: dict, want) -> None:
    x, prompt = _verl_inputs(**MAIN, values=V.VALUES if name == "gae" else None)
    adv, _ = estimate_advantages(name, x, settings)
    assert _close(_padded(adv, V.RESPONSE_LENGTHS, prompt), _masked(want, V.RESPONSE_LENGTHS)), name


VERL_CASES = [
    ("grpo", {"norm_by_std": True}, V.GRPO_ADVANTAGES["norm_adv_by_std_in_grpo=True"]),
    ("grpo", {"norm_by_std": False}, V.GRPO_ADVANTAGES["norm_adv_by_std_in_grpo=False"]),
    ("rloo", {}, V.RLOO_ADVANTAGES),
    ("reinforce_pp", {"gamma": 1.0}, V.REINFORCE_PP["gamma=1.0"]["advantages"]),
    ("reinforce_pp", {"gamma": 0.9}, V.REINFORCE_PP["gamma=0.9"]["advantages"]),
    ("reinforce_pp_baseline", {}, V.REINFORCE_PP_BASELINE_ADVANTAGES),
]


@pytest.mark.parametrize(("name", "settings", "want"), VERL_CASES, ids=[f"{c[0]}-{c[1]}" for c in VERL_CASES])
def test_each_estimator_equals_verl_core_algos(name, settings, want):
    """On verl's case (row 5: a group of one with an empty response, so verl's raw-score
    convention for a lone sample does not show; group 3: equal rewards)."""
    check_against_verl(name, {**SETTINGS, **settings}, want)


def test_reinforce_pp_returns_equal_verls():
    for gamma in (1.0, 0.9):
        x, prompt = _verl_inputs(**MAIN)
        _, returns = estimate_advantages("reinforce_pp", x, {**SETTINGS, "gamma": gamma})
        want = V.REINFORCE_PP[f"gamma={gamma}"]["returns"]
        assert _close(_padded(returns, V.RESPONSE_LENGTHS, prompt), _masked(want, V.RESPONSE_LENGTHS))


@pytest.mark.parametrize("key", list(V.GAE))
def test_gae_returns_equal_verls_and_its_advantages_are_verls_before_whitening(key):
    """verl whitens GAE's advantages over the batch, Enginekit does not (stated in
    roles.advantages): whitened here with the module's ``whiten`` (itself checked against verl by
    the REINFORCE++ cases), they are verl's."""
    gamma, lam = (float(p.split("=")[1]) for p in key.split(", "))
    x, prompt = _verl_inputs(**MAIN, values=V.VALUES)
    adv, returns = estimate_advantages("gae", x, {**SETTINGS, "gamma": gamma, "lam": lam})
    lengths = V.RESPONSE_LENGTHS
    assert _close(_padded(returns, lengths, prompt), _masked(V.GAE[key]["returns"], lengths))
    assert _close(_padded(adv_mod.whiten(adv, x.mask), lengths, prompt), _masked(V.GAE[key]["advantages"], lengths))


def test_a_group_of_one_gets_no_advantage_where_verl_keeps_its_raw_score():
    """verl's supplement case (a lone, non-empty sample in group 1): the pair's advantages equal
    verl's; the lone sample's is 0 here (stated), verl's its raw score."""
    lengths, groups = [2, 1, 2], V.SUPPLEMENT_GROUP_INDEX
    scores = [sum(r) for r in V.SUPPLEMENT_TOKEN_LEVEL_REWARDS]
    for name, settings, key in [
        ("grpo", {"norm_by_std": True}, "grpo norm_adv_by_std_in_grpo=True"),
        ("grpo", {"norm_by_std": False}, "grpo norm_adv_by_std_in_grpo=False"),
        ("rloo", {}, "rloo"),
    ]:
        x, prompt = _verl_inputs(lengths, groups, scores)
        got = _padded(estimate_advantages(name, x, {**SETTINGS, **settings})[0], lengths, prompt, T=3)
        want = _masked(V.SUPPLEMENT_ADVANTAGES[key], lengths)
        assert _close(got[:2], want[:2]) and got[2] == [0.0, 0.0, 0.0], name
        assert want[2][0] != 0.0  # verl's differs exactly there


# ----------------------------------------------------------------------------- the hand reference

# Two prompts of three trajectories and one of two; trajectory 4 is split over two rows (a
# multi-turn history split), trajectory 6 has an empty response, trajectories 0-2 have equal
# rewards. Row layout: (trajectory, mask) with 0 = an unsampled position (prompt, observation).
ROWS = [
    (0, [0, 1, 1]),
    (1, [0, 0, 1]),
    (2, [0, 1, 1, 1]),
    (3, [0, 1, 0, 0, 1, 1]),  # two turns with an observation between
    (4, [0, 1, 1]),
    (4, [0, 0, 1, 0, 1]),
    (5, [0, 1]),
    (6, [0, 0]),
]
HAND_SCORES = [0.5, 0.5, 0.5, 1.0, 0.2, -0.4, 0.7]
HAND_GROUPS = [0, 0, 0, 1, 1, 1, 2]


def _hand_inputs():
    mask = [m for _, ms in ROWS for m in ms]
    offsets = [0]
    for _, ms in ROWS:
        offsets.append(offsets[-1] + len(ms))
    return AdvantageInputs(
        torch.tensor(HAND_SCORES),
        torch.tensor(HAND_GROUPS),
        torch.tensor([t for t, _ in ROWS]),
        torch.tensor(mask, dtype=torch.float32),
        torch.tensor(offsets),
    )


def _hand(name: str, gamma: float = 1.0, norm_by_std: bool = True) -> list[float]:
    """Each estimator's per-token advantage from its paper's formula in plain Python."""
    s, g = HAND_SCORES, HAND_GROUPS
    members = {k: [i for i in range(len(s)) if g[i] == k] for k in set(g)}

    def baseline(i, leave_one_out=False):
        m = members[g[i]]
        if len(m) < 2:
            return None
        others = [s[j] for j in m if j != i] if leave_one_out else [s[j] for j in m]
        return sum(others) / len(others)

    per_token = []  # (value, sampled) in the flat order
    for traj, ms in ROWS:
        sampled = [k for k, m in enumerate(ms) if m]
        for k, m in enumerate(ms):
            if not m:
                per_token.append((0.0, False))
                continue
            if name == "grpo":
                b = baseline(traj)
                sd = statistics.stdev([s[j] for j in members[g[traj]]]) if b is not None else 0.0
                v = 0.0 if b is None else (s[traj] - b) / (sd + 1e-6) if norm_by_std else s[traj] - b
            elif name == "rloo":
                b = baseline(traj, leave_one_out=True)
                v = 0.0 if b is None else s[traj] - b
            elif name == "reinforce_pp":
                v = gamma ** len([j for j in sampled if j > k]) * s[traj]
            else:  # reinforce_pp_baseline
                b = baseline(traj)
                v = 0.0 if b is None else s[traj] - b
            per_token.append((v, True))
    if name.startswith("reinforce_pp"):
        xs = [v for v, on in per_token if on]
        mean, sd = statistics.fmean(xs), math.sqrt(statistics.variance(xs) + 1e-8)
        per_token = [((v - mean) / sd if on else 0.0, on) for v, on in per_token]
    return [v for v, _ in per_token]


HAND_CASES = [("grpo", {}), ("grpo", {"norm_by_std": False}), ("rloo", {}), ("reinforce_pp", {}), ("reinforce_pp", {"gamma": 0.8})]
HAND_CASES += [("reinforce_pp_baseline", {})]


@pytest.mark.parametrize(("name", "settings"), HAND_CASES, ids=[f"{c[0]}-{c[1]}" for c in HAND_CASES])
def test_each_estimator_equals_its_formula_written_out_by_hand(name, settings):
    got, _ = estimate_advantages(name, _hand_inputs(), {**SETTINGS, **settings})
    want = _hand(name, **settings)
    assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(got.tolist(), want, strict=True)), (got.tolist(), want)


def test_equal_rewards_and_empty_responses_get_zero_advantage_under_group_estimators():
    """GRPO and RLOO: a group of equal rewards has no signal (0); an empty response has no token.
    REINFORCE++ with baseline whitens over the batch, so such a group gets ``-mean / std``
    there (as in verl: its group 3), the same value on every token of the group."""
    x = _hand_inputs()
    for name in ("grpo", "rloo", "reinforce_pp_baseline"):
        adv, _ = estimate_advantages(name, x, SETTINGS)
        rows = adv.split(x.offsets.diff().tolist())
        assert not rows[7].any(), name
        flat = torch.cat([r[m.bool()] for r, m in zip(rows[:3], x.mask.split(x.offsets.diff().tolist())[:3], strict=True)])
        assert (flat == flat[0]).all() and (name == "reinforce_pp_baseline") == bool(flat[0] != 0), name


def test_the_estimators_do_not_depend_on_the_row_order():
    """Permuting the rows (as a different packing or DP sharding would) permutes the result."""
    x = _hand_inputs()
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    rows = list(range(len(ROWS)))
    lengths = x.offsets.diff().tolist()
    pieces = x.mask.split(lengths)
    y = AdvantageInputs(
        x.scores,
        x.groups,
        x.row_traj[perm],
        torch.cat([pieces[i] for i in perm]),
        torch.tensor([0, *torch.tensor(lengths)[perm].cumsum(0).tolist()]),
    )
    for name, settings in HAND_CASES:
        a = estimate_advantages(name, x, {**SETTINGS, **settings})[0].split(lengths)
        b = estimate_advantages(name, y, {**SETTINGS, **settings})[0].split([lengths[i] for i in perm])
        for k, i in enumerate(perm):
            assert torch.allclose(a[i], b[k], rtol=1e-6, atol=1e-7), (name, rows[i])


# ----------------------------------------------------------------------------- teeth


def _broken_rloo(x, s):  # the mean including the sample itself (GRPO without std)
    return adv_mod._per_token(adv_mod.group_baseline(x.scores, x.groups), x), None


def _broken_whiten(x, s):  # the biased variance
    returns = adv_mod.discounted_returns(x, float(s["gamma"]))
    keep = x.mask > 0
    mean, var = returns[keep].mean(), returns[keep].var(unbiased=False)
    return (returns - mean) * torch.rsqrt(var + 1e-8) * keep, returns


def _broken_discount(x, s):  # the discount counted over every position, sampled or not
    out = torch.zeros_like(x.mask, dtype=torch.float64)
    for r in range(x.row_traj.numel()):
        a, b = int(x.offsets[r]), int(x.offsets[r + 1])
        last = a + int(x.mask[a:b].nonzero().max()) if x.mask[a:b].any() else b
        out[a:b] = x.scores[x.row_traj[r]] * float(s["gamma"]) ** (last - torch.arange(a, b)).clamp(min=0).double()
    out = out * x.mask
    return adv_mod.whiten(out, x.mask), out


@pytest.mark.parametrize(
    ("name", "broken", "settings"),
    [("rloo", _broken_rloo, {}), ("reinforce_pp", _broken_whiten, {}), ("reinforce_pp", _broken_discount, {"gamma": 0.8})],
)
def test_a_broken_estimator_fails_the_checks(monkeypatch, name, broken, settings):
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, name, adv_mod.AdvantageEstimator(broken))
    with pytest.raises(AssertionError):
        test_each_estimator_equals_its_formula_written_out_by_hand(name, settings)


# ----------------------------------------------------------------------------- the recipe's config


def test_the_recipe_config_takes_every_estimator_and_refuses_what_cannot_run():
    from recipes.ppo import AlgoConfig

    for name, est in ADVANTAGE_ESTIMATORS.items():
        assert AlgoConfig(advantage=name, n_samples=2)._problems() == [], name
        assert bool(AlgoConfig(advantage=name, n_samples=1)._problems()) == est.groups, name
    assert "advantage = 'ppo': unknown; fix: use one of gae, grpo, rloo" in AlgoConfig(advantage="ppo")._problems()[0]
    assert "rloo needs groups of >= 2" in AlgoConfig(advantage="rloo", n_samples=1)._problems()[0]
    assert "gamma = 1.5" in AlgoConfig(gamma=1.5)._problems()[0]
