"""Rollout correction (truncated / masked importance sampling) against hand-worked cases.

The batch of the unit tests: two sequences, A = 4 tokens (prompt 1, response 3) and B = 3 tokens
(prompt 1, response 2); flat positions 0-3 are A, 4-6 are B. On the response tokens the log ratio
d = old - rollout is log of the weights w = [0.25, 3, 1] (A) and [1.5, 4] (B). The prompt
positions carry d = 7 and -5: they are not response tokens and must be ignored (a sequence sum
that included them would multiply A's weight by e^7).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from engine_api.batch import make_batch, unpack
from engine_api.losses import agg_loss, build_norm_context
from engine_api.typed_config import load_typed
from roles.actor import Actor, ActorConfig, apply_rollout_correction, policy_objective, update_fields
from roles.algos import RolloutCorrectionConfig, ppo_policy_loss, rollout_correction

W = [7.0, 0.25, 3.0, 1.0, -5.0, 1.5, 4.0]  # exp(d) per flat position; positions 0 and 4 are prompts
MASK = [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
ROLLOUT = torch.tensor([0.0, -1.2, -0.3, -2.0, 0.0, -0.7, -0.1])
D = torch.tensor([7.0, math.log(0.25), math.log(3.0), 0.0, -5.0, math.log(1.5), math.log(4.0)])
OLD = ROLLOUT + D
OFFSETS = torch.tensor([0, 4, 7])
ROOT = Path(__file__).resolve().parents[2]


def _correct(**kw):
    return rollout_correction(OLD, ROLLOUT, torch.tensor(MASK), OFFSETS, RolloutCorrectionConfig(**kw))


def _close(got: dict, want: dict) -> None:
    assert set(got) == {f"rollout_correction/{k}" for k in want}, got
    for key, value in want.items():
        assert math.isclose(got[f"rollout_correction/{key}"], value, rel_tol=1e-5, abs_tol=1e-6), (key, got)


# ----------------------------------------------------------------------------- the math


def test_token_tis_caps_each_token_weight_at_the_threshold():
    weights, mask, metrics = _correct(mode="tis", level="token", threshold=2.0)
    # w = [0.25, 3, 1 | 1.5, 4] -> min(w, 2) = [0.25, 2, 1 | 1.5, 2]; 0 off the response
    assert torch.allclose(weights, torch.tensor([0.0, 0.25, 2.0, 1.0, 0.0, 1.5, 2.0]), atol=1e-6)
    assert mask.tolist() == MASK  # TIS masks nothing
    # applied mean (0.25 + 2 + 1 + 1.5 + 2) / 5 = 1.35, max 2; raw mean (0.25 + 3 + 1 + 1.5 + 4) / 5
    # = 1.95, max 4; truncated: 3 and 4, 2 of 5 tokens
    _close(
        metrics,
        dict(weight_mean=1.35, weight_max=2.0, raw_weight_mean=1.95, raw_weight_max=4.0, truncated_frac=0.4, masked_frac=0.0),
    )


def test_sequence_tis_uses_the_product_over_the_response_and_caps_it():
    weights, mask, metrics = _correct(mode="tis", level="sequence", threshold=2.0)
    # w_A = 0.25 * 3 * 1 = 0.75 (under the cap); w_B = 1.5 * 4 = 6 -> 2; each on all its tokens
    assert torch.allclose(weights, torch.tensor([0.0, 0.75, 0.75, 0.75, 0.0, 2.0, 2.0]), atol=1e-6)
    assert mask.tolist() == MASK
    # applied mean (3 * 0.75 + 2 * 2) / 5 = 1.25; raw mean (3 * 0.75 + 2 * 6) / 5 = 2.85, max 6;
    # truncated: B's 2 tokens of 5
    _close(
        metrics,
        dict(weight_mean=1.25, weight_max=2.0, raw_weight_mean=2.85, raw_weight_max=6.0, truncated_frac=0.4, masked_frac=0.0),
    )
    # a larger cap leaves w_B = 6 as it is
    weights, _, metrics = _correct(mode="tis", level="sequence", threshold=10.0)
    assert torch.allclose(weights, torch.tensor([0.0, 0.75, 0.75, 0.75, 0.0, 6.0, 6.0]), atol=1e-5)
    assert metrics["rollout_correction/truncated_frac"] == 0.0


def test_tis_weights_are_constants_without_gradient():
    old = OLD.clone().requires_grad_(True)
    weights, _, _ = rollout_correction(old, ROLLOUT, torch.tensor(MASK), OFFSETS, RolloutCorrectionConfig(mode="tis"))
    assert not weights.requires_grad and weights.grad_fn is None


def test_token_mis_removes_tokens_outside_the_default_band():
    # threshold 2, threshold_lower null -> band [1/2, 2]: 0.25 (below), 3 and 4 (above) leave the mask
    weights, mask, metrics = _correct(mode="mis", level="token", threshold=2.0)
    assert mask.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert weights.tolist() == mask.tolist()  # kept tokens have weight 1: no reweighting
    # applied weights over the 5 response tokens: [0, 0, 1, 1, 0] -> mean 0.4, max 1; 3 of 5 removed
    _close(
        metrics,
        dict(weight_mean=0.4, weight_max=1.0, raw_weight_mean=1.95, raw_weight_max=4.0, truncated_frac=0.0, masked_frac=0.6),
    )


def test_token_mis_each_bound_alone():
    # threshold_lower = 0 (TRL's masking: only above the cap): 0.25 stays, 3 and 4 go
    _, mask, metrics = _correct(mode="mis", threshold=2.0, threshold_lower=0.0)
    assert mask.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert math.isclose(metrics["rollout_correction/masked_frac"], 0.4, rel_tol=1e-6)
    # band [0.3, 5]: only 0.25 (below) goes; 3 and 4 are inside
    _, mask, metrics = _correct(mode="mis", threshold=5.0, threshold_lower=0.3)
    assert mask.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert math.isclose(metrics["rollout_correction/masked_frac"], 0.2, rel_tol=1e-6)
    # default lower bound 1/5 = 0.2 < 0.25: nothing goes
    _, mask, _ = _correct(mode="mis", threshold=5.0)
    assert mask.tolist() == MASK


def test_sequence_mis_removes_whole_sequences():
    # w_A = 0.75 inside [1/2, 2]; w_B = 6 above 2: both of B's tokens go
    weights, mask, metrics = _correct(mode="mis", level="sequence", threshold=2.0)
    assert mask.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert weights.tolist() == mask.tolist()
    # raw: 3 * 0.75 + 2 * 6 over 5 tokens = 2.85
    _close(
        metrics,
        dict(weight_mean=0.6, weight_max=1.0, raw_weight_mean=2.85, raw_weight_max=6.0, truncated_frac=0.0, masked_frac=0.4),
    )
    # band [0.8, 10]: A (0.75) goes by the lower bound, B (6) stays
    _, mask, _ = _correct(mode="mis", level="sequence", threshold=10.0, threshold_lower=0.8)
    assert mask.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    # default lower bound 1/10: A stays too
    _, mask, _ = _correct(mode="mis", level="sequence", threshold=10.0)
    assert mask.tolist() == MASK


def test_off_returns_the_mask_and_no_metrics():
    weights, mask, metrics = _correct(mode="off")
    assert weights.tolist() == MASK and mask.tolist() == MASK and metrics == {}


def test_huge_log_ratios_give_finite_weights_and_metrics():
    # d = 1000 on a response token: exp would overflow; the weight is computed from d clamped to 20
    old = torch.tensor([0.0, 1000.0, 0.0])
    for mode in ("tis", "mis"):
        for level in ("token", "sequence"):
            cfg = RolloutCorrectionConfig(mode=mode, level=level)
            weights, mask, metrics = rollout_correction(old, torch.zeros(3), torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 3]), cfg)
            assert torch.isfinite(weights).all() and all(math.isfinite(v) for v in metrics.values())
            assert math.isclose(metrics["rollout_correction/raw_weight_max"], math.exp(20.0), rel_tol=1e-5)


def test_invalid_config_raises_in_the_function():
    with pytest.raises(ValueError, match="mode = 'is': unknown"):
        rollout_correction(OLD, ROLLOUT, torch.tensor(MASK), OFFSETS, RolloutCorrectionConfig(mode="is"))


# ----------------------------------------------------------------------------- the loss


def _micro_batch():
    seqs = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])]
    adv = [torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([0.0, -2.0, -2.0])]
    return make_batch(
        seqs,
        loss_mask=[torch.tensor(MASK[:4]), torch.tensor(MASK[4:])],
        advantages=adv,
        old_log_probs=[OLD[:4], OLD[4:]],
        rollout_log_probs=[ROLLOUT[:4], ROLLOUT[4:]],
    )


def _outputs(mb, log_probs):
    return TensorDict({"log_probs": unpack(log_probs, mb["input_ids"])}, batch_size=mb.batch_size)


def test_tis_weight_multiplies_the_policy_loss_and_its_gradient():
    """log_probs == old_log_probs: ratio 1, so the PPO token loss is -A = [-1, -1, -1 | 2, 2].
    With the token TIS weights [0.25, 2, 1 | 1.5, 2] the token-mean loss is
    (-0.25 - 2 - 1 + 3 + 4) / 5 = 0.75 (unweighted: (-3 + 4) / 5 = 0.2), and d loss / d log_prob_t
    = -A_t w_t / 5: the weight scales the gradient, it receives none."""
    config = ActorConfig(rollout_correction=RolloutCorrectionConfig(mode="tis", threshold=2.0))
    batch, metrics = apply_rollout_correction(config, _micro_batch())
    assert torch.allclose(batch["rollout_is_weights"].values(), torch.tensor([0.0, 0.25, 2.0, 1.0, 0.0, 1.5, 2.0]), atol=1e-6)
    log_probs = OLD.clone().requires_grad_(True)
    norm = build_norm_context(batch["loss_mask"], "token-mean", None)
    loss, m = policy_objective(config, batch, _outputs(batch, log_probs), norm)
    assert math.isclose(float(loss.detach()), 0.75, abs_tol=1e-6) and math.isclose(m["pg_loss"], 0.75, abs_tol=1e-6)
    loss.backward()
    want = torch.tensor([0.0, -0.25, -2.0, -1.0, 0.0, 3.0, 4.0]) / 5
    assert torch.allclose(log_probs.grad, want, atol=1e-6)
    unweighted, _ = policy_objective(ActorConfig(), _micro_batch(), _outputs(batch, OLD.clone()), norm)
    assert math.isclose(float(unweighted), 0.2, abs_tol=1e-6)


def test_kl_and_entropy_are_not_reweighted():
    """kl_coef 1 (k1 = log p - log p_ref = 1 on every token) and entropy_coef 1 (entropy 3): with TIS
    the loss is 0.75 (weighted pg) + 1 - 3, the two extra terms unweighted."""
    config = ActorConfig(kl_coef=1.0, kl_estimator="k1", entropy_coef=1.0, rollout_correction=RolloutCorrectionConfig(mode="tis"))
    mb = _micro_batch()
    mb.set("ref_log_probs", unpack(OLD - 1.0, mb["input_ids"]))
    batch, _ = apply_rollout_correction(config, mb)
    out = _outputs(batch, OLD.clone())
    out.set("entropy", unpack(torch.full((7,), 3.0), batch["input_ids"]))
    loss, m = policy_objective(config, batch, out, build_norm_context(batch["loss_mask"], "token-mean", None))
    assert math.isclose(float(loss), 0.75 + 1.0 - 3.0, abs_tol=1e-5)
    assert math.isclose(m["kl"], 1.0, abs_tol=1e-6) and math.isclose(m["entropy"], 3.0, abs_tol=1e-6)


def test_mis_removes_tokens_from_the_loss_and_its_denominator():
    """Token MIS, band [1/2, 2]: only A's third token (A = 1) and B's first (A = -2) stay, so the
    token-mean loss is (-1 + 2) / 2 = 0.5: the removed tokens leave the denominator too."""
    config = ActorConfig(rollout_correction=RolloutCorrectionConfig(mode="mis"))
    original = _micro_batch()
    batch, metrics = apply_rollout_correction(config, original)
    assert "rollout_is_weights" not in batch.keys()
    assert batch["loss_mask"].values().tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert original["loss_mask"].values().tolist() == MASK  # the caller's batch is not modified
    norm = build_norm_context(batch["loss_mask"], "token-mean", None)
    assert norm.counts.tokens == 2.0
    loss, _ = policy_objective(config, batch, _outputs(batch, OLD.clone()), norm)
    assert math.isclose(float(loss), 0.5, abs_tol=1e-6)
    assert math.isclose(metrics["rollout_correction/masked_frac"], 0.6, rel_tol=1e-6)


def test_mis_that_removes_every_token_raises():
    config = ActorConfig(rollout_correction=RolloutCorrectionConfig(mode="mis", level="sequence", threshold=2.0, threshold_lower=0.8))
    with pytest.raises(ValueError, match="removed every response token"):
        apply_rollout_correction(config, _micro_batch())


def test_mode_off_leaves_the_batch_and_the_loss_bit_identical():
    """Off: the batch passes through untouched (same object, no new field) and the loss is the
    PPO formula of before, bit for bit, even though rollout_log_probs are present."""
    mb = _micro_batch()
    batch, metrics = apply_rollout_correction(ActorConfig(), mb)
    assert batch is mb and metrics == {} and "rollout_is_weights" not in mb.keys()
    assert update_fields(ActorConfig()) == ["old_log_probs", "advantages"]
    log_probs = OLD + torch.linspace(-0.3, 0.3, 7)
    norm = build_norm_context(mb["loss_mask"], "token-mean", None)
    loss, _ = policy_objective(ActorConfig(), mb, _outputs(mb, log_probs), norm)
    pg, _ = ppo_policy_loss(log_probs, mb["old_log_probs"].values(), mb["advantages"].values(), 0.2, 0.2, None)
    assert torch.equal(loss, agg_loss(pg, mb["loss_mask"], norm))
    # TIS with no mismatch (weights exactly 1) gives the same bits as well
    same = _micro_batch()
    same.set("rollout_log_probs", unpack(OLD.clone(), same["input_ids"]))
    tis = ActorConfig(rollout_correction=RolloutCorrectionConfig(mode="tis"))
    weighted, _ = apply_rollout_correction(tis, same)
    loss_tis, _ = policy_objective(tis, weighted, _outputs(weighted, log_probs), norm)
    assert torch.equal(loss_tis, loss)


# ----------------------------------------------------------------------------- config and wiring


def test_config_problems_name_field_value_and_fix():
    assert RolloutCorrectionConfig()._problems() == []
    assert RolloutCorrectionConfig(mode="mis", level="sequence", threshold=3.0, threshold_lower=0.0)._problems() == []
    assert RolloutCorrectionConfig(mode="tis", threshold=0.5)._problems() == []  # a cap below 1 is legal for TIS
    assert RolloutCorrectionConfig(mode="x", level="seq")._problems() == [
        "mode = 'x': unknown; fix: use one of off, tis, mis",
        "level = 'seq': unknown; fix: use one of token, sequence",
    ]
    assert RolloutCorrectionConfig(mode="tis", threshold=0.0)._problems() == ["threshold = 0.0: must be > 0; fix: e.g. 2.0"]
    assert RolloutCorrectionConfig(mode="mis", threshold=2.0, threshold_lower=-0.1)._problems() == [
        "threshold_lower = -0.1: must be >= 0; fix: e.g. 0 (mask only above threshold), or null for 1/threshold"
    ]
    assert RolloutCorrectionConfig(mode="mis", threshold=2.0, threshold_lower=2.0)._problems() == [
        "threshold_lower = 2.0: must be below threshold = 2.0; fix: a smaller value, or null for 1/threshold"
    ]
    assert RolloutCorrectionConfig(mode="mis", threshold=1.0)._problems() == [
        "threshold = 1.0: with threshold_lower = null the MIS lower bound 1/threshold = 1 is not below it; "
        "fix: use a threshold > 1, or set threshold_lower below threshold"
    ]


def test_the_loader_reports_the_nested_problems_and_the_demo_configs_load():
    from recipes.ppo import PPOConfig

    for name in ("ppo_tiny.yaml", "grpo_tiny.yaml"):
        assert load_typed(PPOConfig, ROOT / "configs" / name).actor.rollout_correction == RolloutCorrectionConfig()
    overrides = ["actor.rollout_correction.mode=tiss", "actor.rollout_correction.threshold=-1", "actor.rollout_correction.thresold=3"]
    with pytest.raises(ValueError) as err:
        load_typed(PPOConfig, ROOT / "configs" / "ppo_tiny.yaml", overrides)
    text = str(err.value)
    assert (
        "actor.rollout_correction.thresold: unknown key 'thresold'" in text and "did you mean 'actor.rollout_correction.threshold'" in text
    )
    with pytest.raises(ValueError) as err:
        load_typed(PPOConfig, ROOT / "configs" / "ppo_tiny.yaml", overrides[:2])
    assert "actor.rollout_correction.mode = 'tiss': unknown; fix: use one of off, tis, mis" in str(err.value)
    assert "actor.rollout_correction.threshold = -1.0: must be > 0; fix: e.g. 2.0" in str(err.value)
    cfg = load_typed(
        PPOConfig, ROOT / "configs" / "grpo_tiny.yaml", ["actor.rollout_correction.mode=mis", "actor.rollout_correction.threshold_lower=0"]
    )
    assert cfg.actor.rollout_correction == RolloutCorrectionConfig(mode="mis", threshold_lower=0.0)
    # YAML reads a bare off as false (a str field gets "False"): it still means off
    assert (
        load_typed(PPOConfig, ROOT / "configs" / "ppo_tiny.yaml", ["actor.rollout_correction.mode=off"]).actor.rollout_correction.mode
        == "off"
    )
    assert load_typed(RolloutCorrectionConfig, {"mode": False}).mode == "off"


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_update_without_rollout_log_probs_raises_naming_the_field(mode):
    config = ActorConfig(rollout_correction=RolloutCorrectionConfig(mode=mode))
    assert update_fields(config) == ["old_log_probs", "advantages", "rollout_log_probs"]
    actor = Actor(SimpleNamespace(set_loss_fn=lambda fn: None), config)  # fails before any engine call
    mb = _micro_batch()
    del mb["rollout_log_probs"]
    with pytest.raises(ValueError, match=r"Actor.update batch lacks \['rollout_log_probs'\]"):
        actor.update(mb)


# ----------------------------------------------------------------------------- end to end (FSDP engine, one process)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.support.hf_utils import make_model

    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama")


def _actor(model_dir, correction: RolloutCorrectionConfig, impl: str = "engine"):
    """The engine role, or the legacy FSDP worker's actor (``use_legacy_worker_impl=enable``):
    both must train on the corrected batch whose metrics they report."""
    from engine_api import build_engine, load_config

    config = load_config(None, ["strategy=fsdp", f"model.path={model_dir}", "optim.lr=0.01", "micro_batch_size=2"])
    if impl == "legacy":
        from roles.legacy.roles import LegacyActor

        return LegacyActor(config, ActorConfig(rollout_correction=correction))
    engine = build_engine(config)
    engine.init_model()
    return Actor(engine, ActorConfig(rollout_correction=correction))


def _engine_batch(actor):
    """The backend tests' 6-sequence batch with old log-probs from the actor and rollout log-probs
    shifted from them by a fixed pattern of log ratios in [-1.2, 1.2]."""
    from tests.support.hf_utils import make_test_batch

    batch = make_test_batch()
    old = actor.compute_log_probs(batch)["log_probs"].values()
    tokens = old.shape[0]
    shift = torch.linspace(-1.2, 1.2, tokens)[torch.randperm(tokens, generator=torch.Generator().manual_seed(0))]
    batch.set("old_log_probs", unpack(old, batch["input_ids"]))
    batch.set("rollout_log_probs", unpack(old - shift, batch["input_ids"]))
    return batch, shift


@pytest.mark.parametrize("impl", ["engine", "legacy"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_actor_update_applies_tis_through_sharding_and_micro_batches(model_dir, level, impl):
    """First step: ratio 1, so the global loss (3 micro-batches of 2) is the token-mean of
    -A * min(w, 2), with w from the batch's own log ratios; the metrics ride on every dict."""
    correction = RolloutCorrectionConfig(mode="tis", level=level, threshold=2.0)
    actor = _actor(model_dir, correction, impl)
    batch, shift = _engine_batch(actor)
    mask, adv = batch["loss_mask"].values(), batch["advantages"].values()
    d = shift * mask
    if level == "sequence":
        d = torch.repeat_interleave(
            torch.stack([s.sum() for s in d.split(batch["input_ids"].offsets().diff().tolist())]), batch["input_ids"].offsets().diff()
        )
    w = torch.exp(d).clamp(max=2.0)
    metrics = actor.update(batch)
    want = float((-adv * w * mask).sum() / mask.sum())
    assert math.isclose(metrics[0]["loss"], want, rel_tol=1e-5, abs_tol=1e-6)
    assert metrics[0]["rollout_correction/truncated_frac"] > 0
    assert math.isclose(metrics[0]["rollout_correction/weight_mean"], float((w * mask).sum() / mask.sum()), rel_tol=1e-5)
    assert "rollout_is_weights" not in batch.keys()


