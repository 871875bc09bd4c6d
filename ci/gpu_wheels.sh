#!/usr/bin/env bash
# Fetch the wheels `make gpu-check` needs on a GPU machine that has Python 3.12, CUDA torch,
# transformers, peft, pytest and pyarrow but not this project's other dependencies (the device
# image here): megatron-core, tensordict (+ pyvers), omegaconf (+ antlr4, built locally: it is
# published as a source archive only). About 4 MB into .whl/ (git-ignored); carry .whl to the
# GPU machine and run `make gpu-check` there (ci/gpu_check.sh installs them first).
# Not carried: Transformer-Engine and flash-attn (large CUDA builds); the report says so.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl \
  megatron-core==0.16.1 tensordict==0.15.3 "pyvers>=0.2,<0.3" omegaconf==2.3.0
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -la .whl
