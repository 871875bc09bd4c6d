"""A step's rollout sharded across ranks equals the single-rank one (issue 27, item 3).

Each rank of the rollout group generates a contiguous block of the prompts with its own
engine and the samples are gathered with tensor collectives; a prompt's seed depends on
(seed, step, prompt index) only. So the assembled batch on 2 ranks must equal, token for
token, the batch one rank samples alone, on every backend; and a rank whose engine fails
makes every rank raise instead of leaving the other one waiting in the gather.
"""

from __future__ import annotations

import pytest
import torch

from engine_api.rollout import RolloutEngineConfig
from engine_api.rollout_registry import build_rollout, rollout_installed
from roles.rollout import Rollout, RolloutConfig
from tests.support.launch import RankError, run_distributed

# 13 prompts of 1-9 tokens: 2 ranks get blocks of 7 and 6, with unequal lengths in each.
PROMPTS = [
    torch.randint(4, 32, (int(n),), generator=torch.Generator().manual_seed(i))
    for i, n in enumerate([3, 1, 5, 9, 2, 7, 4, 4, 6, 8, 2, 3, 5])
]
CONFIG = RolloutConfig(max_new_tokens=6, temperature=0.9, seed=11)


def _model(root) -> str:
    from posttrain.tiny_model import build_tiny_model

    # head_dim 32 (vLLM's CPU kernel needs >= 32); qwen2: biases, tied embeddings.
    return build_tiny_model(root, family="qwen2", vocab_size=32, hidden_size=64, num_heads=2, num_kv_heads=1, max_position_embeddings=64)


def _generate(rank: int, world: int, model_dir: str, backend: str, fail_rank: int | None = None):
    engine = build_rollout(backend, RolloutEngineConfig(model_path=model_dir))
    if fail_rank == rank:

        def broken(*args, **kwargs):
            raise RuntimeError("simulated engine failure")

        engine._generate = broken
    rollout = Rollout(source=None, engine=engine, config=CONFIG, stop_token_ids=[3])
    batch = rollout.generate(PROMPTS, seed_offset=5)
    engine.shutdown()
    return {
        k: batch[k].values().clone() if batch[k].is_nested else batch[k].clone()
        for k in ("input_ids", "rollout_log_probs", "loss_mask", "prompt_len", "rollout_truncated")
    }, batch["input_ids"].offsets().clone()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_two_ranks_assemble_the_single_rank_batch(backend, tmp_path):
    if not rollout_installed(backend):
        pytest.skip(f"{backend} not installed (make test installs it)")
    model_dir = _model(tmp_path / "m")
    alone, alone_offsets = run_distributed(_generate, 1, model_dir, backend, timeout=300)[0]
    ranks = run_distributed(_generate, 2, model_dir, backend, timeout=300)
    for fields, offsets in ranks:  # both ranks hold the whole batch, equal to the single rank's
        assert torch.equal(offsets, alone_offsets)
        for key in ("input_ids", "loss_mask", "prompt_len", "rollout_truncated"):
            assert torch.equal(fields[key], alone[key]), key
        torch.testing.assert_close(fields["rollout_log_probs"], alone["rollout_log_probs"], rtol=0, atol=1e-5)
    # Non-vacuous: responses differ in length (EOS 3 ends some) and the prompts kept their order.
    lengths = alone_offsets.diff() - alone["prompt_len"]
    assert len(set(lengths.tolist())) > 1


@pytest.mark.slow
def test_a_failing_rank_makes_every_rank_raise(tmp_path):
    model_dir = _model(tmp_path / "m")
    with pytest.raises(RankError) as info:
        run_distributed(_generate, 2, model_dir, "hf", 1, timeout=120)
    text = str(info.value)
    assert "rollout generation failed" in text and "simulated engine failure" in text


def _sync_an_ungathered_shard(rank: int, world: int, model_dir: str):
    """Each rank holds the trainer's weights, the last of them as a DTensor sharded over the 2
    ranks (its shape is the global one, its data half of it): what a sync that forgot to gather
    sends. The engine must refuse it before applying anything, then take the gathered update."""
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    engine = build_rollout("hf", RolloutEngineConfig(model_path=model_dir))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    files = load_file(f"{model_dir}/model.safetensors")
    named = [(n, t + 0.01) for n, t in files.items() if n in engine.weight_shapes()]
    last, full = named[-1]
    shard = distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)])
    try:
        engine.sync_weights([*named[:-1], (last, shard)], version=1, chunk_mb=None)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    unchanged = all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
    version_after_refusal = engine.weight_version
    engine.sync_weights([*named[:-1], (last, shard.full_tensor())], version=1, chunk_mb=None)
    applied = torch.equal(engine.model.state_dict()[last], full)
    return refused, unchanged, version_after_refusal, engine.weight_version, applied, last


def test_an_ungathered_dtensor_shard_is_refused_and_nothing_is_applied(tmp_path):
    model_dir = _model(tmp_path / "m")
    for refused, unchanged, version_after_refusal, version, applied, last in run_distributed(_sync_an_ungathered_shard, 2, model_dir):
        assert refused is not None and repr(last) in refused and "DTensor" in refused, refused
        assert unchanged and version_after_refusal == 0  # not one weight of the update was applied
        assert version == 1 and applied  # and the gathered update after it goes through
