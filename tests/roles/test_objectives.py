"""The policy-objective registry (``roles.objectives``) through the actor's loss
(``roles.actor.policy_objective``): values and gradients against verl's ``core_algos`` on the same
tensors (``verl_values``, computed once with verl's source at hand), against a hand computation of
each formula in plain Python, the actor equal to the Tinker server's datum losses bit for bit, and
the config's refusals. Every check here is also run on a broken objective to show it fails.

The batch is verl's padded ``[8, 5]`` case made jagged: row ``b`` is ``1 + b % 3`` unmasked prompt
positions then its ``L[b]`` response tokens (row 5 has none: a zero-length response), aggregated by
the engine's own ``agg_loss`` under each ``loss_agg_mode``.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_api.batch import make_batch, unpack
from engine_api.losses import NormContext, NormCounts, build_norm_context
from roles import objectives as obj
from roles.actor import ActorConfig, policy_objective
from roles.datum_losses import DatumLossError, batch_loss, check_loss
from tests.roles import verl_values as V

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CASES = {  # name -> (our actor config, verl's config, verl's outputs)
    "ppo": (ActorConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0), V.POLICY_LOSS_VANILLA_CONFIG, V.POLICY_LOSS_VANILLA),
    "gspo": (
        ActorConfig(policy_loss="gspo", clip_low=0.0003, clip_high=0.0004),
        V.POLICY_LOSS_GSPO_CONFIG,
        V.POLICY_LOSS_GSPO,
    ),
    "cispo": (ActorConfig(policy_loss="cispo", clip_low=0.2, clip_high=0.28), V.POLICY_LOSS_CISPO_CONFIG, V.POLICY_LOSS_CISPO),
    "cispo_example": (
        ActorConfig(policy_loss="cispo", clip_low=10.0, clip_high=0.2),
        V.POLICY_LOSS_CISPO_EXAMPLE_CONFIG,
        V.POLICY_LOSS_CISPO_EXAMPLE,
    ),
}
PROMPT = [1 + b % 3 for b in range(V.B)]  # unmasked positions before each row's response


def _rows(padded):
    """verl's padded [B, T] values as the jagged rows (prompt positions hold 0.3, unmasked)."""
    return [torch.tensor([0.3] * PROMPT[b] + list(padded[b][: V.RESPONSE_LENGTHS[b]]), dtype=torch.float64) for b in range(V.B)]


def _batch():
    rows = _rows(V.LOG_PROB)
    mask = [torch.tensor([0.0] * PROMPT[b] + [1.0] * V.RESPONSE_LENGTHS[b], dtype=torch.float64) for b in range(V.B)]
    batch = make_batch(
        [torch.arange(len(r)) for r in rows],
        loss_mask=mask,
        old_log_probs=_rows(V.OLD_LOG_PROB),
        advantages=_rows(V.POLICY_ADVANTAGES),
    )
    lp = torch.cat(rows).requires_grad_(True)
    return batch, lp


def _actor_loss(config: ActorConfig, mode: str, constant: float | None = None):
    """The actor's loss, its metrics and d loss / d log_prob as verl's padded [B, T] (0 where
    verl has no token)."""
    batch, lp = _batch()
    norm = build_norm_context(batch["loss_mask"], mode, None, constant)
    loss, metrics = policy_objective(config, batch, {"log_probs": unpack(lp, batch["input_ids"])}, norm)
    (grad,) = torch.autograd.grad(loss, lp)
    padded = [[0.0] * V.T for _ in range(V.B)]
    for b, row in enumerate(grad.split(batch["input_ids"].offsets().diff().tolist())):
        for t, g in enumerate(row[PROMPT[b] :].tolist()):
            padded[b][t] = g
        assert not row[: PROMPT[b]].any()  # nothing flows to unmasked positions
    return float(loss), metrics, padded


