"""Engine registry: which class ``engine.strategy`` names, and which settings it owns.

A strategy is one of:

* a name registered with ``@register_engine(name)`` in a module already imported;
* a built-in backend (``fsdp``, ``megatron``: imported on first use, so ``import engine_api``
  never imports megatron or transformers);
* a name published by an installed distribution in the entry-point group
  ``enginekit.backends`` (``name = "package.module:ClassName"`` in its ``pyproject.toml``);
* an import path ``package.module:ClassName`` (the module must be importable: installed or on
  ``PYTHONPATH``); the class is imported and registered under that path on first use.

The class must subclass ``BaseEngine``. Its settings are its ``options_class`` (a frozen
``BackendOptions`` subclass whose ``config_section`` names the engine-config section holding
them, e.g. ``fsdp.*``); the config loader (``engine_api.loader``) reads that section through
:func:`get_engine_class` and :func:`section_of`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine_api.base import BaseEngine
from engine_api.config import BackendOptions, EngineConfig, format_problem, problems_of
from engine_api.plugins import import_class, is_import_path, known_specs, module_exists

ENTRY_POINT_GROUP = "enginekit.backends"
# The backends shipped in this repository: name -> "module:Class" (imported on first use).
_BUILTINS = {"fsdp": "backends.fsdp:FSDPEngine", "megatron": "backends.megatron:MegatronEngine"}
_REGISTRY: dict[str, type[BaseEngine]] = {}
_HOW = (
    "fix: set engine.strategy to one of them, to an import path 'package.module:ClassName' of a BaseEngine subclass, "
    f"or register a name (@register_engine('name') in an imported module, or an entry point in the group {ENTRY_POINT_GROUP!r})"
)


def register_engine(name: str) -> Callable[[type[BaseEngine]], type[BaseEngine]]:
    """Class decorator registering a :class:`BaseEngine` subclass under ``name``.

    Raises:
        ValueError: ``name`` is already registered to another class, or the class's
            ``options_class`` is not usable (see :func:`check_engine_class`).
        TypeError: the class is not a ``BaseEngine`` subclass.
    """

    def decorator(cls: type[BaseEngine]) -> type[BaseEngine]:
        check_engine_class(cls, f"@register_engine({name!r})")
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


def check_engine_class(cls: object, where: str) -> None:
    """Raise unless ``cls`` is a ``BaseEngine`` subclass whose ``options_class`` (if any) is a
    frozen dataclass subclassing ``BackendOptions``, with an identifier ``config_section`` that
    is not an ``EngineConfig`` field."""
    if not (isinstance(cls, type) and issubclass(cls, BaseEngine)):
        raise TypeError(f"{where} needs a BaseEngine subclass, got {cls!r}; fix: subclass engine_api.BaseEngine")
    options = cls.options_class
    if options is None:
        return
    section = getattr(options, "config_section", None)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    # ``__dataclass_fields__`` in the class's own namespace: decorated itself, not only through its base.
    declared = isinstance(options, type) and dataclasses.is_dataclass(options) and "__dataclass_fields__" in vars(options)
    if not (declared and issubclass(options, BackendOptions) and options.__dataclass_params__.frozen):
        raise ValueError(
            f"{where}: options_class = {options!r} is not a frozen dataclass subclassing engine_api.kit.BackendOptions "
            "(EngineConfig.backend holds it); fix: declare it as @dataclass(frozen=True) class MyOptions(BackendOptions)"
        )
    if not (isinstance(section, str) and section.isidentifier()) or section in fields:
        raise ValueError(
            f"{where}: {options.__qualname__}.config_section = {section!r} must be an identifier that is not an engine "
            f"config field ({', '.join(sorted(fields))}); fix: declare config_section: ClassVar[str] = '<your backend name>'"
        )


def available_engines() -> list[str]:
    """Names that :func:`build_engine` accepts without an import path: registered engines,
    installed built-ins and entry points (found without importing them)."""
    return sorted(set(_REGISTRY) | set(_known_specs()))


def builtin_engines() -> list[str]:
    """The built-in backends that are installed (they train HF model directories); test
    suites parametrized over it cover a backend added to ``_BUILTINS`` automatically."""
    return sorted(n for n, spec in _BUILTINS.items() if module_exists(spec.partition(":")[0]))


def strategy_problem(strategy: str) -> str | None:
    """Why ``strategy`` cannot name an engine, found without importing any backend (None when
    it can): empty, not registered, not an installed built-in or entry point, and not an import
    path of a module that exists. Config loading calls it, so a typo fails in milliseconds."""
    if not strategy:
        return format_problem("strategy", strategy, "empty", "name a registered engine, e.g. fsdp or megatron")
    if strategy in _REGISTRY or strategy in _known_specs():
        return None
    if is_import_path(strategy):
        module = strategy.partition(":")[0]
        if module_exists(module):
            return None
        return (
            f"strategy = {strategy!r}: cannot import module {module!r} (no such module); "
            "fix: install the package that provides it or put its directory on PYTHONPATH"
        )
    return _unknown_strategy(strategy)


def _unknown_strategy(strategy: str) -> str:
    return f"strategy = {strategy!r} is not a registered engine; available: {', '.join(available_engines()) or 'none'}; {_HOW}"


def get_engine_class(strategy: str) -> type[BaseEngine]:
    """The engine class ``strategy`` names (see the module docstring), importing and
    registering it on first use.

    Raises:
        ValueError: unknown name, or an import path that does not import or does not name a
            ``BaseEngine`` subclass; the message lists the available names and how to register.
    """
    if strategy in _REGISTRY:
        return _REGISTRY[strategy]
    specs = _known_specs()
    spec = specs.get(strategy) or (strategy if is_import_path(strategy) else None)
    if spec is None:
        raise ValueError(_unknown_strategy(strategy))
    cls = import_class("strategy", strategy, spec, check_engine_class)
    if strategy not in _REGISTRY:  # importing the module may have registered it already
        register_engine(strategy)(cls)
    return _REGISTRY[strategy]


def section_of(name: str) -> str:
    """The config section of engine ``name`` without importing it (an engine not yet imported
    is assumed to use its name, as the built-ins do)."""
    cls = _REGISTRY.get(name)
    options = cls.options_class if cls is not None else None
    return options.config_section if options is not None else name


def build_engine(config: EngineConfig) -> BaseEngine:
    """Validate ``config`` and construct (not initialise) the engine named by ``config.strategy``.

    Fills ``config.backend`` with the backend's default options when unset. The general checks
    and the backend's own (``BaseEngine.check_config``: e.g. a tensor-parallel size that does
    not divide the model's heads) run here, before any model, process group or optimizer
    exists, so a bad config never fails mid-run.

    Raises:
        ValueError: the config has problems (all listed at once), or the strategy is unknown.
    """
    try:
        cls = get_engine_class(config.strategy)
    except ValueError as exc:
        problems = problems_of(config)
        if not problems:
            raise
        raise ValueError(f"{len(problems) + 1} config problem(s):\n" + "\n".join(f"  - {p}" for p in [*problems, str(exc)])) from None
    options = cls.options_class
    wrong_type = []
    if options is not None and config.backend is None:
        config = dataclasses.replace(config, backend=options())
    elif config.backend is not None and (options is None or not isinstance(config.backend, options)):
        want = options.__qualname__ if options is not None else "None (this backend has no settings)"
        wrong_type.append(
            f"backend = {type(config.backend).__qualname__}: strategy {config.strategy!r} takes {want}; "
            "fix: build the config with load_config, or pass that class"
        )
    problems = problems_of(config) + wrong_type
    if config.model.lora.enabled and not cls.supports_lora:
        problems.append(
            f"model.lora.rank = {config.model.lora.rank}: the {config.strategy!r} backend does not support LoRA; "
            "fix: set engine.model.lora.rank=0, or use a backend that supports it (fsdp)"
        )
    if not wrong_type:
        problems += cls.check_config(config)
    if problems:
        raise ValueError(f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    return cls(config)


def _known_specs() -> dict[str, str]:
    """name -> "module:Class" for installed built-ins and entry points (nothing imported)."""
    return known_specs({n: spec for n, spec in _BUILTINS.items() if module_exists(spec.partition(":")[0])}, ENTRY_POINT_GROUP)
