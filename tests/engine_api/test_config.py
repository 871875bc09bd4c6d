"""Typed configs: loading, overrides, misspelt keys, value checks, the documented YAML defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from backends.megatron.options import MegatronOptions
from engine_api import build_engine, load_config
from engine_api.config import EngineConfig, OptimConfig
from engine_api.registry import get_engine_class

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "engine"


@pytest.mark.parametrize("name", ["fsdp", "megatron"])
def test_yaml_defaults_equal_dataclass_defaults(name):
    """The YAML documents the defaults; it must not drift from the dataclasses."""
    cfg = load_config(CONFIGS / f"{name}.yaml")
    options = get_engine_class(name).options_class
    assert cfg == dataclasses.replace(EngineConfig(), strategy=name, backend=options())


@pytest.mark.parametrize("name", ["fsdp", "megatron"])
def test_every_yaml_key_has_a_comment_above_it(name):
    lines = (CONFIGS / f"{name}.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and ":" in stripped:
            assert lines[i - 1].strip().startswith("#"), f"{name}.yaml line {i + 1} ({stripped!r}) has no comment above it"


def test_overrides_win_and_result_is_typed_and_frozen():
    cfg = load_config(CONFIGS / "fsdp.yaml", ["optim.lr=3e-4", "micro_batch_size=2", "optim.betas=[0.8,0.95]"])
    assert isinstance(cfg, EngineConfig) and isinstance(cfg.optim, OptimConfig)
    assert cfg.optim.lr == 3e-4 and cfg.micro_batch_size == 2 and cfg.optim.betas == (0.8, 0.95)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]


def test_mapping_source():
    # world_size explicit: otherwise it comes from WORLD_SIZE or an initialised process group.
    cfg = load_config({"strategy": "megatron", "world_size": 2, "megatron": {"tensor_model_parallel_size": 2}})
    assert cfg.backend == MegatronOptions(tensor_model_parallel_size=2)


def test_misspelt_key_names_the_closest_valid_one():
    with pytest.raises(ValueError, match=r"optim\.lrr: unknown key 'lrr'.*did you mean 'optim\.lr'"):
        load_config(None, ["optim.lrr=1e-3"])
    with pytest.raises(ValueError, match=r"did you mean 'megatron\.tensor_model_parallel_size'"):
        load_config({"strategy": "megatron", "megatron": {"tensor_model_paralel_size": 2}})


def test_all_problems_are_reported_at_once():
    with pytest.raises(ValueError) as err:
        load_config(
            {"optim": {"lr": -1.0, "lrr": 2}, "loss_agg_mode": "mean"},
            [
                "micro_batch_size=2",
                "max_token_len_per_micro_batch=128",
                "seed=abc",
                "strategy=megatron",
                "megatron.tensor_model_parallel_size=3",
                "world_size=4",
            ],
        )
    msg = str(err.value)
    assert msg.startswith("6 config problem(s)")
    for needle in (
        "optim.lr = -1.0",
        "optim.lrr",
        "loss_agg_mode = 'mean'",
        "max_token_len_per_micro_batch = 128",
        "seed = 'abc'",
        "does not divide the world size 4",
    ):
        assert needle in msg, needle
    assert "fix:" in msg


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("loss_agg_mode=seq-mean-token-sum-norm", "loss_agg_constant = None"),
        ("optim.lr_schedule=cosine", "optim.total_steps = None"),
        # a short run of a config with warmup: the fix is the warmup, named by the key to type
        (
            "optim.lr_schedule=cosine,optim.total_steps=3,optim.warmup_steps=5",
            "optim.warmup_steps = 5: lr_schedule=cosine needs warmup_steps < total_steps = 3 (the run's optimizer steps); "
            "fix: set optim.warmup_steps below 3",
        ),
        ("strategy=megatron,megatron.sequence_parallel=true", "needs tensor_model_parallel_size > 1"),
        ("strategy=megatron,megatron.virtual_pipeline_model_parallel_size=2", "megatron.virtual_pipeline_model_parallel_size = 2"),
        ("model.head=policy", "model.head = 'policy'"),
        ("model.path=/nonexistent/model", "no such directory"),
        ("optim.clip_grad=0", "optim.clip_grad = 0.0"),
        ("checkpoint.max_ckpt_to_keep=0", "checkpoint.max_ckpt_to_keep = 0"),
        ("fsdp.reduce_dtype=fp8", "fsdp.reduce_dtype = 'fp8'"),
    ],
)
def test_value_checks(override, needle):
    with pytest.raises(ValueError, match="fix:") as err:
        load_config(None, override.split(","))
    assert needle in str(err.value)


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        load_config(None, ["strategy=megatron", "megatron.pipeline_model_parallel_size=3"])
    load_config(None, ["strategy=megatron", "megatron.pipeline_model_parallel_size=2"])


def test_build_engine_rejects_a_config_built_by_hand():
    """Configs that bypass load_config are still checked before any engine exists."""
    with pytest.raises(ValueError, match="optim.lr = -1.0"):
        build_engine(EngineConfig(optim=OptimConfig(lr=-1.0)))


def test_yaml_is_plain_yaml():
    # A recipe or a human can read the files without OmegaConf.
    assert yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())["strategy"] == "fsdp"


def _float_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted paths of every float-valued setting (float, float | None, tuple of floats)."""
    import typing

    out = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out += _float_fields(hint, f"{prefix}{f.name}.")
        elif float in typing.get_args(hint) or hint is float:
            out.append(f"{prefix}{f.name}")
    return out


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_setting_refuses_non_finite_values(value):
    """Issue 13: ``optim.lr=inf`` and ``optim.clip_grad=nan`` passed validation (``x < 0`` checks
    let NaN through) and the first step wrote NaN into every weight. Every float field of the
    engine config, found from the dataclasses, must be refused at load and at build_engine."""
    paths = _float_fields(EngineConfig) + ["optim.betas"]
    assert {"optim.lr", "optim.clip_grad", "optim.weight_decay", "optim.eps", "loss_agg_constant"} <= set(paths)
    for path in paths:
        override = f"{path}=[0.9,{value}]" if path == "optim.betas" else f"{path}={value}"
        with pytest.raises(ValueError, match=rf"{path.split('.')[-1]} = .*not a finite number"):
            load_config(CONFIGS / "fsdp.yaml", [override])
    hand_built = EngineConfig(optim=OptimConfig(lr=float(value)))
    with pytest.raises(ValueError, match="optim.lr = .*not a finite number"):
        build_engine(hand_built)


