"""The engine registry and the BaseEngine contract."""

from __future__ import annotations

import inspect

import pytest

from engine_api import BaseEngine, available_engines, build_engine, load_config, register_engine, unregister_engine
from engine_api.registry import get_engine_class
from tests.reference_engine import ReferenceEngine, register

# The public contract: templates BaseEngine implements once (the bookkeeping) ...
CONTRACT = [
    "init_model",
    "train_mode",
    "eval_mode",
    "forward_backward_step",
    "optimizer_zero_grad",
    "optimizer_step",
    "lr_scheduler_step",
    "to",
    "save_checkpoint",
    "load_checkpoint",
    "export_weights",
]
# ... over the hooks a backend must fill in (docs/adding-a-backend.md lists them).
HOOKS = [
    "_build_model",
    "_modules",
    "_step_spec",
    "_save_checkpoint",
    "_load_checkpoint",
    "_export_weights",
    "dp_rank",
    "dp_size",
    "dp_group",
]


def test_base_engine_is_abstract_with_the_design_methods():
    assert set(BaseEngine.__abstractmethods__) == set(HOOKS)
    assert all(callable(getattr(BaseEngine, name)) for name in CONTRACT)
    with pytest.raises(TypeError):
        BaseEngine(load_config())  # type: ignore[abstract]
    params = list(inspect.signature(BaseEngine.forward_backward_step).parameters)
    assert params == ["self", "batch", "ctx", "forward_only", "preprocess_fn", "postprocess_fn"]
    assert list(inspect.signature(BaseEngine.save_checkpoint).parameters) == [
        "self",
        "local_path",
        "hdfs_path",
        "global_step",
        "max_ckpt_to_keep",
    ]
    assert list(inspect.signature(BaseEngine.load_checkpoint).parameters) == ["self", "local_path", "hdfs_path", "del_local_after_load"]
    assert list(inspect.signature(BaseEngine.to).parameters) == ["self", "device", "model", "optimizer"]
    for name in [*CONTRACT, "set_loss_fn", "shard_data", "unshard_data", "train_batch", "infer_batch"]:
        assert inspect.getdoc(getattr(BaseEngine, name)), f"{name} has no docstring"


def test_an_incomplete_backend_cannot_be_instantiated():
    class Half(BaseEngine):
        def _build_model(self):
            pass

    with pytest.raises(TypeError, match="_step_spec"):
        Half(load_config())


def test_register_build_and_list():
    register()
    assert "reference" in available_engines()
    engine = build_engine(load_config(None, ["strategy=reference"]))
    assert isinstance(engine, ReferenceEngine)
    assert get_engine_class("reference") is ReferenceEngine


def test_duplicate_registration_raises():
    register()
    with pytest.raises(ValueError, match="already registered"):
        register_engine("reference")(ReferenceEngine)


def test_unknown_strategy_lists_available_engines():
    register()
    with pytest.raises(ValueError, match=r"'nope' is not a registered engine; available: .*reference"):
        build_engine(load_config(None, ["strategy=nope"]))


def test_non_engine_cannot_register():
    with pytest.raises(TypeError, match="BaseEngine subclass"):
        register_engine("x")(object)  # type: ignore[arg-type]
    unregister_engine("x")


# ----------------------------------------------------------------------------- plug-ins
def _write_module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


PLUGIN = """
from dataclasses import dataclass
from typing import ClassVar
from engine_api import BackendOptions
from tests.reference_engine import ReferenceEngine

@dataclass(frozen=True)
class Opts(BackendOptions):
    config_section: ClassVar[str] = "plug"
    width: int = 3

class Plug(ReferenceEngine):
    options_class = Opts

class NotAnEngine:
    pass

@dataclass
class Loose:
    config_section: ClassVar[str] = "loose"

class LooseEngine(ReferenceEngine):
    options_class = Loose

@dataclass(frozen=True)
class Plain:  # frozen, but not a BackendOptions: EngineConfig.backend could not hold it
    config_section: ClassVar[str] = "plain"

class PlainEngine(ReferenceEngine):
    options_class = Plain

class Undecorated(Opts):  # inherits the dataclass machinery but declares no fields of its own
    config_section: ClassVar[str] = "undecorated"
    extra: int = 1

class UndecoratedEngine(ReferenceEngine):
    options_class = Undecorated
"""


