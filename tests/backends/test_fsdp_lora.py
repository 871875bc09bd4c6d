"""LoRA on the FSDP backend (issue 17), against peft itself: the adapters-off forward equals the
base HF model, the adapters-on forward equals peft's own model, an engine step equals a
hand-written peft step (loss, grad norm, adapters) in every aggregation mode with micro-batching
and on 2 DP ranks, the merged export equals peft's ``merge_and_unload``, checkpoints hold the
adapters only and resume bit-exactly, and backends without LoRA refuse it.

fp32, CPU. Tolerances: relative 1e-6 on loss / grad norm / adapters (the engine and the reference
differ only in summation order, measured ~1e-8); log-probs 1e-5 absolute (as for full models).
"""

from __future__ import annotations

import math

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_api import build_engine, load_config
from tests.support.hf_utils import EPS, engine_for, hf_log_probs, hf_log_probs_of, make_model, make_test_batch, max_abs_diff
from tests.support.launch import run_distributed

RANK, ALPHA = 4, 8.0
LORA = [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}"]
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
CONSTANT = 8.0  # C of seq-mean-token-sum-norm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("lora") / "llama", "llama")


def _engine(model_dir, *extra):
    return engine_for(model_dir, *LORA, f"optim.eps={EPS}", f"loss_agg_constant={CONSTANT}", *extra)


def _peft_model(model_dir, adapters):
    """peft's own model on the HF base with the engine's adapters loaded."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0))
    result = peft.set_peft_model_state_dict(model, adapters)
    assert not result.unexpected_keys
    return model


def _loss(model, batch, mode):
    """The aggregation modes by their definitions (engine_api/losses.py's table), one sequence
    at a time, with hf_utils.pg_loss's per-token loss."""
    token_sum, tokens, seq_means, seq_sums = 0.0, 0.0, [], []
    for ids, mask, adv in zip(batch["input_ids"].unbind(), batch["loss_mask"].unbind(), batch["advantages"].unbind(), strict=True):
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        lp = torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)])
        per_tok = (-lp * adv + 0.1 * lp.pow(2)) * mask
        token_sum, tokens = token_sum + per_tok.sum(), tokens + float(mask.sum())
        seq_means.append(per_tok.sum() / mask.sum())
        seq_sums.append(per_tok.sum())
    return {
        "token-mean": token_sum / tokens,
        "seq-mean-token-mean": sum(seq_means) / len(seq_means),
        "seq-mean-token-sum": sum(seq_sums) / len(seq_sums),
        "seq-mean-token-sum-norm": token_sum / (len(seq_sums) * CONSTANT),
    }[mode]


def _peft_steps(model_dir, adapters, mode, batches):
    """The hand-written baseline: peft model, the whole batch at once, clip 1.0, AdamW on the
    adapters (lr 0.01, eps EPS, weight decay 0.01). Returns per-step losses and grad norms and
    the final adapters by peft's names."""
    model = _peft_model(model_dir, adapters)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.999), eps=EPS, weight_decay=0.01)
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad()
        loss = _loss(model, batch, mode)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


def _engine_steps(engine, batches):
    initial = {k: v.clone() for k, v in engine.export_adapter_weights()}
    losses, norms = [], []
    with engine.train_mode():
        for batch in batches:
            m = engine.train_batch(engine.shard_data(batch))
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
    return initial, losses, norms, {k: v.clone() for k, v in engine.export_adapter_weights()}


def _rel(got, want):
    a = torch.cat([got[k].flatten().double() for k in want])
    b = torch.cat([v.flatten().double() for v in want.values()])
    return float((a - b).norm() / b.norm())


def _assert_steps_equal(engine_result, model_dir, mode, batches):
    initial, losses, norms, final = engine_result
    want_losses, want_norms, want_final = _peft_steps(model_dir, initial, mode, batches)
    assert set(final) == set(want_final)
    for got, want in zip(losses + norms, want_losses + want_norms, strict=True):
        assert math.isclose(got, want, rel_tol=1e-6), (mode, losses, want_losses, norms, want_norms)
    assert _rel(final, want_final) <= 1e-6, (mode, _rel(final, want_final))
    assert _rel(final, initial) > 1e-3  # the adapters did move


# Two steps: the first moves lora_B off its zero init, so the second has gradients on A and B.
BATCHES = [make_test_batch(0), make_test_batch(1)]


@pytest.mark.parametrize("mode", MODES)
def test_engine_step_equals_a_hand_written_peft_step(model_dir, mode):
    engine = _engine(model_dir, f"loss_agg_mode={mode}", "micro_batch_size=2")
    _assert_steps_equal(_engine_steps(engine, BATCHES), model_dir, mode, BATCHES)


