"""The command line of the recipes: ``--config FILE`` plus ``key=value`` overrides, a ``--help``
that lists every config key, and ``--print-config``.

A recipe calls :func:`parse_recipe_args` with its root config dataclass; the key listing is
generated from that schema, so it never goes stale:

* every leaf key as the dotted path the loader (``engine_api.typed_config.load_typed``) accepts,
  with its type, its default (the root dataclass's default instance, in YAML) and the first
  sentence of the field's doc from the Google-style ``Attributes:`` section of its dataclass
  (or of a base class it inherits the field from);
* nested dataclasses are sections; lists and dicts are leaves;
* the engine's backend settings (``EngineConfig.backend``) are not a key of their own: the
  loader reads them from the section the strategy's options class names (``engine.fsdp.*``,
  ``engine.megatron.*``), so the listing shows those sections, one per known strategy, each
  marked with the strategy it belongs to.

``--print-config`` loads the config exactly as a run does and prints it as YAML that loads back
to an equal config (:func:`config_yaml`).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import shutil
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine_api.config import BackendOptions, EngineConfig
from engine_api.loader import engine_sections
from engine_api.registry import available_engines, section_of
from engine_api.typed_config import load_typed

__all__ = [
    "ConfigKey",
    "ConfigSection",
    "build_parser",
    "config_container",
    "config_sections",
    "config_yaml",
    "field_docs",
    "first_sentence",
    "format_config_keys",
    "parse_recipe_args",
    "type_name",
    "yaml_value",
]

# Wider lines than this are hard to read even on a wide terminal; narrower ones leave no room for the docs.
_MAX_WIDTH, _MIN_WIDTH = 140, 70
# A default cell longer than this does not widen its column; the doc of that row moves to the next line.
_MAX_DEFAULT_CELL = 24


class _Absent:
    """The value of a key a loaded config does not have (a backend section of another strategy)."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


@dataclass(frozen=True)
class ConfigKey:
    """One leaf key of a recipe config.

    Attributes:
        path: the dotted key as YAML and overrides write it (``engine.optim.lr``).
        type: the declared type as text (``float | None``).
        default: the default value (of the root config's default instance).
        doc: the first sentence of the field's doc; empty when the field has none.
        attrs: the attribute path to the value in a loaded config (``engine.fsdp.x`` is
            ``("engine", "backend", "x")``).
    """

    path: str
    type: str
    default: Any
    doc: str
    attrs: tuple[str, ...]


@dataclass(frozen=True)
class ConfigSection:
    """A nested dataclass of a recipe config, with its leaf keys.

    Attributes:
        path: the dotted section path (``engine.optim``; ``""`` for the top level).
        doc: the first sentence of the section field's doc (or of the options class's docstring).
        keys: its leaf keys, in declaration order.
        strategy: for a backend section: the ``engine.strategy`` it belongs to; else None.
        error: why a backend section's keys cannot be listed (e.g. the backend does not import).
    """

    path: str
    doc: str
    keys: tuple[ConfigKey, ...]
    strategy: str | None = None
    error: str | None = None


