"""Load frozen dataclass configs from YAML / mappings + OmegaConf dot-list overrides.

Generic over the schema, so recipes reuse it for their own top-level configs. Every problem
is collected before raising: misspelt keys (with the closest valid key), values of the wrong
type, non-finite numbers (NaN and +-inf are refused in every float field: no setting of this
project means "infinite", and a NaN passes every ``x < 0``-style range check), and the schema's
own value checks (a dataclass may define ``_problems(self) -> list[str]``; they are gathered
from every nested dataclass). One ``ValueError`` lists them all, each naming the field, the
value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


def load_typed(schema: type[T], source: str | os.PathLike | Mapping | None = None, overrides: Sequence[str] = ()) -> T:
    """Merge ``source`` (a YAML path or a mapping) and dot-list ``overrides`` onto ``schema``.

    Returns:
        An instance of the frozen dataclass ``schema``.

    Raises:
        ValueError: listing every unknown key, type error and invalid value.
    """
    layers = []
    if source is not None:
        layers.append(OmegaConf.load(source) if isinstance(source, (str, os.PathLike)) else OmegaConf.create(dict(source)))
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    problems: list[str] = []
    merged = OmegaConf.structured(schema)
    for layer in layers:
        leaves = _leaves(OmegaConf.to_container(layer, resolve=False))
        for key, value in leaves:
            problem = _unknown_key(schema, key)
            if problem:
                problems.append(problem)
                continue
            try:
                merged = OmegaConf.merge(merged, _nest(key, value))
            except OmegaConfBaseException as exc:
                problems.append(f"{key} = {value!r}: {str(exc).splitlines()[0]}; fix: give a value of the declared type")
    # Bad leaves were skipped above, so the merged config is well-formed: check its values too
    # and report everything in one error.
    try:
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:  # e.g. a missing mandatory value or a bad interpolation
        raise ValueError(_format([*problems, str(exc).splitlines()[0]])) from None
    problems += check(obj)
    if problems:
        raise ValueError(_format(problems))
    return obj


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
        found += [f"{prefix}{p}" for p in own()]
    for f in dataclasses.fields(obj):
        found += check(getattr(obj, f.name), f"{prefix}{f.name}.")
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


def _nest(key: str, value: Any) -> DictConfig:
    node: Any = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return OmegaConf.create(node)


def _unknown_key(schema: type, key: str) -> str | None:
    """A message if ``key`` (dotted) is not a field path of ``schema``, else None."""
    cls: Any = schema
    walked = []
    for part in key.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return None  # below a leaf (e.g. a dict-typed field): OmegaConf checks the type
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            where = ".".join(walked) or "the top level"
            close = difflib.get_close_matches(part, list(names), n=1, cutoff=0.5)
            hint = f"did you mean {'.'.join([*walked, close[0]])!r}?" if close else f"valid keys at {where}: {', '.join(sorted(names))}"
            return f"{key}: unknown key {part!r} at {where}; fix: {hint}"
        walked.append(part)
        cls = typing.get_type_hints(cls).get(part)
    return None
