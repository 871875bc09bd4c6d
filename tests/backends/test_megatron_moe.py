"""Mixture of experts on both backends (issue 15, items 3-5): Qwen3-MoE and Mixtral.

Models are built from their HF configs with a fixed seed (reduced width and depth; the
families' real routing choices: softmax router, top-2 of 4 experts, renormalised top-k or not,
Qwen3-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``) and loaded back through the normal
loading path, from the per-expert files transformers 5 writes and from the fused in-memory
layout.

Checks, against independent references:
* megatron log-probs == a per-sequence HF forward (packed and padded), within 1e-5 (the
  project's HF tolerance; the issue asks 1e-4; measured ~2e-6: experts' outputs are summed in
  another order);
* export == HF's ``state_dict`` (names and bits) before training; after a step at EP=2 the
  exported weights load into the HF model and give the engine's log-probs;
* one train step megatron == fsdp (loss, grad norm, updated weights; relative 1e-5) at EP=1,
  EP=2 (2 ranks) and EP=2 x expert-TP=2 (4 ranks, slow); resume bit-exact at EP=2 with the
  distributed optimizer;
* the router load-balancing loss: one micro-batch == HF's own ``aux_loss`` (the model's
  output) times the coefficient, gradient included; the same step from copies of the batch
  in 2 micro-batches or on 2 DP ranks (its invariance: ``engine_api.moe``); megatron == fsdp
  with it on;
* the per-expert load of a call == the top-k counts of HF's own ``router_logits``.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_api import build_engine, load_config, make_batch
from engine_api.conformance import fixtures
from tests.backends.moe_utils import build_moe_models, hf_aux_step, hf_router_counts
from tests.support import megatron_workers as W
from tests.support.hf_utils import (
    assert_same,
    engine_for,
    full_params,
    hf_log_probs,
    hf_log_probs_of,
    make_test_batch,
    max_abs_diff,
    one_step,
)
from tests.support.launch import run_distributed

TOL = 1e-5
FAMILIES = ("qwen3_moe", "qwen3_moe_mixed", "mixtral")
EP2 = ["megatron.expert_model_parallel_size=2"]
EP2_ETP2 = ["megatron.expert_model_parallel_size=2", "megatron.expert_tensor_parallel_size=2"]
DISTOPT = ["megatron.use_distributed_optimizer=true"]
ONE_MB = ["micro_batch_size=64"]  # the whole (local) batch in one micro-batch


def duplicated_batch():
    """Two copies of the test batch (the second copy after the first)."""
    b = make_test_batch()
    fields = {k: list(b[k].unbind()) * 2 for k in ("loss_mask", "advantages")}
    return make_batch(list(b["input_ids"].unbind()) * 2, **fields)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_moe_models(tmp_path_factory.mktemp("moe"))


# ----------------------------------------------------------------------------- rank workers
def _single(rank, world, models):
    from backends.megatron import cpu_compat

    out = {}
    for name in (*FAMILIES, "qwen3_moe_fused"):
        for packed in (True, False):
            out[("lp", name, packed)] = W.infer(models[name], f"use_remove_padding={packed}", "micro_batch_size=2")["log_probs"]
            W.reset_parallel_state()
        out[("export", name)] = full_params(engine_for(models[name], strategy="megatron"))
        W.reset_parallel_state()
    for name in ("qwen3_moe", "mixtral", "qwen3_moe_mixed", "mixtral_aux"):
        out[("step", name)] = W.one_step(models[name], "token-mean", [])
        W.reset_parallel_state()
    engine = engine_for(models["qwen3_moe"], strategy="megatron")
    with engine.train_mode():
        ctx = engine.forward_backward_step(engine.shard_data(make_test_batch()))[2]
    out["ctx"] = {"metrics": ctx["metrics"], "counts": ctx["moe_expert_tokens"]}
    out["sites"] = dict(cpu_compat.SITES)
    return out


def _fsdp(rank, world, models, names, extra, batch_fn):
    return {name: one_step(models[name], "token-mean", extra, batch_fn=batch_fn) for name in names}


def _fsdp_ctx(rank, world, model_dir):
    engine = engine_for(model_dir)
    with engine.train_mode():
        ctx = engine.forward_backward_step(engine.shard_data(make_test_batch()))[2]
    return {"metrics": ctx["metrics"], "counts": ctx["moe_expert_tokens"]}


def _ep2(rank, world, models, ckpt_dir):
    out = {}
    for name in ("qwen3_moe", "mixtral"):
        out[("step", name)] = W.one_step(models[name], "token-mean", EP2)
        W.reset_parallel_state()
    # After a step at EP=2: the exported weights and the engine's own log-probs.
    engine = engine_for(models["qwen3_moe"], "micro_batch_size=2", *EP2, strategy="megatron")
    local = engine.shard_data(make_test_batch())
    with engine.train_mode():
        engine.forward_backward_step(local)
        engine.optimizer_step()
    with engine.eval_mode():
        out["trained_lp"] = engine.unshard_data(engine.infer_batch(local))["log_probs"]
    out["trained_export"] = full_params(engine)
    W.reset_parallel_state()
    out["resume"] = _resume(models["qwen3_moe"], ckpt_dir, [*EP2, *DISTOPT, "micro_batch_size=2"])
    return out


def _resume(model_dir, ckpt_dir, extra):
    """Two steps straight, vs one step, save, a fresh engine, load, one step."""

    def step(engine):
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward_step(engine.shard_data(make_test_batch(seed=engine.global_step)))
            engine.optimizer_step()

    straight = engine_for(model_dir, *extra, strategy="megatron")
    step(straight)
    straight.save_checkpoint(ckpt_dir, global_step=1)
    step(straight)
    want = full_params(straight)
    W.reset_parallel_state()
    resumed = engine_for(model_dir, *extra, strategy="megatron")
    resumed.load_checkpoint(ckpt_dir)
    step(resumed)
    got = full_params(resumed)
    W.reset_parallel_state()
    return {
        "bit_exact": set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want),
        "moved": max(float((want[k] - v).abs().max()) for k, v in full_params_of_dir(model_dir).items()),
    }


def full_params_of_dir(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def _ep2_etp2(rank, world, models):
    return {"step": W.one_step(models["qwen3_moe"], "token-mean", EP2_ETP2, batch_fn=fixtures.make_test_batch)}


@pytest.fixture(scope="module")
def single(models):
    return run_distributed(_single, 1, models, timeout=900)[0]


@pytest.fixture(scope="module")
def fsdp_steps(models):
    names = ("qwen3_moe", "mixtral", "qwen3_moe_mixed", "mixtral_aux")
    return run_distributed(_fsdp, 1, models, names, [], make_test_batch, timeout=600)[0]


@pytest.fixture(scope="module")
def ep2(models, tmp_path_factory):
    return run_distributed(_ep2, 2, models, str(tmp_path_factory.mktemp("ep2_ckpt")), timeout=900)[0]


# ----------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_moe_fused"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_log_probs_match_hf(single, models, name, packed):
    reference = models["qwen3_moe" if name == "qwen3_moe_fused" else name]
    assert max_abs_diff(single[("lp", name, packed)], hf_log_probs(reference, make_test_batch())) <= TOL


def test_the_routing_choices_matter(models):
    """Control: renormalising the top-k weights or not, and which layers are MoE, change HF's
    log-probs far beyond the tolerance (a converter that ignored them could not pass)."""
    batch = make_test_batch()
    base = AutoModelForCausalLM.from_pretrained(models["qwen3_moe_mixed"], dtype=torch.float32).eval()
    flipped = AutoModelForCausalLM.from_pretrained(models["qwen3_moe_mixed"], dtype=torch.float32, norm_topk_prob=True).eval()
    lp = torch.nested.as_nested_tensor(hf_log_probs_of(base, batch), layout=torch.jagged)
    assert max_abs_diff(lp, hf_log_probs_of(flipped, batch)) > 100 * TOL
    moe = [i for i, layer in enumerate(base.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe == [1]


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_moe_fused"])
def test_export_round_trips_bit_exact_in_hf_layout(single, models, name):
    """HF -> megatron -> export_weights: HF's own state_dict (fused expert tensors), bit-equal."""
    want = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).state_dict()
    got = single[("export", name)]
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_expert_load_metrics_are_hf_router_top_k_counts(single, models):
    counts = torch.tensor(single["ctx"]["counts"], dtype=torch.float64)
    want = hf_router_counts(models["qwen3_moe"], make_test_batch())
    assert torch.equal(counts, want)
    metrics = single["ctx"]["metrics"]
    per_layer = want[want.sum(1) > 0]
    assert metrics["moe/expert_load_max"] == [float(per_layer.max())]
    assert math.isclose(metrics["moe/expert_load_imbalance"][0], float((per_layer.max(1).values / per_layer.mean(1)).max()))
    assert "moe/aux_loss" not in metrics  # the loss is off for this model


