"""The engine-config loader: :func:`load_config` and the resolver of the backend sections.

It joins ``engine_api.config`` (no backend knowledge) and ``engine_api.registry`` (which class a
strategy names): :func:`engine_sections` is registered for ``EngineConfig`` with the generic
loader, so an ``EngineConfig`` alone or nested in a recipe's config (``engine.*``) resolves its
section. The ``engine_api`` package imports this module, so the registration is always in place.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from engine_api.config import EngineConfig
from engine_api.registry import available_engines, get_engine_class, section_of, strategy_problem
from engine_api.typed_config import SectionSchema, load_typed, register_sections


def engine_sections(raw: Mapping[str, Any]) -> SectionSchema:
    """How the loader reads an engine config's keys that are not ``EngineConfig`` fields: the
    strategy's section against its ``options_class``, another backend's section refused.

    The strategy is resolved here, at load and before anything is built, so a misspelt one is
    reported before a recipe spends time on data, tokenizer or model. Its class is imported only
    when a section key is present: a config without backend keys loads without importing any
    backend (``build_engine`` fills in the backend's defaults).
    """
    strategy = raw.get("strategy", EngineConfig.strategy)
    if strategy is None:  # the override ``strategy=`` (null): the type check reports it
        return SectionSchema(target="backend")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    problem = strategy_problem(str(strategy))
    if problem is not None or all(k in fields for k in raw):
        return SectionSchema(target="backend", error=problem)
    try:
        cls = get_engine_class(str(strategy))
    except ValueError as exc:  # e.g. the module imports but fails, or names no engine class
        return SectionSchema(target="backend", error=str(exc))
    known = {name: section_of(name) for name in available_engines()}
    options = cls.options_class
    active = options.config_section if options is not None else None
    foreign = {
        section: f"belongs to backend {name!r}, but strategy = {strategy!r}; fix: remove it, or set strategy={name}"
        for name, section in known.items()
        if section != active
    }
    if options is None and isinstance(strategy, str) and strategy.isidentifier():
        foreign[strategy] = f"backend {strategy!r} declares no settings (no options_class); fix: remove these keys"
    return SectionSchema(target="backend", active=active, schema=options, foreign=foreign)


register_sections(EngineConfig, engine_sections)


def load_config(source: str | os.PathLike | Mapping | None = None, overrides: Sequence[str] = ()) -> EngineConfig:
    """Load an :class:`EngineConfig` from a YAML path or a mapping, plus dot-list overrides.

    Example: ``load_config("configs/engine/fsdp.yaml", ["micro_batch_size=2", "optim.lr=1e-4"])``.

    Raises:
        ValueError: one error listing every misspelt key (with the closest valid key), every
            wrong type and every invalid value, each with the field, the value and the fix; a
            strategy that names no engine is one of them.
    """
    return load_typed(EngineConfig, source, overrides)
