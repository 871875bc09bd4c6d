"""Config-loader messages for a scalar where a section belongs (issue 28): ``engine.optim=5`` or
``engine.fsdp=5`` says the key is a section and shows how to set a key inside it."""

from __future__ import annotations

import dataclasses

import pytest

from engine_api.config import load_config
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
