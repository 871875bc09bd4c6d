"""A tokenizer with more tokens than the model embeds is refused when the rollout engine is
built, naming both sizes and the fix (issue 53 item 19), on both backends; before, the hf
backend built and failed in generation with a raw ``IndexError``. vLLM refuses before it
starts an engine, so the check costs no engine start."""

from __future__ import annotations

import pytest

from engine_api.rollout import RolloutEngineConfig
from engine_api.rollout_registry import build_rollout, rollout_installed
from posttrain.tiny_model import build_tiny_model
from tests.support import user_data as ud


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok_vocab")
    small = build_tiny_model(root / "small", family="qwen2", vocab_size=16, hidden_size=64, num_heads=2, num_kv_heads=1)
    ud.build_tokenizer(root / "small")  # 21 tokens
    fits = ud.build_model_dir(root / "fits", family="qwen2", head_dim=32)
    return str(small), str(fits)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_tokenizer_larger_than_the_model_is_refused_at_build(dirs, backend):
    if not rollout_installed(backend):
        pytest.skip(f"{backend} not installed")
    small, _ = dirs
    with pytest.raises(ValueError, match=r"has 21 tokens .* embeds 16 \(vocab_size\).*fix:"):
        build_rollout(backend, RolloutEngineConfig(model_path=small, tokenizer_path=small))


def test_a_tokenizer_that_fits_is_accepted(dirs):
    _, fits = dirs
    build_rollout("hf", RolloutEngineConfig(model_path=fits, tokenizer_path=fits)).shutdown()
