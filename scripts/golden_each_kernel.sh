#!/usr/bin/env bash
# The golden end-to-end tests (tests/e2e/test_golden.py) with each CPU kernel class forced in turn
# (--cpu-kernels avx512, avx2, scalar): every class must reproduce the references, and a CPU
# with AVX-512 runs the classes of older CPUs this way. A class this CPU cannot run is skipped
# with its name printed.
#
#   scripts/golden_each_kernel.sh [build/rolloutd] [pytest args...]
#
# GOLDEN_SKIP_AUTO=1 leaves out the class --cpu-kernels auto picks on this CPU (the highest it
# runs), for a caller that has already run the golden tests on the same daemon with the default
# setting (after `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-$PWD/build/rolloutd}
shift || true
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { for f in "$@"; do [[ $flags == *" $f "* ]] || return 1; done; }
top=scalar
if has avx2 fma f16c; then top=avx2; has avx512f && top=avx512; fi
for k in avx512 avx2 scalar; do
  if [[ ${GOLDEN_SKIP_AUTO:-0} == 1 && $k == "$top" ]]; then
    echo "== golden, --cpu-kernels $k: skipped (what auto picks on this CPU; already run with the default)"
    continue
  fi
  case $k in
    avx512) has avx512f avx2 fma f16c || { echo "== golden, --cpu-kernels $k: skipped (this CPU has no AVX-512F)"; continue; } ;;
    avx2) has avx2 fma f16c || { echo "== golden, --cpu-kernels $k: skipped (this CPU has no AVX2+FMA+F16C)"; continue; } ;;
  esac
  echo "== golden, --cpu-kernels $k"
  ROLLOUTD_BIN=$bin ROLLOUTD_ARGS="--cpu-kernels $k" python3 -m pytest -q "$@" tests/e2e/test_golden.py
done
