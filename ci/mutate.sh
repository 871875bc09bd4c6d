#!/usr/bin/env bash
# `make mutate`: mutation testing (mutmut) of engine_api/losses.py, engine_api/microbatch.py,
# roles/algos.py and roles/actor.py against the fast in-process tests listed in pyproject.toml's
# [tool.mutmut]. Slow (minutes to tens of minutes on 2 cores), so not part of `make test`.
# Writes the per-mutant results to docs/mutation-results.txt; docs/mutation.md explains every
# survivor. Usage: bash ci/mutate.sh [VENV]   (default .venv; installs mutmut there if missing).
set -euo pipefail
VENV=${1:-.venv}
PY="$VENV/bin/python"
"$PY" -c "import mutmut" 2>/dev/null || "$PY" -m pip install -q "mutmut>=3.8,<4"
rm -rf mutants
export TRANSFORMERS_VERBOSITY=error
"$VENV/bin/mutmut" run --max-children "${MUTATE_JOBS:-2}" || true   # a surviving mutant is a result, not an error
{
  echo "# mutmut results ($(date -u +%Y-%m-%d), $("$VENV/bin/mutmut" --version 2>&1 | tail -1)); see docs/mutation.md"
  "$VENV/bin/mutmut" results --all true
} > docs/mutation-results.txt
echo "wrote docs/mutation-results.txt:"
grep -c ": killed" docs/mutation-results.txt | sed 's/^/  killed: /' || true
grep -v ": killed" docs/mutation-results.txt | grep -c ": " | sed 's/^/  not killed: /' || true
