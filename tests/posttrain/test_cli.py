"""The recipes' command line (``posttrain.cli``): ``--help`` lists every key the loader accepts,
with its type, default and doc; ``--print-config`` round-trips through the loader; bad arguments
are refused. The expected keys and defaults are computed here from the dataclasses, not from
``posttrain.cli``."""

from __future__ import annotations

import dataclasses
import re
import textwrap
import typing
from pathlib import Path

import pytest
import yaml

import recipes.dpo as dpo
import recipes.ppo as ppo
import recipes.reward_model as reward_model
import recipes.sft as sft
from backends.fsdp.options import FSDPOptions
from backends.megatron.options import MegatronOptions
from engine_api.config import EngineConfig
from engine_api.typed_config import load_typed
from posttrain.cli import config_sections, parse_recipe_args
from tests.support.launch import run_script

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {
    "sft": (sft, sft.SFTConfig, "configs/sft_tiny.yaml"),
    "ppo": (ppo, ppo.PPOConfig, "configs/ppo_tiny.yaml"),
    "dpo": (dpo, dpo.DPOConfig, "configs/dpo_tiny.yaml"),
    "reward_model": (reward_model, reward_model.RMConfig, "configs/rm_tiny.yaml"),
}
# The backend sections the loader accepts under ``engine.`` (EngineConfig.backend is filled from them).
BACKEND_OPTIONS = (FSDPOptions, MegatronOptions)


def _parse(name: str, argv: list[str]) -> tuple[str, list[str]]:
    module, cls, default = RECIPES[name]
    return parse_recipe_args(
        argv, prog=f"python -m recipes.{name}", description=_description(module), config_cls=cls, default_config=default
    )


def _description(module) -> str:
    return module.__doc__.split("\n\n")[0]


def _run(name: str, argv: list[str], capsys) -> str:
    """stdout of an argv that must exit with status 0."""
    with pytest.raises(SystemExit) as exc:
        _parse(name, argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "142")  # 140 columns: what the listing is laid out for


@pytest.fixture(autouse=True)
def _only_the_built_in_backends(monkeypatch):
    """--help lists the section of every engine registered in this process, and other tests
    of the suite register some at runtime (e.g. the reference engine): compared against the
    built-in backends' sections, the listing must not depend on which tests ran before."""
    from engine_api import registry

    builtins = set(registry.builtin_engines())
    monkeypatch.setattr(registry, "_REGISTRY", {k: v for k, v in registry._REGISTRY.items() if k in builtins})


