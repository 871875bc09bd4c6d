"""Backends reach ``engine_api`` through ``engine_api.kit`` only, checked statically (``ast``,
nothing imported): every import statement, function bodies included, of every module under
``backends/``, of the worked example ``tests/reference_engine.py`` and of the conformance kit's
broken engines. ``from engine_api import kit`` and ``from engine_api.kit import ...`` are the
only forms allowed, so the kit's ``__all__`` is the whole surface a backend depends on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "backends").rglob("*.py")) + [
    ROOT / "tests" / "reference_engine.py",
    ROOT / "tests" / "conformance" / "broken_engines.py",
]


def off_kit_imports(source: str) -> list[str]:
    """``engine_api`` imports of ``source`` that do not go through ``engine_api.kit``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad += [
                f"line {node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "engine_api" and a.name != "engine_api.kit"
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "engine_api":
            names = [a.name for a in node.names]
            if node.module == "engine_api.kit" or (node.module == "engine_api" and names == ["kit"]):
                continue
            bad.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
    return bad


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_backend_modules_import_only_the_kit(path):
    bad = off_kit_imports(path.read_text())
    assert not bad, (
        f"{path.relative_to(ROOT)} imports engine_api past the kit: {bad}; fix: import it from engine_api.kit (export it there if missing)"
    )


def test_the_check_sees_every_way_past_the_kit():
    """The rule's teeth: each form that reaches past the kit is reported, the two kit forms are not."""
    assert off_kit_imports("from engine_api import kit\nfrom engine_api.kit import BaseEngine\nimport engine_api.kit\n") == []
    for line in (
        "from engine_api.base import BaseEngine",
        "from engine_api import ckpt_layout",
        "import engine_api.optim",
        "import engine_api",
    ):
        assert off_kit_imports(f"def f():\n    {line}\n"), line


def test_the_kit_exports_every_name_it_declares():
    import engine_api.kit as kit

    missing = [name for name in kit.__all__ if not hasattr(kit, name)]
    assert not missing and len(set(kit.__all__)) == len(kit.__all__), missing
