"""Rollout: weights synced from the actor through export_weights; sampling log-probs."""

from __future__ import annotations

import torch

from engine_api.batch import unpack
from recipes.hf_sampler import HFSampler
from roles.actor import Actor, ActorConfig
from roles.rollout import Rollout, RolloutConfig
from tests.backends.hf_utils import make_model, make_test_batch, max_abs_diff
from tests.roles.test_roles import _engine, _with_old_log_probs

# Lengths 3, 2, 4, 1, 3, 2, 3: the sampler decodes equal-length prompts as one batch.
PROMPTS = [torch.tensor(p) for p in ([1, 5, 9], [2, 7], [3, 3, 4, 8], [6], [4, 4, 2], [9, 1], [7, 7, 7])]


def _trained_actor(model_dir):
    actor = Actor(_engine(model_dir), ActorConfig())
    actor.update(_with_old_log_probs(actor, make_test_batch()))  # weights now differ from the HF dir
    return actor


def test_synced_rollout_log_probs_equal_the_actors(tmp_path):
    model_dir = make_model(tmp_path / "llama", "llama")
    actor = _trained_actor(model_dir)
    eos = 5
    rollout = Rollout(
        actor.engine, HFSampler(model_dir, eos_token_id=eos), RolloutConfig(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3)
    )
    rollout.sync_weights()
    batch = rollout.generate(PROMPTS)
    responses = []
    for i, p in enumerate(PROMPTS):
        assert int(batch["prompt_len"][i]) == len(p)
        assert torch.equal(batch["input_ids"][i][: len(p)], p)
        assert batch["loss_mask"][i].tolist() == [0.0] * len(p) + [1.0] * (len(batch["input_ids"][i]) - len(p))
        responses.append(batch["input_ids"][i][len(p) :].tolist())
    # A response stops right after its first EOS (rows of a batch that ended keep no tokens).
    for r in responses:
        assert eos not in r[:-1] and (len(r) == 6 or r[-1] == eos), r
    assert any(len(r) < 6 for r in responses) and any(len(r) == 6 for r in responses), "seed should give both kinds"
    # The actor scores the sampled tokens at the same temperature: equal to what the sampler recorded.
    ours = actor.compute_log_probs(batch)["log_probs"]
    masked = unpack(ours.values() * batch["loss_mask"].values(), batch["input_ids"])
    assert max_abs_diff(masked, list(batch["rollout_log_probs"].unbind())) <= 1e-5


def test_stale_weights_are_detected_and_sampling_is_seeded(tmp_path):
    model_dir = make_model(tmp_path / "llama", "llama")
    actor = _trained_actor(model_dir)
    stale = Rollout(actor.engine, HFSampler(model_dir), RolloutConfig(max_new_tokens=6, temperature=0.8, seed=3))
    batch = stale.generate(PROMPTS)  # no sync: the sampler still holds the HF directory's weights
    ours = actor.compute_log_probs(batch)["log_probs"]
    masked = unpack(ours.values() * batch["loss_mask"].values(), batch["input_ids"])
    assert max_abs_diff(masked, list(batch["rollout_log_probs"].unbind())) > 1e-3
    again = Rollout(actor.engine, HFSampler(model_dir), RolloutConfig(max_new_tokens=6, temperature=0.8, seed=3)).generate(PROMPTS)
    assert torch.equal(again["input_ids"].values(), batch["input_ids"].values())


class _Recording:
    """A sampler that keeps what it was loaded with."""

    def __init__(self):
        self.loaded = []

    def load_weights(self, named):
        self.loaded = [(n, t.clone()) for n, t in named]


class _OldSource:
    """A weight source written before ``bucket_mb`` existed (no such parameter)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def export_weights(self):
        self.calls += 1
        return self.engine.export_weights()


def test_sync_passes_the_bucket_size_and_loads_the_same_weights(tmp_path, monkeypatch):
    import pytest

    actor = _trained_actor(make_model(tmp_path / "llama", "llama"))
    seen = []
    export = type(actor.engine).export_weights

    def recording_export(self, bucket_mb=None):
        seen.append(bucket_mb)
        return export(self, bucket_mb=bucket_mb)

    monkeypatch.setattr(type(actor.engine), "export_weights", recording_export)
    loaded = {}
    for mb in (None, 0.01, 512.0):
        sampler = _Recording()
        Rollout(actor, sampler, RolloutConfig(sync_bucket_mb=mb)).sync_weights()  # through the role, as the recipes do
        loaded[mb] = sampler.loaded
    assert seen == [None, 0.01, 512.0]
    assert RolloutConfig().sync_bucket_mb == 512.0  # the recipes' default: bucketed
    for mb in (0.01, 512.0):
        assert [n for n, _ in loaded[mb]] == [n for n, _ in loaded[None]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded[mb], loaded[None], strict=True))
    # A source without bucket_mb still syncs (per tensor), with a warning that names the fix.
    old = _OldSource(actor.engine)
    with pytest.warns(UserWarning, match=r"rollout.sync_bucket_mb = 512.0: _OldSource.export_weights takes no bucket_mb.*fix:"):
        rollout = Rollout(old, _Recording(), RolloutConfig())
        rollout.sync_weights()
    assert old.calls == 1 and len(rollout.sampler.loaded) == len(loaded[None])
    # The same through a role (what the recipes pass): Actor over an engine without bucket_mb.
    from roles.common import TrainableRole

    role = TrainableRole()
    role.engine = _OldSource(actor.engine)
    with pytest.warns(UserWarning, match=r"_OldSource.export_weights takes no bucket_mb.*fix:"):
        Rollout(role, sampler := _Recording(), RolloutConfig()).sync_weights()
    assert role.engine.calls == 1 and [n for n, _ in sampler.loaded] == [n for n, _ in loaded[None]]
    problems = RolloutConfig(sync_bucket_mb=0)._problems()
    assert any("sync_bucket_mb = 0: must be a number > 0 of MB or null; fix:" in p for p in problems), problems
