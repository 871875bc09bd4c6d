"""MoE routing replay and recording on both backends (issue 32; ``engine_api.moe``, "Routing
replay"): tiny Qwen3-MoE and Mixtral models (``tests.backends.moe_utils``), loaded through the
normal path.

Checks, against independent references:

* the recorded routing (``return_routing``) is the top-k of HF's own ``router_logits`` for
  every token and MoE layer (Qwen3-MoE with a dense layer too: columns are MoE layers only);
* replaying a routing that is *not* the router's own (every expert shifted by one) gives HF's
  log-probs with the router forced to that routing (a forward hook in this file, HF's weight
  formula: softmax probabilities at the forced experts, renormalised when the family does):
  the replayed experts are used, with the current router's weights;
* replaying the recorded routing reproduces the recording forward's log-probs (float noise),
  on another layout (packed <-> padded, other micro-batches) in a training call, and
  ``moe/router_disagreement`` is exactly 0 there; fsdp and megatron, EP=1 and EP=2, PP=2, 1
  and 2 DP ranks;
* without replay, after one optimizer step the router's own routing differs from the
  recording (``moe/router_disagreement`` > 0), while replay keeps it at 0 and reports the
  drift as ``moe/router_replay_override``;
* a routing with the wrong layer count, top-k, dtype or experts, and a replay request without a
  routing or on a dense model, are refused naming the field, before any gradient exists.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine_api import make_batch
from engine_api.moe import routing_disagreement
from tests.backends.moe_utils import build_moe_models
from tests.support import megatron_workers as W
from tests.support.hf_utils import engine_for, make_test_batch, max_abs_diff
from tests.support.launch import run_distributed

FLOAT_NOISE = 1e-5  # the project's HF tolerance (experts' outputs summed in another order)
EP2 = ("megatron.expert_model_parallel_size=2",)
PP2 = ("megatron.pipeline_model_parallel_size=2",)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_moe_models(tmp_path_factory.mktemp("replay_moe"))


def with_field(batch, name, values):
    batch.set(name, torch.nested.nested_tensor_from_jagged(values, batch["input_ids"].offsets()))
    return batch


def shifted(routing: torch.Tensor, experts: int) -> torch.Tensor:
    """Every expert index moved by one (mod E): a valid top-k routing, never the router's own."""
    return torch.where(routing >= 0, (routing + 1) % experts, routing)


# ----------------------------------------------------------------------------- independent references
def hf_routing(model_dir: str, batch) -> list[torch.Tensor]:
    """Per sequence ``[T, L_moe, k]``: the top-k of HF's own ``router_logits``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for ids in batch["input_ids"].unbind():
            logits = model(ids[None], output_router_logits=True).router_logits
            out.append(torch.stack([lg.topk(k, -1).indices for lg in logits], 1))
    return out


def hf_forced_log_probs(model_dir: str, batch, routing: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """HF's per-sequence log-probs with every MoE router forced to ``routing`` (per sequence
    ``[T, L_moe, k]``): the weights are HF's own formula at the forced experts (softmax of the
    logits, renormalised over the top-k when the family does); and the routers' own top-k in
    that forward (``[tokens, L_moe, k]``: past the first MoE layer the hidden states, so the
    router's own choice, follow the forced experts)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    renorm = cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    current: dict = {}
    own: list[list[torch.Tensor]] = []

    def force(column):
        def hook(module, args, out):
            logits = out[0]
            own[-1].append(logits.topk(cfg.num_experts_per_tok, -1).indices)
            idx = current["routing"][:, column]
            weights = torch.softmax(logits.float(), -1).gather(1, idx)
            if renorm:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(out[1].dtype), idx

        return hook

    handles = [router.register_forward_hook(force(j)) for j, router in enumerate(routers)]
    out = []
    try:
        with torch.no_grad():
            for ids, r in zip(batch["input_ids"].unbind(), routing, strict=True):
                current["routing"] = r
                own.append([])
                logits = model(ids[None]).logits[0]
                out.append(torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)]))
    finally:
        for h in handles:
            h.remove()
    return out, torch.cat([torch.stack(layers, 1) for layers in own])


