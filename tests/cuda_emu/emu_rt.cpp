/* emu_rt.cpp — the CUDA emulation runtime: CUDA blocks as fibers on one OS thread, device memory as tracked host memory. */
#include <cuda_runtime.h>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>
#include <algorithm>
#include <atomic>
#include <functional>
#include <sys/mman.h>

extern "C" {
size_t emu_launches, emu_blocks_run;
}
dim3 threadIdx, blockIdx, blockDim, gridDim;

/* ---------------- fibers ---------------- */
/* Saves the callee-saved registers on this stack and switches to another. MXCSR and the x87
 * control word are not switched: no emulated code changes them, and ldmxcsr / fldcw took half of
 * every switch's time (every fiber switches at each shuffle and barrier). */
extern "C" void emu_ctx_switch(void **save_sp, void *new_sp);
asm(R"(
.text
.globl emu_ctx_switch
.type emu_ctx_switch,@function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_ctx_switch,.-emu_ctx_switch
)");

enum { F_RUN, F_WARP, F_BLOCK, F_DONE };
struct Fiber {
    void *sp;
    char *stack;
    int state;
    unsigned tid;
    unsigned shfl_count;
};
/* A fiber's stack is STACK bytes plus a color: each fiber's top sits (tid mod 256) x 448 bytes
 * further into its page-aligned mapping. Mapped one after another with STACK bytes each, every
 * fiber's top frames (its saved registers, the kernel's locals) fell into the same L1 and L2 cache
 * sets, and a round over a block's fibers in a random order missed both caches at every switch. */
static const size_t STACK = 256 << 10, COLOR_STEP = 448, COLORS = 256;
/* the bytes of fiber tid's mapping, from its guard page's start to its stack's top */
static size_t stack_bytes(unsigned tid) { return STACK + (tid % COLORS) * COLOR_STEP; }
static std::vector<Fiber> fibers;
static void *sched_sp;
static Fiber *cur;
static void (*g_body)(void *);
static void *g_arg;
static uint64_t shfl_buf[2][1024];
static unsigned shfl_tag[2][1024];
static const char *g_name;
static std::set<std::string> warned;
static int sched_mode = -1; /* 0 forward, 1 reverse, 2 random */
static uint64_t rng_state = 12345; /* EMU_SEED */

/* A Fisher-Yates shuffle on xorshift64* (EMU_SCHED=2 shuffles every round of every block: with
 * std::shuffle over mt19937 that was a tenth of the sanitized emulation's time). The index is the
 * high half of a 64-bit product, within 2^-32 of uniform. */
static void shuffle_order(std::vector<unsigned> &v) {
    for (size_t i = v.size(); i > 1; i--) {
        rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
        const uint64_t r = (rng_state * 0x2545f4914f6cdd1dull) >> 32;
        const size_t j = (size_t)((r * i) >> 32);
        std::swap(v[i - 1], v[j]);
    }
}

static void warn_once(const char *what) {
    std::string k = std::string(g_name) + ": " + what;
    if (warned.insert(k).second) fprintf(stderr, "emu WARNING: %s\n", k.c_str());
}
[[noreturn]] static void emu_die(const char *what) {
    fprintf(stderr, "emu ERROR in kernel %s block (%u,%u,%u) thread %u: %s\n", g_name, blockIdx.x, blockIdx.y,
            blockIdx.z, cur ? cur->tid : 0u, what);
    abort();
}

/* The build compiles this runtime without the sanitizers (they check the kernels, not the emulator)
 * and defines EMU_FIBER_ANNOTATIONS when the kernels are under ASan, which must still be told of
 * every stack switch. */
#if defined(__SANITIZE_ADDRESS__) || defined(EMU_FIBER_ANNOTATIONS)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
static void *sched_fake;
static const void *sched_bottom;
static size_t sched_size;
#endif

/* A round of run_block runs every runnable fiber once, in `order`: the scheduler switches to the
 * first, each fiber at its next scheduling point switches straight to the next runnable one, and the
 * last back to the scheduler (one switch a fiber and round, not two). */
static std::vector<unsigned> order;
static size_t order_pos;
static bool entered_from_sched; /* the switch into a new fiber came from the scheduler */
#ifdef EMU_ASAN
struct FiberFake { void *fake = NULL; };
static FiberFake fakes[1024];
#endif

