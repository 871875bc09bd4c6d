"""The Tinker API server's old module path, kept so that ``python -m recipes.tinker_server`` and
``import recipes.tinker_server.<module>`` keep working: the server now lives in the top-level
package ``tinker_server`` (docs/tinker.md); each submodule here IS that package's module (one
object, not a copy), so state and monkeypatches are shared."""

from __future__ import annotations

import importlib
import sys

_MODULES = (
    "app",
    "checkpoints",
    "config",
    "contract",
    "datums",
    "demo",
    "engines",
    "factory",
    "futures",
    "ray_engine",
    "shared_engine",
    "signature",
    "snapshots",
    "tenants",
    "wire",
)
for _name in _MODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"tinker_server.{_name}")
