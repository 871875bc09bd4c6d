"""DEPRECATED: the Tinker API server's old module path, removed after 2027-03-01; use the
top-level package ``tinker_server`` (``python -m tinker_server``, ``import tinker_server.<module>``;
docs/tinker.md).

Until then ``python -m recipes.tinker_server`` and ``import recipes.tinker_server.<module>`` keep
working: each submodule here IS that package's module (one object, not a copy), so state and
monkeypatches are shared. Importing this package warns once (``DeprecationWarning``).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

REMOVED_AFTER = "2027-03-01"

warnings.warn(
    f"recipes.tinker_server is deprecated and will be removed after {REMOVED_AFTER}; use the package tinker_server "
    "(python -m tinker_server, import tinker_server.<module>)",
    DeprecationWarning,
    stacklevel=2,
)

_package = importlib.import_module("tinker_server")
for _info in pkgutil.walk_packages(_package.__path__, "tinker_server."):
    if _info.name.rsplit(".", 1)[-1] == "__main__":
        continue  # python -m recipes.tinker_server runs this package's own __main__
    sys.modules[__name__ + _info.name[len("tinker_server") :]] = importlib.import_module(_info.name)
