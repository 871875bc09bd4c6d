"""The seams between the project's packages, checked statically: every module is parsed with
``ast``, nothing is imported.

* The graph of *module-level* imports (the imports a module executes when it is imported: its
  top-level statements and those nested in top-level ``if`` / ``try`` / ``with`` / ``for`` /
  class bodies, but not function bodies, nor ``if TYPE_CHECKING:`` blocks) of ``engine_api``,
  ``backends``, ``roles``, ``posttrain``, ``recipes`` and ``benchmarks`` has no cycle. ``from pkg import name``
  where ``pkg.name`` is a module is an edge to that module, otherwise an edge to ``pkg``; a
  package's ``__init__`` is the module ``pkg``. The implicit import of a module's parent
  packages is not an edge (else every ``__init__`` that re-exports a submodule would close a
  cycle with it).
* Nor has that graph plus the function-level (lazy) imports: a lazy import breaks a cycle at
  import time but not the dependency between the two modules (``roles.factory`` imports
  ``roles.legacy`` lazily, so ``roles.legacy`` may not import ``roles.factory``). That holds
  inside one package too: ``engine_api.config`` once reached back to ``engine_api.registry``
  lazily, and now the loader (``engine_api.loader``) is what joins the two.
* ``engine_api`` imports nothing from ``backends``, ``roles``, ``posttrain`` or ``recipes``, not
  even inside a function. (``engine_api.registry`` loads the built-in backends by module-name
  *string* through ``importlib``, which is not an import statement.)
* ``recipes`` and the ``posttrain`` library import nothing from ``backends`` (they reach a backend
  through the ``engine_api`` contract only), and ``posttrain`` nothing from ``recipes``, not even
  inside a function.

Modules are discovered from the file tree, so new modules and subpackages are covered as they
appear.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_api", "backends", "roles", "posttrain", "recipes", "tinker_server", "benchmarks")
ENGINE_API_MAY_NOT_IMPORT = ("backends", "roles", "posttrain", "recipes", "tinker_server")
# package -> the packages it may not import, function bodies included.
MAY_NOT_IMPORT = {"recipes": ("backends",), "posttrain": ("backends", "recipes"), "tinker_server": ("backends", "recipes")}

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


# ---------------------------------------------------------------------------------- analysis
def discover(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under each package directory."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_imports(body: Iterable[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``body`` that run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # runs when called, not at import
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from import_time_imports(node.orelse)
        else:  # if / try / with / for / while / match / class bodies all run at import
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or ():
                    yield from import_time_imports([child] if isinstance(child, ast.stmt) else child.body)


def all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of the module, function bodies included."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute dotted names ``node`` imports; for ``from base import name`` both
    ``base.name`` (in case it is a submodule) and ``base``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        base = ".".join([*anchor, *([base] if base else [])])
    return [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"] + [base]


def resolve(name: str, modules: Iterable[str]) -> str | None:
    """The project module ``name`` executes: its longest prefix that is a project module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def import_graph(modules: dict[str, Path], lazy: bool = False) -> Graph:
    """Edges between project modules: the module-level imports, plus (``lazy``) the
    function-level ones."""
    graph: Graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = graph.setdefault(module, {})
        at_import = list(import_time_imports(tree.body))
        function_level = [node for node in all_imports(tree) if lazy and node not in at_import]
        for node in at_import + function_level:
            names = imported_names(node, module, is_package)
            if isinstance(node, ast.ImportFrom):
                # ``from base import name``: the submodule ``base.name`` when there is one, else ``base``.
                *subs, base = names
                targets = [sub if sub in modules else base for sub in subs] or [base]
            else:
                targets = names
            for target in filter(None, (resolve(t, modules) for t in targets)):
                if target == module:
                    continue
                edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    out = []
    for component in components:
        members, start = set(component), min(component)
        # Shortest path from start back to start inside the component (BFS).
        parent: dict[str, str] = {}
        frontier, end = [start], None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, {})):
                    if w == start:
                        end = v
                        break
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [start]
        v = end
        while v != start:
            path.append(v)
            v = parent[v]
        out.append([start, *reversed(path[1:]), start])
    return sorted(out)