@pytest.mark.parametrize(
    "layout", [["max_token_len_per_micro_batch=16"], ["use_remove_padding=false", "micro_batch_size=4"], ["micro_batch_size=1"]]
)
def test_lora_step_is_invariant_to_micro_batching_and_packing(model_dir, layout):
    engine = _engine(model_dir, "loss_agg_mode=seq-mean-token-mean", *layout)
    _assert_steps_equal(_engine_steps(engine, BATCHES), model_dir, "seq-mean-token-mean", BATCHES)


def _dp_worker(rank, world, model_dir, mode):
    engine = _engine(model_dir, f"loss_agg_mode={mode}", "micro_batch_size=1")
    return _engine_steps(engine, BATCHES)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_two_dp_ranks_equal_the_hand_written_peft_step(model_dir, mode):
    results = run_distributed(_dp_worker, 2, model_dir, mode, timeout=300)
    for result in results:
        _assert_steps_equal(result, model_dir, mode, BATCHES)


def test_adapters_off_is_the_base_model_and_on_is_peft(model_dir):
    engine = _engine(model_dir, "micro_batch_size=2")
    _engine_steps(engine, BATCHES[:1])  # lora_B is no longer zero: on and off differ
    batch = make_test_batch(2)
    off = make_test_batch(2)
    off.set_non_tensor("disable_adapters", True)
    with engine.eval_mode():
        lp_on, lp_off = engine.infer_batch(batch)["log_probs"], engine.infer_batch(off)["log_probs"]
    assert max_abs_diff(lp_off, hf_log_probs(model_dir, batch)) <= 1e-5
    reference = _peft_model(model_dir, dict(engine.export_adapter_weights())).eval()
    assert max_abs_diff(lp_on, hf_log_probs_of(reference, batch)) <= 1e-5
    assert max_abs_diff(lp_on, hf_log_probs(model_dir, batch)) > 1e-3  # the adapters matter


def test_only_adapters_train_and_the_optimizer_state_is_adapter_sized(model_dir):
    engine = _engine(model_dir)
    before = {k: v.clone() for k, v in engine.export_weights()}
    adapter_numel = sum(v.numel() for _, v in engine.export_adapter_weights())
    _engine_steps(engine, BATCHES[:1])
    state = [v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert sum(v.numel() for v in state) == 2 * adapter_numel  # Adam's two moments, adapters only
    assert sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]) == adapter_numel
    assert adapter_numel < 0.2 * sum(v.numel() for v in before.values())
    # the base stays frozen: with the adapters off the engine still computes the base model
    base_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert set(before) == set(base_model)


def test_merged_export_equals_peft_merge_and_unload(model_dir):
    engine = _engine(model_dir)
    _engine_steps(engine, BATCHES[:1])
    merged = {k: v.clone() for k, v in engine.export_weights()}
    want = _peft_model(model_dir, dict(engine.export_adapter_weights())).merge_and_unload().state_dict()
    assert set(merged) == set(want)
    assert max(float((merged[k] - want[k]).abs().max()) for k in want) <= 1e-6
    # and the merged weights are what a rollout engine loads: HF with them gives the LoRA model's log-probs
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.load_state_dict(merged)
    batch = make_test_batch(3)
    with engine.eval_mode():
        assert max_abs_diff(engine.infer_batch(batch)["log_probs"], hf_log_probs_of(hf.eval(), batch)) <= 1e-5


def test_checkpoint_holds_adapters_only_and_resumes_bit_exactly(model_dir, tmp_path):
    batches = [make_test_batch(i) for i in range(3)]
    full = _engine(model_dir, "optim.lr_schedule=cosine", "optim.total_steps=3", "optim.warmup_steps=1")
    _, full_losses, _, full_final = _engine_steps(full, batches)

    first = _engine(model_dir, "optim.lr_schedule=cosine", "optim.total_steps=3", "optim.warmup_steps=1")
    _engine_steps(first, batches[:1])
    first.save_checkpoint(str(tmp_path), global_step=1)
    ckpt = tmp_path / "global_step_1"
    # what DCP wrote: the adapters and their optimizer state, nothing of the frozen base
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)
    assert len(model_keys) == sum(1 for _ in first.export_adapter_weights())
    assert all(".lora_" in k for k in saved if k.startswith("optimizer.state."))

    resumed = _engine(model_dir, "optim.lr_schedule=cosine", "optim.total_steps=3", "optim.warmup_steps=1")
    assert resumed.load_checkpoint(str(ckpt)) == 1
    _, losses, _, final = _engine_steps(resumed, batches[1:])
    assert losses == full_losses[1:]
    assert all(torch.equal(final[k], full_final[k]) for k in full_final)

    plain = engine_for(model_dir)  # a checkpoint of another LoRA setting is refused by name
    with pytest.raises(ValueError, match=r"model.lora.rank = 4 \(this engine: 'off'\).*fix: build the engine with the checkpoint's LoRA"):
        plain.load_checkpoint(str(ckpt))
    other_alpha = _engine(model_dir, "model.lora.alpha=4")
    with pytest.raises(ValueError, match=r"model.lora.alpha = 8.0 \(this engine: 4.0\)"):
        other_alpha.load_checkpoint(str(ckpt))