# ----------------------------------------------------------------------------- rank workers
def _replay(rank, world, model_dir, strategy, record_layout, replay_layout, extra):
    """Record with one layout, replay with another, on this rank's shard; everything gathered."""
    out = {}
    engine = engine_for(model_dir, *record_layout, *extra, strategy=strategy)
    batch = make_test_batch()
    local = engine.shard_data(batch)
    local.set_non_tensor("return_routing", True)
    with engine.eval_mode():
        recorded = engine.unshard_data(engine.infer_batch(local))
    out["log_probs"] = recorded["log_probs"]
    out["routing"] = recorded["routed_experts"]
    hf_config = AutoConfig.from_pretrained(model_dir)
    n_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
    if strategy == "megatron":
        W.reset_parallel_state()
    # Another layout, a training call: replay the recording, then a shifted routing.
    engine = engine_for(model_dir, *replay_layout, *extra, strategy=strategy)
    for name, values in (
        ("same", recorded["routed_experts"].values()),
        ("shifted", shifted(recorded["routed_experts"].values(), n_experts)),
    ):
        b = with_field(make_test_batch(), "routed_experts", values)
        b.set_non_tensor("replay_routing", True)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            predictions, _, ctx = engine.forward_backward_step(engine.shard_data(b))
        out[name] = {"log_probs": engine.unshard_data(predictions)["log_probs"], "metrics": ctx["metrics"]}
    return out


def _drift(rank, world, model_dir, strategy, extra):
    """One optimizer step (large LR) on a batch, then a training call on the recorded batch
    without replay and with it: the disagreement each reports."""
    engine = engine_for(model_dir, "optim.lr=0.5", *extra, strategy=strategy)
    batch = make_test_batch()
    local = engine.shard_data(batch)
    local.set_non_tensor("return_routing", True)
    with engine.eval_mode():
        recorded = engine.unshard_data(engine.infer_batch(local))["routed_experts"].values()
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_step(engine.shard_data(make_test_batch(seed=1)))
        engine.optimizer_step()
    out = {}
    for replay in (False, True):
        b = with_field(make_test_batch(), "routed_experts", recorded)
        b.set_non_tensor("replay_routing", replay)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            out[replay] = engine.forward_backward_step(engine.shard_data(b))[2]["metrics"]
    return out


def _refusals(rank, world, model_dir, dense_dir, strategy):
    engine = engine_for(model_dir, strategy=strategy)
    b0 = make_test_batch()
    tokens = int(b0["input_ids"].offsets()[-1])
    cases = {
        "layers": torch.zeros(tokens, 3, 2, dtype=torch.long),
        "top_k": torch.zeros(tokens, 2, 1, dtype=torch.long),
        "dtype": torch.zeros(tokens, 2, 2),
        "expert": torch.full((tokens, 2, 2), 7, dtype=torch.long),
        "twice": torch.zeros(tokens, 2, 2, dtype=torch.long),
    }
    errors = {}
    with engine.train_mode():
        for name, values in cases.items():
            b = with_field(make_test_batch(), "routed_experts", values)
            b.set_non_tensor("replay_routing", True)
            try:
                engine.forward_backward_step(engine.shard_data(b))
                errors[name] = None
            except ValueError as exc:
                errors[name] = str(exc)
        b = make_test_batch()
        b.set_non_tensor("replay_routing", True)
        try:
            engine.forward_backward_step(engine.shard_data(b))
            errors["missing"] = None
        except ValueError as exc:
            errors["missing"] = str(exc)
        grads = [p.grad for module in engine._modules() for p in module.parameters() if p.grad is not None]
    if strategy == "megatron":
        W.reset_parallel_state()
    dense = engine_for(dense_dir, strategy=strategy)
    b = make_test_batch()
    b.set_non_tensor("return_routing", True)
    try:
        with dense.eval_mode():
            dense.infer_batch(dense.shard_data(b))
        errors["dense"] = None
    except ValueError as exc:
        errors["dense"] = str(exc)
    return {"errors": errors, "grads": len(grads)}


# ----------------------------------------------------------------------------- tests
PACKED, PADDED = ("use_remove_padding=true",), ("use_remove_padding=false",)
SETUPS = {
    # (strategy, ranks, record layout, replay layout, extra)
    "fsdp-packed": ("fsdp", 1, PADDED + ("micro_batch_size=2",), PACKED + ("max_token_len_per_micro_batch=24",), ()),
    "fsdp-padded": ("fsdp", 1, PACKED + ("micro_batch_size=4",), PADDED + ("micro_batch_size=1",), ()),
    # recorded under dynamic batching: the routing comes back through its order restore
    "fsdp-dp2": ("fsdp", 2, PACKED + ("max_token_len_per_micro_batch=24",), PADDED + ("micro_batch_size=1",), ()),
    "megatron-packed": ("megatron", 1, PADDED + ("micro_batch_size=2",), PACKED + ("max_token_len_per_micro_batch=24",), ()),
    "megatron-padded": ("megatron", 1, PACKED + ("micro_batch_size=4",), PADDED + ("micro_batch_size=1",), ()),
    "megatron-ep2-dp2": ("megatron", 2, PACKED + ("max_token_len_per_micro_batch=24",), PADDED + ("micro_batch_size=2",), EP2),
    # each pipeline stage records and replays its own MoE layer; the recordings are joined
    "megatron-pp2": ("megatron", 2, PADDED + ("micro_batch_size=2",), PACKED + ("micro_batch_size=2",), PP2),
}


