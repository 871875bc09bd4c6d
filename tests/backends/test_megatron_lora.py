"""LoRA on the megatron backend (``backends/megatron/lora.py``), beyond the conformance kit's ``lora``
check (which runs on every megatron layout of tests/conformance: two steps equal peft + torch
AdamW, adapters off equal HF, on equal peft, merged export equals peft's merge): only the adapters
train, the checkpoint holds the adapters alone and resumes bit-exactly, another LoRA setting's
checkpoint is refused by name, and what the backend does not adapt is refused at build time with
the field and the fix.

fp32, CPU, one process (the multi-rank layouts are the kit's).
"""

from __future__ import annotations

import pytest
import torch

from backends.megatron.engine import MegatronEngine
from engine_api import build_engine, load_config
from tests.support.hf_utils import EPS, engine_for, make_model, make_test_batch
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


def _checkpoint_worker(rank, world, model_dir, root) -> dict:
    """Three steps in one engine; one step, a save, and a resume for the other two; the loads
    another LoRA setting refuses. Runs in a spawned process (megatron's CPU compat layer)."""
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
    return out


def test_only_adapters_train_and_the_checkpoint_holds_them_alone_and_resumes_bit_exactly(model_dir, tmp_path):
    out = run_distributed(_checkpoint_worker, 1, model_dir, str(tmp_path))[0]
    full_losses, full_final = out["full"]
    assert out["trained_numel"] == sum(v.numel() for v in full_final.values())  # the adapters only
    assert out["state_numel"] == 2 * out["trained_numel"]  # Adam's two moments of the adapters
    assert out["merged_keys_same"] and out["merged_moved"]  # merged export: HF's names, the adapters in it

    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "global_step_1")).read_metadata().state_dict_metadata
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
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        build_engine(load_config(None, ["strategy=megatron", f"model.path={model_dir}", *LORA, "model.lora.target_modules=[nothing]"]))
