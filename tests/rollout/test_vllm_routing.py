"""The vllm backend's MoE routing (``return_routing``, router replay R3).

* On CPU (every CI run): ``return_routing=True`` is refused at construction, naming the field
  and the fix, before anything is built (vLLM records routing only with its model runner V2,
  which needs Triton on a CUDA GPU; see ``backends.rollout.vllm.routed_experts_tensor``).
* The pieces that need no engine: which decoder layers are MoE (checked against the HF
  models' own modules) and the conversion of vLLM's ``routed_experts`` array into
  ``Sample.routed_experts`` (all decoder layers or MoE layers only, the missing last row,
  shapes that cannot be matched refused).
* On a GPU (``pytest -m gpu`` / ``make gpu-check``; skipped on CPU): a tiny Qwen3-MoE with dense
  layers between its MoE ones samples with ``return_routing=True`` and every recorded routing
  equals the top-k of HF's own ``router_logits`` on the same tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backends.rollout import vllm as backend
from backends.rollout.vllm import RoutingLayout, moe_layer_indices, routed_experts_tensor
from engine_api.rollout import RolloutEngineConfig, SamplingParams
from engine_api.rollout_registry import build_rollout, rollout_installed

needs_vllm = pytest.mark.skipif(not rollout_installed("vllm"), reason="vllm not installed (make test installs it)")

# 6 decoder layers, an MoE layer every 2nd except those in mlp_only_layers: MoE 1 and 3; 0, 2, 4
# and 5 dense (so a wrong layer selection reads vLLM's zero columns of dense layers).
MIXED = dict(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[5])


# ---------------------------------------------------------------------------------- CPU refusal
@needs_vllm
def test_return_routing_is_refused_on_cpu_before_anything_is_built(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "head_dim": 32, **MIXED}))  # no weights
    monkeypatch.setattr(backend, "_ON_CPU", True)  # the CPU path, also when this runs on a GPU machine

    def built(*args, **kwargs):
        raise AssertionError("the engine started building before refusing return_routing")

    # Everything heavy starts with the environment set up for vLLM's import.
    monkeypatch.setattr(backend, "_environment", built)
    config = RolloutEngineConfig(model_path=str(tmp_path), return_routing=True)
    with pytest.raises(ValueError, match=r"return_routing = True .*actor\.router_replay=r3.*fix: use rollout\.backend=hf on CPU") as err:
        build_rollout("vllm", config)
    assert "run on a GPU" in str(err.value) and "actor.router_replay=r2" in str(err.value)


def test_supports_routing_only_with_cuda():
    assert backend.VLLMRollout.supports_routing is torch.cuda.is_available()


# ---------------------------------------------------------------------------------- MoE layers
def test_moe_layer_indices_follow_each_family():
    assert moe_layer_indices({"num_hidden_layers": 3, "num_local_experts": 4}) == [0, 1, 2]  # mixtral: every layer
    assert moe_layer_indices({"num_hidden_layers": 3, "num_experts": 4}) == [0, 1, 2]  # qwen defaults: step 1, none dense
    assert moe_layer_indices(MIXED) == [1, 3]
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts: the layer keys still count
    assert moe_layer_indices({**{k: v for k, v in MIXED.items() if k != "num_experts"}, "num_local_experts": 8}) == [1, 3]
    assert moe_layer_indices({**MIXED, "decoder_sparse_step": 3, "mlp_only_layers": []}) == [2, 5]
    assert moe_layer_indices({"num_hidden_layers": 3, "num_experts": 0}) == []
    assert moe_layer_indices({"num_hidden_layers": 3, "intermediate_size": 64}) == []  # dense


@pytest.mark.parametrize("family", ["qwen3_moe_mixed", "qwen3_moe", "mixtral"])
def test_moe_layer_indices_match_hf_modules(family):
    """The independent reference: which layers of HF's own model have a router."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    base = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)
    config = {
        "qwen3_moe_mixed": lambda: Qwen3MoeConfig(**base, **MIXED, moe_intermediate_size=8),
        "qwen3_moe": lambda: Qwen3MoeConfig(**base, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
        "mixtral": lambda: MixtralConfig(**base, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2),
    }[family]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    routed = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    assert routed and moe_layer_indices(config.to_dict()) == routed


def test_a_dense_model_is_refused_for_routing():
    with pytest.raises(ValueError, match=r"return_routing = True .*no MoE layer.*fix: actor\.router_replay=off"):
        RoutingLayout.from_hf({"model_type": "qwen2", "num_hidden_layers": 2}, "/m")
    assert RoutingLayout.from_hf({"model_type": "qwen3_moe", **MIXED}) == RoutingLayout(6, (1, 3), 2)


# ---------------------------------------------------------------------------------- conversion
LAYOUT = RoutingLayout(num_layers=6, moe_layers=(1, 3), top_k=2)
P, R = 5, 3


def _moe_rows(tokens: int) -> np.ndarray:
    """``[tokens, 2 MoE layers, 2]`` distinct expert ids (uint8, as vLLM reports <= 256 experts)."""
    return (np.arange(tokens * 4).reshape(tokens, 2, 2) % 250 + 1).astype(np.uint8)


def _all_layers(moe: np.ndarray) -> np.ndarray:
    """As vLLM reports it: every decoder layer, the dense ones left at the capture buffer's zeros."""
    rows = np.zeros((moe.shape[0], LAYOUT.num_layers, LAYOUT.top_k), dtype=moe.dtype)
    rows[:, list(LAYOUT.moe_layers)] = moe
    return rows


@pytest.mark.parametrize("reported", ["all_layers", "moe_only"])
def test_conversion_selects_moe_layers_and_pads_the_last_token(reported):
    moe = _moe_rows(P + R - 1)  # vLLM: every token but the last sampled one (never run)
    rows = _all_layers(moe) if reported == "all_layers" else moe
    out = routed_experts_tensor(rows, P, R, LAYOUT)
    assert out.dtype == torch.int64 and out.shape == (P + R, 2, 2)
    assert torch.equal(out[:-1], torch.from_numpy(moe.astype(np.int64)))
    assert (out[-1] == -1).all()


def test_conversion_keeps_a_full_report_and_wide_ids():
    moe = _moe_rows(P + R).astype(np.uint16) + 300  # > 256 experts: vLLM reports uint16
    out = routed_experts_tensor(_all_layers(moe), P, R, LAYOUT)
    assert torch.equal(out, torch.from_numpy(moe.astype(np.int64)))


@pytest.mark.parametrize(
    "shape",
    [
        (P + R - 2, 6, 2),  # a row missing besides the last: tokens would shift
        (P + R + 1, 6, 2),  # more rows than tokens
        (P + R - 1, 4, 2),  # neither all 6 decoder layers nor the 2 MoE ones
        (P + R - 1, 6, 3),  # a different top-k
        (P + R - 1, 12),  # not [tokens, layers, k]
    ],
)
def test_conversion_refuses_shapes_it_cannot_match(shape):
    with pytest.raises(RuntimeError, match=r"routed_experts has shape .*expected .*fix:"):
        routed_experts_tensor(np.zeros(shape, dtype=np.uint8), P, R, LAYOUT)


@needs_vllm
@pytest.mark.parametrize("routing", [True, False])
def test_generate_asks_for_the_whole_prompts_routing_and_converts_it(routing):
    """``_generate``'s wiring without an engine (vLLM cannot record routing on CPU): a stand-in
    ``LLM`` answers as vLLM 0.32 does (all decoder layers, no row for the last token)."""
    from types import SimpleNamespace

    sent = []

    def fake_generate(requests, sampling, use_tqdm, lora_request):
        sent.extend(sampling)
        outs = []
        for request in requests:
            ids = [7] * R
            rows = _all_layers(_moe_rows(len(request["prompt_token_ids"]) + R - 1)) if routing else None
            logprobs = [{t: SimpleNamespace(logprob=-1.0)} for t in ids]
            outs.append(
                SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason="length", routed_experts=rows)])
            )
        return outs

    engine = object.__new__(backend.VLLMRollout)  # the state _generate reads, no vLLM engine
    engine.config = RolloutEngineConfig(model_path="unused")
    engine._version, engine._lora, engine._routing = 0, None, LAYOUT if routing else None
    engine.llm = SimpleNamespace(generate=fake_generate)
    prompts = [torch.arange(P), torch.arange(P + 2)]
    out = engine._generate(prompts, SamplingParams(n=2, max_tokens=R), [0, 1])
    assert all(params.routed_experts_prompt_start == 0 for params in sent)
    for prompt, samples in zip(prompts, out, strict=True):
        for sample in samples:
            if not routing:
                assert sample.routed_experts is None
                continue
            want = _moe_rows(len(prompt) + R - 1).astype(np.int64)
            assert sample.routed_experts.shape == (len(prompt) + R, 2, 2)
            assert torch.equal(sample.routed_experts[:-1], torch.from_numpy(want)) and (sample.routed_experts[-1] == -1).all()