@pytest.fixture(scope="module")
def replays(models):
    out = {}
    for name, (strategy, ranks, rec, rep, extra) in SETUPS.items():
        family = "mixtral" if name == "fsdp-padded" else "qwen3_moe_mixed" if name == "megatron-padded" else "qwen3_moe"
        out[name] = (family, run_distributed(_replay, ranks, models[family], strategy, rec, rep, extra, timeout=600)[0])
    return out


@pytest.mark.parametrize("setup", list(SETUPS))
def test_recorded_routing_is_hf_router_top_k(replays, models, setup):
    family, got = replays[setup]
    want = hf_routing(models[family], make_test_batch())
    for g, w in zip(got["routing"].unbind(), want, strict=True):
        assert g.shape == w.shape
        assert torch.equal(g.sort(-1).values, w.sort(-1).values)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_replay_reproduces_the_recording_forward(replays, setup):
    """The update's forward, in another layout, on the recorded routing: the recording
    forward's log-probs at float noise, and every replayed choice used."""
    _, got = replays[setup]
    assert max_abs_diff(got["same"]["log_probs"], list(got["log_probs"].unbind())) <= FLOAT_NOISE
    assert got["same"]["metrics"]["moe/router_disagreement"] == [0.0]
    assert got["same"]["metrics"]["moe/router_replay_override"] == [0.0]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_replayed_experts_are_used_with_the_current_router_weights(replays, models, setup):
    """A routing that is never the router's own: HF's forward forced to it, and the override
    metric equal to an independent count of the changed choices (all of them)."""
    family, got = replays[setup]
    batch = make_test_batch()
    forced = [shifted(r, 4) for r in got["routing"].unbind()]
    want, own = hf_forced_log_probs(models[family], batch, forced)
    assert max_abs_diff(got["shifted"]["log_probs"], want) <= FLOAT_NOISE
    # control: the forced routing moves the log-probs far beyond the tolerance
    assert max_abs_diff(got["log_probs"], want) > 100 * FLOAT_NOISE
    assert got["shifted"]["metrics"]["moe/router_disagreement"] == [0.0]
    override = routing_disagreement(torch.cat(forced), own)
    assert got["shifted"]["metrics"]["moe/router_replay_override"] == [pytest.approx(override)]
    assert override > 0.5


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_without_replay_routing_drifts_after_a_step(models, strategy):
    # One MoE layer: its input does not depend on the routing, so the router's own choice is
    # the same with and without replay and the two metrics must agree exactly.
    got = run_distributed(_drift, 1, models["qwen3_moe_mixed"], strategy, (), timeout=600)[0]
    assert got[False]["moe/router_disagreement"][0] > 0.05
    assert "moe/router_replay_override" not in got[False]
    assert got[True]["moe/router_disagreement"] == [0.0]
    assert got[True]["moe/router_replay_override"][0] == pytest.approx(got[False]["moe/router_disagreement"][0])


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_bad_routing_is_refused_naming_the_field(models, tmp_path, strategy):
    from transformers import Qwen3Config

    from engine_api.conformance.fixtures import TINY_DIMS, save_model

    dense = save_model(Qwen3Config(**TINY_DIMS, head_dim=8), tmp_path / "dense")
    got = run_distributed(_refusals, 1, models["qwen3_moe"], dense, strategy, timeout=600)[0]
    errors = got["errors"]
    assert "per-token shape (3, 2)" in errors["layers"] and "routed_experts" in errors["layers"]
    assert "per-token shape (2, 1)" in errors["top_k"]
    assert "dtype torch.float32" in errors["dtype"]
    assert "holds 7" in errors["expert"]
    assert "twice" in errors["twice"]
    assert "no 'routed_experts' field" in errors["missing"]
    assert "no MoE layers" in errors["dense"]
    assert got["grads"] == 0  # refused before any backward


