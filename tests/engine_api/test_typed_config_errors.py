"""Config-loader messages for a scalar where a section belongs (issue 28): ``engine.optim=5`` or
``engine.fsdp=5`` says the key is a section and shows how to set a key inside it."""

from __future__ import annotations

import dataclasses

import pytest

from backends.megatron.options import MegatronOptions
from engine_api import EngineConfig, load_config
from engine_api.typed_config import load_typed


@pytest.mark.parametrize(
    ("override", "example"),
    [
        ("optim=5", "optim.lr=..."),  # a plain nested dataclass
        ("model=abc", "model.path=..."),
        ("fsdp=5", "fsdp.fsdp_size=..."),  # the active backend's plug-in section
        ("optim=[1,2]", "optim.lr=..."),
    ],
)
def test_a_scalar_for_a_section_says_so_with_an_example(override, example):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    msg = str(err.value)
    key = override.split("=")[0]
    assert f"{key} is a section (a mapping of keys)" in msg and f"e.g. {example}" in msg, msg
    assert "unknown key" not in msg and "did you mean" not in msg and "not a subclass" not in msg, msg


def test_an_empty_section_is_its_defaults():
    got, default = load_config(None, ["fsdp={}", "optim={}"]), load_config(None, [])
    assert got.optim == default.optim
    assert got.backend in (None, type(got.backend)())  # None reads as the backend's defaults (options_of)


@dataclasses.dataclass(frozen=True)
class _Files:
    paths: list[str] = dataclasses.field(default_factory=list, metadata={"scalar_as_list": True})
    other: list[str] = dataclasses.field(default_factory=list)


def test_scalar_as_list_is_opt_in_per_field():
    assert load_typed(_Files, {"paths": "a.jsonl"}).paths == ["a.jsonl"]
    with pytest.raises(ValueError, match=r"other = 'a.jsonl'"):
        load_typed(_Files, {"other": "a.jsonl"})


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """A recipe-style config holding an engine config (as SFTConfig / PPOConfig do)."""

    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    steps: int = 1


def test_a_nested_engine_config_gets_its_backend_section_and_strategy_resolved():
    """The loader's section resolver applies wherever an EngineConfig sits, not only at the top."""
    cfg = load_typed(_Recipe, {"engine": {"strategy": "megatron", "world_size": 2, "megatron": {"tensor_model_parallel_size": 2}}})
    assert cfg.engine.backend == MegatronOptions(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"engine\.strategy = 'fsdpp' is not a registered engine") as err:
        load_typed(_Recipe, None, ["engine.strategy=fsdpp", "steps=2"])
    assert str(err.value).startswith("1 config problem(s)")
    with pytest.raises(
        ValueError, match=r"engine\.megatron\.tensor_paralel_size: .*did you mean 'engine\.megatron\.tensor_model_parallel_size'"
    ):
        load_typed(_Recipe, None, ["engine.strategy=megatron", "engine.megatron.tensor_paralel_size=2"])
    with pytest.raises(ValueError, match=r"engine\.megatron\.tensor_model_parallel_size: belongs to backend 'megatron'"):
        load_typed(_Recipe, None, ["engine.megatron.tensor_model_parallel_size=2"])


def test_a_misspelt_strategy_is_reported_once_even_with_section_keys():
    with pytest.raises(ValueError) as err:
        load_config(None, ["strategy=fsdpp", "fsdp.fsdp_size=2"])
    assert str(err.value).count("strategy = 'fsdpp' is not a registered engine") == 1, str(err.value)
    with pytest.raises(ValueError, match=r"strategy = '': empty; fix: name a registered engine"):
        load_config({"strategy": ""})


def test_section_resolvers_can_be_given_per_call():
    """``sections`` replaces the registered table: with none, a backend section is an unknown key."""
    with pytest.raises(ValueError, match=r"engine\.megatron\.tensor_model_parallel_size: unknown key 'megatron' at engine"):
        load_typed(_Recipe, None, ["engine.strategy=megatron", "engine.megatron.tensor_model_parallel_size=2"], sections={})
    assert load_typed(_Recipe, None, ["engine.strategy=fsdpp"], sections={}).engine.strategy == "fsdpp"  # nothing resolves it


def test_a_value_left_as_mandatory_is_reported_unless_a_later_layer_sets_it(tmp_path):
    """``???`` (OmegaConf's mandatory marker) in a config file names the key; OmegaConf's merge
    alone would keep the default (null) and a recipe would then build its tiny demo model."""
    from engine_api import EngineConfig
    from engine_api.typed_config import load_typed

    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: ???\nseed: ???\n")
    with pytest.raises(ValueError) as err:
        load_typed(EngineConfig, path)
    assert "model.path = ???: a value this config leaves to you; fix: set it, e.g. model.path=VALUE" in str(err.value)
    assert "seed = ???" in str(err.value)
    cfg = load_typed(EngineConfig, path, [f"model.path={tmp_path}", "seed=3"])
    assert (cfg.model.path, cfg.seed) == (str(tmp_path), 3)