# ---------------------------------------------------------------------------------- docs
_ENTRY = re.compile(r"^(?P<names>[A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*:(?:\s+(?P<doc>.*))?$")


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its full doc (continuation lines joined) from the ``Attributes:`` section of
    ``cls``'s docstring and of its dataclass bases (a subclass's own entry wins).

    Handles ``name: doc``, grouped ``a, b, c: doc`` and indented continuation lines.
    """
    docs: dict[str, str] = {}
    # Bases first, so a subclass that re-documents an inherited field wins.
    for klass in reversed(cls.__mro__):
        own = klass.__dict__.get("__doc__")
        if isinstance(own, str):
            docs.update(_attributes_section(own))
    return docs


def _attributes_section(docstring: str) -> dict[str, str]:
    lines = inspect.cleandoc(docstring).splitlines()
    out: dict[str, str] = {}
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return out
    base = _indent(lines[start])
    entry_indent: int | None = None
    names: list[str] = []
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= base:
            break  # the section ended (a paragraph or another section follows)
        if entry_indent is None:
            entry_indent = indent
        match = _ENTRY.match(line.strip()) if indent == entry_indent else None
        if match:
            names = [n.strip() for n in match["names"].split(",")]
            for name in names:
                out[name] = (match["doc"] or "").strip()
        elif names and indent > entry_indent:
            for name in names:
                out[name] = f"{out[name]} {line.strip()}".strip()
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


_MARKUP = re.compile(r":(?:class|func|meth|attr|mod|data|obj):`~?([^`]+)`")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.")


def first_sentence(doc: str) -> str:
    """The first sentence of ``doc`` (up to a ``.``/``!``/``?`` followed by a space, outside
    parentheses, brackets and backticks, and not ending ``e.g.``), Sphinx markup removed."""
    text = _MARKUP.sub(r"\1", " ".join(doc.split())).replace("``", "`")
    depth, quoted = 0, False
    for i, ch in enumerate(text):
        if ch == "`":
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(depth - 1, 0)
        elif ch in ".!?" and depth == 0 and (i + 1 == len(text) or text[i + 1] == " "):
            if not text[: i + 1].endswith(_ABBREVIATIONS):
                return text[: i + 1].replace("`", "")
    return text.replace("`", "")


# ---------------------------------------------------------------------------------- schema walk
def config_sections(config_cls: type) -> list[ConfigSection]:
    """Every section of the recipe config ``config_cls`` with its leaf keys, depth first in
    declaration order: the keys ``load_typed(config_cls, ...)`` accepts.

    The backend settings of an ``EngineConfig`` (at any depth) are listed as one section per
    known strategy (``available_engines``), under the section name its options class declares;
    the engine class is imported for that (the registry has no other way to name an options
    class), and a backend that fails to import gets a section with ``error`` set.
    """
    try:
        root = config_cls()
    except TypeError:  # a mandatory field: fall back to the per-class defaults
        root = None
    out: list[ConfigSection] = []
    _walk(config_cls, root, "", (), "", out)
    return out


def _walk(cls: type, obj: Any, prefix: str, attrs: tuple[str, ...], doc: str, out: list[ConfigSection]) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    target = _backend_target() if issubclass(cls, EngineConfig) else None
    keys: list[ConfigKey] = []
    nested: list[tuple[type, Any, str, tuple[str, ...], str]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        value = getattr(obj, f.name) if obj is not None else _field_default(f)
        if f.name == target:
            continue  # filled from the strategy's own section, listed below
        key = f.metadata.get("key", f.name)  # the config key (``async`` for the field ``async_``)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            nested.append(
                (hint, value if dataclasses.is_dataclass(value) else None, f"{prefix}{key}.", (*attrs, f.name), docs.get(f.name, ""))
            )
            continue
        keys.append(ConfigKey(f"{prefix}{key}", type_name(hint), value, first_sentence(docs.get(f.name, "")), (*attrs, f.name)))
    out.append(ConfigSection(prefix.rstrip("."), first_sentence(doc), tuple(keys)))
    for args in nested:
        _walk(*args, out)
    if target is not None:
        out += _backend_sections(prefix, (*attrs, target))


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"  # OmegaConf's mark of a mandatory value


def _backend_target() -> str:
    """The ``EngineConfig`` field the loader fills from the strategy's section (``backend``)."""
    return engine_sections({}).target


def _backend_sections(prefix: str, attrs: tuple[str, ...]) -> list[ConfigSection]:
    """One section per known strategy, resolved by the loader's own resolver
    (``engine_api.loader.engine_sections``), so the names are exactly those a run accepts."""
    out = []
    for strategy in available_engines():
        section = section_of(strategy)
        # A node that sets the strategy and holds its section: what a config with backend keys is.
        spec = engine_sections({"strategy": strategy, section: {}})
        if spec.error is not None or spec.active is None or spec.schema is None:
            reason = spec.error or "this backend declares no settings"
            out.append(ConfigSection(f"{prefix}{section}", "", (), strategy=strategy, error=reason))
            continue
        options = spec.schema
        hints, docs, defaults = typing.get_type_hints(options), field_docs(options), options()
        keys = tuple(
            ConfigKey(
                f"{prefix}{spec.active}.{f.name}",
                type_name(hints[f.name]),
                getattr(defaults, f.name),
                first_sentence(docs.get(f.name, "")),
                (*attrs, f.name),
            )
            for f in dataclasses.fields(options)
        )
        head = first_sentence((options.__doc__ or "").split("\n\n")[0])
        out.append(ConfigSection(f"{prefix}{spec.active}", head, keys, strategy=strategy))
    return out


def type_name(hint: Any) -> str:
    """A type hint as short text: ``int``, ``float | None``, ``list[str]``, ``str | bool``."""
    if hint is type(None):
        return "None"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return " | ".join(type_name(a) for a in [*(a for a in args if a is not type(None)), *(a for a in args if a is type(None))])
    if origin is not None:
        args = typing.get_args(hint)
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join(type_name(a) for a in args)}]" if args else base
    if hint is typing.Any:
        return "Any"
    return getattr(hint, "__name__", str(hint))


# ---------------------------------------------------------------------------------- formatting
def yaml_value(value: Any) -> str:
    """``value`` as a one-line YAML flow value (``null``, ``true``, ``1.0e-05``, ``[a, b]``), as
    a YAML file or an override writes it."""
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=10**6)
    return text.removesuffix("...\n").strip()


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_container(value)
    return value