def test_make_batch_carries_routing_through_sharding_and_micro_batches():
    """The field is an ordinary per-token field: split, reordered and restored with its rows."""
    from engine_api.batch import cat_rows, restore_order, take_rows

    seqs = [torch.arange(n) for n in (3, 5, 2, 4)]
    routing = [torch.arange(n * 4).reshape(n, 2, 2) for n in (3, 5, 2, 4)]
    b = make_batch(seqs, routed_experts=routing)
    order = torch.tensor([2, 0, 3, 1])
    back = restore_order(cat_rows([take_rows(b, order[:2]), take_rows(b, order[2:])]), order)
    for got, want in zip(back["routed_experts"].unbind(), routing, strict=True):
        assert torch.equal(got, want)


def _recomputed(rank, world, model_dir, strategy):
    """One step on a shifted routing, with and without activation recomputation."""
    out = {}
    for checkpointing in (False, True):
        engine = engine_for(model_dir, f"model.gradient_checkpointing={str(checkpointing).lower()}", strategy=strategy)
        batch = make_test_batch()
        local = engine.shard_data(batch)
        local.set_non_tensor("return_routing", True)
        with engine.eval_mode():
            routing = engine.unshard_data(engine.infer_batch(local))["routed_experts"].values()
        b = with_field(make_test_batch(), "routed_experts", shifted(routing, 4))
        b.set_non_tensor("replay_routing", True)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward_step(engine.shard_data(b))
            out[checkpointing] = engine.optimizer_step()
        if strategy == "megatron":
            W.reset_parallel_state()
    return out


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_activation_recomputation_replays_what_its_forward_routed_by(models, strategy):
    """The recomputed forward in backward must route as the forward did (the replayed experts,
    not the router's own): the gradient equals the one without recomputation."""
    got = run_distributed(_recomputed, 1, models["qwen3_moe"], strategy, timeout=600)[0]
    assert got[True] == pytest.approx(got[False], rel=1e-6)


# More HF MoE families on FSDP: the router's output triple in another order (GraniteMoE), a
# router inside a block with a shared expert (Qwen2-MoE), top-k softmax without renormalisation
# (OLMoE), softmax over the top-k logits (GPT-OSS), sigmoid scores renormalised and scaled
# (DeepSeek-V3; one group and a zero bias, so the choice is the logits' top-k), and a router
# whose weights no supported form reproduces (PhiMoE's sparsemixer: refused).
FAMILIES = {
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=16),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, head_dim=8),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_shared_experts=1,
        num_key_value_heads=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16),
}


def _family(rank, world, model_dir):
    engine = engine_for(model_dir)
    b = make_test_batch()
    b.set_non_tensor("return_routing", True)
    with engine.eval_mode():
        recorded = engine.infer_batch(engine.shard_data(b))
    out = {"log_probs": recorded["log_probs"], "routing": recorded["routed_experts"]}
    for name, values in (("same", recorded["routed_experts"].values()), ("shifted", shifted(recorded["routed_experts"].values(), 4))):
        b = with_field(make_test_batch(), "routed_experts", values)
        b.set_non_tensor("replay_routing", True)
        try:
            with engine.train_mode():
                engine.optimizer_zero_grad()
                predictions, _, ctx = engine.forward_backward_step(engine.shard_data(b))
            out[name] = {"log_probs": predictions["log_probs"], "metrics": ctx["metrics"]}
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_hf_families_record_and_replay(tmp_path, family):
    from engine_api.conformance.fixtures import TINY_DIMS, save_model

    config = AutoConfig.for_model(family, **{**TINY_DIMS, "initializer_range": 0.3, **FAMILIES[family]})
    model_dir = save_model(config, tmp_path / family)
    got = run_distributed(_family, 1, model_dir, timeout=600)[0]
    want = hf_routing(model_dir, make_test_batch())
    for g, w in zip(got["routing"].unbind(), want, strict=True):
        assert torch.equal(g.sort(-1).values, w.sort(-1).values)
    if family == "phimoe":
        assert "weighs its experts by no form this replay reproduces" in got["same"]
        return
    assert max_abs_diff(got["same"]["log_probs"], list(got["log_probs"].unbind())) <= FLOAT_NOISE
    assert got["same"]["metrics"]["moe/router_disagreement"] == [0.0]
    assert got["shifted"]["metrics"]["moe/router_disagreement"] == [0.0]
    # the replayed experts are used: the log-probs move far beyond the tolerance
    assert max_abs_diff(got["shifted"]["log_probs"], list(got["log_probs"].unbind())) > 100 * FLOAT_NOISE
