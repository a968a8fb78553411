#!/usr/bin/env bash
# The GPU check: one prepared run on a machine with an NVIDIA GPU (sm_90, CUDA 13), under about eight
# minutes. Everything goes under $OUT (default build-cuda/): the full log in gpu-check.txt, one line
# per step (name, exit status, seconds) in gpu-check-summary.txt, the build's output in build.txt.
# Most valuable first. Every step runs under its own time limit, cut to what is left of the run's
# budget (GPU_CHECK_BUDGET seconds, default 480, counted from the start; a step with less than 20 s
# left is skipped and says so); a failing or timed-out step is recorded and the run goes on, so a
# run cut short still brings back the verdicts that matter most:
#
#   build      make CUDA=1 (all programs)                                                <= 180 s
#   ops        every cuda_* unit test: each CUDA op against the CPU backend (exact numerics), fast
#              numerics against exact (cuBLASLt BF16 and block-scaled FP8 GEMMs, the FP8 GEMV,
#              split and tensor-core attention, device sampling, MoE), cuBLASLt's own refusals
#              (the emulation's rules against the real library), step graphs, capture rules   <= 120 s
#   golden     test_golden.py against transformers, daemon --device cuda --numerics exact    <= 110 s
#   numerics   test_numerics.py: fast against exact and transformers, seeded determinism     <= 40 s
#   att        the attention op alone on decode rows (1, 32, 256 rows at contexts 1k and 4k, Qwen3-8B
#              heads, BF16 and E4M3 pages): us per call and K/V GB/s, exact numerics, fast numerics
#              at the automatic, 8 and 32 context splits with each kernel (tiles, staged, warps,
#              pipelined, mma)                                                                 <= 90 s
#   shared     the attention op on decode rows forked 8 at a time from 1024-position prompts (32 and
#              256 rows, 64 and 256 positions of their own): private pages, shared pages, and shared
#              pages read once per unit (RS_CUDA_ATTENTION_SHARED), pipelined and mma kernels  <= 60 s
#   sample     device sampling alone, 1/32/256 requests over Qwen3's vocabulary: greedy and T = 1
#              (over parts of the row in fast numerics) and top_p 0.95, exact against fast    <= 30 s
#   decode8b   batch-1 decode, the 8B-shaped random model (preset qwen3-8b, written once: 16 GB),
#              FP8 and BF16 weights                                                          <= 240 s
#   gemm       cuBLASLt block-scaled FP8 vs BF16 TFLOP/s at prefill shapes                   <= 60 s
#   torchmm    torch._scaled_mm (1x128 x 128x128 blocks) and torch.matmul in BF16 at the same
#              shapes, where torch sees the GPU                                              <= 60 s
#   rl_bf16    the RL shape on the 8B-shaped model: 32 prompts x n = 8 = 256 sequences, prompt
#              1024, 256 new tokens (cut from 2048 to fit the run: decode steps scale linearly),
#              T = 1; BF16 weights, BF16 KV                                                  <= 120 s
#   rl_att     the op profile of 32 decode rows at a 1k context with each attention kernel
#              (RS_CUDA_ATTENTION=tiles|staged|warps|pipelined|mma)                           <= 150 s
#   rl_fp8     the same with FP8 weights, BF16 KV then FP8 KV                                <= 150 s
#   rl_mma     rl_bf16 and rl_fp8 with decode attention on tensor cores (RS_CUDA_ATTENTION=mma,
#              not the default until measured)                                               <= 150 s
#   rl_shared  rl_bf16 and rl_fp8 (FP8 KV) with shared pages read once per unit
#              (RS_CUDA_ATTENTION_SHARED=1) over the mma kernel, then BF16 over the pipelined one <= 150 s
#   decode06   batch-1 and batch-32 decode tokens/s and MBU (weight bytes per step / the
#              device-to-device copy bandwidth measured in the same run), Qwen3-0.6B shapes,
#              FP8 and BF16 weights, fast numerics                                            <= 60 s
#   kernels    GPU time per kernel of Qwen3-0.6B-shaped batch-1 FP8 decode steps (Nsight Compute,
#              graphs off, per step: scripts/ncu_summary.py), against decode06's ms/step       <= 90 s
#   pdl        decode06 and decode8b's batch-1 runs with the tensor-core GEMVs launched as
#              programmatic dependents (RS_CUDA_PDL=1, off by default until measured)          <= 120 s
#   decode06x  the same in exact numerics (the CUDA-core kernels), for fast against exact     <= 60 s
#   gemv       the GEMV/cuBLASLt crossover per weight dtype at decode shapes (the defaults: 8
#              rows for FP8 and BF16, RS_CUDA_GEMV_ROWS_*)                                   <= 60 s
#   push       a BF16 push of the 8B-shaped model into a GPU daemon serving FP8 weights and FP8
#              KV: requantization and KV recalibration included                              <= 150 s
#   fleet      one shm push to 3 CPU daemons against the same push to one (target <= 1.3x
#              with a core or more per daemon), Qwen3-0.6B shapes, on this host's CPU cores: each
#              daemon with every core for its conversion, then with 4                         <= 100 s
#   nccl       tests/e2e/test_nccl_gpu.py: NCCL weight updates from rolloutd_client (unique id)
#              and from an SGLang-style torch.distributed trainer over its TCPStore, with each
#              NCCL backend its torch has (nccl; nccl2 and nccl-legacy by name from torch 2.15) <= 120 s
#   e2e        the weight-sync, generation-API and top-p replay e2e files against a GPU daemon
#              in exact numerics (they hold it to transformers within 1e-3)                  <= 180 s
#   cpu        the CPU benchmarks on this host's cores                                       <= 120 s
#   unit       the whole unit suite on the CUDA build                                        <= 240 s
#
# GPU_CHECK_STEPS="ops golden ..." runs only the named steps (the build always runs);
# GPU_CHECK_DRY_RUN=1 prints each step's command and records it without running anything (a
# check of the script itself on a machine without a GPU).
#
# A GPU machine without the C libraries (libmicrohttpd, jansson, libuv, ISA-L, PCRE2, utf8proc) and
# without network: run scripts/fetch-debs.sh (and scripts/fetch-wheels.sh for the Python packages)
# where there is network and copy .debs/ and .whl/ along with the checkout; this script unpacks the
# .debs into .debs/root and installs the wheels into /tmp/rolloutd-site.
# One run:  OUT=/some/dir bash scripts/gpu-check.sh   (about 8 min)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-build-cuda}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/gpu-check-summary.txt
BUDGET=${GPU_CHECK_BUDGET:-480}
ONLY=${GPU_CHECK_STEPS:-}
DRY=${GPU_CHECK_DRY_RUN:-0}
T0=$(date +%s)
: >"$SUMMARY"

