# rolloutd — plain Makefile.
#
#   make                 build/rolloutd, build/rollout-bench, tools (CPU backend)
#   make docs            docs/api-fields.md from the request parsers' tables (build/print-fields)
#   make CUDA=1          also compile and link the CUDA backend (cudart, cuBLASLt, NCCL)
#   make run             serve the embedded default model on 127.0.0.1:8000
#   make test            C unit tests + end-to-end tests against the real daemon
#   make golden-kernels  the golden end-to-end tests with each CPU kernel class forced in turn
#   make SANITIZE=address,undefined unit   unit tests under ASan+UBSan (own build dir)
#   make fuzz            libFuzzer targets (clang), bounded run (FUZZ_SECONDS each, one a core: scripts/fuzz.sh)
#   make fp8-exhaustive  FP8 encoders vs CUDA's cuda_fp8.h host path on all 2^32 floats
#   make cuda-emu        the CUDA kernels under a CPU emulation of CUDA: every cuda_* test, no GPU
#   make rl-demo         GRPO on rolloutd, FP8 vs BF16 rollouts with TIS/MIS (examples/grpo/README.md)
#
# Missing Debian packages are installed by scripts/install-deps.sh on first use.

CC       ?= cc
PYTHON   ?= python3
PORT     ?= 8000
SANITIZE ?=
CUDA     ?=
WERROR   ?=

BUILD := build
ifneq ($(SANITIZE),)
BUILD := build-san
endif

WARN    := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes
CFLAGS  := -std=c11 -O2 -g $(WARN) -ffp-contract=off -fno-fast-math -pthread -D_GNU_SOURCE \
           -fno-omit-frame-pointer $(EXTRA_CFLAGS)
LDLIBS  := -lmicrohttpd -ljansson -luv -lisal -lpcre2-8 -lutf8proc -lm -pthread
ifneq ($(WERROR),)
CFLAGS  += -Werror
endif
ifneq ($(SANITIZE),)
CFLAGS  += -fsanitize=$(SANITIZE) -fno-sanitize-recover=all
LDFLAGS += -fsanitize=$(SANITIZE)
endif

comma := ,
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(CUDA_HOME)/bin/nvcc
# NCCL from elsewhere than the toolkit or /usr (e.g. the nvidia-nccl pip wheel, which ships only
# libnccl.so.2): NCCL_HOME=DIR with DIR/include/nccl.h and DIR/lib, and NCCL_LIB=-l:libnccl.so.2.
NCCL_HOME ?=
NCCL_LIB  ?= -lnccl
# CUDA=1 adds CUDA_CFLAGS to the sources that test RS_CUDA and to nothing else (below)
CUDA_CFLAGS := -DRS_CUDA -I$(CUDA_HOME)/include $(if $(NCCL_HOME),-I$(NCCL_HOME)/include)
ifneq ($(CUDA),)
NVFLAGS   := -O2 -g -std=c++17 -arch=sm_90 -DRS_CUDA -Xcompiler -fno-fast-math,-pthread --fmad=false \
             $(if $(NCCL_HOME),-I$(NCCL_HOME)/include)
LDLIBS    += -L$(CUDA_HOME)/lib64 $(if $(NCCL_HOME),-L$(NCCL_HOME)/lib -Wl$(comma)-rpath$(comma)$(NCCL_HOME)/lib) \
             -lcudart -lcublasLt -lcublas $(NCCL_LIB) -lstdc++