def test_gpu_check_names_this_test_in_its_report():
    """``make gpu-check`` reports this file's gpu test by name: skipped (with the reason) on CPU."""
    from benchmarks.gpu_check import NAMED_GPU_TESTS, named_outcomes

    (case,) = [c for c, path in NAMED_GPU_TESTS.items() if path == "tests/rollout/test_vllm_routing.py"]
    skipped = "SKIPPED [1] tests/rollout/test_vllm_routing.py:170: needs a CUDA device (GPU-only path); run on a GPU machine"

    def row(log: str) -> dict:  # this file's row (the report has one per named GPU test)
        return next(r for r in named_outcomes(log) if r["case"] == case)

    assert row(f"x\n{skipped}\n1 skipped") == {
        "case": case,
        "outcome": "skipped",
        "reason": "needs a CUDA device (GPU-only path); run on a GPU machine",
    }
    failed = "FAILED tests/rollout/test_vllm_routing.py::test_vllm_routed_experts_match_hf_router_logits - AssertionError"
    assert row(f"{skipped}\n{failed}")["outcome"] == "failed"
    assert row("PASSED tests/rollout/test_vllm_routing.py::test_x")["outcome"] == "passed"
    assert row("PASSED tests/other.py::test_x")["outcome"] == "not run"


# ---------------------------------------------------------------------------------- GPU: vs HF
# Both sides run fp32, but vLLM's GPU kernels (Triton fused MoE, attention) may multiply in TF32
# (inputs rounded to 2^-11 ~ 5e-4 relative) and sum in another order, and this model amplifies
# such noise through its layers. Measured on CPU with HF alone, as a pessimistic stand-in:
# every weight of this model perturbed by a relative 1e-3 (twice TF32's rounding) moved router
# logits (std ~1) by at most 0.032 where no earlier routing had flipped, and every first flip
# sat at a top-k gap < 0.021; at 2e-3: 0.065 and < 0.025 (30 sequences of 64 tokens).
# NEAR_TIE: HF's k-th and (k+1)-th largest logits closer than this are a near-tie, where a
# first disagreement is noise; 3x the 1e-3 measurement. A bug (wrong expert ids, a dense
# layer's zero column, rows shifted by a token) disagrees at gaps of order 1.
NEAR_TIE = 0.1
# A flip at a near-tie changes that token's MoE output by a whole expert's contribution, so the
# routing it feeds (later MoE layers, of that token and, through attention, of later tokens) may
# legitimately disagree too: allowed when an earlier flip explains it, as long as each MoE layer
# keeps at most this fraction of its rows disagreeing. The stand-in above flipped 0.9% (1e-3)
# and 1.8% (2e-3) of all rows, cascades included; a wrong layer selected disagrees on every row
# of that layer, rows shifted by one token on ~90% of them.
MAX_DISAGREEING = 0.1