def _close(a, b, rel=1e-6, abs_=1e-9):
    if isinstance(a, list):
        return all(_close(x, y, rel, abs_) for x, y in zip(a, b, strict=True))
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def check_against_verl(name: str, mode: str) -> None:
    """Our loss, clip fraction and gradients == verl's for case ``name`` under ``mode``.

    Stated differences: verl's ``seq-mean-token-sum-norm`` without its global batch info divides
    by ``T`` only, ours by ``T * |B|`` (|B| = 7 rows with a response token), so ours * 7 is
    verl's; verl's GSPO always aggregates ``seq-mean-token-mean``, so ours is compared in that
    mode against every verl entry (they are equal there)."""
    config, _, verl = CASES[name]
    ours_mode = "seq-mean-token-mean" if name == "gspo" else mode
    loss, metrics, grad = _actor_loss(config, ours_mode, V.AGG_LOSS_SCALE_FACTOR)
    scale = 7.0 if ours_mode == "seq-mean-token-sum-norm" else 1.0
    want = verl[mode]
    assert _close(loss * scale, want["loss"]), (name, mode, loss * scale, want["loss"])
    assert _close([[g * scale for g in row] for row in grad], want["grad_log_prob"]), (name, mode)
    assert _close(metrics["clipfrac"], want["pg_clipfrac"]), (name, mode, metrics["clipfrac"], want["pg_clipfrac"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_each_objective_equals_verl_core_algos_in_value_gradient_and_clipfrac(name, mode):
    check_against_verl(name, mode)


def test_the_clip_settings_are_verls_translated_once():
    """verl's margins (clip_ratio_low / high) are the actor's; the bounds the registry gets are
    1 - low and 1 + high (the same floats a Tinker client would send as thresholds)."""
    for name, (config, verl_config, _) in CASES.items():
        s = config.objective_settings()
        assert (s["lo"], s["hi"]) == (1.0 - verl_config["clip_ratio_low"], 1.0 + verl_config["clip_ratio_high"]), name
    assert (
        ActorConfig(clip_low=0.2, clip_high=0.28).objective_settings()["lo"]
        == check_loss("ppo", {"clip_low_threshold": 0.8})["clip_low_threshold"]
    )


# ----------------------------------------------------------------------------- the hand reference


def _hand(name: str, settings: dict, mode: str, constant: float = 5.0):
    """The loss and d loss / d lp of objective ``name`` written out per token in plain Python
    floats from the papers' formulas (no torch, no registry), aggregated as ``mode`` says."""
    lp, q, adv = V.LOG_PROB, V.OLD_LOG_PROB, V.POLICY_ADVANTAGES
    lens = V.RESPONSE_LENGTHS
    lo, hi = settings.get("lo"), settings.get("hi")
    terms = [[0.0] * V.T for _ in range(V.B)]
    grads = [[0.0] * V.T for _ in range(V.B)]
    for b in range(V.B):
        seq_ratio = math.exp(sum(lp[b][t] - q[b][t] for t in range(lens[b])) / lens[b]) if lens[b] else 1.0
        for t in range(lens[b]):
            a, r = adv[b][t], math.exp(lp[b][t] - q[b][t])
            if name in ("ppo", "gspo"):
                x = r if name == "ppo" else seq_ratio
                unclipped, clipped = -a * x, -a * min(max(x, lo), hi)
                term, grad = (unclipped, -a * x) if unclipped >= clipped else (clipped, 0.0)
                c = settings.get("dual_clip")
                if name == "ppo" and c is not None and a < 0 and -c * a < term:
                    term, grad = -c * a, 0.0
            elif name == "cispo":
                w = min(max(r, lo), hi)
                term, grad = -w * a * lp[b][t], -w * a
            elif name == "importance_sampling":
                term, grad = -r * a, -r * a
            else:  # dro
                beta = settings["beta"]
                term, grad = -(lp[b][t] * a - beta / 2 * (lp[b][t] - q[b][t]) ** 2), -(a - beta * (lp[b][t] - q[b][t]))
            terms[b][t], grads[b][t] = term, grad
    nonempty = [b for b in range(V.B) if lens[b]]
    tokens = sum(lens)
    weight = {  # d loss / d term of token (b, t)
        "token-mean": lambda b: 1.0 / tokens,
        "seq-mean-token-sum": lambda b: 1.0 / len(nonempty),
        "seq-mean-token-mean": lambda b: 1.0 / (len(nonempty) * lens[b]),
        "seq-mean-token-sum-norm": lambda b: 1.0 / (len(nonempty) * constant),
    }[mode]
    loss = sum(weight(b) * terms[b][t] for b in nonempty for t in range(lens[b]))
    return loss, [[weight(b) * grads[b][t] if t < lens[b] else 0.0 for t in range(V.T)] for b in range(V.B)]


HAND = [
    ("ppo", ActorConfig(clip_low=0.2, clip_high=0.28, dual_clip=1.2)),  # c = 1.2 caps A < 0 tokens here
    ("gspo", ActorConfig(policy_loss="gspo", clip_low=0.01, clip_high=0.01)),  # some sequences clip, some do not
    ("cispo", ActorConfig(policy_loss="cispo", clip_low=0.1, clip_high=0.05)),
    ("importance_sampling", ActorConfig(policy_loss="importance_sampling")),
    ("dro", ActorConfig(policy_loss="dro", policy_loss_config={"beta": 0.3})),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "config"), HAND, ids=[h[0] for h in HAND])
def test_each_objective_equals_its_formula_written_out_by_hand(name, config, mode):
    loss, _, grad = _actor_loss(config, mode, 5.0)
    want_loss, want_grad = _hand(name, config.objective_settings(), mode)
    assert _close(loss, want_loss), (loss, want_loss)
    assert _close(grad, want_grad)


def test_the_hand_cases_exercise_the_clips():
    """The hand cases are not vacuous: PPO's dual clip and both bounds bind on some tokens, GSPO
    clips some sequences and not others, CISPO's weight is clipped on some tokens."""
    for name, config in HAND[:3]:
        _, metrics, _ = _actor_loss(config, "token-mean")
        assert 0.0 < metrics["clipfrac"] < 1.0, (name, metrics)


# ----------------------------------------------------------------------------- teeth


def _broken_cispo(x, s):  # the weight not detached: the gradient of the ratio leaks in
    r = torch.exp(x.lp - x.q)
    w = torch.clamp(r, s["lo"], s["hi"])
    return -w * x.lp * x.adv, (w != r).to(x.lp.dtype)


def _broken_gspo(x, s):  # the token ratio instead of the sequence ratio
    return obj.clipped_surrogate(torch.exp(x.lp - x.q), x.adv, s["lo"], s["hi"])


def _broken_ppo(x, s):  # the sign of the advantage flipped inside the clipped term
    r = torch.exp(x.lp - x.q)
    return torch.maximum(-x.adv * r, x.adv * torch.clamp(r, s["lo"], s["hi"])), torch.zeros_like(r)


def _broken_gspo_mean(x, s):  # the sequence's log-ratio summed, not averaged
    counted = x.counted != 0
    seq = torch.repeat_interleave(torch.arange(x.offsets.numel() - 1), x.offsets.diff())
    total = torch.zeros(x.offsets.numel() - 1, dtype=x.lp.dtype).index_add(0, seq, (x.lp.detach() - x.q) * counted)
    return obj.clipped_surrogate(torch.exp(total[seq] + x.lp - x.lp.detach()), x.adv, s["lo"], s["hi"])


@pytest.mark.parametrize(
    ("name", "broken"), [("cispo", _broken_cispo), ("gspo", _broken_gspo), ("ppo", _broken_ppo), ("gspo", _broken_gspo_mean)]
)
def test_a_broken_objective_fails_the_checks(monkeypatch, name, broken):
    monkeypatch.setitem(obj.POLICY_OBJECTIVES, name, obj.PolicyObjective(broken, obj.POLICY_OBJECTIVES[name].settings))
    with pytest.raises(AssertionError):
        for mode in MODES:
            check_against_verl(name, mode)
    config = dict(HAND)[name]
    with pytest.raises(AssertionError):
        test_each_objective_equals_its_formula_written_out_by_hand(name, config, "token-mean")


# ----------------------------------------------------------------------------- actor == server


@pytest.mark.parametrize(
    ("name", "actor", "tinker"),
    [
        ("ppo", ActorConfig(clip_low=0.2, clip_high=0.28), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}),
        ("gspo", ActorConfig(policy_loss="gspo", clip_low=0.01, clip_high=0.01), {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}),
        ("cispo", ActorConfig(policy_loss="cispo", clip_low=0.2, clip_high=0.28), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}),
        ("importance_sampling", ActorConfig(policy_loss="importance_sampling"), None),
        ("dro", ActorConfig(policy_loss="dro", policy_loss_config={"beta": 0.3}), {"beta": 0.3}),
    ],
)
def test_the_actor_and_the_tinker_server_compute_the_same_loss_bit_for_bit(name, actor, tinker):
    """The same datums (fp32) through the actor's loss in the engine's ``sum`` mode and through
    the server's datum loss: equal loss and gradient (torch.equal). Position 0 (which no token
    predicts, so the actor's mask leaves it out) has advantage 0 and ``q = lp`` there, so its
    server term is 0 too; GSPO's ratio mask is the actor's loss mask."""
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 1, 6, 2]
    rows_lp = [-torch.rand(n, generator=gen) * 2 for n in lengths]
    rows_q = [torch.cat([lp[:1], lp[1:] + 0.3 * torch.randn(n - 1, generator=gen)]) for lp, n in zip(rows_lp, lengths, strict=True)]
    rows_a = [torch.cat([torch.zeros(1), torch.randn(n - 1, generator=gen)]) for n in lengths]
    masks = [torch.cat([torch.zeros(1), torch.ones(n - 1)]) for n in lengths]
    ids = [torch.arange(n) for n in lengths]
    actor_batch = make_batch(ids, loss_mask=masks, old_log_probs=rows_q, advantages=rows_a)
    datum_batch = make_batch(ids, sampling_logprobs=rows_q, advantages=rows_a, sequence_ratio_mask=masks)
    norm = NormContext(mode="sum", counts=NormCounts(sum(lengths), len(lengths)), denominator=1.0, dp_size=1)
    grads = []
    for side in ("actor", "server"):
        lp = torch.cat(rows_lp).requires_grad_(True)
        if side == "actor":
            loss, _ = policy_objective(actor, actor_batch, {"log_probs": unpack(lp, actor_batch["input_ids"])}, norm)
        else:
            loss = batch_loss(name, lp, datum_batch, check_loss(name, tinker))
        grads.append((loss.detach(), torch.autograd.grad(loss, lp)[0]))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        (ActorConfig(policy_loss="grpo"), ["policy_loss = 'grpo': unknown", "ppo, gspo, cispo"]),
        (ActorConfig(clip_low=-0.1), ["do not hold the ratio 1", "1 - clip_low 1.1", "margins"]),
        (ActorConfig(policy_loss="cispo", clip_high=-0.5), ["1 + clip_high 0.5", "fix"]),
        (ActorConfig(policy_loss="gspo", dual_clip=3.0), ["dual_clip = 3 applies to policy_loss ppo only", "actor.dual_clip=null"]),
        (ActorConfig(policy_loss_config={"lo": 0.8}), ["policy_loss_config.lo is not set here", "actor.clip_low"]),
        (ActorConfig(policy_loss_config={"beta": 0.1}), ["'beta' is not a setting of ppo", "drop it"]),
        (ActorConfig(policy_loss="dro", policy_loss_config={"beta": -1}), ["beta = -1", "fix: e.g. 0.05"]),
        (ActorConfig(policy_loss="dro", policy_loss_config={"beta": "x"}), ["beta = 'x'", "a finite number"]),
    ],
)
def test_bad_objective_settings_are_refused_naming_the_field_value_and_fix(config, needles):
    problems = " ".join(config._problems())
    for needle in needles:
        assert needle in problems, (needle, problems)


