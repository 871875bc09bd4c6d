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
