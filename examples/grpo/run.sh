#!/bin/sh
# The GRPO example, from a fresh checkout: builds rolloutd, makes a Python environment with
# PyTorch, transformers and matplotlib, and runs examples/grpo/run.py (default: the demo).
#
#   examples/grpo/run.sh [demo|bench|plot] [flags of run.py ...]     (make rl-demo runs "demo")
#
# The environment is a venv in build/rl-venv (RL_VENV=DIR elsewhere), filled from PyPI by name:
# torch, transformers, matplotlib, pytest (for tests/e2e/test_grpo_smoke.py) and ./clients/python
# (with numpy, requests and crc32c). RL_PYTHON=/path/to/python uses an interpreter that already has
# torch, transformers, matplotlib, safetensors, numpy, requests and crc32c instead.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${RL_VENV:-$ROOT/build/rl-venv}
PY=${RL_PYTHON:-}
NEEDS='import torch, transformers, matplotlib, safetensors, numpy, requests, crc32c'

make -C "$ROOT" --no-print-directory -j2 build/rolloutd build/fp8-mismatch
if [ -z "$PY" ]; then
    PY=$VENV/bin/python
    if ! "$PY" -c "$NEEDS" 2>/dev/null; then
        echo "making $VENV (torch, transformers, matplotlib, rolloutd-client from PyPI; a few minutes)"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install --quiet torch transformers matplotlib safetensors pytest crc32c "$ROOT/clients/python"
    fi
fi
"$PY" -c "$NEEDS" || { echo "$PY lacks one of: ${NEEDS#import }"; exit 1; }
[ $# -gt 0 ] || set -- demo
exec "$PY" "$ROOT/examples/grpo/run.py" "$@"