def test_a_tinker_threshold_given_as_a_margin_is_refused_naming_both_conventions():
    with pytest.raises(DatumLossError) as err:
        check_loss("cispo", {"clip_low_threshold": 0.2, "clip_high_threshold": 0.28})
    assert "clip_high_threshold 0.28" in str(err.value) and "margins" in str(err.value)


def test_an_objective_added_to_the_registry_is_usable_by_name_in_the_actor(monkeypatch):
    """Adding an objective is one entry: the actor config accepts it and the loss uses it."""

    def halved(x, s):
        return -0.5 * s["scale"] * x.adv * x.lp, torch.zeros_like(x.lp)

    monkeypatch.setitem(obj.POLICY_OBJECTIVES, "halved_pg", obj.PolicyObjective(halved, {"scale": 1.0}))
    config = ActorConfig(policy_loss="halved_pg", policy_loss_config={"scale": 2.0})
    assert config._problems() == []
    loss, _, grad = _actor_loss(config, "token-mean")
    lens, tokens = V.RESPONSE_LENGTHS, sum(V.RESPONSE_LENGTHS)
    adv, lp = V.POLICY_ADVANTAGES, V.LOG_PROB
    assert _close(loss, -sum(adv[b][t] * lp[b][t] for b in range(V.B) for t in range(lens[b])) / tokens)
    assert _close(grad, [[-adv[b][t] / tokens if t < lens[b] else 0.0 for t in range(V.T)] for b in range(V.B)])


def test_the_docs_tables_are_the_registries():
    """docs/recipes.md shows both registries as their ``markdown_table`` writes them."""
    from pathlib import Path

    from roles import advantages

    docs = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    assert obj.markdown_table() in docs and advantages.markdown_table() in docs
