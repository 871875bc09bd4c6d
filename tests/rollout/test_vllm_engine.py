"""What the in-process vLLM engine must leave alone in the trainer's process: the default
process group (vLLM's shutdown destroys it otherwise), the global RNG streams and the thread
count (vLLM's worker start reseeds them and swaps ``torch.set_num_threads``)."""

from __future__ import annotations

import pytest
import torch

from engine_api.rollout import RolloutEngineConfig, SamplingParams
from engine_api.rollout_registry import build_rollout, rollout_installed
from tests.support.launch import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not rollout_installed("vllm"), reason="vllm not installed (make test installs it)")]


def _model(root) -> str:
    from posttrain.tiny_model import build_tiny_model

    return build_tiny_model(root, family="qwen2", vocab_size=32, hidden_size=64, num_heads=2, num_kv_heads=1, max_position_embeddings=64)


def _lifecycle(rank: int, world: int, model_dir: str):
    import random

    import numpy as np
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    engine = build_rollout("vllm", RolloutEngineConfig(model_path=model_dir))
    after_start = (torch.rand(3), random.random(), np.random.rand())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # still the real function: it takes effect
    set_threads_works = torch.get_num_threads() == 2
    out = engine.generate([torch.tensor([1, 4, 5])], SamplingParams(max_tokens=4), [0])
    released = engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate([torch.tensor([1, 4, 5])], SamplingParams(max_tokens=4), [0])
    engine.resume_memory()
    reload_warnings = _sync_own_weights(engine, model_dir)
    engine.shutdown()
    engine.shutdown()  # idempotent
    total = torch.ones(1)
    dist.all_reduce(total)  # the trainer's world survived the engine
    return {
        "rng": all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(expected, after_start, strict=True)),
        "threads": threads,
        "set_threads_works": set_threads_works,
        "generated": len(out[0][0].token_ids),
        "released": released,
        "world_after_shutdown": int(total.item()),
        "reload_warnings": reload_warnings,
    }


def _sync_own_weights(engine, model_dir: str) -> list[str]:
    """A weight update of the model's own weights; returns what vLLM's layerwise reload warned."""
    import logging

    from safetensors.torch import load_file

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger, grab = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise"), Grab(logging.WARNING)
    logger.addHandler(grab)
    try:
        shapes = engine.weight_shapes()
        engine.sync_weights([(n, t) for n, t in load_file(f"{model_dir}/model.safetensors").items() if n in shapes], version=1)
    finally:
        logger.removeHandler(grab)
    return [r for r in records if "Failed to load weights" in r]


def test_only_the_rotary_reload_warning_is_dropped():
    """vLLM warns "RotaryEmbedding: Failed to load weights" on every update (its computed
    cos/sin cache counts as loadable); the filter drops that line only, never the same
    warning for a layer whose weights really were not sent."""
    import logging

    from backends.rollout.vllm import RotaryReloadNoise

    def record(layer):
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None)

    noise = RotaryReloadNoise()
    assert not noise.filter(record("RotaryEmbedding")) and not noise.filter(record("Llama3RotaryEmbedding"))
    assert noise.filter(record("QKVParallelLinear")) and noise.filter(record("FusedMoE"))


def test_the_engine_leaves_the_trainers_process_state_alone(tmp_path):
    (result,) = run_distributed(_lifecycle, 1, _model(tmp_path / "m"), timeout=300)
    assert result["rng"], "vLLM's start reseeded the trainer's RNG streams"
    assert result["threads"] == 1 and result["set_threads_works"]
    assert result["generated"] == 4
    assert result["released"] is False  # CPU: nothing to free, recorded as a no-op
    assert result["world_after_shutdown"] == 1
    assert result["reload_warnings"] == []  # a clean update: no "Failed to load weights" for the rotary cache


@pytest.mark.parametrize(
    ("options", "extra", "key", "reason"),
    [
        ({"gpu_memory_utilization": 2.0}, {}, "rollout.options.gpu_memory_utilization = 2.0", "less than or equal to 1"),
        ({"max_num_seqs": -3}, {}, "rollout.options.max_num_seqs = -3", "greater than or equal to 1"),
        ({}, {"max_model_len": -5}, "rollout.max_model_len = -5", "greater than or equal to -1"),
    ],
)
def test_vllms_own_validation_errors_name_the_enginekit_key(tmp_path_factory, options, extra, key, reason):
    """vLLM validates its engine arguments with pydantic (``CacheConfig``, ``SchedulerConfig``,
    ``ModelConfig``): the error reaches the user as a ValueError naming the Enginekit key that set
    the field, its value and vLLM's reason (before: pydantic's ``ValidationError`` naming only
    vLLM's field). Refused while vLLM builds its config, before any weight is loaded."""
    model = _model(tmp_path_factory.mktemp("vllm_refusal"))
    with pytest.raises(ValueError) as info:
        build_rollout("vllm", RolloutEngineConfig(model_path=model, options=options, **extra))
    assert key in str(info.value) and reason in str(info.value), str(info.value)
