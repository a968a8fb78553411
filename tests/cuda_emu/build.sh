#!/usr/bin/env bash
# tests/cuda_emu/build.sh OUT: builds OUT/unit-tests, the unit-test runner with the CUDA backend's
# real kernel sources (kernels/cuda/*.cu; NCCL and its transport, sync/nccl_staging.cu, are not
# emulated) compiled for the CPU emulation of CUDA in this folder, linked with the rest of rolloutd
# (the CPU backend is the tests' reference), and OUT/rolloutd, the daemon on that backend
# (--device cuda), for end-to-end tests.
# `make cuda-emu` builds and runs it; see README.md here for what it can and cannot show.
#   EMU_CXXFLAGS / EMU_CFLAGS   extra flags (e.g. -fsanitize=address,undefined for both)
#   EMU_CC / EMU_CXX            the compilers (gcc, g++)
#   EMU_PLAIN_DIRS              source folders compiled without EMU_CFLAGS (e.g. kernels/cpu: the
#                               CPU backend, the tests' reference, which the sanitized unit tests
#                               of the CPU build check; under ASan it made this build 2m37s
#                               instead of 1m45s on 2 cores)
#   EMU_REUSE                   a plain build of this script (e.g. build-emu) whose objects of the
#                               EMU_PLAIN_DIRS sources are copied (the same flags; with their times,
#                               so that one older than its sources is still compiled again)
#   EMU_REUSE_MAKE              a build folder of the Makefile made with its defaults (CC=cc, gcc;
#                               no EXTRA_CFLAGS), e.g. build: the objects of the sources that do
#                               not test RS_CUDA are copied from there wherever this build compiles
#                               them without EMU_CFLAGS (the same compiler and code-generation
#                               flags; only warnings differ, and RS_CUDA and the fake CUDA headers
#                               reach no such source). On 2 cores the plain build took 27 s
#                               instead of 54 s.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/build-emu}
emu=$root/tests/cuda_emu
mkdir -p "$out/obj" "$out/gen"
common="-O2 -g -pthread -ffp-contract=off -fno-fast-math -D_GNU_SOURCE -fno-omit-frame-pointer -DRS_CUDA -I$emu/include"
cflags="-std=c11 -Wall -Wextra $common ${EMU_CFLAGS:-}"
plain_cflags="-std=c11 -Wall -Wextra $common"
cxxflags="-std=c++17 -Wall -Wno-unknown-pragmas -Wno-unused-function $common -I$root/kernels/cuda ${EMU_CXXFLAGS:-}"
# The kernels' fma / fmaf (__fma_rn, __fmaf_rn: the exact FP8 GEMM's double block sums) as one
# instruction where this machine has FMA, not a libm call each: the same correctly rounded result,
# and the emulated daemon's start (its FP8 KV calibration's forward) took 31 s through the calls
# against 13-15 s. Only the C++ (the kernels, the cuBLASLt emulation) gets it: this build runs where
# it is built, and the CPU backend picks its instructions at run time.
if grep -qw fma /proc/cpuinfo 2>/dev/null; then cxxflags+=" -mfma"; fi
jobs=$(nproc)
cc=${EMU_CC:-gcc}
cxx=${EMU_CXX:-g++}