def describe(cycle: list[str], graph: Graph, modules: dict[str, Path], root: Path) -> str:
    steps = [f"  {a} ({modules[a].relative_to(root)}:{graph[a][b]}) imports {b}" for a, b in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


# ---------------------------------------------------------------------------------- the checks
def _assert_acyclic(lazy: bool) -> None:
    modules = discover(ROOT, PACKAGES)
    assert "engine_api" in modules and "roles.factory" in modules, "module discovery found nothing"
    graph = import_graph(modules, lazy=lazy)
    found = cycles(graph)
    what = "import cycles (lazy imports between packages included)" if lazy else "module-level import cycles"
    message = f"{what}:\n" + "\n\n".join(describe(c, graph, modules, ROOT) for c in found)
    if found:
        print(message)
    assert not found, message


def test_module_level_imports_have_no_cycle():
    _assert_acyclic(lazy=False)


def test_no_cycle_even_through_lazy_imports_between_packages():
    """A lazy import only hides a cycle from the import machinery: the two packages still depend
    on each other (``roles.factory`` imports ``roles.legacy`` inside ``build_roles``, so
    ``roles.legacy`` must not import ``roles.factory`` back; what both need is in
    ``roles.legacy_flag``)."""
    _assert_acyclic(lazy=True)


def engine_api_violations(root: Path) -> list[str]:
    """Every import (function bodies included) of an ``engine_api`` module from ``backends``,
    ``roles`` or ``recipes``."""
    offending = set()
    for module, path in discover(root, ("engine_api",)).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in all_imports(tree):
            for name in imported_names(node, module, path.name == "__init__.py"):
                if name.split(".")[0] in ENGINE_API_MAY_NOT_IMPORT:
                    offending.add(f"{path.relative_to(root)}:{node.lineno}: {module} imports {name}")
    return sorted(offending)


def test_engine_api_imports_no_backend_role_or_recipe():
    offending = engine_api_violations(ROOT)
    assert not offending, "engine_api must not depend on backends/roles/recipes:\n" + "\n".join(offending)


def forbidden_imports(root: Path, rules: dict[str, tuple[str, ...]]) -> list[str]:
    """Every import (function bodies included) of a module of a package in ``rules`` from one of
    the packages ``rules`` forbids it."""
    offending = set()
    for package, forbidden in rules.items():
        for module, path in discover(root, (package,)).items():
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in all_imports(tree):
                for name in imported_names(node, module, path.name == "__init__.py"):
                    if name.split(".")[0] in forbidden:
                        offending.add(f"{path.relative_to(root)}:{node.lineno}: {module} imports {name}")
    return sorted(offending)


def test_recipes_and_posttrain_import_no_backend():
    """The scripts and their library reach a backend through ``engine_api`` only (the adapter
    export builds peft's config from the engine config, ``posttrain.export``)."""
    offending = forbidden_imports(ROOT, {package: ("backends",) for package in MAY_NOT_IMPORT})
    assert not offending, "recipes and posttrain must not import backends:\n" + "\n".join(offending)


def test_posttrain_imports_no_recipe():
    """``posttrain`` is the library the recipes are built from, never the other way round."""
    offending = forbidden_imports(ROOT, {"posttrain": ("recipes",)})
    assert not offending, "posttrain must not import recipes:\n" + "\n".join(offending)


def test_the_server_is_its_own_room_at_the_recipes_floor():
    """The Tinker server (``tinker_server``) builds on the contract, the roles and ``posttrain``,
    and nothing below it knows of it; it imports no backend and no recipe (the old module path
    ``recipes.tinker_server`` forwards to it, not the other way round)."""
    below = {package: ("tinker_server",) for package in ("engine_api", "backends", "roles", "posttrain")}
    offending = forbidden_imports(ROOT, {**below, "tinker_server": ("backends", "recipes")})
    assert not offending, "the server's seams:\n" + "\n".join(offending)


# ---------------------------------------------------------------------------------- the checker itself
def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return discover(tmp_path, ("pkg",))


def test_checker_sees_module_level_cycles_and_not_lazy_imports(tmp_path):
    modules = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "A = 1\nimport os\ntry:\n    from pkg.sub import b\nexcept ImportError:\n    pass\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "if True:\n    from ..c import C\n",
            "pkg/c.py": "from .a import A as C\n\ndef f():\n    from pkg import d\n",
            "pkg/d.py": "import pkg.c\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
            "pkg/e.py": "import pkg.d\n",
            "pkg/x.py": "def f():\n    from pkg.sub import y\n",
            "pkg/sub/y.py": "from pkg import x\n",
        },
    )
    graph = import_graph(modules)
    assert graph["pkg"] == {"pkg.a": 1}  # the parent package of pkg.a is not an edge back
    assert graph["pkg.a"] == {"pkg.sub.b": 4}  # inside try; a submodule named by ``from pkg.sub import b``
    assert graph["pkg.sub.b"] == {"pkg.c": 2}  # relative, inside if
    assert graph["pkg.c"] == {"pkg.a": 1}  # the import in f() is lazy
    assert graph["pkg.d"] == {"pkg.c": 1}  # TYPE_CHECKING imports do not run
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert graph["pkg.x"] == {}
    lazy = import_graph(modules, lazy=True)
    assert lazy["pkg.c"] == {"pkg.a": 1, "pkg.d": 4}  # a lazy import counts, inside one package too
    assert lazy["pkg.x"] == {"pkg.sub.y": 2}
    assert cycles(lazy) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"], ["pkg.sub.y", "pkg.x", "pkg.sub.y"]]
    assert "pkg.sub.b" in describe(cycles(graph)[0], graph, modules, tmp_path)


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("import a.b as x, c", "m", False, ["a.b", "c"]),
        ("from a import b, c", "m", False, ["a.b", "a.c", "a"]),
        ("from . import b", "p.q.m", False, ["p.q.b", "p.q"]),
        ("from .. import b", "p.q.m", False, ["p.b", "p"]),
        ("from .x import *", "p.q", True, ["p.q.x"]),
    ],
)
def test_imported_names(source, module, is_package, expected):
    assert imported_names(ast.parse(source).body[0], module, is_package) == expected