CU_SRC    := $(wildcard kernels/cuda/*.cu) sync/nccl_staging.cu
CU_OBJ    := $(patsubst %.cu,$(BUILD)/%.o,$(CU_SRC))
endif

# Every module folder is compiled into one static library; programs link against it.
LIB_DIRS := core config protocol scheduler kvcache model kernels kernels/cpu sync tokenizer server
LIB_SRC  := $(filter-out server/main.c,$(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.c)))
LIB_OBJ  := $(patsubst %.c,$(BUILD)/%.o,$(LIB_SRC)) $(CU_OBJ)
TEST_SRC := $(wildcard tests/unit/*.c)
TEST_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(TEST_SRC))
DEPS_OK  := $(BUILD)/.deps-ok

# CUDA= changes the compile of exactly the sources that test RS_CUDA: headers never do
# (scripts/check_layers.sh checks it), so every other object is the same in both builds. Their
# objects depend on $(BUILD)/.cuda, which holds the setting of the last make in this folder, so that
# switching CUDA= in one build folder recompiles them, adds or drops the .cu objects, and relinks.
CUDA_AWARE_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(shell grep -lw RS_CUDA $(LIB_SRC) server/main.c tools/*.c $(TEST_SRC)))
CUDA_SETTING   := $(BUILD)/.cuda
$(shell mkdir -p $(BUILD) && { [ "$$(cat $(CUDA_SETTING) 2>/dev/null)" = "CUDA=$(CUDA)" ] || echo "CUDA=$(CUDA)" > $(CUDA_SETTING); })
$(CUDA_AWARE_OBJ): $(CUDA_SETTING)
ifneq ($(CUDA),)
$(CUDA_AWARE_OBJ): CFLAGS += $(CUDA_CFLAGS)
endif

PROGRAMS := $(BUILD)/rolloutd $(BUILD)/rollout-bench $(BUILD)/make-default-model $(BUILD)/unit-tests \
            $(BUILD)/bench-matmul $(BUILD)/bench-quant $(BUILD)/fp8-mismatch $(BUILD)/rl-bench $(BUILD)/bench-inproc \
            $(BUILD)/tcpstore-probe $(BUILD)/tokenize $(BUILD)/print-fields $(BUILD)/bench-gpu $(BUILD)/bench-gemv

.PHONY: all run test unit e2e fuzz clean deps cuda-emu golden-kernels docs rl-demo
all: $(PROGRAMS)

$(DEPS_OK):
	@mkdir -p $(BUILD)
	@pkg-config --exists libmicrohttpd jansson libuv libisal libpcre2-8 libutf8proc 2>/dev/null || ./scripts/install-deps.sh
	@printf '  deps   libmicrohttpd %s, jansson %s, libuv %s, isa-l %s, pcre2 %s, utf8proc %s\n' \
	  "$$(pkg-config --modversion libmicrohttpd)" "$$(pkg-config --modversion jansson)" "$$(pkg-config --modversion libuv)" \
	  "$$(pkg-config --modversion libisal)" "$$(pkg-config --modversion libpcre2-8)" "$$(pkg-config --modversion libutf8proc)"
	@touch $@

# the CUDA toolkit and NCCL, checked before the first CUDA compile (also of a folder built without them)
$(BUILD)/.cuda-ok:
	@test -x $(NVCC) || { echo "CUDA=1 but $(NVCC) not found"; exit 1; }
	@printf '  cuda   %s\n' "$$($(NVCC) --version | tail -1)"
	@test -e $(CUDA_HOME)/include/nccl.h -o -e /usr/include/nccl.h -o -e "$(NCCL_HOME)/include/nccl.h" && echo "  ✓ NCCL found" \
	  || { echo "NCCL not found (nccl.h): set NCCL_HOME, see the Makefile"; exit 1; }
	@touch $@
ifneq ($(CUDA),)
$(CUDA_AWARE_OBJ) $(CU_OBJ): | $(BUILD)/.cuda-ok
endif

$(BUILD)/%.o: %.c $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/%.o: %.cu $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

# the embedded default tokenizer (.incbin, relative to the repository root)
$(BUILD)/tokenizer/default_tokenizer.o: tokenizer/default_tokenizer.json

$(BUILD)/librolloutd.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

ifeq ($(SANITIZE),)
$(BUILD)/rolloutd: $(BUILD)/server/main.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)
else
# The sanitized daemon (build-san/rolloutd, which the e2e tests run under ASan+UBSan in CI) links the
# matmul kernels uninstrumented: they were 64% of its CPU time there (the KV calibration's forward at
# every start and after pushes, prefills, lm_head), and they take their pointers from the backend,
# not from requests.
# The sanitized unit tests (build-san/unit-tests) keep them instrumented and check them on ragged
# shapes, every row count and every dispatch.
SAN_PLAIN_SRC := $(addprefix kernels/cpu/,fp8_gemm.c fp8_gemm_vnni.c fp8_gemm_avx2.c cpu_amx.c cpu_simd_avx512.c \
                   cpu_simd_avx2.c cpu_fp8_quant.c fp8_layout.c)
SAN_PLAIN_OBJ := $(patsubst %.c,$(BUILD)/plain/%.o,$(SAN_PLAIN_SRC))
$(BUILD)/plain/%.o: %.c $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -fsanitize=% -fno-sanitize-recover=%,$(CFLAGS)) -MMD -MP -c $< -o $@

$(BUILD)/librolloutd-daemon.a: $(filter-out $(patsubst %.c,$(BUILD)/%.o,$(SAN_PLAIN_SRC)),$(LIB_OBJ)) $(SAN_PLAIN_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/rolloutd: $(BUILD)/server/main.o $(BUILD)/librolloutd-daemon.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)
endif

$(BUILD)/rollout-bench: $(BUILD)/tools/rollout_bench.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/make-default-model: $(BUILD)/tools/make_default_model.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/bench-matmul: $(BUILD)/tools/bench_matmul.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/bench-gemv: $(BUILD)/tools/bench_gemv.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/fp8-mismatch: $(BUILD)/tools/fp8_mismatch.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/rl-bench: $(BUILD)/tools/rl_bench.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/bench-quant: $(BUILD)/tools/bench_quant.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/bench-inproc: $(BUILD)/tools/bench_inproc.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tcpstore-probe: $(BUILD)/tools/tcpstore_probe.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tokenize: $(BUILD)/tools/tokenize.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/print-fields: $(BUILD)/tools/print_fields.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/bench-gpu: $(BUILD)/tools/bench_gpu.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/unit-tests: $(TEST_OBJ) $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

docs: $(BUILD)/print-fields
	@mkdir -p docs
	$(abspath $(BUILD))/print-fields > docs/api-fields.md

run: $(BUILD)/rolloutd
	$(abspath $(BUILD))/rolloutd --host 127.0.0.1 --port $(PORT)

# The CUDA backend's kernels under the CPU emulation of CUDA (tests/cuda_emu/README.md): every cuda_*
# unit test on a machine without a GPU.
cuda-emu: $(DEPS_OK)
	tests/cuda_emu/build.sh $(abspath build-emu)
	RS_TEST_JOBS=$${RS_TEST_JOBS:-$$(nproc)} RS_FIXTURES=$(abspath tests/fixtures) $(abspath build-emu)/unit-tests cuda_

# The GRPO example: a warm start and four RL runs (BF16; FP8 without correction, with TIS, with
# MIS), results and figures in examples/grpo/results/. Makes build/rl-venv (torch, transformers,
# matplotlib from PyPI) on first use; RL_ARGS="--steps 20" passes flags to examples/grpo/run.py.
rl-demo: $(BUILD)/rolloutd $(BUILD)/fp8-mismatch
	examples/grpo/run.sh demo $(RL_ARGS)

# The unit tests run UNIT_JOBS at a time, each in its own process (tests/unit/runner.c).
UNIT_JOBS ?= $(shell nproc 2>/dev/null || echo 2)

unit: $(BUILD)/unit-tests
	RS_TEST_JOBS=$(UNIT_JOBS) $(abspath $(BUILD))/unit-tests

# The end-to-end tests run E2E_JOBS test files at a time (pytest-xdist; a file's tests stay on one
# worker, so its daemons and fixtures are made once). One at a time they leave cores idle (daemons
# starting, tests waiting out timeouts): on a 2-vCPU Xeon 2 workers ran them in 3m46s against
# 6m11s. E2E_JOBS=0 runs them in one process.
E2E_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n / 2 > 2 ? n / 2 : 2 )))
E2E_PAR := $(if $(filter 0,$(E2E_JOBS)),,-n $(E2E_JOBS) --dist loadfile)
# The daemon the end-to-end tests start (and the tools beside it they run: `tokenize`, compared with
# Hugging Face's, and `tcpstore-probe`): this build's, or another one, e.g. `make test
# E2E_BIN=$PWD/build-san/rolloutd` (the ASan+UBSan build, which .ci/run makes first).
E2E_BIN ?= $(abspath $(BUILD)/rolloutd)

e2e: $(BUILD)/rolloutd
	@$(PYTHON) -c 'import pytest, xdist, numpy' 2>/dev/null || ./scripts/install-deps.sh
	ROLLOUTD_BIN=$(E2E_BIN) $(PYTHON) -m pytest -q $(E2E_PAR) tests/e2e

test: all
	RS_TEST_JOBS=$(UNIT_JOBS) $(abspath $(BUILD))/unit-tests
	@$(MAKE) --no-print-directory e2e

golden-kernels: $(BUILD)/rolloutd
	@$(PYTHON) -c 'import pytest, numpy' 2>/dev/null || ./scripts/install-deps.sh
	./scripts/golden_each_kernel.sh $(abspath $(BUILD)/rolloutd)

# ---- FP8 codec vs CUDA's own cuda_fp8.h (host path) on all 2^32 inputs --------------------------
# Needs the CUDA headers only (no nvcc, no GPU, no CUDA libraries): cuda_fp8.h compiles as plain
# host C++. Under a minute on 2 cores; exits 1 on any mismatch.
CXXFLAGS_CUDA_REF := -std=c++17 -O2 -g -Wall -Wextra -ffp-contract=off -fno-fast-math -I$(CUDA_HOME)/include

$(BUILD)/tools/fp8_cuda_ref.o: tools/fp8_cuda_ref.cpp
	@mkdir -p $(dir $@)
	@test -e $(CUDA_HOME)/include/cuda_fp8.h || { echo "fp8-exhaustive needs $(CUDA_HOME)/include/cuda_fp8.h"; exit 1; }
	$(CXX) $(CXXFLAGS_CUDA_REF) -c $< -o $@

$(BUILD)/fp8-exhaustive: $(BUILD)/tools/fp8_exhaustive.o $(BUILD)/tools/fp8_cuda_ref.o $(BUILD)/librolloutd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

.PHONY: fp8-exhaustive
fp8-exhaustive: $(BUILD)/fp8-exhaustive
	$(abspath $(BUILD))/fp8-exhaustive

FUZZ_TARGETS := $(patsubst tests/fuzz/%.c,build-fuzz/%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_SECONDS ?= 30
# The library is compiled once with the fuzzer's coverage instrumentation; each target links it.
FUZZ_OBJ := $(patsubst %.c,build-fuzz/obj/%.o,$(LIB_SRC))
FUZZ_BASE_CFLAGS := -std=c11 -g -O1 -D_GNU_SOURCE
FUZZ_CFLAGS := $(FUZZ_BASE_CFLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all
build-fuzz/obj/%.o: %.c $(DEPS_OK)
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -MMD -MP -c $< -o $@

build-fuzz/obj/tokenizer/default_tokenizer.o: tokenizer/default_tokenizer.json
# The CPU kernels are linked but no parser reaches them (the sanitized unit tests check them), so they
# are compiled without instrumentation: under it they were 200 of the build's ~240 CPU seconds.
build-fuzz/obj/kernels/cpu/%.o: kernels/cpu/%.c $(DEPS_OK)
	@mkdir -p $(dir $@)
	clang $(FUZZ_BASE_CFLAGS) -MMD -MP -c $< -o $@
.SECONDARY: $(FUZZ_OBJ)

build-fuzz/%: tests/fuzz/%.c $(FUZZ_OBJ) $(DEPS_OK)
	@mkdir -p build-fuzz
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< $(FUZZ_OBJ) $(LDLIBS)

fuzz: $(FUZZ_TARGETS)
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh $(FUZZ_TARGETS)

clean:
	rm -rf build build-san build-fuzz

-include $(SAN_PLAIN_OBJ:.o=.d) $(LIB_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(BUILD)/server/main.d $(wildcard $(BUILD)/tools/*.d) $(wildcard build-fuzz/obj/*/*.d build-fuzz/obj/*/*/*.d)