def test_import_path_strategy_is_imported_registered_and_owns_its_section(tmp_path, monkeypatch):
    mod = _write_module(tmp_path, monkeypatch, "plugin_mod_a", PLUGIN)
    try:
        cfg = load_config(None, [f"strategy={mod}:Plug", "plug.width=5"])
        assert cfg.backend.width == 5
        with pytest.raises(AttributeError):
            cfg.plug  # noqa: B018  # the section is read as config.backend (or options_of)
        engine = build_engine(cfg)
        assert type(engine).__name__ == "Plug" and f"{mod}:Plug" in available_engines()
        # Defaults are filled in when the section is absent.
        assert build_engine(load_config(None, [f"strategy={mod}:Plug"])).config.backend.width == 3
        with pytest.raises(ValueError, match=r"plug\.widht: unknown key 'widht'.*did you mean 'plug\.width'"):
            load_config(None, [f"strategy={mod}:Plug", "plug.widht=5"])
        with pytest.raises(ValueError, match=r"megatron\.tensor_model_parallel_size: belongs to backend 'megatron'"):
            load_config(None, [f"strategy={mod}:Plug", "megatron.tensor_model_parallel_size=2"])
        with pytest.raises(ValueError, match=r"fsdp\.fsdp_size: belongs to backend 'fsdp'"):
            load_config(None, [f"strategy={mod}:Plug", "fsdp.fsdp_size=2"])
    finally:
        unregister_engine(f"{mod}:Plug")


def test_another_backends_section_is_refused_and_a_typo_gets_a_suggestion():
    with pytest.raises(ValueError, match=r"megatron\.tensor_model_parallel_size: belongs to backend 'megatron', but strategy = 'fsdp'"):
        load_config(None, ["strategy=fsdp", "megatron.tensor_model_parallel_size=2"])
    with pytest.raises(ValueError, match=r"fsdp\.fsdp_size: belongs to backend 'fsdp', but strategy = 'megatron'"):
        load_config(None, ["strategy=megatron", "fsdp.fsdp_size=2"])
    with pytest.raises(ValueError, match=r"unknown key 'megatrn'.*did you mean 'megatron'"):
        load_config(None, ["strategy=megatron", "megatrn.tensor_model_parallel_size=2"])
    with pytest.raises(ValueError, match=r"filled from the backend's own section"):
        load_config(None, ["strategy=fsdp", "backend.fsdp_size=2"])


def test_bad_import_paths_and_classes_name_the_fix(tmp_path, monkeypatch):
    mod = _write_module(tmp_path, monkeypatch, "plugin_mod_b", PLUGIN)
    cases = {
        "no_such_module_xyz:Engine": "cannot import module 'no_such_module_xyz'",
        f"{mod}:Missing": "has no attribute 'Missing'",
        f"{mod}:NotAnEngine": "needs a BaseEngine subclass",
        f"{mod}:LooseEngine": "is not a frozen dataclass",
        f"{mod}:PlainEngine": "is not a frozen dataclass subclassing engine_api.kit.BackendOptions",
        f"{mod}:UndecoratedEngine": "is not a frozen dataclass subclassing",
        "nope": "is not a registered engine",
    }
    for strategy, needle in cases.items():
        with pytest.raises(ValueError, match=needle) as err:
            build_engine(load_config(None, [f"strategy={strategy}"]))
        assert "fix:" in str(err.value)
    with pytest.raises(ValueError, match="entry point in the group 'enginekit.backends'"):
        build_engine(load_config(None, ["strategy=nope"]))


def test_an_entry_point_registers_a_backend_by_name(tmp_path, monkeypatch):
    mod = _write_module(tmp_path, monkeypatch, "plugin_mod_c", PLUGIN)
    dist = tmp_path / "plugin_mod_c-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-mod-c\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[enginekit.backends]\nplugc = {mod}:Plug\n")
    try:
        assert "plugc" in available_engines()
        engine = build_engine(load_config(None, ["strategy=plugc", "plug.width=7"]))
        assert type(engine).__name__ == "Plug" and engine.config.backend.width == 7
    finally:
        unregister_engine("plugc")


def test_engine_api_has_no_strategy_name_branches():
    """No comparison in engine_api against a built-in backend's name: backends are plug-ins."""
    import ast
    from pathlib import Path

    from engine_api.registry import builtin_engines

    names = set(builtin_engines())
    root = Path(__file__).resolve().parents[2] / "engine_api"
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                found += [f"{path.name}:{node.lineno}" for c in consts if c in names]
    assert found == [], found


def test_an_unknown_strategy_fails_at_config_load_before_any_backend_is_imported():
    """Issue 28: a misspelt strategy was reported only by build_engine, after a recipe had built
    its data and model; the name is now resolved when the config loads, without imports."""
    for strategy in ("fsdpp", "no_such_module_xyz:Engine"):
        with pytest.raises(ValueError, match=rf"strategy = '{strategy}'.*fix:"):
            load_config(None, [f"strategy={strategy}"])
    assert load_config(None, ["strategy=megatron"]).strategy == "megatron"
