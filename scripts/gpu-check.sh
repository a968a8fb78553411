#!/usr/bin/env bash
# The GPU check: one prepared run on a machine with an NVIDIA GPU (sm_90), meant to finish in about
# eight minutes. It builds with `make CUDA=1`, runs the CUDA-vs-CPU op tests (every test whose name
# starts with cuda_), the golden end-to-end test with the daemon on the GPU, the GPU and CPU
# benchmarks, the NCCL end-to-end test, and last the whole unit suite on that build, and writes
# everything to $OUT/gpu-check.txt (OUT defaults to build-cuda/). The NCCL test includes an
# SGLang-style trainer (torch.distributed, init_method tcp://, dist.broadcast) joining over the
# trainer's TCPStore. Most valuable first: a run cut short by the device's time limit still brings
# back the CUDA verdicts.
#
# The device machine lacks libmicrohttpd, jansson and libuv, and has no network. Before the call,
# run scripts/fetch-debs.sh here and name `.debs` in the device tool's `carry`; this script unpacks
# them into .debs/root. One call:  OUT=$OUT bash scripts/gpu-check.sh   (timeout_s ~540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build-cuda}
mkdir -p "$OUT"
log="$OUT/gpu-check.txt"
exec > >(tee "$log") 2>&1

if ls .debs/*.deb >/dev/null 2>&1; then
  mkdir -p .debs/root
  for f in .debs/*.deb; do dpkg -x "$f" .debs/root; done
  root=$PWD/.debs/root
  export CPATH="$root/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PKG_CONFIG_PATH="$root/usr/lib/x86_64-linux-gnu/pkgconfig"
  # the .pc files name /usr as prefix; point them at the unpacked tree
  for pc in "$PKG_CONFIG_PATH"/*.pc; do sed -i "s|^prefix=/usr|prefix=$root/usr|" "$pc"; done
  # the Makefile's dependency stamp would run install-deps.sh (apt, no network there) if pkg-config
  # were missing; the libraries are in place, so mark them found
  command -v pkg-config >/dev/null 2>&1 || { mkdir -p build-cuda && touch build-cuda/.deps-ok; }
fi

# NCCL: the toolkit's, the system's, or the nvidia-nccl pip wheel's (the device image has the wheel)
nccl_args=()
if [ ! -e /usr/local/cuda/include/nccl.h ] && [ ! -e /usr/include/nccl.h ]; then
  nccl_home=$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  if [ -n "$nccl_home" ] && [ -e "$nccl_home/include/nccl.h" ]; then
    nccl_args=(NCCL_HOME="$nccl_home")
    [ -e "$nccl_home/lib/libnccl.so" ] || nccl_args+=(NCCL_LIB=-l:libnccl.so.2)
    export LD_LIBRARY_PATH="$nccl_home/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

echo "== $(date -u +%FT%TZ) gpu-check on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== build (make CUDA=1)"
echo "   NCCL: ${nccl_args[*]:-toolkit or /usr}"
make -j"$(nproc)" CUDA=1 BUILD=build-cuda "${nccl_args[@]}" all || { echo "BUILD FAILED"; exit 1; }
echo "== CUDA op tests (every test named cuda_*: each CUDA op against the CPU backend)"
timeout 150 ./build-cuda/unit-tests cuda_
echo "== end-to-end on the GPU: golden (transformers' logprobs), weight pushes, generation API; daemons --device cuda"
if python3 -c 'import pytest, requests, numpy' 2>/dev/null; then
  ROLLOUTD_BIN=$PWD/build-cuda/rolloutd ROLLOUTD_ARGS="--device cuda" \
    timeout 200 python3 -m pytest -q -rs tests/e2e/test_golden.py tests/e2e/test_weight_sync.py tests/e2e/test_generate_api.py
else
  echo "skipped: needs python3 with pytest, requests and numpy"
fi
echo "== GPU decode: FP8 vs BF16 weights, the model on the H200"
timeout 180 ./build-cuda/rollout-bench --device cuda --preset qwen3-0.6b --quantization both --batches 1,32,256
echo "== NCCL weight updates end to end (tests/e2e/test_nccl_gpu.py; trainer = this python, rank 0: rolloutd_client's"
echo "   unique-id push, then an SGLang-style torch.distributed trainer over the TCPStore rendezvous)"
if python3 -c 'import pytest, requests, numpy, torch; assert torch.cuda.is_available()' 2>/dev/null; then
  ROLLOUTD_BIN=$PWD/build-cuda/rolloutd timeout 180 python3 -m pytest -q -rs tests/e2e/test_nccl_gpu.py
else
  echo "skipped: needs python3 with pytest, requests, numpy and torch with CUDA"
fi
echo "== weight sync into a GPU-served daemon (requantization and KV recalibration on the GPU)"
if python3 -c 'import requests, numpy' 2>/dev/null; then
  timeout 180 python3 scripts/bench_weight_sync.py --bin build-cuda/rolloutd --repeat 3 --daemon-args "--device cuda" \
    --quantizations bf16/bf16,fp8/bf16,fp8
else
  echo "weight-sync bench skipped: needs python3 with requests and numpy"
fi
echo "== benchmarks (CPU backend on this host's $(nproc) cores)"
# FP8 vs BF16 batch-1 decode on more than the CI VM's two cores: there the exact FP8 kernel should
# have the compute to be memory-bound (docs/benchmarks.md "Decode: FP8 against BF16 weights").
timeout 150 ./build-cuda/rollout-bench --preset qwen3-0.6b --quantization both --batches 1,32
./build-cuda/bench-matmul 3072 1024 fp8,bf16 "$(nproc)" 1,32
# the host-side quantizer a push into the GPU daemon runs (table encoder where the CPU has VBMI)
./build-cuda/bench-quant 4096 7168 bf16 "$(nproc)" normal
if python3 -c 'import requests, numpy' 2>/dev/null; then
  timeout 120 python3 scripts/bench_weight_sync.py --bin build-cuda/rolloutd --repeat 2 \
    --quantizations bf16/bf16,fp8/bf16,fp8
fi
echo "== full unit suite on the CUDA build"
timeout 240 ./build-cuda/unit-tests
echo "== done"
