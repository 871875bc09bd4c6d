#!/usr/bin/env bash
# `make gpu-check`: run benchmarks.gpu_check (every GPU-only path, one report in $OUT or
# outputs/gpu_check). With the project's .venv (a CPU dev machine) it uses that; on a bare GPU
# machine (python3 with CUDA torch) it first installs the carried wheels of ci/gpu_wheels.sh
# from .whl/ into /tmp/site (stale versions there are replaced). Without CUDA the check runs its
# smoke mode. The check bounds its own time (--budget, default 450 s: with the install, within 8
# minutes on one H200) and rewrites its report after every step, so a kill keeps what was done.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
exec "$PY" -m benchmarks.gpu_check "$@"
