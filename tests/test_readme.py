"""The README's API example runs as written, and what the README names (make targets, modules,
files, links) exists."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.launch import run_script

ROOT = Path(__file__).resolve().parents[1]


def test_readme_api_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    result = run_script(["-c", blocks[0]], timeout=120)
    assert result.returncode == 0, result.stderr
    # Hand computation (seq-mean-token-mean, fake log_probs = -0.1 * position, loss = -lp * adv):
    # seq 1: (0.2 + 0.3) / 2 = 0.25; seq 2: (-0.1 - 0.2) / 2 = -0.15; seq 3: (0.6 + 0.8) / 2 = 0.7.
    assert "2 micro-batches, global loss 0.2667" in result.stdout


def test_readme_engine_example_runs():
    """The second block continues the first (same names) with the FSDP engine."""
    text = (ROOT / "README.md").read_text()
    first, second = re.findall(r"```python\n(.*?)```", text, flags=re.S)[:2]
    result = run_script(["-c", first + second], timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"loss \d+\.\d+, grad norm \d+\.\d+", result.stdout), result.stdout


# ------------------------------------------------------------------ the README as a map
README_MAX_LINES = 250
# Written by another change (issue 14); the link check below fails until that file exists.
PENDING_DOC = "docs/adding-a-backend.md"
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _doc_files() -> list[Path]:
    extra = [ROOT / name for name in ("CHANGELOG.md", "BENCHMARKS.md", "benchmarks/FINDINGS.md") if (ROOT / name).is_file()]
    return [ROOT / "README.md", *extra, *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M)}


def test_readme_is_a_short_map():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (limit {README_MAX_LINES})"


def test_readme_and_docs_relative_links_resolve():
    """Every relative link in README.md, CHANGELOG.md, BENCHMARKS.md, benchmarks/FINDINGS.md and
    docs/*.md names a file of the repository (and a heading of it, for ``file.md#anchor``)."""
    broken = []
    for path in _doc_files():
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in _LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)} -> {target}"
            if not dest.is_file():
                broken.append(f"{where}: no such file")
            elif not dest.is_relative_to(ROOT):
                broken.append(f"{where}: outside the repository")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading with that anchor")
    pending = "" if (ROOT / PENDING_DOC).is_file() else f"\n({PENDING_DOC} is still to be written; its links fail until it exists)"
    assert not broken, "broken links:\n" + "\n".join(broken) + pending


# ------------------------------------------------------------------ the README's commands are true
def _code_spans(text: str) -> list[str]:
    """Inline code spans and fenced blocks of a markdown text."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return fenced + re.findall(r"`([^`\n]+)`", rest)


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {name for line in re.findall(r"^([A-Za-z0-9_.-][^:=\n]*):(?!=)", text, flags=re.M) for name in line.split()}


def test_every_make_target_the_readme_names_exists():
    """``make X`` in README.md's code names a target of the Makefile, and .PHONY lists it."""
    targets = _make_targets()
    phony = set(re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1).split())
    named = {m for span in _code_spans((ROOT / "README.md").read_text()) for m in re.findall(r"(?:^|[\s;(])make ([a-z][\w-]*)", span)}
    assert {"test", "run"} <= named, "README.md no longer names make test and make run"
    missing = sorted(named - targets)
    assert not missing, f"README.md names make targets the Makefile lacks: {missing}"
    assert not sorted(named - phony), f"README.md names make targets missing from .PHONY: {sorted(named - phony)}"


# First path components that name no file of the repository: run outputs and placeholders.
_NOT_REPOSITORY_PATHS = {"outputs", "path"}


def test_every_module_and_file_the_readme_names_exists():
    """``python -m pkg.mod`` names a module of the repository; a path in code (``configs/x.yaml``,
    ``engine_api/base.py``, ``tests/backends/test_megatron*.py``) names existing files. Paths under
    ``outputs/`` (written by runs) and placeholders (``path/to/file.py``) are not checked."""
    text = (ROOT / "README.md").read_text()
    missing = []
    for span in _code_spans(text):
        for module in re.findall(r"python -m ([A-Za-z_][\w.]*)", span):
            if module.split(".")[0] in {"torch", "pytest", "pip"}:
                continue
            base = ROOT.joinpath(*module.split("."))
            if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
                missing.append(f"python -m {module}")
        for path in re.findall(r"(?<![\w./:=-])((?:\.?[\w-]+/)+[\w*.-]+\.(?:py|yaml|md|sh|toml))\b", span):
            if path.split("/")[0] in _NOT_REPOSITORY_PATHS:
                continue
            if not list(ROOT.glob(path)):
                missing.append(path)
    assert not missing, "README.md names what the repository lacks:\n" + "\n".join(missing)


# Volatile numbers drift with every commit (eight commits once only updated the README's test
# count and minutes): they belong in CI's output and CHANGELOG.md, not in the map.
_VOLATILE = {
    "a test count": re.compile(r"\b\d+ (?:passed|failed|skipped|tests? pass)", re.I),
    "a suite duration": re.compile(r"\b\d+(?:\.\d+)? ?min(?:utes)? (?:of tests|with the install)", re.I),
    "a commit hash": re.compile(r"\b(?:commit|run of|at) [0-9a-f]{7,40}\b"),
    "an issue number": re.compile(r"\bissues? \d+", re.I),
}


def test_readme_holds_no_volatile_numbers():
    text = (ROOT / "README.md").read_text()
    found = [f"{what}: {m.group(0)!r}" for what, rx in _VOLATILE.items() for m in rx.finditer(text)]
    assert not found, "README.md holds volatile content (CI prints counts and times; history goes to CHANGELOG.md):\n" + "\n".join(found)


def test_benchmarks_md_holds_generated_tables_only():
    """The analysis lives in benchmarks/FINDINGS.md and profile dumps are produced on demand, so
    neither is pasted into BENCHMARKS.md (its generator, benchmarks/run_all.py, links them)."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert "## Findings" not in text and "## Profiles" not in text
    assert "calls/step" not in text, "a cProfile dump is in BENCHMARKS.md"
    assert "(benchmarks/FINDINGS.md)" in text
    findings = (ROOT / "benchmarks" / "FINDINGS.md").read_text()
    assert findings.startswith("# "), "benchmarks/FINDINGS.md stands alone (it is no longer pasted under a heading)"


def test_docs_do_not_depend_on_files_outside_the_repository():
    for path in _doc_files():
        assert "DESIGN.md" not in path.read_text(), f"{path.relative_to(ROOT)} mentions DESIGN.md (not part of this repository)"
