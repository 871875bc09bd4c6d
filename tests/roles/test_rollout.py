"""Rollout role: weights synced from the actor through export_weights into a rollout engine;
sampling log-probs equal the actor's; versions; bucketed sync; failures agreed on every rank."""

from __future__ import annotations

import pytest
import torch

from engine_api.batch import unpack
from engine_api.rollout import RolloutEngineConfig
from engine_api.rollout_registry import build_rollout
from roles.actor import Actor, ActorConfig
from roles.rollout import Rollout, RolloutConfig
from tests.support.hf_utils import make_model, make_test_batch, max_abs_diff
from tests.support.role_engines import fsdp_engine as _engine
from tests.support.role_engines import with_old_log_probs as _with_old_log_probs

# Lengths 3, 2, 4, 1, 3, 2, 3: the hf backend decodes equal-length prompts as one batch.
PROMPTS = [torch.tensor(p) for p in ([1, 5, 9], [2, 7], [3, 3, 4, 8], [6], [4, 4, 2], [9, 1], [7, 7, 7])]


def _trained_actor(model_dir):
    actor = Actor(_engine(model_dir), ActorConfig())
    actor.update(_with_old_log_probs(actor, make_test_batch()))  # weights now differ from the HF dir
    return actor


def _rollout(source, model_dir, config: RolloutConfig, **kw) -> Rollout:
    return Rollout(source, build_rollout(config.backend, RolloutEngineConfig(model_path=str(model_dir))), config, **kw)


def test_synced_rollout_log_probs_equal_the_actors(tmp_path):
    model_dir = make_model(tmp_path / "llama", "llama")
    actor = _trained_actor(model_dir)
    eos = 5  # sampled by some rows of this seed, not by others
    rollout = _rollout(actor.engine, model_dir, RolloutConfig(max_new_tokens=6, temperature=0.8, seed=3), stop_token_ids=[eos])
    rollout.sync_weights()
    batch = rollout.generate(PROMPTS)
    responses = []
    for i, p in enumerate(PROMPTS):
        assert int(batch["prompt_len"][i]) == len(p)
        assert torch.equal(batch["input_ids"][i][: len(p)], p)
        assert batch["loss_mask"][i].tolist() == [0.0] * len(p) + [1.0] * (len(batch["input_ids"][i]) - len(p))
        responses.append(batch["input_ids"][i][len(p) :].tolist())
    # A response stops right after its first EOS (rows of a batch that ended keep no tokens).
    for r, truncated in zip(responses, batch["rollout_truncated"].tolist(), strict=True):
        assert eos not in r[:-1] and (len(r) == 6 or r[-1] == eos), r
        assert truncated == int(r[-1] != eos)
    assert any(len(r) < 6 for r in responses) and any(len(r) == 6 for r in responses), "seed should give both kinds"
    assert batch["rollout_weight_version"].tolist() == [1] * len(PROMPTS)
    # The actor scores the sampled tokens at the same temperature: equal to what the engine recorded.
    ours = actor.compute_log_probs(batch)["log_probs"]
    masked = unpack(ours.values() * batch["loss_mask"].values(), batch["input_ids"])
    assert max_abs_diff(masked, list(batch["rollout_log_probs"].unbind())) <= 1e-5


def test_stale_weights_are_detected_and_sampling_is_seeded(tmp_path):
    model_dir = make_model(tmp_path / "llama", "llama")
    actor = _trained_actor(model_dir)
    config = RolloutConfig(max_new_tokens=6, temperature=0.8, seed=3)
    stale = _rollout(actor.engine, model_dir, config)
    batch = stale.generate(PROMPTS)  # no sync: the engine still holds the HF directory's weights
    assert batch["rollout_weight_version"].tolist() == [0] * len(PROMPTS)
    ours = actor.compute_log_probs(batch)["log_probs"]
    masked = unpack(ours.values() * batch["loss_mask"].values(), batch["input_ids"])
    assert max_abs_diff(masked, list(batch["rollout_log_probs"].unbind())) > 1e-3
    again = _rollout(actor.engine, model_dir, config).generate(PROMPTS)
    assert torch.equal(again["input_ids"].values(), batch["input_ids"].values())
    # A prompt's sample depends on (seed, call, index) only: the prompts split in two calls with
    # the same offset and their indices kept would not be the same call; but a reordered
    # neighbourhood must not change prompt 0's sample when it keeps index 0.
    other = _rollout(actor.engine, model_dir, config).generate([PROMPTS[0], *PROMPTS[3:]])
    assert torch.equal(other["input_ids"][0], batch["input_ids"][0])


