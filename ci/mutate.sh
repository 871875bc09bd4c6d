#!/usr/bin/env bash
# `make mutate`: mutation testing (mutmut) of the modules listed in pyproject.toml's
# [tool.mutmut] only_mutate (the numerical core, checkpoint integrity and layout, the optimizer
# step guard, the batch protocol, rewards, PPO's advantage inputs, the HF sampler, the legacy
# worker, the conformance checks) against the fast in-process tests listed there. Slow (minutes
# per module to an hour for all of them on 2 cores), so not part of `make test`.
#
# Usage: bash ci/mutate.sh [VENV]                        (default .venv; installs mutmut there if missing)
#        MUTATE_ONLY="engine_api/batch.py engine_api/losses.py" bash ci/mutate.sh   (score these modules alone)
#        MUTATE_JOBS=N                                   (parallel mutant runs; default 2)
#
# Results: outputs/mutation/results.txt (a run artefact; outputs/ is git-ignored), one line per
# mutant. A full run rewrites it; a MUTATE_ONLY run replaces only the lines of the modules it ran
# and keeps the others (each module's lines are from the last run that covered it; the header line
# lists when). docs/mutation.md holds the human summary and explains every survivor.
set -euo pipefail
VENV=${1:-.venv}
PY="$VENV/bin/python"
RESULTS=outputs/mutation/results.txt
mkdir -p "$(dirname "$RESULTS")"
"$PY" -c "import mutmut" 2>/dev/null || "$PY" -m pip install -q "mutmut>=3.8,<4"
# engine_api/batch.py -> the mutant-name pattern engine_api.batch.* (mutmut matches with fnmatch)
PATTERNS=()
for f in ${MUTATE_ONLY:-}; do
  [ -f "$f" ] || { echo "MUTATE_ONLY: no such file: $f" >&2; exit 2; }
  grep -q "\"$f\"" pyproject.toml || { echo "MUTATE_ONLY: $f is not in [tool.mutmut] only_mutate of pyproject.toml" >&2; exit 2; }
  m=${f%.py}; PATTERNS+=("${m//\//.}.*")
done
rm -rf mutants
export TRANSFORMERS_VERBOSITY=error
"$VENV/bin/mutmut" run --max-children "${MUTATE_JOBS:-2}" "${PATTERNS[@]}" || true   # a surviving mutant is a result, not an error
NEW=$(mktemp)
"$VENV/bin/mutmut" results --all true > "$NEW"
"$PY" - "$RESULTS" "$NEW" "$("$VENV/bin/mutmut" --version 2>&1 | tail -1)" "${PATTERNS[@]}" <<'PYEOF'
import datetime, fnmatch, os, sys
results, new, version, patterns = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def name(line):
    return line.strip().split(":")[0]
fresh = [l.rstrip("\n") for l in open(new) if ": " in l]
if patterns:  # keep only the modules run now, and every other module's lines from before
    fresh = [l for l in fresh if any(fnmatch.fnmatch(name(l), p) for p in patterns)]
    old = [l.rstrip("\n") for l in open(results)][1:] if os.path.exists(results) else []
    kept = [l for l in old if ": " in l and not any(fnmatch.fnmatch(name(l), p) for p in patterns)]
    scope = "modules " + " ".join(p[:-2] for p in patterns)
else:
    kept, scope = [], "all modules"
day = datetime.date.today().isoformat()
with open(results, "w") as f:
    f.write(f"# mutmut results ({version}); last run {day}: {scope}; see docs/mutation.md\n")
    for l in kept + fresh:
        f.write(l + "\n")
print(f"wrote {results} ({scope}):")
status = {}
for l in fresh:
    s = l.rsplit(": ", 1)[1].strip()
    status[s] = status.get(s, 0) + 1
print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(status.items())))
PYEOF
rm -f "$NEW"
