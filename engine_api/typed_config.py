"""Load frozen dataclass configs from YAML / mappings + OmegaConf dot-list overrides.

Generic over the schema, so recipes reuse it for their own top-level configs. Every problem
is collected before raising: misspelt keys (with the closest valid key), values of the wrong
type, non-finite numbers (NaN and +-inf are refused in every float field: no setting of this
project means "infinite", and a NaN passes every ``x < 0``-style range check), and the schema's
own value checks (a dataclass may define ``_problems(self) -> list[str]``; they are gathered
from every nested dataclass). One ``ValueError`` lists them all, each naming the field, the
value and the fix.

A field whose ``dataclasses.field`` metadata has ``key: NAME`` is also read from the config key
``NAME`` (a key that is a Python keyword, e.g. ``async`` for a field ``async_``).

A scalar given for a section (``engine.optim=5``) is reported as such, with an example of a key
inside it. A list field whose ``dataclasses.field`` metadata has ``scalar_as_list: True`` also
takes a single string, read as a one-element list (``data.train_files=x.jsonl``).

Plug-in sections (a backend's options) are read by a *section resolver* registered for the
dataclass that holds them (:func:`register_sections`), wherever it is nested.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class SectionSchema:
    """What a section resolver returns: how the keys of its dataclass's node that are not
    fields are read (the backend sections of ``EngineConfig``).

    Attributes:
        target: the field that receives the active section's object (e.g. ``backend``).
        active: the section name validated against ``schema`` (None: no section is active).
        schema: the frozen dataclass of the active section (None: it takes no keys).
        foreign: other known section names -> why they are refused (the message's problem
            and fix, without the key).
        error: a problem of the node itself (e.g. a strategy that names no engine), reported
            under the node's path; the active section is then not built.
    """

    target: str
    active: str | None = None
    schema: type | None = None
    foreign: Mapping[str, str] = dataclasses.field(default_factory=dict)
    error: str | None = None


#: Reads a node's raw mapping (the merged YAML and overrides, before typing) and says how its
#: non-field keys are read (:class:`SectionSchema`).
SectionResolver = Callable[[Mapping[str, Any]], SectionSchema]

# Dataclass -> the resolver of its plug-in sections, used by every ``load_typed`` call that is
# not given its own table. Filled by ``engine_api.loader`` (``EngineConfig``), which the
# ``engine_api`` package imports, so any import of this module has it.
_RESOLVERS: dict[type, SectionResolver] = {}


def register_sections(schema: type, resolver: SectionResolver) -> None:
    """Make ``resolver`` read the plug-in sections of ``schema`` wherever ``load_typed`` meets
    it (the top-level schema or a nested field, at any depth)."""
    _RESOLVERS[schema] = resolver


def load_typed(
    schema: type[T],
    source: str | os.PathLike | Mapping | None = None,
    overrides: Sequence[str] = (),
    sections: Mapping[type, SectionResolver] | None = None,
    value_problems: list[str] | None = None,
) -> T:
    """Merge ``source`` (a YAML path or a mapping) and dot-list ``overrides`` onto ``schema``.

    A dataclass (``schema`` or one nested in it, at any depth) that has a section resolver
    (``sections``, by default those registered with :func:`register_sections`) has the keys
    of its node that are not fields routed by it, so a plug-in section (a backend's options)
    is validated like every other key.

    ``value_problems``: a list to receive the problems instead of raising on them, for a caller
    that shows the config anyway (``--print-config``): every problem found while a config could
    still be built (invalid values, values left to the user, keys that were skipped); when
    nothing could be built, it raises as usual.

    Returns:
        An instance of the frozen dataclass ``schema``.

    Raises:
        ValueError: listing every unknown key, type error and invalid value.
    """
    resolvers = _RESOLVERS if sections is None else sections
    layers = []
    if source is not None:
        layers.append(OmegaConf.load(source) if isinstance(source, (str, os.PathLike)) else OmegaConf.create(dict(source)))
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    leaves = [[(_unalias(schema, k), v) for k, v in _leaves(OmegaConf.to_container(layer, resolve=False))] for layer in layers]
    problems: list[str] = []
    found = _sections(schema, resolvers, layers, leaves, problems)
    obj = _build(schema, leaves, problems, prefix="")
    for path, (spec, section_leaves) in found.items():
        if spec.schema is None or spec.error is not None or obj is None:
            continue
        value = _build(spec.schema, section_leaves, problems, prefix=f"{path}{spec.active}.")
        obj = _replace_at(obj, path, spec.target, value)
    if obj is None:
        raise ValueError(_format(problems))
    if value_problems is not None:
        value_problems.extend(problems + check(obj))
        return obj
    problems += check(obj)
    if problems:
        raise ValueError(_format(problems))
    return obj


def _build(schema: type[T], leaves: list[list[tuple[str, Any]]], problems: list[str], prefix: str) -> T | None:
    """``schema`` merged with every layer's leaves; bad leaves become problems (and are
    skipped, so the result is well-formed and its values can be checked too). None when even
    that fails (e.g. a missing mandatory value)."""
    merged = OmegaConf.structured(schema)
    required: set[str] = set()
    for layer in leaves:
        for key, value in layer:
            # "???" (OmegaConf's mandatory marker) leaves a value to the user; merging it would
            # silently keep the default, so it is tracked here until a later layer sets the key.
            if value == MISSING:
                required.add(key)
                continue
            required.discard(key)
            problem = _unknown_key(schema, key, prefix)
            if problem:
                problems.append(problem)
                continue
            field, hint = _field_at(schema, key)
            if isinstance(hint, type) and dataclasses.is_dataclass(hint) and not isinstance(value, (dict, DictConfig)):
                problems.append(_scalar_for_section(prefix + _realias(schema, key), value, hint))
                continue
            if field is not None and field.metadata.get("scalar_as_list") and isinstance(value, str):
                value = [value]  # one path (or pattern) without brackets
            try:
                merged = OmegaConf.merge(merged, _nest(key, value))
            except OmegaConfBaseException as exc:
                problems.append(
                    f"{prefix}{_realias(schema, key)} = {value!r}: {str(exc).splitlines()[0]}; fix: give a value of the declared type"
                )
    problems.extend(
        f"{prefix}{key} = ???: a value this config leaves to you; fix: set it, e.g. {prefix}{key}=VALUE" for key in sorted(required)
    )
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:  # e.g. a missing mandatory value or a bad interpolation
        problems.append(prefix + str(exc).splitlines()[0])
        return None


def _sections(
    schema: type,
    resolvers: Mapping[type, SectionResolver],
    layers: list[Any],
    leaves: list[list[tuple[str, Any]]],
    problems: list[str],
) -> dict[str, tuple[SectionSchema, list]]:
    """Find the nodes of ``schema`` that have a section resolver, ask each how to read its
    non-field keys, and move those keys out of ``leaves`` (in place): into the active
    section's own leaves, or into ``problems``."""
    hooked = _hooked_nodes(schema, resolvers)
    if not hooked:
        return {}
    raw = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=False) if layers else {}
    found: dict[str, tuple[SectionSchema, list]] = {}
    for path, cls in hooked.items():
        node = raw
        for part in path.split(".")[:-1] if path else []:
            node = node.get(part) if isinstance(node, dict) else None
        spec = resolvers[cls](node if isinstance(node, dict) else {})
        if spec.error is not None:
            problems.append(f"{path}{spec.error}")
        fields = {f.name for f in dataclasses.fields(cls)}
        own: list[list[tuple[str, Any]]] = []
        for layer in leaves:
            kept, mine = [], []
            for key, value in layer:
                head, _, rest = key[len(path) :].partition(".") if key.startswith(path) else ("", "", "")
                if not key.startswith(path) or head in fields and head != spec.target:
                    kept.append((key, value))
                elif head == spec.target:
                    problems.append(
                        f"{key}: {spec.target!r} is filled from the backend's own section; fix: write its keys under "
                        f"{path}{spec.active or '<section>'}.*"
                    )
                elif head == spec.active and rest:
                    mine.append((rest, value))
                elif head == spec.active and spec.schema is not None and not isinstance(value, dict):
                    problems.append(_scalar_for_section(key, value, spec.schema))
                elif head == spec.active and value == {}:
                    pass  # an empty section: its defaults
                elif head in spec.foreign:
                    problems.append(f"{key}: {spec.foreign[head]}")
                elif spec.error is None or head not in fields:
                    names = sorted(fields - {spec.target} | set(spec.foreign) | ({spec.active} if spec.active else set()))
                    close = difflib.get_close_matches(head, names, n=1, cutoff=0.5)
                    hint = f"did you mean {path + close[0]!r}?" if close else f"valid keys: {', '.join(names)}"
                    problems.append(f"{key}: unknown key {head!r} at {path.rstrip('.') or 'the top level'}; fix: {hint}")
            layer[:] = kept
            own.append(mine)
        found[path] = (spec, own)
    return found