# step ID SECONDS CMD...: CMD under a time limit of SECONDS, or what is left of the budget if less;
# records "ID exit-status seconds" in the summary and in LAST_RC, and returns 0 (the run goes on).
LAST_RC=0
step() {
  local id=$1 secs=$2
  shift 2
  LAST_RC=0
  if [ -n "$ONLY" ] && [ "$id" != build ] && [[ " $ONLY " != *" $id "* ]]; then return 0; fi
  local now=$(($(date +%s) - T0))
  local left=$((BUDGET - now))
  if ((left < 20)); then
    echo "== $id: skipped (${now} s of the ${BUDGET} s budget used)"
    printf '%-10s skipped (budget)\n' "$id" >>"$SUMMARY"
    return 0
  fi
  ((secs > left)) && secs=$left
  echo "== $id (at most ${secs} s; ${now} s into the run): $*"
  if [ "$DRY" = 1 ]; then
    printf '%-10s dry run\n' "$id" >>"$SUMMARY"
    return 0
  fi
  local t
  t=$(date +%s)
  # timeout runs CMD in its own process group and signals the whole group, so daemons that a
  # pytest fixture started go too; -k: SIGKILL 10 s after a SIGTERM that did not end it
  timeout -k 10 "$secs" "$@"
  local rc=$?
  LAST_RC=$rc
  local took=$(($(date +%s) - t))
  local what="exit $rc"
  ((rc == 124 || rc == 137)) && what="$what (time limit)"
  echo "   -> $what after ${took} s"
  printf '%-10s %-22s %4d s\n' "$id" "$what" "$took" >>"$SUMMARY"
  return 0
}

