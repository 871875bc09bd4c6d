#!/usr/bin/env bash
# Fetch the wheels `make gpu-check` needs on a GPU machine that has Python 3.12, CUDA torch,
# transformers, peft, pytest, pytest-timeout, psutil and pyarrow but not this project's other
# dependencies (the device image here): megatron-core, tensordict (+ pyvers) and omegaconf, at the
# versions CI pins (read from ci/constraints.txt, so the GPU run tests what CI tests). All four are
# published as wheels; omegaconf 2.4 vendors its ANTLR runtime (antlr4-python3-runtime, which CI
# pins for other packages, is not needed). About 4 MB into .whl/ (git-ignored); carry .whl to the
# GPU machine and run `make gpu-check` there (ci/gpu_check.sh installs them first).
# Not carried: Transformer-Engine and flash-attn (large CUDA builds), and the optional extras
# (Tinker, Ray, datasets, vLLM, the loggers): their test modules are skipped there, the report says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(megatron-core tensordict pyvers omegaconf)
PINS=()
for name in "${PACKAGES[@]}"; do
  # constraints.txt spells names as pip freeze does (case and -/_ may differ): compare normalised
  pin=$(python3 - "$name" <<'EOF'
import re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
for line in open("ci/constraints.txt"):
    name, _, version = line.split("#", 1)[0].strip().partition("==")
    if version and norm(name) == norm(sys.argv[1]):
        print(f"{sys.argv[1]}=={version.strip()}")
        break
EOF
)
  if [ -z "$pin" ]; then
    echo "ci/gpu_wheels.sh: $name is not pinned in ci/constraints.txt; fix: pin it there (make constraints)" >&2
    exit 1
  fi
  PINS+=("$pin")
done
echo "fetching ${PINS[*]}"
rm -rf .whl
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl "${PINS[@]}"
ls -la .whl