def format_config_keys(
    config_cls: type,
    width: int | None = None,
    loaded: Any = _ABSENT,
    loaded_label: str = "",
) -> str:
    """The key listing of ``config_cls`` (the ``--help`` epilog): one row per key, ``path  type
    default  doc``, grouped by section, wrapped to ``width`` columns.

    Args:
        loaded: a config loaded from a file; a key whose value there differs from its default
            shows it as ``default (set: value)``.
        loaded_label: names the file (and overrides) in the legend.
    """
    width = width or _width()
    lines = [
        "config keys (YAML under --config, or key=value overrides):",
        "  KEY  TYPE  DEFAULT  DOC; a section's keys are grouped under its name.",
    ]
    if loaded is not _ABSENT:
        lines.append(f"  DEFAULT (set: X): {loaded_label} sets X, which differs from the default.")
    for section in config_sections(config_cls):
        if not section.keys and section.error is None:
            continue
        lines.append("")
        lines += _section_lines(section, width, loaded)
    return "\n".join(lines) + "\n"


def _section_lines(section: ConfigSection, width: int, loaded: Any) -> list[str]:
    name = section.path or "top level"
    head = f"{name}:"
    if section.strategy is not None:
        head += f" (engine.backend: the settings of engine.strategy={section.strategy} only)"
    if section.doc:
        head += f" {section.doc}"
    out = _wrap(head, width, subsequent_indent="    ")
    if section.error is not None:
        return out + _wrap(f"(keys not listed: {section.error})", width, initial_indent="  ", subsequent_indent="    ")
    cells = [(k, _default_cell(k, loaded)) for k in section.keys]
    pw = max(len(k.path) for k, _ in cells)
    tw = max(len(k.type) for k, _ in cells)
    dw = min(max(len(d) for _, d in cells), _MAX_DEFAULT_CELL)
    doc_col = 2 + pw + 2 + tw + 2 + dw + 2
    for key, default in cells:
        row = f"  {key.path:<{pw}}  {key.type:<{tw}}  {default}"
        doc = key.doc or "(undocumented)"
        if len(default) <= dw and doc_col <= width - 30:
            wrapped = _wrap(doc, width - doc_col) or [""]
            out.append(f"{row:<{doc_col}}{wrapped[0]}".rstrip())
            out += [" " * doc_col + part for part in wrapped[1:]]
        else:  # no room beside the row: the doc goes below it
            out.append(row)
            out += _wrap(doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return out


def _wrap(text: str, width: int, **kwargs: str) -> list[str]:
    # Not at hyphens: keys and values (``log-probs``, ``token-mean``) must stay whole to be found.
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **kwargs)


def _default_cell(key: ConfigKey, loaded: Any) -> str:
    text = yaml_value(key.default)
    if loaded is _ABSENT:
        return text
    value = _value_at(loaded, key)
    if value is _ABSENT or _plain(value) == _plain(key.default):
        return text
    return f"{text} (set: {yaml_value(value)})"


def _value_at(obj: Any, key: ConfigKey) -> Any:
    for i, name in enumerate(key.attrs):
        if obj is None or not hasattr(obj, name):
            return _ABSENT
        obj = getattr(obj, name)
        # A backend key has a value only when the loaded backend is of that key's section.
        if isinstance(obj, BackendOptions) and not key.path.endswith(f"{obj.config_section}.{'.'.join(key.attrs[i + 1 :])}"):
            return _ABSENT
    return obj


def _width() -> int:
    """The terminal's width (120 when not a terminal), within [70, 140]."""
    return max(_MIN_WIDTH, min(shutil.get_terminal_size((120, 24)).columns - 2, _MAX_WIDTH))


# ---------------------------------------------------------------------------------- print-config
def config_container(obj: Any) -> dict[str, Any]:
    """A loaded config as plain YAML-able data in the layout ``load_typed`` reads: a backend's
    options under their section name (``fsdp: {...}``), an unset backend left out, tuples as lists."""
    out: dict[str, Any] = {}
    target = _backend_target() if isinstance(obj, EngineConfig) else None
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, BackendOptions):
            out[value.config_section] = config_container(value)
        elif f.name == target and value is None:
            continue  # the loader refuses the key itself; unset means the backend's defaults
        else:
            out[f.metadata.get("key", f.name)] = _plain(value)
    return out


def config_yaml(cfg: Any) -> str:
    """``cfg`` (a loaded recipe config) as YAML; ``load_typed(type(cfg), <that YAML file>)``
    gives an equal config."""
    return OmegaConf.to_yaml(OmegaConf.create(config_container(cfg)))


