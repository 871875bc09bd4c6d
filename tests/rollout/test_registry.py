"""``rollout.backend`` resolves like ``engine.strategy``: registered names, built-ins (lazily:
``import engine_api`` imports no inference library), import paths, entry points; bad names and
a missing extra are refused with one line naming the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_api import rollout_registry as reg
from engine_api.rollout import BaseRollout, SamplingParams, sample_seed
from roles.rollout import RolloutConfig


class _Tiny(BaseRollout):
    def _generate(self, prompts, params, seeds):
        return []

    def _apply_weights(self, weights):
        pass


def test_names_import_paths_and_duplicates():
    assert {"hf", "vllm"} <= set(reg.available_rollouts())
    assert reg.get_rollout_class("hf").__name__ == "HFRollout"
    cls = reg.get_rollout_class("tests.rollout.test_registry:_Tiny")
    assert cls is _Tiny and "tests.rollout.test_registry:_Tiny" in reg.available_rollouts()
    reg.unregister_rollout("tests.rollout.test_registry:_Tiny")
    reg.register_rollout("tiny-x")(_Tiny)
    try:
        with pytest.raises(ValueError, match="already registered"):
            reg.register_rollout("tiny-x")(reg.get_rollout_class("hf"))
    finally:
        reg.unregister_rollout("tiny-x")
    with pytest.raises(ValueError, match=r"rollout.backend = 'nope' is not a registered rollout backend; available: .*hf.*fix:"):
        reg.get_rollout_class("nope")
    with pytest.raises(ValueError, match=r"needs a BaseRollout subclass"):
        reg.get_rollout_class("engine_api.rollout:SamplingParams")
    with pytest.raises(TypeError, match="BaseRollout subclass"):
        reg.register_rollout("bad")(dict)


def test_entry_points_are_found(monkeypatch):
    import importlib.metadata as md

    ep = md.EntryPoint(name="mine", value="tests.rollout.test_registry:_Tiny", group=reg.ENTRY_POINT_GROUP)
    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda group=None, **kw: [ep] if group == reg.ENTRY_POINT_GROUP else real(group=group, **kw))
    assert "mine" in reg.available_rollouts()
    try:
        assert reg.get_rollout_class("mine") is _Tiny
    finally:
        reg.unregister_rollout("mine")


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    # As on a machine without vllm: not importable, and not registered by an earlier import.
    monkeypatch.setattr(reg, "module_exists", lambda name: name != "vllm")
    monkeypatch.setattr(reg, "_REGISTRY", {k: v for k, v in reg._REGISTRY.items() if k != "vllm"})
    with pytest.raises(ValueError) as info:
        reg.get_rollout_class("vllm")
    assert "\n" not in str(info.value) and "'vllm' package is not installed; fix: pip install -e '.[vllm]'" in str(info.value)
    problems = RolloutConfig(backend="vllm")._problems()
    assert any(p.startswith("backend = 'vllm': the 'vllm' package is not installed; fix:") for p in problems), problems
    assert any(p.startswith("backend = 'sglang': not a rollout backend") for p in RolloutConfig(backend="sglang")._problems())


def test_engine_api_imports_no_inference_library():
    code = "import engine_api, engine_api.rollout, engine_api.rollout_registry, sys; print(sorted(m for m in ('vllm', 'transformers', 'backends') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_sampling_params_name_every_bad_field():
    problems = SamplingParams(n=0, temperature=0.0, top_p=1.5, top_k=0, max_tokens=0, stop_token_ids=(-1,), stop=("",))._problems()
    for field in ("n = 0", "temperature = 0.0", "top_p = 1.5", "top_k = 0", "max_tokens = 0", "stop_token_ids", "stop = "):
        assert any(p.startswith(field) and "fix:" in p for p in problems), (field, problems)
    assert SamplingParams()._problems() == []


def test_sample_seeds_are_stable_and_distinct():
    seeds = {sample_seed(s, j) for s in range(50) for j in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**63 for x in seeds)
    # The same in another process with another hash seed: a resumed run samples what the first did.
    code = "from engine_api.rollout import sample_seed; print(sample_seed(7, 3))"
    env = {**__import__("os").environ, "PYTHONHASHSEED": "123"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.strip()
    assert int(other) == sample_seed(7, 3)