class _Recording:
    """A stand-in engine keeping what each update phase received."""

    supports_lora = False

    def __init__(self):
        self.loaded, self.chunks, self.weight_version = [], 0, 0

    def begin_weight_update(self, version):
        self.loaded, self.chunks, self.pending = [], 0, version

    def update_weights(self, chunk):
        self.chunks += 1
        self.loaded += [(n, t.clone()) for n, t in chunk]

    def finish_weight_update(self):
        self.weight_version = self.pending

    def abort_weight_update(self):
        pass

    def resume_memory(self):
        pass


def test_sync_passes_the_bucket_size_and_loads_the_same_weights(tmp_path, monkeypatch):
    actor = _trained_actor(make_model(tmp_path / "llama", "llama"))
    seen = []
    export = type(actor.engine).export_weights

    def recording_export(self, bucket_mb=None):
        seen.append(bucket_mb)
        return export(self, bucket_mb=bucket_mb)

    monkeypatch.setattr(type(actor.engine), "export_weights", recording_export)
    loaded, chunks = {}, {}
    for mb in (None, 0.01, 512.0):
        engine = _Recording()
        Rollout(actor, engine, RolloutConfig(sync_bucket_mb=mb)).sync_weights()  # through the role, as the recipes do
        loaded[mb], chunks[mb] = engine.loaded, engine.chunks
    assert seen == [None, 0.01, 512.0]
    assert RolloutConfig().sync_bucket_mb == 512.0  # the recipes' default: bucketed
    # The engine gets one chunk per tensor without buckets, one in all for a tiny model in 512 MB.
    assert chunks[None] == len(loaded[None]) and chunks[512.0] == 1 and 1 < chunks[0.01] < chunks[None]
    for mb in (0.01, 512.0):
        assert [n for n, _ in loaded[mb]] == [n for n, _ in loaded[None]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded[mb], loaded[None], strict=True))
    problems = RolloutConfig(sync_bucket_mb=0)._problems()
    assert any("sync_bucket_mb = 0: must be a number > 0 of MB or null; fix:" in p for p in problems), problems


def test_sync_chunks_hold_chunk_mb_of_bytes_whatever_the_dtype():
    """``chunk_mb`` is a memory budget: a chunk closes at the first tensor that brings it to
    ``chunk_mb`` MB of bytes (not elements: fp32 chunks would be 4x the size asked for)."""
    from engine_api.rollout import chunk_pairs

    mib = 2**20
    for dtype, per_chunk in ((torch.float32, 4), (torch.bfloat16, 8), (torch.float64, 2)):
        named = [(f"w{i}", torch.zeros(2**16, dtype=dtype)) for i in range(10)]  # 256 KiB in fp32
        chunks = list(chunk_pairs(named, 1.0))
        sizes = [sum(t.numel() * t.element_size() for _, t in c) for c in chunks]
        assert [len(c) for c in chunks[:-1]] == [per_chunk] * (len(chunks) - 1), (dtype, [len(c) for c in chunks])
        assert all(size == mib for size in sizes[:-1]) and 0 < sizes[-1] <= mib, (dtype, sizes)
        assert [n for c in chunks for n, _ in c] == [n for n, _ in named]  # every tensor once, in order
    # Tensors of mixed sizes: each chunk reaches the budget only with its last tensor.
    mixed = [(f"m{i}", torch.zeros(n)) for i, n in enumerate([300_000, 10, 100_000, 200_000, 5, 400_000, 70_000])]
    for chunk in list(chunk_pairs(mixed, 1.0))[:-1]:
        size = [t.numel() * t.element_size() for _, t in chunk]
        assert sum(size) >= mib > sum(size[:-1]), size


def test_a_refused_sync_keeps_the_old_weights_and_names_the_tensor(tmp_path):
    """A trainer whose model differs from the rollout's (another width): the update is refused
    naming a tensor, the engine keeps its version and its weights (same samples as before)."""
    model_dir = make_model(tmp_path / "llama", "llama")
    other = make_model(tmp_path / "other", "qwen2")
    rollout = _rollout(_trained_actor(other).engine, model_dir, RolloutConfig(max_new_tokens=4, seed=1))
    before = rollout.generate(PROMPTS, seed_offset=0)
    with pytest.raises(RuntimeError, match=r"weight sync to version 1 failed.*'model\.[^']+'.*(not a weight|shape).*fix:"):
        rollout.sync_weights()
    assert rollout.weight_version == 0
    after = rollout.generate(PROMPTS, seed_offset=0)
    assert torch.equal(after["input_ids"].values(), before["input_ids"].values())
    assert torch.equal(after["rollout_log_probs"].values(), before["rollout_log_probs"].values())


def test_rollout_config_problems_name_the_field():
    problems = RolloutConfig(temperature=0, top_k=0, lora_sync="x", max_new_tokens=0)._problems()
    for needle in ("temperature = 0", "top_k = 0", "lora_sync = 'x'", "max_new_tokens = 0"):
        assert any(p.startswith(needle) and "fix:" in p for p in problems), (needle, problems)
