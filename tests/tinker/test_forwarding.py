"""The old module path ``recipes.tinker_server`` forwards to ``tinker_server`` until its removal
date: the same module objects (submodules of subpackages too), and one ``DeprecationWarning``
naming the date, however often it is imported. In a fresh interpreter: this process may have
imported it already."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.launch import REPO

_PROBE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import recipes.tinker_server
    import recipes.tinker_server.shared_engine as old_engine
    import recipes.tinker_server.routes.training as old_router
    import recipes.tinker_server
import tinker_server.shared_engine, tinker_server.routes.training
print(json.dumps({
    "warnings": [(w.category.__name__, str(w.message)) for w in caught if "recipes.tinker_server" in str(w.message)],
    "same": [old_engine is tinker_server.shared_engine, old_router is tinker_server.routes.training],
    "removed_after": recipes.tinker_server.REMOVED_AFTER,
}))
"""


def test_the_old_module_path_forwards_and_warns_once_with_its_removal_date():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"] == [True, True]
    assert got["removed_after"] == "2027-03-01"
    [(category, message)] = got["warnings"]
    assert category == "DeprecationWarning" and "removed after 2027-03-01" in message and "tinker_server" in message
