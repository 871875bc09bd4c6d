"""The hf rollout backend records MoE routing (``return_routing``; issue 32, R3 on CPU): every
sample's ``routed_experts`` is the top-k of HF's own ``router_logits`` for its prompt and
response tokens (a whole-sequence forward: an independent reference for the incremental
decoding that produced it), -1 on the last token, which no forward ran on; the ``Rollout``
role gathers it as ``rollout_routed_experts`` and 2 ranks assemble the single-rank routing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_api.moe import NOT_ROUTED
from engine_api.rollout import RolloutEngineConfig, SamplingParams
from engine_api.rollout_registry import build_rollout
from posttrain.tiny_model import build_tiny_model
from roles.rollout import Rollout, RolloutConfig
from tests.backends.moe_utils import build_moe_models
from tests.support.launch import run_distributed

PROMPTS = [torch.randint(4, 32, (n,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate([3, 5, 3, 7, 2])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_moe_models(tmp_path_factory.mktemp("rollout_moe"))


def hf_top_k(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids[None], output_router_logits=True).router_logits
    return torch.stack([lg.topk(model.config.num_experts_per_tok, -1).indices for lg in logits], 1)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_moe_mixed"])
def test_recorded_routing_is_the_routers_top_k(models, family):
    engine = build_rollout("hf", RolloutEngineConfig(models[family], return_routing=True))
    groups = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, stop_token_ids=tuple(range(4, 12))), list(range(len(PROMPTS))))
    model = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32).eval()
    moe_layers = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    lengths = set()
    for prompt, samples in zip(PROMPTS, groups, strict=True):
        for sample in samples:
            seq = torch.cat([prompt, sample.token_ids])
            lengths.add(len(sample.token_ids))
            got = sample.routed_experts
            assert got.shape == (len(seq), moe_layers, 2)
            assert bool((got[-1] == NOT_ROUTED).all())
            assert torch.equal(got[:-1].sort(-1).values, hf_top_k(model, seq)[:-1].sort(-1).values)
    assert len(lengths) > 1  # some responses stopped early: rows of one block end at different tokens


def test_dense_model_and_backends_without_routing_are_refused(tmp_path):
    dense = build_tiny_model(tmp_path / "dense", family="qwen2", vocab_size=32)
    with pytest.raises(ValueError, match="return_routing = True: .* no MoE routers"):
        build_rollout("hf", RolloutEngineConfig(dense, return_routing=True))


def _gathered(rank, world, model_dir, prompts=PROMPTS):
    engine = build_rollout("hf", RolloutEngineConfig(model_dir, return_routing=True))
    rollout = Rollout(source=None, engine=engine, config=RolloutConfig(max_new_tokens=5, seed=3), stop_token_ids=[5])
    batch = rollout.generate(prompts, seed_offset=1)
    return batch["input_ids"].values().clone(), batch["rollout_routed_experts"].values().clone(), batch["input_ids"].offsets().clone()


def test_two_ranks_gather_the_single_rank_routing(models):
    alone = run_distributed(_gathered, 1, models["qwen3_moe"], timeout=300)[0]
    for got in run_distributed(_gathered, 2, models["qwen3_moe"], timeout=300):
        for a, b in zip(got, alone, strict=True):
            assert torch.equal(a, b)
    # One prompt for 2 ranks: rank 1 samples nothing and knows no routing shape of its own; the
    # ranks agree on it (L layers x top-k) before the gather, so both get the single-rank routing.
    one = run_distributed(_gathered, 1, models["qwen3_moe"], PROMPTS[:1], timeout=300)[0]
    for got in run_distributed(_gathered, 2, models["qwen3_moe"], PROMPTS[:1], timeout=300):
        for a, b in zip(got, one, strict=True):
            assert torch.equal(a, b)
    ids, routing, offsets = alone
    assert routing.shape == (ids.shape[0], 2, 2)
    assert bool((routing[offsets[1:] - 1] == NOT_ROUTED).all())  # each sequence's last token


def test_a_continued_sample_keeps_each_tokens_routing_of_the_version_that_generated_it(models):
    """Partial rollouts with R3 (issue 43): a sample paused after 3 tokens under version 0 and
    continued after an update to version 1 replays, per token, the routing of the version that
    generated it: the rows that sampled the kept tokens are version 0's top-k (the rows first
    recorded), the rows from the last kept token on are version 1's (an HF forward of the whole
    sequence under the new weights), the last row -1. The update moves the routers, so the two
    versions route some kept tokens differently: the check can tell them apart."""
    engine = build_rollout("hf", RolloutEngineConfig(models["qwen3_moe"], return_routing=True))
    old = AutoModelForCausalLM.from_pretrained(models["qwen3_moe"], dtype=torch.float32).eval()
    kept = [g[0] for g in engine.generate(PROMPTS, SamplingParams(max_tokens=3), list(range(len(PROMPTS))))]
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in old.state_dict().items() if "gate" in k}
    engine.sync_weights([(k, v) for k, v in old.state_dict().items() if k not in new] + list(new.items()), version=1)
    model = AutoModelForCausalLM.from_pretrained(models["qwen3_moe"], dtype=torch.float32).eval()
    model.load_state_dict(new, strict=False)
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=3), list(range(len(PROMPTS))), kept=kept)
    differ = 0
    for prompt, k, (s,) in zip(PROMPTS, kept, out, strict=True):
        seq, cut = torch.cat([prompt, s.token_ids]), len(prompt) + len(k.token_ids) - 1
        assert s.token_versions.tolist() == [0] * 3 + [1] * (len(s.token_ids) - 3)
        assert torch.equal(s.routed_experts[:cut], k.routed_experts[:cut])
        assert torch.equal(s.routed_experts[cut:-1].sort(-1).values, hf_top_k(model, seq)[cut:-1].sort(-1).values)
        assert bool((s.routed_experts[-1] == NOT_ROUTED).all())
        differ += int((hf_top_k(model, seq)[:cut].sort(-1).values != k.routed_experts[:cut].sort(-1).values).any())
    assert differ > 0