def test_checker_sees_engine_api_importing_a_backend_inside_a_function(tmp_path):
    files = {
        "engine_api/__init__.py": "",
        "engine_api/ok.py": "import importlib\n\ndef load(name):\n    return importlib.import_module(f'backends.{name}')\n",
        "engine_api/bad.py": "def f():\n    from backends.fsdp import engine\n    import roles\n",
    }
    _tree(tmp_path, files)
    assert engine_api_violations(tmp_path) == [
        "engine_api/bad.py:2: engine_api.bad imports backends.fsdp",
        "engine_api/bad.py:2: engine_api.bad imports backends.fsdp.engine",
        "engine_api/bad.py:3: engine_api.bad imports roles",
    ]


def test_checker_sees_a_lazy_backend_import_from_the_library(tmp_path):
    files = {
        "posttrain/__init__.py": "",
        "posttrain/ok.py": "from engine_api.config import LoraConfig\nimport peft\n",
        "posttrain/bad.py": "def f():\n    from backends.fsdp.lora import apply_lora\n    import recipes.common\n",
        "recipes/__init__.py": "",
        "recipes/run.py": "from posttrain import ok\n\ndef g():\n    import backends\n",
    }
    _tree(tmp_path, files)
    assert forbidden_imports(tmp_path, MAY_NOT_IMPORT) == [
        "posttrain/bad.py:2: posttrain.bad imports backends.fsdp.lora",
        "posttrain/bad.py:2: posttrain.bad imports backends.fsdp.lora.apply_lora",
        "posttrain/bad.py:3: posttrain.bad imports recipes.common",
        "recipes/run.py:4: recipes.run imports backends",
    ]


def private_imports_between_recipes(root: Path) -> list[str]:
    """``path:line: statement`` for every import by a recipe of another recipe module's private
    (``_``-prefixed) name: a recipe is a script; what two recipes share lives in ``posttrain``
    (or is public in one of them), never reached for through the other's internals."""
    found = []
    for module, path in discover(root, ["recipes"]).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in all_imports(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("recipes") or node.module == module:
                continue
            private = [alias.name for alias in node.names if alias.name.startswith("_")]
            if private:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {module} imports {node.module}.{', '.join(private)}")
    return found


def test_no_recipe_imports_another_recipes_private_names(tmp_path):
    assert private_imports_between_recipes(ROOT) == []
    _tree(tmp_path, {"recipes/__init__.py": "", "recipes/a.py": "_x = 1\n", "recipes/b.py": "def f():\n    from recipes.a import _x, y\n"})
    assert private_imports_between_recipes(tmp_path) == ["recipes/b.py:2: recipes.b imports recipes.a._x"]