# skip ID REASON: records a step that cannot run here
skip() {
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $1 "* ]]; then return 0; fi
  echo "== $1: skipped ($2)"
  printf '%-10s skipped (%s)\n' "$1" "$2" >>"$SUMMARY"
}

have_py() { python3 -c "import $1" 2>/dev/null; }

setup_deps() {
  if ls .debs/*.deb >/dev/null 2>&1; then
    mkdir -p .debs/root
    for f in .debs/*.deb; do dpkg -x "$f" .debs/root; done
    local root=$PWD/.debs/root
    export CPATH="$root/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PKG_CONFIG_PATH="$root/usr/lib/x86_64-linux-gnu/pkgconfig"
    # the .pc files name /usr as prefix; point them at the unpacked tree
    for pc in "$PKG_CONFIG_PATH"/*.pc; do sed -i "s|^prefix=/usr|prefix=$root/usr|" "$pc"; done
    # the Makefile's dependency stamp would run install-deps.sh (apt, no network there) when
    # pkg-config does not find them; the libraries are in place, so mark them found
    mkdir -p build-cuda && touch build-cuda/.deps-ok
  fi
  # Python packages the e2e tests need and the machine lacks (crc32c for checksummed pushes), as
  # wheels in .whl/ (scripts/fetch-wheels.sh), installed into a throwaway target
  if ls .whl/*.whl >/dev/null 2>&1; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rolloutd-site \
      .whl/*.whl 2>/dev/null; then
      export PYTHONPATH=/tmp/rolloutd-site${PYTHONPATH:+:$PYTHONPATH}
    else
      echo "   .whl: the wheels do not install on this Python ($(python3 -V 2>&1)); see scripts/fetch-wheels.sh"
    fi
  fi
  # NCCL: the nvidia-nccl pip wheel's when torch is there to use it too (the NCCL e2e test needs one
  # release on both sides: on an H200 image the system had 2.28.3 and torch's wheel 2.28.9), else
  # the toolkit's or the system's, else the wheel's
  NCCL_ARGS=()
  local home
  home=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  local system=0
  [ -e /usr/local/cuda/include/nccl.h ] || [ -e /usr/include/nccl.h ] && system=1
  if [ -n "$home" ] && [ -e "$home/include/nccl.h" ] && { python3 -c 'import torch' 2>/dev/null || ((!system)); }; then
    NCCL_ARGS=(NCCL_HOME="$home")
    [ -e "$home/lib/libnccl.so" ] || NCCL_ARGS+=(NCCL_LIB=-l:libnccl.so.2)
    export LD_LIBRARY_PATH="$home/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
}

main() {
  setup_deps
  echo "== $(date -u +%FT%TZ) gpu-check on $(hostname), budget ${BUDGET} s${ONLY:+, steps: $ONLY}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null ||
    echo "   nvidia-smi: no GPU visible"
  echo "   NCCL: ${NCCL_ARGS[*]:-toolkit or /usr}"
  local B=build-cuda
  # the build's output goes to build.txt; its last lines come into the log when it fails
  step build 180 sh -c "make -j$(nproc) CUDA=1 BUILD=build-cuda ${NCCL_ARGS[*]} all >'$OUT/build.txt' 2>&1 ||
    { tail -40 '$OUT/build.txt'; exit 1; }"
  if ((LAST_RC != 0)); then
    echo "BUILD FAILED: nothing else can run"
    return 1
  fi

  local fx=$PWD/tests/fixtures py_e2e=0 py_torch_cuda=0
  have_py pytest && have_py requests && have_py numpy && py_e2e=1
  python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && py_torch_cuda=1
  local daemon="ROLLOUTD_BIN=$PWD/$B/rolloutd"
  local m8 # where rollout-bench and rl-bench write the preset
  m8=/tmp/rolloutd-bench-qwen3-8b-$(id -u)

  step ops 120 env RS_FIXTURES="$fx" RS_TEST_TIMEOUT=90 $B/unit-tests cuda_
  if ((py_e2e)); then
    step golden 110 env "$daemon" ROLLOUTD_ARGS="--device cuda --numerics exact" \
      python3 -m pytest -q -rs tests/e2e/test_golden.py
    step numerics 40 env "$daemon" ROLLOUTD_ARGS="--device cuda" python3 -m pytest -q -rs tests/e2e/test_numerics.py
  else
    skip golden "needs python3 with pytest, requests and numpy"
    skip numerics "needs python3 with pytest, requests and numpy"
  fi
  step att 90 $B/bench-gpu attention
  step shared 60 $B/bench-gpu shared
  step sample 30 $B/bench-gpu sample
  step decode8b 240 $B/rollout-bench --device cuda --preset qwen3-8b --quantization both --batches 1 \
    --prompt 32 --gen 32
  step gemm 60 $B/bench-gpu gemm
  if ((py_torch_cuda)); then
    step torchmm 60 python3 scripts/bench_scaled_mm.py
  else
    skip torchmm "no torch with CUDA"
  fi
  local rl=("$B/rl-bench" --device cuda --preset qwen3-8b --runs engine --prompts 32 --n 8 --prompt-len 1024 --gen 256)
  step rl_bf16 120 "${rl[@]}" --quantization bf16 --kv-dtype bf16
  step rl_att 150 sh -c "for k in tiles staged warps pipelined mma; do echo \"RS_CUDA_ATTENTION=\$k\"; RS_CUDA_ATTENTION=\$k \
      $B/rollout-bench --device cuda --preset qwen3-8b --quantization bf16 --batches 32 --prompt 1024 --gen 8 \
      --kv-cache-dtype bf16 --no-bandwidth --profile-ops | grep -E 'ms/step|fast +32|attention|all ops'; done"
  step rl_fp8 150 "${rl[@]}" --quantization fp8 --kv-dtype bf16,fp8
  step rl_mma 150 sh -c "RS_CUDA_ATTENTION=mma ${rl[*]} --quantization bf16 --kv-dtype bf16 &&
    RS_CUDA_ATTENTION=mma ${rl[*]} --quantization fp8 --kv-dtype bf16,fp8"
  step rl_shared 150 sh -c "RS_CUDA_ATTENTION_SHARED=1 RS_CUDA_ATTENTION=mma ${rl[*]} --quantization bf16 --kv-dtype bf16 &&
    RS_CUDA_ATTENTION_SHARED=1 RS_CUDA_ATTENTION=mma ${rl[*]} --quantization fp8 --kv-dtype fp8 &&
    RS_CUDA_ATTENTION_SHARED=1 ${rl[*]} --quantization bf16 --kv-dtype bf16"
  step decode06 60 $B/rollout-bench --device cuda --numerics fast --preset qwen3-0.6b --quantization both \
    --batches 1,32 --prompt 32 --gen 32
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$ncu" ] || [ "$DRY" = 1 ]; then
    # per step: greedy fast-numerics sampling ends each step with one sample_finish_kernel
    step kernels 90 sh -c "'${ncu:-ncu}' --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      --launch-skip 2500 --launch-count 1800 --log-file '$OUT/kernels.csv' $B/rollout-bench --device cuda \
      --numerics fast --preset qwen3-0.6b --quantization fp8 --batches 1 --prompt 32 --gen 8 --graphs off \
      --no-bandwidth >/dev/null && python3 scripts/ncu_summary.py '$OUT/kernels.csv' --per sample_finish_kernel"
  else
    skip kernels "no ncu (Nsight Compute)"
  fi
  step pdl 120 sh -c "RS_CUDA_PDL=1 $B/rollout-bench --device cuda --numerics fast --preset qwen3-0.6b \
      --quantization both --batches 1,32 --prompt 32 --gen 32 && RS_CUDA_PDL=1 $B/rollout-bench --device cuda \
      --preset qwen3-8b --quantization both --batches 1 --prompt 32 --gen 32 --no-bandwidth"
  step decode06x 60 $B/rollout-bench --device cuda --numerics exact --preset qwen3-0.6b --quantization both \
    --batches 1,32 --prompt 32 --gen 32
  step gemv 60 $B/bench-gpu gemv --shapes 6144:4096,4096:12288 --rows 1,2,4,8,12,16,32
  if have_py requests && have_py numpy && { [ -e "$m8/model.safetensors" ] || [ "$DRY" = 1 ]; }; then
    step push 150 python3 scripts/bench_weight_sync.py --bin $B/rolloutd --model-dir "$m8" --repeat 2 \
      --kv-cache-mb 4096 --daemon-args "--device cuda" --quantizations fp8
  else
    skip push "needs python3 with requests and numpy, and the 8B preset that decode8b writes"
  fi
  # the fleet-push ratio's target assumes a core or more per daemon: this host's CPU cores, CPU daemons
  if have_py requests && have_py numpy; then
    local m06=/tmp/rolloutd-q06 fl
    fl="python3 scripts/bench_fleet_push.py --bin $B/rolloutd --model-dir $m06 --daemons 3 --repeat 5 --bucket-mb 64"
    step fleet 100 bash -c "set -o pipefail; { [ -e $m06/model.safetensors ] || $B/make-default-model --preset qwen3-0.6b --out $m06; } &&
      $fl --daemon-args '--device cpu --kv-scale-mode dynamic' | tail -5 &&
      $fl --daemon-args '--device cpu --kv-scale-mode dynamic --weight-sync-threads 4' | tail -5"
  else
    skip fleet "needs python3 with requests and numpy"
  fi
  if ((py_e2e && py_torch_cuda)); then
    step nccl 120 env "$daemon" python3 -m pytest -q -rs tests/e2e/test_nccl_gpu.py
  else
    skip nccl "needs python3 with pytest, requests, numpy and torch with CUDA"
  fi
  if ((py_e2e)); then
    step e2e 180 env "$daemon" ROLLOUTD_ARGS="--device cuda --numerics exact" \
      python3 -m pytest -q -rs tests/e2e/test_weight_sync.py tests/e2e/test_generate_api.py \
        tests/e2e/test_top_p_ids.py
  else
    skip e2e "needs python3 with pytest, requests and numpy"
  fi
  local n
  n=$(nproc)
  step cpu 120 sh -c "$B/rollout-bench --preset qwen3-0.6b --quantization both --batches 1,32 &&
    $B/bench-matmul 3072 1024 fp8,bf16 $n 1,32 && $B/bench-quant 4096 7168 bf16 $n normal"
  step unit 240 env RS_FIXTURES="$fx" $B/unit-tests
  echo "== done after $(($(date +%s) - T0)) s; summary ($SUMMARY):"
  cat "$SUMMARY"
}

# the pipeline ends when tee has written the last line, so the log is complete when the script exits
main 2>&1 | tee "$OUT/gpu-check.txt"
exit "${PIPESTATUS[0]}"