def _hooked_nodes(schema: type, resolvers: Mapping[type, SectionResolver], path: str = "") -> dict[str, type]:
    """Dotted path prefix (``""`` or ``"engine."``) -> dataclass that has a section resolver."""
    out = {path: schema} if schema in resolvers else {}
    for name, hint in typing.get_type_hints(schema).items():
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.update(_hooked_nodes(hint, resolvers, f"{path}{name}."))
    return out


def _replace_at(obj: Any, path: str, target: str, value: Any) -> Any:
    """``obj`` with ``<path><target>`` set to ``value`` (frozen dataclasses are rebuilt)."""
    if not path:
        return dataclasses.replace(obj, **{target: value})
    head, _, rest = path.partition(".")
    return dataclasses.replace(obj, **{head: _replace_at(getattr(obj, head), rest, target, value)})


# Written before a key in a ``_problems`` message (``f"{SIBLING}warmup_steps"``) to name another
# key of the same section by its full path (``engine.optim.warmup_steps`` in a recipe,
# ``optim.warmup_steps`` in an engine config): a fix must name the key the user types.
SIBLING = "\x00"


def check(obj: Any, prefix: str = "") -> list[str]:
    """Every problem reported by ``_problems()`` of ``obj`` and its nested dataclasses."""
    found: list[str] = []
    if not dataclasses.is_dataclass(obj):
        return found
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _non_finite(value):
            found.append(f"{prefix}{f.name} = {value!r}: not a finite number; fix: give a finite value (NaN and inf are never valid)")
    own = getattr(obj, "_problems", None)
    if own is not None:
        found += [f"{prefix}{p}".replace(SIBLING, prefix) for p in own()]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        # A nested section that names itself (a backend's options) is reported under that name.
        label = getattr(type(value), "config_section", None) or f.metadata.get("key", f.name)
        found += check(value, f"{prefix}{label}.")
    return found


