"""vLLM on a CUDA device (part of ``pytest -m gpu`` / ``make gpu-check``; skipped on CPU and
where vllm is not installed): sleep frees device memory, wake + a weight sync restores exact
sampling, and the log-probs of a synced engine match the HF forward of the synced weights."""

from __future__ import annotations

import pytest
import torch

from engine_api.rollout import RolloutEngineConfig, SamplingParams
from engine_api.rollout_registry import rollout_installed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not rollout_installed("vllm"), reason="vllm not installed")]


def test_sleep_frees_memory_and_a_synced_engine_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    from engine_api.rollout_registry import build_rollout
    from posttrain.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "m", family="qwen2", vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2)
    engine = build_rollout("vllm", RolloutEngineConfig(model_path=path, dtype="float32", options={"gpu_memory_utilization": 0.2}))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    hf.load_state_dict({k: v + 0.02 * torch.randn_like(v) for k, v in hf.state_dict().items()})
    free_before = torch.cuda.mem_get_info()[0]
    assert engine.release_memory() is True
    assert torch.cuda.mem_get_info()[0] > free_before  # the weights and KV cache left the device
    engine.resume_memory()
    engine.sync_weights(list(hf.state_dict().items()), version=1)
    prompt = torch.tensor([5, 9, 17, 3, 44])
    (sample,) = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.8), [0])[0]
    with torch.no_grad():
        logits = hf(torch.cat([prompt, sample.token_ids])[None]).logits[0].float() / 0.8
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, sample.token_ids[:, None])[:, 0]
    # fp32 on the GPU's attention kernels: agreement to ~1e-5 expected; 1e-3 is the bound.
    assert (ref - sample.log_probs).abs().max() < 1e-3 and sample.weight_version == 1
    engine.shutdown()