@pytest.mark.parametrize("impl", ["engine", "legacy"])
def test_actor_update_applies_mis(model_dir, impl):
    correction = RolloutCorrectionConfig(mode="mis", threshold=2.0)
    actor = _actor(model_dir, correction, impl)
    batch, shift = _engine_batch(actor)
    mask, adv = batch["loss_mask"].values(), batch["advantages"].values()
    kept = mask * ((shift >= -math.log(2.0)) & (shift <= math.log(2.0))).float()
    assert 0 < kept.sum() < mask.sum()
    metrics = actor.update(batch)
    want = float((-adv * kept).sum() / kept.sum())
    assert math.isclose(metrics[0]["loss"], want, rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(metrics[0]["rollout_correction/masked_frac"], float(1 - kept.sum() / mask.sum()), rel_tol=1e-6)
    assert batch["loss_mask"].values().tolist() == mask.tolist()


@pytest.mark.parametrize("field", ["rollout_log_probs", "old_log_probs"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_non_finite_log_probs_on_the_response_are_refused_naming_the_field(field, mode, level):
    """A NaN weight is invisible to MIS's bounds (every comparison with NaN is false: the token
    would be kept, masked_frac 0) and turns TIS's loss into NaN: refused instead, naming the
    field and where. The same values off the response (prompt positions) do not matter."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        rollout, old = ROLLOUT.clone(), OLD.clone()
        (rollout if field == "rollout_log_probs" else old)[5] = bad  # B's first response token
        with pytest.raises(ValueError, match=rf"{field} has 1 non-finite value\(s\) on response tokens \(first: sequence 1"):
            rollout_correction(old, rollout, torch.tensor(MASK), OFFSETS, RolloutCorrectionConfig(mode=mode, level=level))
        (rollout if field == "rollout_log_probs" else old)[5] = (ROLLOUT if field == "rollout_log_probs" else OLD)[5]
        (rollout if field == "rollout_log_probs" else old)[4] = bad  # a prompt position: not a response token
        weights, _, metrics = rollout_correction(old, rollout, torch.tensor(MASK), OFFSETS, RolloutCorrectionConfig(mode=mode, level=level))
        assert torch.isfinite(weights).all() and all(math.isfinite(v) for v in metrics.values())


def _verl_rejection_keep(d: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor, rollout_rs: str, spec: str) -> torch.Tensor:
    """verl 0.9.1's rejection mask for its k1 options, written from its documented rule
    (``trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_rejection_mask``): ``"L_U"`` (or a
    single ``U``, meaning ``L = 1/U``) bounds ``k1 = -log_ratio``, ``log_ratio = old - rollout``,
    per token (``token_k1``) or summed over a sequence's response (``seq_sum_k1``), inclusive."""
    lower, _, upper = spec.partition("_") if "_" in spec else (str(1 / float(spec)), "_", spec)
    lo, hi = math.log(float(lower)), math.log(float(upper))
    k1 = -d.clamp(-20, 20) * mask
    if rollout_rs == "token_k1":
        return ((k1 >= lo) & (k1 <= hi)) | (mask == 0)
    lengths = offsets.diff()
    seq = torch.stack([s.sum() for s in k1.split(lengths.tolist())])
    return torch.repeat_interleave((seq >= lo) & (seq <= hi), lengths) | (mask == 0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(("threshold", "lower"), [(2.0, None), (3.0, 0.5), (1.5, 0.0), (5.0, 0.9)])
def test_the_verl_mapping_masks_the_same_tokens_as_verl(level, threshold, lower):
    """``RolloutCorrectionConfig.verl_keys()`` (the table in docs/rollout-correction.md): the
    MIS band here and verl's rejection sampling under the mapped keys keep the same tokens, on
    log ratios spread over [-1.5, 1.5] (about a third of them outside each band), asymmetric
    bands included. A band ported digit for digit (``"0.5_3.0"``) masks other tokens."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 8, 2, 6, 4, 7, 1] * 4)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    mask = torch.cat([torch.cat([torch.zeros(1), torch.ones(int(n) - 1)]) for n in lengths])
    scale = 1.5 if level == "token" else 0.6  # sequence sums spread wider
    d = (torch.rand(int(offsets[-1]), generator=g) * 2 - 1) * scale
    rollout = -torch.rand(int(offsets[-1]), generator=g) * 3
    config = RolloutCorrectionConfig(mode="mis", level=level, threshold=threshold, threshold_lower=lower)
    _, ours, metrics = rollout_correction(rollout + d, rollout, mask, offsets, config)
    keys = config.verl_keys()
    assert keys["rollout_is"] is None and keys["rollout_rs"] == {"token": "token_k1", "sequence": "seq_sum_k1"}[level]
    theirs = _verl_rejection_keep(d, offsets, mask, keys["rollout_rs"], keys["rollout_rs_threshold"])
    assert torch.equal(ours > 0, theirs & (mask > 0))
    assert 0.05 < metrics["rollout_correction/masked_frac"] < 0.95  # both sides of the band are exercised
    if lower not in (None, 1 / threshold):
        naive = _verl_rejection_keep(d, offsets, mask, keys["rollout_rs"], f"{lower}_{threshold}" if lower else f"{threshold}")
        assert not torch.equal(ours > 0, naive & (mask > 0))


def test_the_verl_mapping_of_tis_and_off():
    tis = RolloutCorrectionConfig(mode="tis", level="sequence", threshold=3.0).verl_keys()
    assert tis == {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_is_batch_normalize": False, "rollout_rs": None}
    assert RolloutCorrectionConfig().verl_keys() == {"rollout_is": None, "rollout_rs": None}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(("threshold", "lower"), [(1.5, None), (2.0, None), (3.0, 0.5), (5.0, 0.9), (1.5, 0.0)])
def test_mis_keeps_a_token_exactly_on_either_bound_as_verl_does(level, threshold, lower):
    """The bounds are inclusive in the precision verl 0.9.1 compares in (an fp32 k1 against the
    bounds' logs as Python floats): a log weight of exactly ``fp32(log(bound))``, e.g.
    ``fp32(log(2/3))`` for ``threshold = 1.5``, is kept, and the next float outward is removed.
    Each token is its own one-token sequence, so the sequence sums are the token values."""
    config = RolloutCorrectionConfig(mode="mis", level=level, threshold=threshold, threshold_lower=lower)
    low = config.lower_bound()
    edges = [math.log(threshold)] + ([math.log(low)] if low > 0 else [])
    d, want = [], []
    for edge in edges:
        on = torch.tensor(edge, dtype=torch.float32)
        out = torch.nextafter(on, torch.tensor(math.inf if edge > 0 else -math.inf))
        inside = torch.nextafter(on, torch.tensor(0.0))
        d += [on, out, inside]
        want += [True, False, True]
    d = torch.stack(d)
    n = d.numel()
    offsets = torch.arange(n + 1)
    mask = torch.ones(n)
    old, rollout = d.clamp(max=0.0), (-d).clamp(max=0.0)  # old - rollout == d exactly (one side is 0)
    assert torch.equal(old - rollout, d)
    _, ours, metrics = rollout_correction(old, rollout, mask, offsets, config)
    assert (ours > 0).tolist() == want, (d.tolist(), ours.tolist())
    keys = config.verl_keys()
    theirs = _verl_rejection_keep(d, offsets, mask, keys["rollout_rs"], keys["rollout_rs_threshold"])
    assert torch.equal(ours > 0, theirs)
    assert metrics["rollout_correction/masked_frac"] == pytest.approx(want.count(False) / n)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_rollout_is_mean_is_weight_mean_and_the_docs_say_so(level):
    """verl 0.9.1's ``rollout_is_mean`` (``compute_rollout_correction_weights``: the masked mean of
    ``exp(clamp(log ratio, +-20))`` truncated at ``rollout_is_threshold``, sequence weights
    broadcast to their tokens) is ``weight_mean`` here, not ``raw_weight_mean``, and the metrics
    table of docs/rollout-correction.md maps it so."""
    config = RolloutCorrectionConfig(mode="tis", level=level)
    _, _, metrics = rollout_correction(OLD, ROLLOUT, torch.tensor(MASK), OFFSETS, config)
    mask = torch.tensor(MASK)
    d = D * mask
    if level == "sequence":
        lengths = OFFSETS.diff()
        d = torch.repeat_interleave(torch.stack([s.sum() for s in d.split(lengths.tolist())]), lengths)
    verl_mean = float((d.clamp(-20, 20).exp() * mask).clamp(max=config.threshold).sum() / mask.sum())
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(verl_mean, rel=1e-6)
    assert abs(metrics["rollout_correction/raw_weight_mean"] - verl_mean) > 0.1  # the two differ on this batch
    rows = [line for line in (ROOT / "docs/rollout-correction.md").read_text().splitlines() if "rollout_is_mean" in line]
    mapped = [row.split("|")[1].strip() for row in rows if "verl's `rollout_is_mean`" in row or "verl 0.9.1's `rollout_is_mean`" in row]
    assert mapped == ["`rollout_correction/weight_mean`"], rows