def _non_finite(value: Any) -> bool:
    """A float (or a list/tuple holding one) that is NaN or infinite."""
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return isinstance(value, float) and not math.isfinite(value)


def validate(obj: Any) -> None:
    """Raise one ``ValueError`` listing every problem of ``obj`` (see :func:`check`)."""
    problems = check(obj)
    if problems:
        raise ValueError(_format(problems))


def _format(problems: list[str]) -> str:
    return f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems)


def _leaves(container: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Flatten nested dicts to (dotted key, value); lists and scalars are leaves."""
    if not isinstance(container, dict) or not container:
        return [(prefix[:-1], container)] if prefix else []
    out = []
    for k, v in container.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [(f"{prefix}{k}", v)]
    return out


def _unalias(schema: type, key: str) -> str:
    """``key`` with every part that is a field's ``key`` alias (``dataclasses.field`` metadata
    ``{"key": "async"}``: a config key that is a Python keyword) replaced by the field's name."""
    cls: Any = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            break
        fields = dataclasses.fields(cls)
        alias = next((f.name for f in fields if f.metadata.get("key") == part), None)
        parts[i] = alias or part
        cls = typing.get_type_hints(cls).get(parts[i])
    return ".".join(parts)


def _realias(schema: type, key: str) -> str:
    """``key`` (field names) as the user writes it: each aliased field by its ``key``."""
    cls: Any = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            break
        field = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if field is None:
            break
        parts[i] = field.metadata.get("key", part)
        cls = typing.get_type_hints(cls).get(part)
    return ".".join(parts)


def _nest(key: str, value: Any) -> DictConfig:
    node: Any = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return OmegaConf.create(node)


def _field_at(schema: type, key: str) -> tuple[dataclasses.Field | None, Any]:
    """The dataclass field that dotted ``key`` names in ``schema`` and its type hint;
    ``(None, None)`` when the path leaves the dataclasses (e.g. inside a dict-typed field)."""
    cls: Any = schema
    field, hint = None, None
    for part in key.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return None, None
        field = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if field is None:
            return None, None
        hint = cls = typing.get_type_hints(cls).get(part)
    return field, hint


def _scalar_for_section(key: str, value: Any, section: type) -> str:
    """The message for a scalar (or list) given where a section (a mapping of keys) belongs."""
    names = [f.name for f in dataclasses.fields(section)]
    example = next((n for n in names if not dataclasses.is_dataclass(typing.get_type_hints(section).get(n))), names[0] if names else "key")
    return (
        f"{key} = {value!r}: {key} is a section (a mapping of keys), and a {type(value).__name__} is not a mapping; fix: set a key "
        f"inside it, e.g. {key}.{example}=... on the command line or `{key.rsplit('.', 1)[-1]}: {{{example}: ...}}` in YAML "
        f"(its keys: {', '.join(names)})"
    )


def _unknown_key(schema: type, key: str, prefix: str = "") -> str | None:
    """A message if ``key`` (dotted) is not a field path of ``schema``, else None. ``prefix``
    is where ``schema`` sits in the user's config (e.g. ``megatron.`` for a backend section)."""
    cls: Any = schema
    walked = [prefix.rstrip(".")] if prefix else []
    for part in key.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return None  # below a leaf (e.g. a dict-typed field): OmegaConf checks the type
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            where = ".".join(walked) or "the top level"
            close = difflib.get_close_matches(part, list(names), n=1, cutoff=0.5)
            shown = {n: f.metadata.get("key", n) for n, f in names.items()}
            hint = (
                f"did you mean {'.'.join([*walked, shown[close[0]]])!r}?"
                if close
                else f"valid keys at {where}: {', '.join(sorted(shown.values()))}"
            )
            return f"{prefix}{_realias(schema, key)}: unknown key {part!r} at {where}; fix: {hint}"
        walked.append(names[part].metadata.get("key", part))
        cls = typing.get_type_hints(cls).get(part)
    return None