# ---------------------------------------------------------------------------------- independent schema walk
def _leaves(cls: type, obj, prefix: str = "") -> dict[str, object]:
    """Dotted leaf key -> default, walking ``dataclasses.fields`` (lists and dicts are leaves);
    a field with a ``key`` alias (``async_``) under the key users write (``async``)."""
    out: dict[str, object] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value, key = getattr(obj, f.name), f.metadata.get("key", f.name)
        if cls is EngineConfig and f.name == "backend":
            for options in BACKEND_OPTIONS:
                out.update(_leaves(options, options(), f"{prefix}{options.config_section}."))
        elif isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]):
            out.update(_leaves(hints[f.name], value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _dataclasses(cls: type, seen: set[type] | None = None) -> set[type]:
    """``cls`` and every dataclass nested in it, plus the backends' options classes."""
    seen = set(BACKEND_OPTIONS) if seen is None else seen
    seen.add(cls)
    for hint in typing.get_type_hints(cls).values():
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and hint not in seen:
            _dataclasses(hint, seen)
    return seen


def _documented_names(cls: type) -> set[str]:
    """Names with an entry in the ``Attributes:`` section of ``cls`` or a base class."""
    names: set[str] = set()
    for klass in cls.__mro__:
        doc = klass.__dict__.get("__doc__") or ""
        section = re.search(r"^([ \t]*)Attributes:[ \t]*\n((?:\1[ \t]+\S.*\n|[ \t]*\n)+)", doc + "\n", re.M)
        if section is None:
            continue
        body = textwrap.dedent(section[2])
        for line in body.splitlines():
            # An entry at the section's own indentation; its doc may start on the next line.
            entry = re.match(r"^(\w+(?:, \w+)*):(?:\s|$)", line)
            if entry:
                names.update(entry[1].split(", "))
    return names


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


_ROW = re.compile(r"^  (?P<path>\S+) +(?P<type>\S.*?)  +(?P<default>\S.*?)(?:  +(?P<doc>\S.*))?$")


def _rows(help_text: str) -> dict[str, dict[str, str]]:
    """Key -> its row's cells (the doc from the row or, when the row has none, the line below)."""
    lines = help_text.splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = _ROW.match(line)
        if m and "." in m["path"] and not m["path"].startswith("-"):
            cells = m.groupdict()
            if cells["doc"] is None and i + 1 < len(lines) and lines[i + 1].startswith(" " * 6):
                cells["doc"] = lines[i + 1].strip()
            out[m["path"]] = cells
    return out


# ---------------------------------------------------------------------------------- --help
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_help_lists_every_key_with_type_default_and_doc(name, capsys):
    module, cls, _ = RECIPES[name]
    out = _run(name, ["--help"], capsys)
    assert out.startswith(f"usage: python -m recipes.{name} ")
    assert " ".join(_description(module).split()) in " ".join(out.split())  # the whole paragraph, not one line
    rows = _rows(out)
    expected = _leaves(cls, cls())
    missing = sorted(set(expected) - set(rows))
    assert not missing, f"keys not in --help: {missing}"
    assert not sorted(set(rows) - set(expected)), "--help lists keys the schema does not have"
    for key, default in expected.items():
        row = rows[key]
        assert yaml.safe_load(row["default"]) == _plain(default), f"{key}: shown default {row['default']!r}, dataclass has {default!r}"
        assert row["doc"] and row["doc"] != "(undocumented)", f"{key}: no doc in --help"
    assert rows["engine.optim.betas"]["type"] == "tuple[float, float]"
    assert rows["engine.dist_timeout_s"]["type"] == "float | None"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_config_field_is_documented(name):
    """Every field of every section (leaves and sections alike) has an ``Attributes:`` entry in
    its dataclass or a base: a new field without one fails here."""
    undocumented = [
        f"{klass.__module__}.{klass.__qualname__}.{f.name}"
        for klass in sorted(_dataclasses(RECIPES[name][1]), key=lambda c: c.__qualname__)
        for f in dataclasses.fields(klass)
        if f.name not in _documented_names(klass)
    ]
    assert not undocumented, f"fields without a doc line in their dataclass's Attributes: section: {undocumented}"


def test_docs_are_the_first_sentence_of_each_entry():
    docs = {k.path: k.doc for s in config_sections(ppo.PPOConfig) for k in s.keys}
    assert docs["engine.optim.lr"] == "peak learning rate."
    assert docs["engine.optim.eps"] == docs["engine.optim.weight_decay"] == "AdamW hyper-parameters."  # grouped entry
    assert docs["engine.model.path"] == "local HF directory (config.json + safetensors)."  # second sentence dropped
    assert docs["tiny_model.head_dim"].endswith("whose CPU attention kernel needs >= 32).")  # continuation line joined
    assert docs["trainer.total_steps"] == "optimizer steps of the run."  # inherited from TrainerConfig
    assert docs["data.chat_template_kwargs"].endswith("(e.g. {enable_thinking: false} for Qwen3).")  # not cut at e.g.


def test_help_names_the_strategy_of_each_backend_section(capsys):
    out = _run("sft", ["--help"], capsys)
    assert re.search(r"^engine\.fsdp: \(engine\.backend: the settings of engine\.strategy=fsdp only\)", out, re.M)
    assert re.search(r"^engine\.megatron: \(engine\.backend: the settings of engine\.strategy=megatron only\)", out, re.M)
    assert "engine.backend " not in out  # not a key: the loader refuses it


def test_help_with_config_shows_the_values_it_sets(capsys):
    out = _run("sft", ["--config", "configs/sft_tiny.yaml", "--help", "trainer.total_steps=7"], capsys)
    rows = _rows(out)
    assert rows["trainer.total_steps"]["default"] == "800 (set: 7)"
    assert rows["engine.optim.lr_schedule"]["default"] == "constant (set: cosine)"  # from the file
    assert rows["engine.strategy"]["default"] == "fsdp"  # same as the default: not repeated


# ---------------------------------------------------------------------------------- --print-config
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_print_config_round_trips(name, capsys, tmp_path):
    _, cls, default = RECIPES[name]
    overrides = ["trainer.total_steps=7", "engine.fsdp.reshard_after_forward=false", "engine.optim.lr=2.5e-4"]
    if name == "dpo":  # the demo's starting model is built by its trainer.setup, which --print-config does not run
        overrides.append("engine.model.path=null")
    out = _run(name, [overrides[0], "--print-config", *overrides[1:]], capsys)
    path = tmp_path / "printed.yaml"
    path.write_text(out)
    expected = load_typed(cls, ROOT / default, overrides)
    assert load_typed(cls, path) == expected
    assert expected.trainer.total_steps == 7 and expected.engine.backend == FSDPOptions(reshard_after_forward=False)
    assert yaml.safe_load(out)["engine"]["fsdp"]["reshard_after_forward"] is False


def test_print_config_of_a_defaults_only_config_leaves_the_backend_unset(capsys, tmp_path):
    out = _run("sft", ["--print-config"], capsys)
    assert "backend" not in yaml.safe_load(out)["engine"]  # the loader would refuse the key
    path = tmp_path / "printed.yaml"
    path.write_text(out)
    assert load_typed(sft.SFTConfig, path) == load_typed(sft.SFTConfig, ROOT / sft.DEFAULT_CONFIG)


def test_print_config_prints_an_invalid_config_then_its_problems(capsys):
    """--print-config shows what was loaded even when a run would refuse it, then every problem
    on stderr, and exits 1 (a script can tell): an unknown key, a value left to the user, and a
    warmup as long as the run."""
    argv = ["--config", "configs/examples/qwen2.5-0.5b-sft.yaml", "--print-config", "trainer.totl_steps=3", "trainer.total_steps=5"]
    with pytest.raises(SystemExit) as exc:
        _parse("sft", argv)
    assert exc.value.code == 1
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    assert printed["trainer"]["total_steps"] == 5 and printed["engine"]["optim"]["warmup_steps"] == 50
    assert err.startswith("4 config problem(s) (a run refuses this config):"), err
    for needle in (
        "trainer.totl_steps: unknown key 'totl_steps'",
        "engine.model.path = ???",
        "data.train_files = ???",
        "fix: set engine.optim.warmup_steps below 5",
    ):
        assert needle in err, (needle, err)


def test_a_bad_override_gives_the_loaders_error(capsys):
    path, overrides = _parse("sft", ["trainer.totl_steps=3"])  # a run: the recipe loads them
    with pytest.raises(ValueError, match=r"trainer\.totl_steps"):
        load_typed(sft.SFTConfig, ROOT / path, overrides)


# ---------------------------------------------------------------------------------- arguments
def test_config_and_overrides_in_any_order():
    assert _parse("sft", []) == ("configs/sft_tiny.yaml", [])
    assert _parse("sft", ["a.x=1", "--config", "c.yaml", "b.y=[1, 2]"]) == ("c.yaml", ["a.x=1", "b.y=[1, 2]"])
    assert _parse("ppo", ["--config=configs/grpo_tiny.yaml", "algo.n_samples=8"]) == ("configs/grpo_tiny.yaml", ["algo.n_samples=8"])


@pytest.mark.parametrize("argv, named", [(["--foo", "a.x=1"], "--foo"), (["a.x=1", "stray"], "'stray'")])
def test_unknown_flags_and_non_overrides_are_refused(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("sft", argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "usage:" in err


def test_help_in_a_fresh_process():
    """``python -m recipes.sft --help`` in a process of its own: exit 0, the whole description, the keys."""
    proc = run_script(["-m", "recipes.sft", "--help"], env={"COLUMNS": "122"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert " ".join(_description(sft).split()) in " ".join(proc.stdout.split())
    assert "trainer.total_steps" in proc.stdout and max(map(len, proc.stdout.splitlines())) <= 120
