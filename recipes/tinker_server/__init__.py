"""The Tinker API server's old module path, kept so that ``python -m recipes.tinker_server`` and
``import recipes.tinker_server.<module>`` keep working: the server now lives in the top-level
package ``tinker_server`` (docs/tinker.md); each submodule here IS that package's module (one
object, not a copy; every module of the package, subpackages included), so state and
monkeypatches are shared."""

from __future__ import annotations

import importlib
import pkgutil
import sys

_package = importlib.import_module("tinker_server")
for _info in pkgutil.walk_packages(_package.__path__, "tinker_server."):
    if _info.name.rsplit(".", 1)[-1] == "__main__":
        continue  # python -m recipes.tinker_server runs this package's own __main__
    sys.modules[__name__ + _info.name[len("tinker_server") :]] = importlib.import_module(_info.name)