# ---------------------------------------------------------------------------------- parser
class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description and the key listing as laid out here (they are pre-wrapped to the
    same width), and gives the option column room for ``--config PATH``."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=_width(), max_help_position=32)


def build_parser(prog: str, description: str, default_config: str) -> argparse.ArgumentParser:
    """The recipe's argument parser (without the key listing, which ``--help`` adds)."""
    width = _width()
    paragraphs = ["\n".join(_wrap(" ".join(p.split()), width)) for p in description.strip().split("\n\n")]
    parser = argparse.ArgumentParser(prog=prog, description="\n\n".join(paragraphs), formatter_class=_Formatter, add_help=False)
    parser.add_argument("-h", "--help", action="store_true", help="show this help, with every config key, and exit")
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"YAML config (default: {default_config}); with --help, the listing also shows the values it sets",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="load the config (file + overrides) as a run would, print it as YAML and exit",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dot-list overrides of the config keys below, e.g. trainer.total_steps=50 engine.optim.lr=1e-4",
    )
    return parser


def run_setup(config_path: str | os.PathLike, overrides: Sequence[str]) -> None:
    """Call the config's ``trainer.setup`` (``package.module:function``), if it names one, before
    the config is loaded and checked (it may build the files the config points at). Every rank
    calls it in turn under a file lock (in the temporary directory, one per working directory), so
    the first builds and the others find the files there.

    Raises:
        ValueError: the function cannot be loaded, naming ``trainer.setup``.
    """
    import fcntl

    from omegaconf import OmegaConf

    from posttrain.fencing import load_callable

    raw = OmegaConf.merge(OmegaConf.load(config_path), OmegaConf.from_dotlist([o for o in overrides if o.startswith("trainer.setup=")]))
    spec = OmegaConf.select(raw, "trainer.setup", default=None)
    if not spec:
        return
    fn = load_callable(str(spec), "trainer.setup")
    import hashlib
    import tempfile

    name = "enginekit-setup-" + hashlib.sha256(os.getcwd().encode()).hexdigest()[:16] + ".lock"
    with open(os.path.join(tempfile.gettempdir(), name), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            fn()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def parse_recipe_args(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    config_cls: type,
    default_config: str,
) -> tuple[str, list[str]]:
    """Parse a recipe's command line: ``--config PATH`` and ``key=value`` overrides in any order.

    ``--help`` prints the usage, ``description`` and every key of ``config_cls``
    (:func:`format_config_keys`; with ``--config``, also the values the file and overrides set)
    and ``--print-config`` prints the loaded config as YAML (:func:`config_yaml`); both then
    exit with status 0. An unknown option or an override without ``=`` is refused (status 2,
    naming it).

    Returns:
        (the config path, the overrides), for ``load_typed(config_cls, path, overrides)``.

    Raises:
        SystemExit: after ``--help`` / ``--print-config`` (0; 1 when ``--print-config`` printed a
            config with invalid values, listed on stderr after it) or on a bad argument (2).
        ValueError: ``--print-config`` with a config that does not load at all (unknown keys,
            type errors: the loader's error).
    """
    parser = build_parser(prog, description, default_config)
    args = parser.parse_intermixed_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"not a key=value override: {', '.join(map(repr, bad))} (e.g. trainer.total_steps=50)")
    path = args.config if args.config is not None else default_config
    if args.help:
        loaded, label = _ABSENT, ""
        if args.config is not None:
            label = args.config + (" + overrides" if args.overrides else "")
            try:
                loaded = load_typed(config_cls, args.config, args.overrides)
            except (
                ValueError,
                OSError,
                yaml.YAMLError,
                OmegaConfBaseException,
            ) as exc:  # still show the help; say why the values are missing
                label = f"{label} (not loaded: {str(exc).splitlines()[-1].strip()})"
        parser.epilog = format_config_keys(config_cls, loaded=loaded, loaded_label=label)
        if loaded is _ABSENT and args.config is not None:
            parser.epilog = f"--config {label}\n\n{parser.epilog}"
        parser.print_help(sys.stdout)
        parser.exit(0)
    if args.print_config:
        # Printed even when values are invalid (what was loaded is what the user needs to see),
        # then the problems, and a non-zero exit: such a config does not run.
        problems: list[str] = []
        sys.stdout.write(config_yaml(load_typed(config_cls, path, args.overrides, value_problems=problems)))
        sys.stdout.flush()
        if problems:
            print(f"{len(problems)} config problem(s) (a run refuses this config):", file=sys.stderr)
            for line in problems:
                print(f"  - {line}", file=sys.stderr)
            parser.exit(1)
        parser.exit(0)
    return path, list(args.overrides)
