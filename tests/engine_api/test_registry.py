"""The engine registry and the BaseEngine contract."""

from __future__ import annotations

import inspect

import pytest

from engine_api import BaseEngine, available_engines, build_engine, load_config, register_engine, unregister_engine
from engine_api.registry import get_engine_class
from tests.reference_engine import ReferenceEngine, register

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
    "dp_rank",
    "dp_size",
    "dp_group",
]


def test_base_engine_is_abstract_with_the_design_methods():
    assert set(BaseEngine.__abstractmethods__) == set(CONTRACT)
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
        def init_model(self):
            pass

    with pytest.raises(TypeError, match="forward_backward_step"):
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