def test_disable_adapters_is_refused_in_training_calls(model_dir):
    engine = _engine(model_dir)
    batch = make_test_batch()
    batch.set_non_tensor("disable_adapters", True)
    before = {k: v.clone() for k, v in engine.export_adapter_weights()}
    with engine.train_mode(), pytest.raises(ValueError, match="disable_adapters = True in a training call"):
        engine.train_batch(batch)
    assert all(torch.equal(v, before[k]) for k, v in engine.export_adapter_weights())


def test_a_base_weights_call_leaves_the_adapters_trainable_without_resharding(model_dir):
    """With ``fsdp.reshard_after_forward=false`` the units stay gathered after a forward: the
    adapters-off call must not leave the sharded adapters frozen (the next step equals a run
    without that call)."""
    plain = _engine(model_dir, "fsdp.reshard_after_forward=false")
    want = _engine_steps(plain, BATCHES)
    engine = _engine(model_dir, "fsdp.reshard_after_forward=false")
    off = make_test_batch(5)
    off.set_non_tensor("disable_adapters", True)
    with engine.eval_mode():
        engine.infer_batch(off)
    got = _engine_steps(engine, BATCHES)
    assert got[1] == want[1] and all(torch.equal(got[3][k], want[3][k]) for k in want[3])


def test_adapters_on_a_tied_embedding_are_refused(tmp_path):
    tied = make_model(tmp_path / "qwen2", "qwen2")  # tie_word_embeddings
    with pytest.raises(ValueError, match=r"model.lora.target_modules = .*share the tied input/output embedding.*fix: drop"):
        build_engine(load_config(None, ["strategy=fsdp", f"model.path={tied}", *LORA, "model.lora.target_modules=[q_proj,lm_head]"]))
    with pytest.raises(ValueError, match="a frozen engine trains nothing"):
        load_config(None, [f"model.path={tied}", *LORA, "frozen=true"])


def test_value_head_with_lora_trains_the_new_head_and_the_adapters(model_dir):
    engine = _engine(model_dir, "model.head=value")
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert any(".lora_" in n for n in trainable) and any("score" in n and ".lora_" not in n for n in trainable)
    assert not any("score" in n and ".lora_" in n for n in trainable)  # the head itself gets no adapter


def test_backends_without_lora_refuse_it(model_dir):
    strategy = "tests.reference_engine:ReferenceEngine"  # declares no supports_lora
    with pytest.raises(ValueError, match=rf"model.lora.rank = 4: the '{strategy}' backend does not support LoRA; fix: .*lora.rank=0"):
        build_engine(load_config(None, [f"strategy={strategy}", f"model.path={model_dir}", *LORA]))
    plain = engine_for(model_dir)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        next(plain.export_adapter_weights())


def test_lora_config_is_validated():
    with pytest.raises(ValueError) as err:
        load_config(None, ["model.lora.rank=-1", "model.lora.alpha=0", "model.lora.dropout=1.5", "model.lora.target_modules=[]"])
    msg = str(err.value)
    assert "4 config problem(s)" in msg and "rank = -1" in msg and "alpha = 0" in msg and "dropout = 1.5" in msg and "target_modules" in msg


def test_reference_role_shares_the_lora_actor_engine(model_dir):
    from roles.reference import Reference

    engine = _engine(model_dir)
    _engine_steps(engine, BATCHES[:1])
    reference = Reference(engine)
    batch = make_test_batch(4)
    assert max_abs_diff(reference.compute_log_probs(batch)["log_probs"], hf_log_probs(model_dir, batch)) <= 1e-5
    assert "disable_adapters" not in batch.keys()  # the caller's batch is untouched
    with pytest.raises(ValueError, match="frozen engine or a LoRA engine"):
        Reference(engine_for(model_dir))