static Fiber *next_runnable(void) { /* after order_pos in this round, or NULL */
    while (++order_pos < order.size()) {
        Fiber &f = fibers[order[order_pos]];
        if (f.state == F_RUN) return &f;
    }
    return NULL;
}

/* scheduler -> the round's first runnable fiber, if any; back when the round is over */
static void run_round(void) {
    order_pos = (size_t)-1;
    Fiber *f = next_runnable();
    if (!f) return;
    cur = f;
    threadIdx = dim3(f->tid, 0, 0);
    entered_from_sched = true;
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(&sched_fake, f->stack + 4096, stack_bytes(f->tid) - 4096);
#endif
    emu_ctx_switch(&sched_sp, f->sp);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(sched_fake, NULL, NULL);
#endif
}

/* fiber -> the round's next runnable fiber, or the scheduler */
static void switch_from_fiber(bool finished) {
    Fiber *me = cur, *next = next_runnable();
#ifdef EMU_ASAN
    void **fake = finished ? NULL : &fakes[me->tid].fake;
#else
    (void)finished;
#endif
    if (next) {
        cur = next;
        threadIdx = dim3(next->tid, 0, 0);
        entered_from_sched = false;
#ifdef EMU_ASAN
        __sanitizer_start_switch_fiber(fake, next->stack + 4096, stack_bytes(next->tid) - 4096);
#endif
        emu_ctx_switch(&me->sp, next->sp);
    } else {
#ifdef EMU_ASAN
        __sanitizer_start_switch_fiber(fake, sched_bottom, sched_size);
#endif
        emu_ctx_switch(&me->sp, sched_sp);
    }
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fakes[me->tid].fake, NULL, NULL);
#endif
}

static void fiber_entry(void) {
#ifdef EMU_ASAN
    const void *from_bottom;
    size_t from_size;
    __sanitizer_finish_switch_fiber(NULL, &from_bottom, &from_size);
    if (entered_from_sched) sched_bottom = from_bottom, sched_size = from_size; /* the launching thread's stack */
#endif
    g_body(g_arg);
    cur->state = F_DONE;
    switch_from_fiber(true);
    abort();
}