def _hf_router_logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """HF's own per-MoE-layer router logits of ``ids``, ``[tokens, E]`` each."""
    with torch.no_grad():
        return [lg.reshape(len(ids), -1) for lg in model(ids[None], output_router_logits=True).router_logits]


def _disagreements(routed: torch.Tensor, logits: list[torch.Tensor], k: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """``(disagreeing, unexplained, compared)``: the ``(token, MoE layer)`` rows whose expert
    set differs from HF's top-k, those of them no earlier disagreement could have caused (one
    at the same or an earlier token in an earlier layer) and are not near-ties, and the number
    of rows compared (every token but the last, never run)."""
    tokens = routed.shape[0] - 1
    wrong = []
    for layer, lg in enumerate(logits):
        top = lg[:tokens].topk(k, dim=-1).indices
        for t in range(tokens):
            if set(routed[t, layer].tolist()) != set(top[t].tolist()):
                wrong.append((t, layer))
    unexplained = []
    for t, layer in wrong:
        if any(t0 <= t and l0 < layer for t0, l0 in wrong):
            continue
        ranked = logits[layer][t].sort(descending=True).values
        if float(ranked[k - 1] - ranked[k]) >= NEAR_TIE:
            unexplained.append((t, layer))
    return wrong, unexplained, tokens * len(logits)


@pytest.mark.gpu
@needs_vllm
def test_vllm_routed_experts_match_hf_router_logits(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # a head size every vLLM GPU attention backend serves
        moe_intermediate_size=64,
        max_position_embeddings=256,
        initializer_range=0.1,  # router logits O(1); at 0.3 noise moved them ~1.6x more relative to their size
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **MIXED,
    )
    path = str(tmp_path / "m")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    engine = build_rollout(
        "vllm",
        RolloutEngineConfig(
            model_path=path, dtype="float32", max_model_len=128, return_routing=True, options={"gpu_memory_utilization": 0.2}
        ),
    )
    try:
        generator = torch.Generator().manual_seed(1)
        # 40 tokens: full KV blocks, so the second sample of a prompt may read its prompt rows
        # from vLLM's prefix-cache store rather than from its own forward.
        prompts = [torch.randint(3, 256, (n,), generator=generator) for n in (5, 23, 40)]
        out = engine.generate(prompts, SamplingParams(n=2, max_tokens=24, temperature=1.0), [0, 1, 2])
    finally:
        engine.shutdown()
    k, experts, moe = config.num_experts_per_tok, config.num_experts, moe_layer_indices(config.to_dict())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # fp32 on CPU: the reference
    compared, disagreeing = 0, {layer: [] for layer in range(len(moe))}
    for prompt, samples in zip(prompts, out, strict=True):
        for sample in samples:
            ids = torch.cat([prompt, sample.token_ids])
            routed = sample.routed_experts
            assert routed is not None and routed.dtype == torch.int64 and routed.shape == (len(ids), len(moe), k)
            assert (routed[-1] == -1).all() and ((routed[:-1] >= 0) & (routed[:-1] < experts)).all()
            logits = _hf_router_logits(hf, ids)
            assert len(logits) == len(moe)
            wrong, unexplained, rows = _disagreements(routed, logits, k)
            assert not unexplained, f"routing differs from HF's top-k away from a near-tie at (token, MoE layer) {unexplained}"
            compared += rows // len(moe)
            for t, layer in wrong:
                disagreeing[layer].append(t)
    for layer, tokens in disagreeing.items():
        assert len(tokens) <= MAX_DISAGREEING * compared, f"MoE layer {layer}: {len(tokens)} of {compared} rows differ from HF"
