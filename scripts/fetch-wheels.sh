#!/usr/bin/env bash
# Downloads the wheels of the Python packages the e2e tests need beyond those of a CUDA machine's
# usual Python image (crc32c, for checksummed weight pushes) into .whl/ (git-ignored), for a GPU
# machine without network; scripts/gpu-check.sh installs them. PYTHON_VERSION: that machine's
# Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl crc32c
ls -l .whl