static void fiber_prepare(Fiber &f) {
    if (!f.stack) {
        f.stack = (char *)mmap(NULL, stack_bytes(f.tid), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (f.stack == MAP_FAILED) abort();
        mprotect(f.stack, 4096, PROT_NONE); /* guard page */
    }
#ifdef EMU_ASAN
    /* The frames of the fiber's last run that returned left their shadow clean; the two that never
     * return (fiber_entry and the final switch) are at the top. (The whole stack's shadow, 32 KiB a
     * fiber and block, was 8% of a sanitized attention test's time.) */
    __asan_unpoison_memory_region(f.stack + stack_bytes(f.tid) - 16384, 16384);
#endif
    uintptr_t top = ((uintptr_t)f.stack + stack_bytes(f.tid)) & ~(uintptr_t)15;
    uint64_t *s = (uint64_t *)top;
    *--s = 0;                           /* fake return address of fiber_entry */
    *--s = (uint64_t)(uintptr_t)&fiber_entry;
    for (int i = 0; i < 6; i++) *--s = 0; /* rbp rbx r12..r15 */
    f.sp = s;
    f.state = F_RUN;
    f.shfl_count = 0;
    shfl_tag[0][f.tid] = shfl_tag[1][f.tid] = ~0u;
}

static void yield_to_sched(int st) {
    cur->state = st;
    switch_from_fiber(false);
}

void emu_syncthreads(void) { yield_to_sched(F_BLOCK); }
void emu_syncwarp(void) { yield_to_sched(F_WARP); }
void emu_check_mask(unsigned m) {
    if (m != 0xffffffffu) emu_die("partial warp mask not emulated");
}
void emu_shfl_put(uint64_t v) {
    shfl_buf[cur->shfl_count & 1][cur->tid] = v;
    shfl_tag[cur->shfl_count & 1][cur->tid] = cur->shfl_count;
    yield_to_sched(F_WARP);
}
uint64_t emu_shfl_get(int src) {
    unsigned base = cur->tid & ~31u;
    unsigned s = base + (unsigned)src;
    if (s >= fibers.size() || s >= blockDim.x) emu_die("shuffle source outside the block");
    if (shfl_tag[cur->shfl_count & 1][s] != cur->shfl_count) emu_die("shuffle source lane is not at the same shuffle");
    uint64_t v = shfl_buf[cur->shfl_count & 1][s];
    cur->shfl_count++;
    return v;
}

static uint8_t exchange_buf[2][1024][EMU_WARP_ROW];
const uint8_t *emu_warp_exchange(const void *mine, size_t bytes) {
    if (bytes > EMU_WARP_ROW) emu_die("warp exchange of more than 64 bytes");
    const unsigned par = cur->shfl_count & 1, base = cur->tid & ~31u;
    memcpy(exchange_buf[par][cur->tid], mine, bytes);
    shfl_tag[par][cur->tid] = cur->shfl_count;
    yield_to_sched(F_WARP);
    if (base + 32 > fibers.size() || base + 32 > blockDim.x) emu_die("warp exchange with lanes outside the block");
    for (unsigned l = 0; l < 32; l++)
        if (shfl_tag[par][base + l] != cur->shfl_count) emu_die("warp exchange: a lane is not at the same collective");
    cur->shfl_count++;
    /* the rows stay as they are until this warp's collective after next (the other parity) */
    return exchange_buf[par][base];
}

static void run_block(unsigned T) {
    if (fibers.size() < T) fibers.resize(T);
    for (unsigned t = 0; t < T; t++) {
        fibers[t].tid = t;
        fiber_prepare(fibers[t]);
    }
    order.resize(T);
    for (unsigned t = 0; t < T; t++) order[t] = sched_mode == 1 ? T - 1 - t : t;
    for (;;) {
        if (sched_mode == 2) shuffle_order(order);
        run_round();
        cur = NULL;
        /* everybody is blocked or done: release what can be released, in one pass over the
         * states (releasing warp w changes no other warp's states, so the totals are those of
         * the round's end) */
        unsigned done = 0, at_block = 0, at_warp = 0;
        bool released = false;
        for (unsigned w = 0; w < (T + 31) / 32; w++) {
            unsigned lo = w * 32, hi = std::min(T, lo + 32), nw = 0, nd = 0, nb = 0;
            for (unsigned t = lo; t < hi; t++) {
                const int s = fibers[t].state;
                nw += s == F_WARP, nd += s == F_DONE, nb += s == F_BLOCK;
            }
            done += nd, at_block += nb, at_warp += nw;
            if (nw && nw + nd == hi - lo) {
                if (nd) {
                    fprintf(stderr, "emu ERROR in kernel %s block (%u,%u,%u): warp %u syncs/shuffles with %u exited lanes\n",
                            g_name, blockIdx.x, blockIdx.y, blockIdx.z, w, nd);
                    abort();
                }
                for (unsigned t = lo; t < hi; t++) fibers[t].state = F_RUN;
                released = true;
            }
        }
        if (done == T) return;
        if (released) continue;
        if (at_block && at_block + done == T) {
            if (done) warn_once("__syncthreads() after some threads of the block exited");
            for (unsigned t = 0; t < T; t++)
                if (fibers[t].state == F_BLOCK) fibers[t].state = F_RUN;
            continue;
        }
        fprintf(stderr, "emu ERROR in kernel %s block (%u,%u,%u): deadlock: %u at __syncthreads, %u at warp sync, %u exited of %u\n",
                g_name, blockIdx.x, blockIdx.y, blockIdx.z, at_block, at_warp, done, T);
        for (unsigned t = 0; t < T; t++) fprintf(stderr, "%d", fibers[t].state);
        fprintf(stderr, "\n");
        abort();
    }
}

/* One launch at a time in the process: the scheduler's state and every kernel's __shared__ arrays
 * are globals, and a daemon launches from two threads (the engine, and the weight-sync service's
 * KV calibration on a backend of its own). A GPU would run them concurrently; here they queue. */
static std::mutex launch_mu;

static void emu_run_grid(const char *name, dim3 g, dim3 b, void (*body)(void *), void *arg) {
    std::lock_guard<std::mutex> launch_lock(launch_mu);
    if (sched_mode < 0) {
        const char *m = getenv("EMU_SCHED");
        sched_mode = m ? atoi(m) : 0;
        if (getenv("EMU_SEED")) rng_state = 0x9e3779b97f4a7c15ull ^ (uint64_t)atoll(getenv("EMU_SEED"));
        if (!rng_state) rng_state = 1; /* xorshift's one fixed point */
    }
    g_name = name;
    if (b.y != 1 || b.z != 1) { fprintf(stderr, "emu: %s: 2-D/3-D blocks not emulated\n", name); abort(); }
    if (b.x == 0 || b.x > 1024) { fprintf(stderr, "emu: %s: bad block size %u\n", name, b.x); abort(); }
    if (b.x % 32) warn_once("block size not a multiple of 32");
    if (g.x == 0 || g.y == 0 || g.z == 0 || g.y > 65535 || g.z > 65535 || g.x > 2147483647u) {
        fprintf(stderr, "emu: %s: invalid grid (%u,%u,%u)\n", name, g.x, g.y, g.z);
        abort();
    }
    emu_launches++;
    static int trace = getenv("EMU_TRACE") != NULL;
    if (trace) fprintf(stderr, "emu launch %s grid (%u,%u,%u) block %u\n", name, g.x, g.y, g.z, b.x);
    g_body = body, g_arg = arg;
    blockDim = b, gridDim = g;
    for (unsigned z = 0; z < g.z; z++)
        for (unsigned y = 0; y < g.y; y++)
            for (unsigned x = 0; x < g.x; x++) {
                blockIdx = dim3(x, y, z);
                run_block(b.x);
                emu_blocks_run++;
            }
}

/* ---------------- streams and capture ---------------- */
/* A stream records instead of running while it captures (cudaStreamBeginCapture, global mode):
 * kernel launches, copies, memsets and library work become the graph's steps, replayed in order by
 * cudaGraphLaunch. What a real capture refuses is refused here too, and invalidates the capture:
 * synchronizing the capturing stream, a copy from or to pageable host memory, and (global mode:
 * "potentially unsafe" calls, in any thread) cudaMalloc / cudaFree / their async forms and
 * synchronous copies. Those calls return cudaErrorStreamCaptureUnsupported, and
 * cudaStreamEndCapture then cudaErrorStreamCaptureInvalidated. */
struct EmuStep {
    const char *what;
    std::function<void()> fn;
};
struct emu_stream {
    bool capturing = false, broken = false;
    std::vector<EmuStep> steps;
};
struct emu_graph {
    std::vector<EmuStep> steps;
};
struct emu_graph_exec {
    std::vector<EmuStep> steps;
};
static emu_stream default_stream; /* the NULL stream: never captures here */
static std::atomic<int> capturing_streams{0};
static std::mutex capture_mu;
static std::set<emu_stream *> capturing_set;

static emu_stream *stream_of(cudaStream_t s) { return s ? s : &default_stream; }

/* Marks the capture broken and returns the error the call gets. */
static cudaError_t capture_refuse(emu_stream *st, const char *what) {
    if (getenv("EMU_TRACE")) fprintf(stderr, "emu: %s during stream capture: not permitted\n", what);
    if (st) st->broken = true;
    return cudaErrorStreamCaptureUnsupported;
}

/* A call that a global-mode capture forbids in any thread: refuses, and invalidates every capture
 * in progress, while any stream captures. */
static bool unsafe_during_capture(const char *what) {
    if (capturing_streams.load() == 0) return false;
    std::lock_guard<std::mutex> l(capture_mu);
    for (emu_stream *st : capturing_set) capture_refuse(st, what);
    return true;
}

void emu_launch_grid(cudaStream_t s, const char *name, dim3 g, dim3 b, std::function<void()> body) {
    emu_stream *st = stream_of(s);
    if (st->capturing) {
        st->steps.push_back({name, [name, g, b, body]() {
                                 std::function<void()> f = body;
                                 emu_run_grid(name, g, b, [](void *p) { (*(std::function<void()> *)p)(); }, &f);
                             }});
        return;
    }
    emu_run_grid(name, g, b, [](void *p) { (*(std::function<void()> *)p)(); }, &body);
}

/* Work a library queues on a stream (cuBLASLt's matmul): runs now, in stream order (every stream
 * operation runs synchronously here), or is recorded while the stream captures. */
void emu_stream_run(cudaStream_t s, const char *what, std::function<void()> fn) {
    emu_stream *st = stream_of(s);
    if (st->capturing) st->steps.push_back({what, fn});
    else fn();
}

/* ---------------- device memory ---------------- */
static std::mutex mu;
static std::map<uintptr_t, size_t> allocs; /* base -> bytes */
static std::map<uintptr_t, size_t> pinned; /* cudaMallocHost / cudaHostAlloc: base -> bytes */

static bool is_pinned(const void *p, size_t n) {
    std::lock_guard<std::mutex> l(mu);
    uintptr_t u = (uintptr_t)p;
    auto it = pinned.upper_bound(u);
    if (it == pinned.begin()) return false;
    --it;
    return u >= it->first && u + n <= it->first + it->second;
}

extern "C" int emu_is_device_ptr(const void *p) {
    std::lock_guard<std::mutex> l(mu);
    uintptr_t u = (uintptr_t)p;
    auto it = allocs.upper_bound(u);
    if (it == allocs.begin()) return 0;
    --it;
    return u >= it->first && u <= it->first + it->second; /* one past the end counts */
}
static void check_range(const void *p, size_t n, bool dev, const char *what) {
    if (n == 0) return;
    uintptr_t u = (uintptr_t)p;
    std::lock_guard<std::mutex> l(mu);
    auto it = allocs.upper_bound(u);
    bool in = false;
    if (it != allocs.begin()) {
        --it;
        in = u >= it->first && u < it->first + it->second;
        if (in && dev && u + n > it->first + it->second) {
            fprintf(stderr, "emu ERROR: %s: %zu bytes at %p overrun a %zu-byte device allocation\n", what, n, p,
                    it->second);
            abort();
        }
    }
    if (in != dev) {
        fprintf(stderr, "emu ERROR: %s: %p is %s memory, expected %s\n", what, p, in ? "device" : "host",
                dev ? "device" : "host");
        abort();
    }
}

extern "C" {
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
    if (d != 0) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof *p);
    strcpy(p->name, "CPU emulation of CUDA");
    p->totalGlobalMem = (size_t)16 << 30;
    p->major = 9, p->minor = 0, p->multiProcessorCount = 4, p->warpSize = 32;
    return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t n) {
    if (unsafe_during_capture("cudaMalloc")) return cudaErrorStreamCaptureUnsupported;
    if (n == 0) { *p = NULL; return cudaSuccess; }
    void *q = NULL;
    if (posix_memalign(&q, 256, n)) return cudaErrorMemoryAllocation;
    memset(q, 0xFF, n); /* device memory is not zeroed: NaN floats, -1 ints */
    std::lock_guard<std::mutex> l(mu);
    allocs[(uintptr_t)q] = n;
    *p = q;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    if (unsafe_during_capture("cudaFree")) return cudaErrorStreamCaptureUnsupported;
    if (!p) return cudaSuccess;
    {
        std::lock_guard<std::mutex> l(mu);
        auto it = allocs.find((uintptr_t)p);
        if (it == allocs.end()) { fprintf(stderr, "emu ERROR: cudaFree(%p): not a device allocation\n", p); abort(); }
        memset(p, 0x5A, it->second);
        allocs.erase(it);
    }
    free(p);
    return cudaSuccess;
}
/* (a capture would record these as graph-owned allocation nodes; the backend never does that) */
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t) { return cudaMalloc(p, n); }
cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return cudaFree(p); }
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned) {
    if (unsafe_during_capture("cudaHostAlloc")) return cudaErrorStreamCaptureUnsupported;
    *p = malloc(n ? n : 1);
    if (!*p) return cudaErrorMemoryAllocation;
    std::lock_guard<std::mutex> l(mu);
    pinned[(uintptr_t)*p] = n ? n : 1;
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, 0); }
cudaError_t cudaFreeHost(void *p) {
    if (unsafe_during_capture("cudaFreeHost")) return cudaErrorStreamCaptureUnsupported;
    if (!p) return cudaSuccess;
    {
        std::lock_guard<std::mutex> l(mu);
        if (!pinned.erase((uintptr_t)p)) { fprintf(stderr, "emu ERROR: cudaFreeHost(%p): not pinned memory\n", p); abort(); }
    }
    free(p);
    return cudaSuccess;
}
static void copy_now(void *d, const void *s, size_t n, cudaMemcpyKind k) {
    switch (k) {
    case cudaMemcpyHostToDevice: check_range(d, n, true, "memcpy H2D dst"), check_range(s, n, false, "memcpy H2D src"); break;
    case cudaMemcpyDeviceToHost: check_range(d, n, false, "memcpy D2H dst"), check_range(s, n, true, "memcpy D2H src"); break;
    case cudaMemcpyDeviceToDevice: check_range(d, n, true, "memcpy D2D dst"), check_range(s, n, true, "memcpy D2D src"); break;
    default: break;
    }
    if (n) memmove(d, s, n);
}
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k) {
    if (unsafe_during_capture("cudaMemcpy (synchronous)")) return cudaErrorStreamCaptureUnsupported;
    copy_now(d, s, n, k);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t st) {
    emu_stream *es = stream_of(st);
    if (!es->capturing) {
        copy_now(d, s, n, k);
        return cudaSuccess;
    }
    const void *host = k == cudaMemcpyHostToDevice ? s : k == cudaMemcpyDeviceToHost ? d : NULL;
    if (host && n && !is_pinned(host, n)) return capture_refuse(es, "cudaMemcpyAsync from/to pageable host memory");
    es->steps.push_back({"cudaMemcpyAsync", [d, s, n, k]() { copy_now(d, s, n, k); }});
    return cudaSuccess;
}
cudaError_t cudaMemset(void *d, int v, size_t n) {
    if (unsafe_during_capture("cudaMemset (synchronous)")) return cudaErrorStreamCaptureUnsupported;
    check_range(d, n, true, "memset dst");
    memset(d, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) {
    emu_stream *es = stream_of(st);
    auto run = [d, v, n]() {
        check_range(d, n, true, "memset dst");
        memset(d, v, n);
    };
    if (es->capturing) es->steps.push_back({"cudaMemsetAsync", run});
    else run();
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t st) {
    if (stream_of(st)->capturing) return capture_refuse(stream_of(st), "cudaStreamSynchronize");
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
    if (unsafe_during_capture("cudaDeviceSynchronize")) return cudaErrorStreamCaptureUnsupported;
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { *s = new emu_stream; return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { *s = new emu_stream; return cudaSuccess; }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (s && s->capturing) { fprintf(stderr, "emu ERROR: cudaStreamDestroy of a capturing stream\n"); abort(); }
    delete s;
    return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode) {
    emu_stream *es = stream_of(s);
    if (!s || es->capturing) return cudaErrorStreamCaptureUnsupported; /* not the NULL stream, not twice */
    if (mode != cudaStreamCaptureModeGlobal) { fprintf(stderr, "emu: only global-mode capture is emulated\n"); abort(); }
    es->capturing = true, es->broken = false, es->steps.clear();
    {
        std::lock_guard<std::mutex> l(capture_mu);
        capturing_set.insert(es);
    }
    capturing_streams++;
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
    emu_stream *es = stream_of(s);
    if (!es->capturing) return cudaErrorStreamCaptureUnsupported;
    {
        std::lock_guard<std::mutex> l(capture_mu);
        capturing_set.erase(es);
    }
    es->capturing = false;
    capturing_streams--;
    *graph = NULL;
    const bool broken = es->broken;
    std::vector<EmuStep> steps;
    steps.swap(es->steps);
    if (broken) return cudaErrorStreamCaptureInvalidated;
    *graph = new emu_graph{std::move(steps)};
    return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status) {
    emu_stream *es = stream_of(s);
    *status = !es->capturing ? cudaStreamCaptureStatusNone
                             : es->broken ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long) {
    if (!graph) return 1; /* cudaErrorInvalidValue */
    *exec = new emu_graph_exec{graph->steps};
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    if (stream_of(s)->capturing) { fprintf(stderr, "emu: launching a graph into a capture is not emulated\n"); abort(); }
    for (EmuStep &st : exec->steps) st.fn();
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) { delete exec; return cudaSuccess; }
cudaError_t cudaGraphDestroy(cudaGraph_t graph) { delete graph; return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    default: return "emuError";
    }
}
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    default: return "emu error";
    }
}
}

/* [p, p + n) must lie in one device allocation (library emulations check what they read and write) */
void emu_require_device_range(const void *p, size_t n, const char *what) { check_range(p, n, true, what); }

/* kernel pointer arguments must be device memory (or NULL) */
void emu_check_kernel_ptr(const char *name, int i, const void *p) {
    if (p && !emu_is_device_ptr(p)) {
        fprintf(stderr, "emu ERROR: kernel %s argument %d = %p is not device memory\n", name, i, p);
        abort();
    }
}
__attribute__((destructor)) static void emu_stats(void) {
    if (getenv("EMU_STATS")) fprintf(stderr, "emu stats: %zu launches, %zu blocks\n", emu_launches, emu_blocks_run);
}
