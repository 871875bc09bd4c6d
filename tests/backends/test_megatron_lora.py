"""LoRA on the megatron backend (``backends/megatron/lora.py``), beyond the conformance kit's ``lora``
check (which runs on every megatron layout of tests/conformance on a GQA Llama: two steps equal
peft + torch AdamW, adapters off equal HF, on equal peft, merged export equals peft's merge): only
the adapters train, the checkpoint holds the adapters alone and resumes bit-exactly, another LoRA
setting's checkpoint is refused by name; other families place their adapters as peft does (Qwen2:
q/k/v biases and a tied head that gets no adapter; Phi-3: fused ``qkv_proj`` / ``gate_up_proj``, each
one adapter over megatron's interleaved rows); gradient checkpointing trains the same adapters
(a frozen embedding would otherwise leave the recomputed layers without gradients); and what the
backend does not adapt is refused at build time with the field and the fix.

fp32, CPU, one process (the multi-rank layouts are the kit's).
"""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config

from backends.megatron.engine import MegatronEngine
from engine_api import build_engine, load_config
from engine_api.conformance.fixtures import TINY_DIMS, save_model
from tests.support.hf_utils import EPS, engine_for, hf_log_probs_of, make_model, make_test_batch, max_abs_diff
from tests.support.launch import run_distributed

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
SCHEDULE = ["optim.lr_schedule=cosine", "optim.total_steps=3", "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("mlora") / "llama", "llama")


def _engine(model_dir, *extra):
    return engine_for(model_dir, *LORA, f"optim.eps={EPS}", *SCHEDULE, *extra, strategy="megatron")


def _steps(engine, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = []
    with engine.train_mode():
        for batch in batches:
            losses.append(engine.train_batch(engine.shard_data(batch))["loss"])
    return losses, {k: v.clone() for k, v in engine.export_adapter_weights()}


def _worker(rank, world, model_dir, root, family_dirs) -> dict:
    """Three steps in one engine (and with gradient checkpointing); one step, a save, and a
    resume for the other two; the loads another LoRA setting refuses; per other family two steps,
    then the log-probs with the adapters on, the merged export and the adapters. One spawned
    process (megatron's CPU compat layer stays out of the test process)."""
    batches = [make_test_batch(i) for i in range(3)]
    full = _engine(model_dir)
    base = {k: v.clone() for k, v in full.export_weights()}
    out = {"full": _steps(full, batches)}
    trained = [p for chunk in full.model for p in chunk.module.parameters() if p.requires_grad]
    optimizers = getattr(full.optimizer, "chained_optimizers", [full.optimizer])
    state = [v for opt in optimizers for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"]
    out["trained_numel"], out["state_numel"] = sum(p.numel() for p in trained), sum(v.numel() for v in state)
    merged = dict(full.export_weights())
    out["merged_keys_same"] = set(merged) == set(base)
    out["merged_moved"] = any(not torch.equal(merged[k], base[k]) for k in base)
    first = _engine(model_dir)
    _steps(first, batches[:1])
    first.save_checkpoint(root, global_step=1)
    resumed = _engine(model_dir)
    out["loaded_step"] = resumed.load_checkpoint(f"{root}/global_step_1")
    out["resumed"] = _steps(resumed, batches[1:])
    before = {k: v.clone() for k, v in resumed.export_adapter_weights()}
    out["refusals"] = []
    for engine in (engine_for(model_dir, strategy="megatron"), _engine(model_dir, "model.lora.alpha=4")):
        try:
            engine.load_checkpoint(f"{root}/global_step_1")
            out["refusals"].append(None)
        except ValueError as exc:
            out["refusals"].append(str(exc))
    out["untouched"] = all(torch.equal(v, before[k]) for k, v in resumed.export_adapter_weights())
    out["recomputed"] = _steps(_engine(model_dir, "model.gradient_checkpointing=true"), batches)
    for family, path in family_dirs.items():
        engine = _engine(path)
        _steps(engine, batches[:2])
        with engine.eval_mode():
            logp = engine.infer_batch(make_test_batch(7))["log_probs"]
        out[family] = (logp, dict(engine.export_weights()), dict(engine.export_adapter_weights()))
    return out


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {
        "qwen2": make_model(root / "qwen2", "qwen2"),  # q/k/v biases, a tied head
        "phi3": save_model(Phi3Config(**TINY_DIMS, pad_token_id=None, bos_token_id=1, eos_token_id=2), root / "phi3"),
    }


@pytest.fixture(scope="module")
def results(model_dir, family_dirs, tmp_path_factory) -> tuple[dict, str]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    return run_distributed(_worker, 1, model_dir, root, family_dirs, timeout=300)[0], root


def test_only_adapters_train_and_the_checkpoint_holds_them_alone_and_resumes_bit_exactly(results):
    out, root = results
    full_losses, full_final = out["full"]
    assert out["trained_numel"] == sum(v.numel() for v in full_final.values())  # the adapters only
    assert out["state_numel"] == 2 * out["trained_numel"]  # Adam's two moments of the adapters
    assert out["merged_keys_same"] and out["merged_moved"]  # merged export: HF's names, the adapters in it

    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(f"{root}/global_step_1").read_metadata().state_dict_metadata
    model_keys = [k for k in saved if not k.startswith("optimizer")]
    assert model_keys and all(k.startswith("lora/") for k in model_keys), model_keys[:4]
    assert len(model_keys) == len(full_final)

    losses, final = out["resumed"]
    assert out["loaded_step"] == 1 and losses == full_losses[1:]
    assert final.keys() == full_final.keys() and all(torch.equal(final[k], full_final[k]) for k in full_final)
    off, alpha = out["refusals"]
    assert off and "model.lora.rank = 4 (this engine: 'off')" in off and "fix: build the engine with the checkpoint's LoRA" in off
    assert alpha and "model.lora.alpha = 8.0 (this engine: 4.0)" in alpha
    assert out["untouched"]


def test_other_families_place_adapters_as_peft_and_recompute_trains_the_same(results, family_dirs):
    out, _ = results
    batch = make_test_batch(7)
    for family, path in family_dirs.items():
        logp, merged, adapters = out[family]
        ref = peft.get_peft_model(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        )
        assert not peft.set_peft_model_state_dict(ref, adapters).unexpected_keys, family
        assert max_abs_diff(logp, hf_log_probs_of(ref.eval(), batch)) <= 1e-5, family
        want = ref.merge_and_unload().state_dict()
        assert set(merged) == set(want), family
        assert max(float((merged[k] - want[k]).abs().max()) for k in want) <= 1e-6, family
    (losses, plain), (recomputed_losses, recomputed) = out["full"], out["recomputed"]
    assert recomputed_losses == pytest.approx(losses, rel=1e-6)
    # (without gradients in the recomputed layers only weight decay would move their adapters: far off)
    assert all(torch.allclose(recomputed[k], plain[k], rtol=1e-6, atol=1e-8) for k in plain)


def _problems(model_dir, *settings) -> str:
    return "\n".join(MegatronEngine.check_config(load_config(None, ["strategy=megatron", f"model.path={model_dir}", *LORA, *settings])))


def test_what_megatron_does_not_adapt_is_refused_naming_the_field(model_dir, tmp_path, monkeypatch):
    assert _problems(model_dir) == ""
    assert _problems(model_dir, "model.lora.target_modules=[q_proj,lm_head]") == ""  # llama: an untied head
    assert "model.lora.target_modules = ['embed_tokens']" in _problems(model_dir, "model.lora.target_modules=[embed_tokens]")
    assert "fix: name those projections" in _problems(model_dir, "model.lora.target_modules=[embed_tokens]")
    assert "a LoRA critic" in _problems(model_dir, "model.head=value")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the config's layout check reads the world size (another test may have set 1)
    dropout = _problems(model_dir, "model.lora.dropout=0.1", "megatron.tensor_model_parallel_size=2")
    monkeypatch.delenv("WORLD_SIZE")
    assert "model.lora.dropout = 0.1" in dropout and "fix: use model.lora.dropout=0" in dropout
    tied = make_model(tmp_path / "qwen2", "qwen2")  # tie_word_embeddings
    assert "fix: drop lm_head from target_modules" in _problems(tied, "model.lora.target_modules=[q_proj,lm_head]")
    monkeypatch.setenv("WORLD_SIZE", "2")
    stages = _problems(model_dir, "model.lora.target_modules=[lm_head]", "megatron.pipeline_model_parallel_size=2")
    assert "pipeline rank(s) [0] of 2 would hold no adapter" in stages and "fix: adapt a module of every pipeline stage" in stages
    assert _problems(model_dir, "megatron.pipeline_model_parallel_size=2") == ""
    phi3 = save_model(Phi3Config(**TINY_DIMS, pad_token_id=None, bos_token_id=1, eos_token_id=2), tmp_path / "phi3")
    assert "megatron.tensor_model_parallel_size = 2" in _problems(phi3, "megatron.tensor_model_parallel_size=2")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        build_engine(load_config(None, ["strategy=megatron", f"model.path={model_dir}", *LORA, "model.lora.target_modules=[nothing]"]))