def test_fsdp_reports_the_same_expert_load(single, models):
    got = run_distributed(_fsdp_ctx, 1, models["qwen3_moe"], timeout=300)[0]
    assert got["counts"] == single["ctx"]["counts"]


# ----------------------------------------------------------------------------- train step parity
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen3_moe_mixed", "mixtral_aux"])
def test_ep1_step_matches_fsdp(single, fsdp_steps, name):
    assert_same(single[("step", name)], fsdp_steps[name], f"{name}, megatron EP=1 vs fsdp", rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_ep2_step_matches_fsdp(ep2, fsdp_steps, name):
    assert_same(ep2[("step", name)], fsdp_steps[name], f"{name}, megatron EP=2 vs fsdp", rtol=1e-5)


def test_ep2_export_after_a_step_loads_into_hf_and_gives_the_engines_log_probs(ep2, models):
    model = AutoModelForCausalLM.from_pretrained(models["qwen3_moe"], dtype=torch.float32).eval()
    model.load_state_dict(ep2["trained_export"], strict=True)
    assert max_abs_diff(ep2["trained_lp"], hf_log_probs_of(model, make_test_batch())) <= TOL


def test_ep2_resume_with_the_distributed_optimizer_is_bit_exact(ep2):
    assert ep2["resume"]["bit_exact"]
    assert ep2["resume"]["moved"] > 0


@pytest.mark.slow
def test_ep2_x_expert_tp2_on_four_processes_matches_fsdp(models):
    """EP=2 x expert-TP=2 (DP=4 for the dense part). megatron-core 0.16 refuses MoE training with
    attention TP > 1 unless sequence parallelism is on, which the local spec cannot do: EP x TP
    training needs the TE spec (GPU)."""
    got = run_distributed(_ep2_etp2, 4, models, timeout=900)[0]
    want = one_step(models["qwen3_moe"], "token-mean", batch_fn=fixtures.make_test_batch)
    assert_same(got["step"], want, "qwen3_moe, megatron EP=2 x expert-TP=2 vs fsdp", rtol=1e-5)


# ----------------------------------------------------------------------------- load-balancing loss
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("name", ["qwen3_moe_aux", "mixtral_aux"])
def test_one_micro_batch_equals_hf_loss_plus_coef_times_its_aux_loss(models, name, packed):
    want = hf_aux_step(models[name])
    got = run_distributed(_fsdp, 1, models, [name], [*ONE_MB, f"use_remove_padding={packed}"], make_test_batch, timeout=300)[0][name]
    assert_same(got, want, f"{name} fsdp vs HF loss + coef x aux_loss", rtol=1e-6)
    off = run_distributed(_fsdp, 1, models, [name.removesuffix("_aux")], ONE_MB, make_test_batch, timeout=300)[0]
    assert abs(off[name.removesuffix("_aux")]["grad_norm"] - want["grad_norm"]) > 1e-4 * want["grad_norm"]  # the term matters


def test_the_loss_does_not_grow_with_micro_batches_or_dp_ranks(models):
    """Two copies of the batch (2 micro-batches, or one copy per DP rank) give the step of one
    copy: each micro-batch's HF loss is weighted by its share of the call's tokens."""
    one = run_distributed(_fsdp, 1, models, ["qwen3_moe_aux"], ["micro_batch_size=6"], make_test_batch, timeout=300)[0]["qwen3_moe_aux"]
    two_mbs = run_distributed(_fsdp, 1, models, ["qwen3_moe_aux"], ["micro_batch_size=6"], duplicated_batch, timeout=300)[0]
    two_ranks = run_distributed(_fsdp, 2, models, ["qwen3_moe_aux"], ["micro_batch_size=6"], duplicated_batch, timeout=300)[0]
    assert_same(two_mbs["qwen3_moe_aux"], one, "2 micro-batches of copies vs 1", rtol=1e-6)
    assert_same(two_ranks["qwen3_moe_aux"], one, "2 DP ranks of copies vs 1", rtol=1e-6)


def test_the_aux_metric_is_hf_aux_times_coef(models):
    engine_ctx = run_distributed(_fsdp_ctx_one_mb, 1, models["qwen3_moe_aux"], timeout=300)[0]
    assert math.isclose(engine_ctx["metrics"]["moe/aux_loss"][0], hf_aux_step(models["qwen3_moe_aux"])["aux"], rel_tol=1e-6)


def _fsdp_ctx_one_mb(rank, world, model_dir):
    engine = engine_for(model_dir, *ONE_MB)
    with engine.train_mode():
        ctx = engine.forward_backward_step(engine.shard_data(make_test_batch()))[2]
    return {"metrics": ctx["metrics"]}


# ----------------------------------------------------------------------------- refusals and the compat layer
def test_expert_layouts_the_model_cannot_take_are_refused_at_build_engine(models, tmp_path):
    def problems(path, *overrides):
        with pytest.raises(ValueError) as info:
            build_engine(load_config(None, ["strategy=megatron", f"model.path={path}", "world_size=12", *overrides]))
        return str(info.value)

    assert "does not divide the model's 4 experts" in problems(models["qwen3_moe"], "megatron.expert_model_parallel_size=3")
    assert "does not divide the model's expert width" in problems(models["qwen3_moe"], "megatron.expert_tensor_parallel_size=3")
    message = problems(models["qwen3_moe_aux"], "megatron.pipeline_model_parallel_size=2")
    assert "load-balancing loss" in message and "output_router_logits: false" in message
    assert "load-balancing loss" in problems(models["qwen3_moe_aux"], "model.gradient_checkpointing=true")
    from engine_api.conformance.fixtures import build_model

    assert "the model has no experts" in problems(build_model(str(tmp_path / "dense")), "megatron.expert_model_parallel_size=2")


def test_mixtral_router_jitter_is_refused(models, tmp_path):
    from transformers import MixtralConfig

    from engine_api.conformance.fixtures import save_model
    from tests.backends.moe_utils import BASE

    path = save_model(
        MixtralConfig(**{**BASE, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1),
        tmp_path / "jitter",
    )
    with pytest.raises(ValueError, match=r"router_jitter_noise = 0.1.*fix:"):
        build_engine(load_config(None, ["strategy=megatron", f"model.path={path}"]))


def test_top1_renormalised_routing_is_refused_at_build_engine(tmp_path):
    """Top-1 routing with the selected probability renormalised (every weight exactly 1.0):
    megatron-core cannot express it and crashed in init_model with its own message about
    --moe-router-pre-softmax; refused at build_engine naming the key (issue 53, item 7). Top-1
    without renormalisation (Qwen3-MoE norm_topk_prob=false: the weight is the probability,
    megatron's pre-softmax routing) still builds."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from engine_api.conformance.fixtures import save_model
    from tests.backends.moe_utils import BASE, QWEN3_MOE

    refused = {
        "mixtral": MixtralConfig(**{**BASE, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=1),
        "qwen3_moe": Qwen3MoeConfig(**BASE, **{**QWEN3_MOE, "num_experts_per_tok": 1}, norm_topk_prob=True),
    }
    for name, config in refused.items():
        path = save_model(config, tmp_path / name)
        with pytest.raises(ValueError, match=r"num_experts_per_tok = 1: top-1 routing .* renormalised.*fix: use strategy=fsdp"):
            build_engine(load_config(None, ["strategy=megatron", f"model.path={path}"]))
    plain = save_model(Qwen3MoeConfig(**BASE, **{**QWEN3_MOE, "num_experts_per_tok": 1}, norm_topk_prob=False), tmp_path / "plain")
    build_engine(load_config(None, ["strategy=megatron", f"model.path={plain}"]))


MOE_CUDA_SITES = {
    ("token_dispatcher.py", "__init__"),  # the dispatcher's device-to-host side stream
    ("token_dispatcher.py", "_maybe_dtoh_and_synchronize"),  # ... and its use
    ("cpu_compat.py", "record_event"),  # the stand-in stream's event (recorded inside the stand-in)
    ("router.py", "gating"),  # the router weight's .to(current_device())
}


def test_compat_layer_sees_only_known_cuda_call_sites(single):
    from tests.support.megatron_workers import KNOWN_CUDA_SITES

    unknown = sorted(set(single["sites"]) - KNOWN_CUDA_SITES - MOE_CUDA_SITES)
    assert not unknown, f"megatron-core hard-codes CUDA at new places on the MoE path: {unknown}"