objs=()
rm -f "$out/failed"
# the folders whose headers the sources include (not the build folders: the end-to-end tests' venvs
# under build/ hold headers of their own)
src_dirs=()
for d in core config protocol scheduler kvcache model kernels sync tokenizer server tools tests; do src_dirs+=("$root/$d"); done
compile() { # compile SRC OBJ CMD...: CMD on SRC unless OBJ is newer than SRC and the headers
  local src=$1 obj=$2; shift 2
  objs+=("$obj")
  if [ ! -e "$obj" ] || [ "$src" -nt "$obj" ] || [ -n "$(find "${src_dirs[@]}" -name '*.h' -newer "$obj" -print -quit)" ]; then
    # a failed compile leaves no object (a stale one would link) and marks the build failed
    { "$@" -c "$src" -o "$obj" || { rm -f "$obj"; echo "$src" >> "$out/failed"; }; } &
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  fi
}
reuse() { # reuse SRC OBJ [FROM]: copy FROM (default: SRC's object in EMU_REUSE_MAKE, when SRC does
  # not test RS_CUDA) to OBJ, with its time, when OBJ is missing and FROM is newer than SRC; compile
  # then still rebuilds it if a header is newer
  local src=$1 obj=$2 from=${3:-}
  if [ -z "$from" ] && [ -n "${EMU_REUSE_MAKE:-}" ] && ! grep -qw RS_CUDA "$src"; then
    from=$EMU_REUSE_MAKE/${src#"$root"/}
    from=${from%.c}.o
  fi
  if [ -n "$from" ] && [ -e "$from" ] && [ "$from" -nt "$src" ] && [ ! -e "$obj" ]; then cp -p "$from" "$obj"; fi
  return 0
}
finish() { # wait for the compiles; stop if one failed
  wait
  if [ -e "$out/failed" ]; then echo "cuda_emu: compile failed: $(tr '\n' ' ' < "$out/failed")" >&2; exit 1; fi
}

cd "$root" # tokenizer/default_tokenizer.c includes its JSON by a path relative to the root
# the kernels first, the longest compiles first (cuda_attention took 60 of the sanitized build's
# 122 s on 2 cores; started last, it ran alone at the end), then the C sources fill in beside them
for f in cuda_attention cuda_attention_tc cuda_matmul cuda_matmul_fast cuda_ops cuda_moe_fast cuda_sample backend_cuda cuda_blas cuda_act cuda_graph cuda_moe; do
  python3 "$emu/gen.py" "$root/kernels/cuda/$f.cu" "$out/gen/$f.cpp"
  compile "$out/gen/$f.cpp" "$out/obj/cu_$f.o" "$cxx" $cxxflags
done
for d in core config protocol scheduler kvcache model kernels kernels/cpu sync tokenizer server; do
  for f in "$root/$d"/*.c; do
    [ "$f" = "$root/server/main.c" ] && continue
    o=$out/obj/$(echo "${f#"$root"/}" | tr / _).o
    if [ "$f" = "$root/sync/nccl.c" ]; then # NCCL is not emulated: its CPU-build form
      compile "$f" "$o" "$cc" ${cflags/-DRS_CUDA/}
    elif [[ " ${EMU_PLAIN_DIRS:-} " == *" $d "* ]]; then
      reuse "$f" "$o" "${EMU_REUSE:+$EMU_REUSE/obj/${o##*/}}"
      compile "$f" "$o" "$cc" $plain_cflags
    else
      [ -z "${EMU_CFLAGS:-}" ] && reuse "$f" "$o"
      compile "$f" "$o" "$cc" $cflags
    fi
  done
done
for f in runner test_util test_cuda_ops test_cuda_matmul test_cuda_attention test_cuda_backend test_cuda_blas test_cuda_fast test_cuda_fused test_cuda_graph test_cuda_attention_fast test_cuda_sample; do
  compile "$root/tests/unit/$f.c" "$out/obj/t_$f.o" "$cc" $cflags
done
# the runtime (fibers, shuffles, streams) without EMU_CXXFLAGS' sanitizers: they are there for the
# kernels, and instrumenting the emulator's fiber switches and shuffles made the sanitized tests
# 1.4x slower; under ASan it still annotates each stack switch (EMU_FIBER_ANNOTATIONS)
rt_flags="-std=c++17 -Wall -Wno-unknown-pragmas -Wno-unused-function $common -I$root/kernels/cuda"
# GCC links its ASan runtime as a shared library unless told otherwise; from there every TLS access
# of the runtime's own (each fiber switch's annotations make several) goes through an intercepted
# __tls_get_addr: linked statically (clang's default) CI's sanitized cuda_ tests took 103 s, not 122 s
link_flags=()
case " ${EMU_CXXFLAGS:-} " in
  *-fsanitize=*address*)
    rt_flags+=" -DEMU_FIBER_ANNOTATIONS"
    "$cxx" --version | head -n 1 | grep -qi clang || link_flags+=(-static-libasan) ;;
esac
compile "$emu/emu_rt.cpp" "$out/obj/emu_rt.o" "$cxx" $rt_flags
compile "$emu/emu_cublaslt.cpp" "$out/obj/emu_cublaslt.o" "$cxx" $cxxflags
lib=("${objs[@]}")
# the daemon's main and the GPU benchmarks (for smoke runs of scripts/gpu-check.sh's steps on tiny
# shapes) in the same round of compiles: they are not part of the unit tests' objects
compile "$root/server/main.c" "$out/obj/server_main.o" "$cc" $cflags
for t in bench_gpu rollout_bench rl_bench; do
  compile "$root/tools/$t.c" "$out/obj/tool_$t.o" "$cc" $cflags
done
finish
link_prog() { # link_prog OUT OBJ...
  local o=$1; shift
  "$cxx" ${EMU_CXXFLAGS:-} ${link_flags[@]+"${link_flags[@]}"} -o "$o" "$@" -lmicrohttpd -ljansson -luv -lisal -lpcre2-8 -lutf8proc -lm -pthread
}
link_prog "$out/unit-tests" "${lib[@]}"
# the daemon too, for end-to-end tests with --device cuda (without the unit tests' objects)
daemon=()
for o in "${lib[@]}"; do case $o in */t_*) ;; *) daemon+=("$o") ;; esac; done
link_prog "$out/rolloutd" "$out/obj/server_main.o" "${daemon[@]}"
for t in bench_gpu rollout_bench rl_bench; do
  link_prog "$out/${t//_/-}" "$out/obj/tool_$t.o" "${daemon[@]}"
done
echo "built $out/unit-tests, $out/rolloutd and the GPU benchmarks"
