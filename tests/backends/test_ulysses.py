"""Ulysses sequence parallelism on the FSDP engine (issue 33): SP=2 against SP=1.

SP=1 runs on 1 process, SP=2 on 2 gloo processes that form one DP rank whose 2 SP ranks split
every sequence: the same data shard and micro-batches, only the split differs (the MoE
load-balancing loss depends on the micro-batches, by its definition, so a DP=2 reference would
not do). SP=1 is the reference (it is checked against per-sequence HF elsewhere:
``test_fsdp_parity``, the conformance kit). Tolerance: relative 1e-6 (norm of the difference
over the norm of the reference, over every token, or every parameter after one AdamW step); the
two differ only in float summation order: the same math on other matmul shapes (measured: 0.0
on log-probs, up to ~2e-7 on the updated weights).

The models cover what the sequence split touches: GQA with KV heads split (llama, 4 query /
2 KV heads) and repeated (mqa, 1 KV head), a sliding window shorter than the sequences
(mistral), soft-capped eager attention on alternating sliding / full layers (gemma2), and an
MoE with HF's load-balancing loss on (qwen3_moe_aux: the aux loss is a product of batch means,
so its statistics must be summed over the SP ranks), plus LoRA, a value head, routing
recording and replay.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen3MoeConfig

from engine_api import build_engine, load_config
from engine_api.conformance.fixtures import CONSTANT, MODES, TINY_DIMS, save_model
from tests.backends.moe_utils import BASE, COEF, QWEN3_MOE
from tests.support.hf_utils import VARIANTS, engine_for, full_params, make_test_batch, rel
from tests.support.launch import run_distributed

RTOL = 1e-6
SP = "fsdp.ulysses_sequence_parallel_size"
LAYOUTS = {"packed-dynamic": ["max_token_len_per_micro_batch=16"], "padded": ["use_remove_padding=false", "micro_batch_size=3"]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ulysses")
    gemma2 = Gemma2Config(
        **{**TINY_DIMS, "num_hidden_layers": 2},
        head_dim=8,
        sliding_window=4,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
    )
    return {
        "llama": save_model(LlamaConfig(**TINY_DIMS, rms_norm_eps=1e-6), root / "llama"),
        "mqa": save_model(LlamaConfig(**{**TINY_DIMS, "num_key_value_heads": 1}, rms_norm_eps=1e-6), root / "mqa"),
        "mistral": save_model(MistralConfig(**TINY_DIMS, sliding_window=4), root / "mistral"),
        "gemma2": save_model(gemma2, root / "gemma2"),
        "qwen3_moe_aux": save_model(
            Qwen3MoeConfig(**BASE, **QWEN3_MOE, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=COEF),
            root / "qwen3_moe_aux",
        ),
    }


def _infer(path, *overrides, **meta):
    engine = engine_for(path, *overrides)
    with engine.eval_mode():
        out = engine.unshard_data(engine.infer_batch(engine.shard_data(make_test_batch(**meta))))
    return {k: out[k].values().clone() for k in out.keys()}


def _step(path, *overrides, batch=None, calls=1, **meta):
    """One optimizer step on this rank's shard of ``batch`` (default ``make_test_batch(**meta)``),
    split into ``calls`` forward_backward calls; the first call's loss and metrics."""
    engine = engine_for(path, "optim.eps=1e-3", *overrides)
    local = engine.shard_data(make_test_batch(**meta) if batch is None else batch)
    n = local.batch_size[0]
    with engine.train_mode():
        engine.optimizer_zero_grad()
        results = [engine.forward_backward_step(local[i * n // calls : (i + 1) * n // calls]) for i in range(calls)]
        norm = engine.optimizer_step()
    _, loss, ctx = results[0]
    metrics = {k: sum(v) / len(v) for k, v in ctx.get("metrics", {}).items()}
    return {"loss": loss, "grad_norm": norm, "params": full_params(engine), "metrics": metrics}


def _worker(rank, world, models):
    """Every comparison's run at SP = the launch's size (1: one process; 2: one SP group)."""
    out, sp = {}, world
    size = f"{SP}={sp}"
    for name, path in models.items():
        for layout, extra in LAYOUTS.items():
            out["outputs", name, layout, sp] = _infer(path, *extra, size, calculate_entropy=True)
            out["step", name, layout, sp] = _step(path, *extra, size)
    llama = models["llama"]
    for mode in MODES:
        for variant, (extra, calls) in VARIANTS.items():
            out["modes", mode, variant, sp] = _step(
                llama, *extra, f"loss_agg_mode={mode}", f"loss_agg_constant={CONSTANT}", size, calls=calls
            )
    out["values", sp] = _infer(llama, "model.head=value", size)
    out["lora", sp] = _step(llama, "model.lora.rank=4", "model.lora.alpha=8", size)
    # activation checkpointing: the recomputation in backward runs the all-to-alls again
    out["recompute", sp] = _step(llama, "model.gradient_checkpointing=true", size)
    out["lora-base", sp] = _infer(llama, "model.lora.rank=4", size, disable_adapters=True)
    moe = models["qwen3_moe_aux"]
    recorded = _infer(moe, size, return_routing=True)["routed_experts"]
    out["recorded", sp] = recorded
    out["replay", sp] = _step(moe, size, batch=_replay_batch(recorded))
    return out


def _replay_batch(recorded):
    """The test batch replaying ``recorded`` (the routing of the same batch, gathered)."""
    batch = make_test_batch(replay_routing=True)
    batch["routed_experts"] = torch.nested.nested_tensor_from_jagged(recorded, batch["input_ids"].offsets())
    return batch


@pytest.fixture(scope="module")
def results(models):
    """Rank 0's results of both runs under one key set (``sp`` last), and the SP=2 run's rank 1."""
    sp1 = run_distributed(_worker, 1, models, timeout=900)[0]
    sp2 = run_distributed(_worker, 2, models, timeout=900)
    return [{**sp1, **sp2[0]}, {**sp1, **sp2[1]}]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["llama", "mqa", "mistral", "gemma2", "qwen3_moe_aux"])
def test_outputs_and_one_step_equal_sp1(results, name, layout):
    for got in results:  # every SP rank returns the whole batch's outputs
        sp1, sp2 = got["outputs", name, layout, 1], got["outputs", name, layout, 2]
        for field in ("log_probs", "entropy"):
            assert _rel(sp2[field], sp1[field]) <= RTOL, (field, _rel(sp2[field], sp1[field]))
    a, b = results[0]["step", name, layout, 2], results[0]["step", name, layout, 1]
    assert _close(a["loss"], b["loss"]) and _close(a["grad_norm"], b["grad_norm"]), (a["loss"], b["loss"], a["grad_norm"], b["grad_norm"])
    assert rel(a["params"], b["params"]) <= RTOL
    if name == "qwen3_moe_aux":  # the aux loss is the whole micro-batches', not each rank's slice's
        assert _close(a["metrics"]["moe/aux_loss"], b["metrics"]["moe/aux_loss"])
        assert a["metrics"]["moe/expert_load_max"] == b["metrics"]["moe/expert_load_max"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_one_step_equals_sp1_in_every_mode_and_micro_batching(results, mode):
    for variant in VARIANTS:
        a, b = results[0]["modes", mode, variant, 2], results[0]["modes", mode, variant, 1]
        assert _close(a["grad_norm"], b["grad_norm"]), (variant, a["grad_norm"], b["grad_norm"])
        assert rel(a["params"], b["params"]) <= RTOL, (variant, rel(a["params"], b["params"]))


@pytest.mark.slow
def test_values_lora_recompute_and_routing_equal_sp1(results):
    r = results[0]
    assert _rel(r["values", 2]["values"], r["values", 1]["values"]) <= RTOL
    for key in ("lora", "recompute"):
        a, b = r[key, 2], r[key, 1]
        assert _close(a["loss"], b["loss"]) and rel(a["params"], b["params"]) <= RTOL, key
    assert _rel(r["lora-base", 2]["log_probs"], r["lora-base", 1]["log_probs"]) <= RTOL
    # Routing: every token recorded once (no NOT_ROUTED), the same experts as at SP=1.
    assert bool((r["recorded", 2] >= 0).all()) and torch.equal(r["recorded", 2], r["recorded", 1])
    a, b = r["replay", 2], r["replay", 1]
    assert a["metrics"]["moe/router_disagreement"] == 0.0 == b["metrics"]["moe/router_disagreement"]
    assert _close(a["loss"], b["loss"]) and rel(a["params"], b["params"]) <= RTOL


def _sp4_worker(rank, world, path):
    return {
        layout: (_infer(path, *extra, f"{SP}=4", calculate_entropy=True), _step(path, *extra, f"{SP}=4"))
        for layout, extra in LAYOUTS.items()
    }


@pytest.mark.slow
def test_sp4_repeats_kv_heads(models, results):
    """SP=4 over 4 query / 2 KV heads: each KV head is repeated for 2 ranks (a KV head for every
    rank's query head; a tiled repeat would pair query head 1 with KV head 1 instead of 0)."""
    got = run_distributed(_sp4_worker, 4, models["llama"], timeout=600)[0]
    for layout in LAYOUTS:
        outputs, step = got[layout]
        assert _rel(outputs["log_probs"], results[0]["outputs", "llama", layout, 1]["log_probs"]) <= RTOL
        want = results[0]["step", "llama", layout, 1]
        assert _close(step["loss"], want["loss"]) and rel(step["params"], want["params"]) <= RTOL


def _mismatch_worker(rank, world, path):
    engine = engine_for(path, f"{SP}=2")
    batch = make_test_batch()
    cases = {
        "another batch": make_test_batch(seed=rank),
        "the same rows in another order": batch[torch.arange(batch.batch_size[0]).flip(0)] if rank else batch,
        "the same batch": batch,
    }
    out = {}
    for name, local in cases.items():
        try:
            with engine.eval_mode():
                engine.infer_batch(local)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.slow
def test_sp_peers_with_different_batches_are_refused(models):
    for got in run_distributed(_mismatch_worker, 2, models["llama"], timeout=300):
        for case in ("another batch", "the same rows in another order"):
            assert got[case] is not None and "were given different batches" in got[case] and "shard_data" in got[case], case
        assert got["the same batch"] is None  # the control: the check does not refuse a good call


# ----------------------------------------------------------------------------- resume across SP
def _resume_worker(rank, world, path, ckpt):
    out = {}
    batch = make_test_batch()
    first = engine_for(path, "optim.eps=1e-3", f"{SP}=1")
    with first.train_mode():
        first.train_batch(first.shard_data(batch))
    first.save_checkpoint(ckpt, global_step=1)
    with first.train_mode():
        first.train_batch(first.shard_data(make_test_batch(seed=1)))
    out["uninterrupted"] = full_params(first)
    resumed = engine_for(path, "optim.eps=1e-3", f"{SP}=2")
    out["step"] = resumed.load_checkpoint(ckpt)
    with resumed.train_mode():
        resumed.train_batch(resumed.shard_data(make_test_batch(seed=1)))
    out["resumed"] = full_params(resumed)
    return out


@pytest.mark.slow
def test_resume_across_an_sp_change(models, tmp_path):
    """A checkpoint saved at SP=1 (DP=2) resumes at SP=2 (DP=1): the next step equals the
    uninterrupted SP=1 run's (model, AdamW moments, scheduler and step all restored)."""
    for got in run_distributed(_resume_worker, 2, models["llama"], str(tmp_path / "ckpt"), timeout=600):
        assert got["step"] == 1
        assert rel(got["resumed"], got["uninterrupted"]) <= RTOL


# ----------------------------------------------------------------------------- refusals
def _config(path, sp, world=2, *extra):
    return load_config(None, ["strategy=fsdp", f"model.path={path}", f"{SP}={sp}", f"world_size={world}", *extra])


def test_sp_must_divide_the_world_and_be_positive(models):
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size.*3"):
        _config(models["llama"], 3, 2)
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size = 0.*must be >= 1"):
        _config(models["llama"], 0, 2)


def test_sp_must_divide_the_heads(tmp_path):
    path = save_model(LlamaConfig(**{**TINY_DIMS, "hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 1}), tmp_path / "m")
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size = 2: does not divide the model's num_attention_heads = 3"):
        build_engine(_config(path, 2))


def test_attention_sinks_are_refused():  # the GPT-OSS family
    from transformers import GptOssConfig

    from backends.fsdp.ulysses import ulysses_problems

    problems = ulysses_problems(GptOssConfig(num_attention_heads=4, num_key_value_heads=2), 2)
    assert problems and "attention sinks" in problems[0] and "use 1" in problems[0]


def test_bidirectional_attention_is_refused():
    from backends.fsdp.ulysses import ulysses_problems

    causal = Gemma2Config(**TINY_DIMS, head_dim=8)
    assert ulysses_problems(causal, 2) == []  # the control
    problems = ulysses_problems(Gemma2Config(**TINY_DIMS, head_dim=8, use_bidirectional_attention=True), 2)
    assert problems and "bidirectionally" in problems[0]
