"""Engine registry: ``@register_engine(name)``, ``build_engine(config)``, ``available_engines()``.

The built-in backends are imported lazily, by name, the first time they are asked for, so
``import engine_api`` never imports megatron or transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from engine_api.base import BaseEngine
from engine_api.config import EngineConfig, config_problems

# name -> module whose import registers it
_BUILTINS = {"fsdp": "backends.fsdp", "megatron": "backends.megatron"}
_REGISTRY: dict[str, type[BaseEngine]] = {}


def register_engine(name: str) -> Callable[[type[BaseEngine]], type[BaseEngine]]:
    """Class decorator registering a :class:`BaseEngine` subclass under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
        TypeError: the class is not a ``BaseEngine`` subclass.
    """

    def decorator(cls: type[BaseEngine]) -> type[BaseEngine]:
        if not (isinstance(cls, type) and issubclass(cls, BaseEngine)):
            raise TypeError(f"@register_engine({name!r}) needs a BaseEngine subclass, got {cls!r}")
        if name in _REGISTRY:
            raise ValueError(
                f"engine {name!r} is already registered (by {_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}); "
                "fix: pick another name or unregister_engine() it first"
            )
        _REGISTRY[name] = cls
        return cls

    return decorator


def unregister_engine(name: str) -> None:
    """Remove ``name`` from the registry (for tests and plugins that re-register)."""
    _REGISTRY.pop(name, None)


def available_engines() -> list[str]:
    """Names that :func:`build_engine` accepts: registered engines plus built-in backends
    whose package is installed (found without importing it)."""
    builtins = [n for n, mod in _BUILTINS.items() if _module_exists(mod)]
    return sorted(set(_REGISTRY) | set(builtins))


def get_engine_class(name: str) -> type[BaseEngine]:
    """The engine class registered as ``name``, importing a built-in backend on first use.

    Raises:
        ValueError: unknown name (the message lists the available ones).
    """
    if name not in _REGISTRY and name in _BUILTINS and _module_exists(_BUILTINS[name]):
        importlib.import_module(_BUILTINS[name])
    if name not in _REGISTRY:
        raise ValueError(
            f"strategy = {name!r} is not a registered engine; available: {', '.join(available_engines()) or 'none'}; "
            "fix: set engine.strategy to one of them, or @register_engine your backend"
        )
    return _REGISTRY[name]


def build_engine(config: EngineConfig) -> BaseEngine:
    """Validate ``config`` and construct (not initialise) the engine named by ``config.strategy``.

    The general checks and the backend's own (``BaseEngine.check_config``: e.g. a tensor-parallel
    size that does not divide the model's heads) run here, before any model, process group or
    optimizer exists, so a bad config never fails mid-run.

    Raises:
        ValueError: the config has problems (all listed at once), or the strategy is unknown.
    """
    problems = config_problems(config)
    try:
        cls = get_engine_class(config.strategy)
    except ValueError:
        if not problems:
            raise
        cls = None
        problems.append(f"strategy = {config.strategy!r}: not a registered engine; fix: use one of {', '.join(available_engines())}")
    if cls is not None:
        problems += cls.check_config(config)
    if problems:
        raise ValueError(f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    return cls(config)


def builtin_engines() -> list[str]:
    """The built-in backends that are installed (they train HF model directories); test
    suites parametrized over it cover a backend added to ``_BUILTINS`` automatically."""
    return sorted(n for n, mod in _BUILTINS.items() if _module_exists(mod))


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
