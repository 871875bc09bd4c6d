"""How a plug-in name resolves, shared by the engine registry (``engine.strategy``) and the
rollout registry (``rollout.backend``): a name registered in this process, a built-in or an
entry point (``name -> "package.module:ClassName"``, found without importing anything), or an
import path ``package.module:ClassName``; the class is imported on first use."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping


def is_import_path(name: str) -> bool:
    """Whether ``name`` has the ``package.module:ClassName`` form."""
    module, sep, cls = name.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and cls.isidentifier()


def module_exists(module: str) -> bool:
    """Whether ``module`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def known_specs(builtins: Mapping[str, str], group: str) -> dict[str, str]:
    """name -> ``"module:Class"`` of ``builtins`` and the entry points of ``group`` (a built-in
    wins over an entry point of the same name)."""
    specs = dict(builtins)
    for ep in importlib.metadata.entry_points(group=group):
        specs.setdefault(ep.name, ep.value)
    return specs


def import_class(field: str, name: str, spec: str, check: Callable[[object, str], None]) -> type:
    """The class ``spec`` (``module:Class``) names, for the setting ``field = name``; ``check``
    raises ``TypeError`` or ``ValueError`` for a class of the wrong kind.

    Raises:
        ValueError: the module does not import, has no such attribute, or ``check`` refused it.
    """
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{field} = {name!r}: cannot import module {module_name!r} ({exc}); "
            "fix: install the package that provides it or put its directory on PYTHONPATH"
        ) from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"{field} = {name!r}: module {module_name!r} has no attribute {class_name!r}; fix: name the class")
    try:
        check(cls, f"{field} = {name!r}")
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return cls
