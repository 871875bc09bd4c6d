"""No module under ``tests/`` imports a test module (``test_*``) or a ``conftest``: shared
helpers live in ``tests/support/`` (or in a helper module of their folder). Importing a test
module runs its module-level code and fixtures a second time under another name, and ties one
test file's private helpers to another's; the scan reads the sources only (nothing imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in dotted.split("."))


def offending_imports(root: Path) -> list[str]:
    """``path:line: statement`` for every import of a ``test_*`` module or ``conftest`` in the
    Python files under ``root`` (at any depth, also inside functions; relative ones too)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                # ``from pkg import test_x`` imports the module test_x as much as ``import pkg.test_x``.
                names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(_is_test_module(name) for name in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_under_tests_imports_a_test_module_or_conftest():
    found = offending_imports(TESTS)
    assert not found, "move what these import into tests/support/:\n" + "\n".join(found)


def test_the_scan_finds_each_form_of_such_an_import(tmp_path):
    sources = {
        "a.py": "from tests.roles.test_roles import _engine\n",
        "b.py": "def f():\n    import tests.backends.test_megatron as m\n",
        "c.py": "from tests.reliability import test_checkpoint_crash\n",
        "d.py": "from . import conftest\n",
        "e.py": "from .test_x import y\n",
        "ok.py": "from tests.support.launch import run_distributed\nfrom tests.reliability._step_common import run\n",
    }
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    assert [line.split(":")[0] for line in offending_imports(tmp_path)] == ["a.py", "b.py", "c.py", "d.py", "e.py"]