def test_backend_options_are_a_declared_type_read_with_options_of():
    """Issue 29: ``EngineConfig.backend`` is typed ``BackendOptions | None`` and read with
    ``options_of``; no attribute is looked up by section name."""
    import typing

    from backends.fsdp.options import FSDPOptions
    from engine_api.config import BackendOptions, options_of

    assert typing.get_type_hints(EngineConfig)["backend"] == BackendOptions | None
    assert "__getattr__" not in vars(EngineConfig)
    cfg = load_config(None, ["strategy=megatron", "world_size=2", "megatron.tensor_model_parallel_size=2"])
    assert isinstance(cfg.backend, BackendOptions) and options_of(cfg, MegatronOptions).tensor_model_parallel_size == 2
    assert options_of(cfg, FSDPOptions) == FSDPOptions()  # another backend's options: its defaults
    with pytest.raises(AttributeError):
        cfg.megatron  # noqa: B018  # the section name is YAML / override syntax only


@pytest.mark.parametrize(
    ("backend", "world", "expected"),
    [
        (
            MegatronOptions(tensor_model_parallel_size=3),
            2,
            ["megatron.tensor_model_parallel_size = 3: TP x PP x CP = 3 does not divide the world size 2"],
        ),
        (
            MegatronOptions(tensor_model_parallel_size=3, expert_model_parallel_size=3),
            2,
            [
                "megatron.tensor_model_parallel_size = 3: TP x PP x CP = 3 does not divide the world size 2",
                "megatron.expert_model_parallel_size = 3: EP x expert-TP x PP = 9 does not divide the world size 2",
            ],
        ),
        (MegatronOptions(tensor_model_parallel_size=2), 4, []),
        (MegatronOptions(pipeline_model_parallel_size=0), 4, []),  # size 0: the option's own check reports it
    ],
)
def test_backend_world_divisors_are_checked_against_the_world_size(backend, world, expected):
    """``BackendOptions.world_divisors`` replaces the backends' own world-size hooks: the engine
    config checks them, with the messages those hooks had."""
    from engine_api.config import problems_of

    problems = [p for p in problems_of(EngineConfig(strategy="megatron", world_size=world, backend=backend)) if "world size" in p]
    assert [p.split("; fix:")[0] for p in problems] == expected


def test_fsdp_size_must_divide_the_world_size():
    from backends.fsdp.options import FSDPOptions
    from engine_api.config import problems_of

    assert problems_of(EngineConfig(world_size=4, backend=FSDPOptions(fsdp_size=3))) == [
        "fsdp.fsdp_size = 3: does not divide the world size 4; fix: use -1 or a divisor of the world size"
    ]
    assert problems_of(EngineConfig(world_size=4, backend=FSDPOptions(fsdp_size=-1))) == []
    with pytest.raises(ValueError, match=r"fsdp\.fsdp_size = 3: does not divide the world size 4"):
        load_config(None, ["fsdp.fsdp_size=3", "world_size=4"])


@pytest.mark.parametrize("example", ["qwen2.5-0.5b-sft.yaml", "llama-3.2-1b-sft.yaml"])
def test_a_short_run_of_an_example_names_the_warmup_key(example, tmp_path):
    """A 5-step trial of an example config sized for 500: the fix names the key the user types
    (engine.optim.warmup_steps), not optim.total_steps, which the recipe sets itself."""
    from engine_api.typed_config import load_typed
    from recipes.sft import SFTConfig

    with pytest.raises(ValueError) as err:
        load_typed(
            SFTConfig,
            f"configs/examples/{example}",
            [f"engine.model.path={tmp_path}", "data.train_files=[x.jsonl]", "trainer.total_steps=5"],
        )
    msg = str(err.value)
    assert "fix: set engine.optim.warmup_steps below 5" in msg and "trainer.total_steps" in msg, msg
    assert "optim.total_steps" not in msg and "\x00" not in msg
