/*
 * backend_cpu.c — the CPU backend's op table, its context and its memory.
 *
 * "Device" memory is host memory: alloc is 64-byte aligned and zeroed (large allocations are
 * mapped, and zeroed by the kernel when first touched), upload and download are memcpy. The
 * context owns a thread pool used by every op that has enough work to split, the SIMD level picked
 * at init, and scratch buffers that grow on demand and are kept, so steady-state decode does not
 * allocate.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "../../core/rs.h"
#include "cpu_internal.h"
#include "fp8_gemm.h"
#include "fp8_layout.h"

#ifdef RS_ASAN
#include <sanitizer/asan_interface.h>
#endif

/* ---- scratch ---- */

void *rs_cpu_scratch(rs_cpu_buf *buf, size_t bytes) {
    if (bytes <= buf->cap) return buf->p;
    size_t cap = buf->cap ? buf->cap : 4096;
    while (cap < bytes) cap *= 2;
    free(buf->p);
    buf->p = NULL;
    if (posix_memalign(&buf->p, 64, cap) != 0) {
        RS_ERROR("cpu backend | out of memory growing scratch to %zu bytes", cap);
        abort();
    }
    buf->cap = cap;
    return buf->p;
}

const float *rs_cpu_param_f32(rs_cpu_buf *buf, const rs_tensor *t, int64_t n) {
    if (!rs_tensor_present(t)) return NULL;
    RS_ASSERT(rs_tensor_numel(t) >= n);
    if (t->dtype == RS_DTYPE_F32) return t->data;
    RS_ASSERT(t->dtype == RS_DTYPE_BF16 || t->dtype == RS_DTYPE_F16);
    float *f = rs_cpu_scratch(buf, (size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) f[i] = rs_cpu_elem(t->data, t->dtype, i);
    return f;
}

/* ---- SIMD level ---- */

const char *rs_cpu_simd_name(rs_cpu_simd s) {
    static const char *names[] = {"scalar", "avx2", "avx512"};
    return s >= RS_CPU_SIMD_SCALAR && s <= RS_CPU_SIMD_AVX512 ? names[s] : "?";
}

/* F16C through cpuid: clang's __builtin_cpu_supports does not know "f16c". */
static int has_f16c(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
#else
    return 0;
#endif
}

static rs_cpu_simd detect_simd(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    if (avx2 && __builtin_cpu_supports("avx512f")) return RS_CPU_SIMD_AVX512;
    return avx2 ? RS_CPU_SIMD_AVX2 : RS_CPU_SIMD_SCALAR;
#else
    return RS_CPU_SIMD_SCALAR;
#endif
}

/* AVX512_BF16 (vdpbf16ps, vcvtneps2bf16): cpuid leaf 7, sub-leaf 1, EAX bit 5. Only consulted at
 * the AVX-512 level, whose detection already checked that the OS saves the zmm state. */
static bool has_avx512_bf16(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
#else
    return false;
#endif
}

/* RS_CPU_SIMD caps the level (to compare paths, or to benchmark AVX2 on an AVX-512 machine). */
static rs_cpu_simd env_simd_cap(void) {
    const char *e = getenv("RS_CPU_SIMD");
    if (!e || !*e) return RS_CPU_SIMD_AVX512;
    for (int s = RS_CPU_SIMD_SCALAR; s <= RS_CPU_SIMD_AVX512; s++)
        if (strcmp(e, rs_cpu_simd_name((rs_cpu_simd)s)) == 0) return (rs_cpu_simd)s;
    RS_WARN("cpu backend | ignoring RS_CPU_SIMD=%s (expected scalar, avx2 or avx512)", e);
    return RS_CPU_SIMD_AVX512;
}

/* RS_CPU_GEMV fixes the batch-1 tile form (cpu_internal.h rs_cpu_gemv); unset or "auto": timed. */
static rs_cpu_gemv env_gemv(void) {
    const char *e = getenv("RS_CPU_GEMV");
    if (!e || !*e || strcmp(e, "auto") == 0) return RS_CPU_GEMV_AUTO;
    if (strcmp(e, "tile") == 0) return RS_CPU_GEMV_TILE;
    if (strcmp(e, "rows") == 0) return RS_CPU_GEMV_ROWS;
    RS_WARN("cpu backend | ignoring RS_CPU_GEMV=%s (expected auto, tile or rows)", e);
    return RS_CPU_GEMV_AUTO;
}

/* RS_CPU_AMX=0 keeps the fast numerics' BF16 matmuls off AMX tiles (on the vdpbf16ps tile). */
static bool env_amx(void) {
    const char *e = getenv("RS_CPU_AMX");
    if (!e || !*e || strcmp(e, "1") == 0) return true;
    if (strcmp(e, "0") == 0) return false;
    RS_WARN("cpu backend | ignoring RS_CPU_AMX=%s (expected 0 or 1)", e);
    return true;
}

bool rs_cpu_set_amx(rs_backend *b, bool on) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    c->amx = on && c->bf16_dot && rs_cpu_amx_supported() && (!c->fast || rs_cpu_amx_available());
    return c->amx;
}

void rs_cpu_set_gemv(rs_backend *b, rs_cpu_gemv mode) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    c->gemv_mode = mode; /* what auto has timed so far stays: the same shapes, the same forms */
}

rs_cpu_simd rs_cpu_set_simd(rs_backend *b, rs_cpu_simd level) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    c->simd = level < c->simd_max ? level : c->simd_max;
    return c->simd;
}

/* ---- memory ---- */

/* Every allocation is zeroed and 64-byte aligned (one cache line, one zmm register), and the 64
 * bytes before it hold how it is given back (mem_hdr).
 *
 * Allocations of at least one huge page (weights, the KV pool, staging) are mapped on their own
 * (mmap), 2 MiB aligned, and are not written here: the kernel hands out zeroed pages on first
 * touch. A default 1 GiB KV pool then costs nothing at start-up and resident memory grows with the
 * pages in use (writing the pool added 0.5 s to a daemon's start at the median and up to 1.9 s on
 * a 2-vCPU Xeon, most of it the kernel clearing pages: docs/benchmarks.md). They are advised
 * MADV_HUGEPAGE before anything touches them, so that with transparent huge pages in "madvise"
 * mode (the common default) they are backed by 2 MiB pages: a first touch faults once per 2 MiB
 * instead of once per 4 KiB (a 1.2 GB weight push: ~600 faults, not ~290,000), and a decode step
 * that streams every weight misses the TLB 512x less often. Where THP is off the advice is a
 * no-op. A page with no access rights follows each mapping, so a run past its end faults at once.
 * Under AddressSanitizer the header (and a mapping's header page) and the slack between a
 * mapping's end and that page are poisoned, so a byte before or after an allocation is reported
 * as a heap redzone's would be. */
#define RS_HUGE_PAGE ((size_t)2 << 20)
#define RS_MEM_HDR   ((size_t)64)

typedef struct mem_hdr {
    void *base; /* what posix_memalign returned, or the mapping's start */
    size_t len; /* the mapping's length; 0 for posix_memalign */
} mem_hdr;

static void *map_huge(size_t bytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (bytes > SIZE_MAX - 3 * page - RS_HUGE_PAGE) return NULL;
    /* a header page, the body 2 MiB aligned somewhere in the next body + 2 MiB, a guard page */
    const size_t body = (bytes + page - 1) / page * page, len = page + body + RS_HUGE_PAGE + page;
    uint8_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    uint8_t *p = (uint8_t *)(((uintptr_t)m + page + RS_HUGE_PAGE - 1) & ~(uintptr_t)(RS_HUGE_PAGE - 1));
    uint8_t *start = p - page, *end = p + body + page;
    if (start > m) munmap(m, (size_t)(start - m));
    if (m + len > end) munmap(end, (size_t)(m + len - end));
    (void)mprotect(p + body, page, PROT_NONE);
#ifdef MADV_HUGEPAGE
    /* the whole mapping but the guard, so that it stays one VMA (two with the guard): a model of
     * many tensors must not run into vm.max_map_count; huge pages back only its whole 2 MiB ranges */
    (void)madvise(start, (size_t)(p + body - start), MADV_HUGEPAGE);
#endif
    *(mem_hdr *)(p - RS_MEM_HDR) = (mem_hdr){.base = start, .len = (size_t)(end - start)};
#ifdef RS_ASAN
    ASAN_POISON_MEMORY_REGION(start, page);
    ASAN_POISON_MEMORY_REGION(p + bytes, body - bytes);
#endif
    return p;
}

static void *cpu_alloc(rs_backend *b, size_t bytes) {
    (void)b;
    if (bytes >= RS_HUGE_PAGE) return map_huge(bytes);
    void *m = NULL;
    if (posix_memalign(&m, 64, RS_MEM_HDR + (bytes ? bytes : 64)) != 0) return NULL;
    memset(m, 0, RS_MEM_HDR + bytes);
    *(mem_hdr *)m = (mem_hdr){.base = m, .len = 0};
#ifdef RS_ASAN
    ASAN_POISON_MEMORY_REGION(m, RS_MEM_HDR);
#endif
    return (uint8_t *)m + RS_MEM_HDR;
}

bool rs_cpu_alloc_poisons(void) {
#ifdef RS_ASAN
    return true;
#else
    return false;
#endif
}

static void cpu_free(rs_backend *b, void *p) {
    (void)b;
    if (!p) return;
#ifdef RS_ASAN
    ASAN_UNPOISON_MEMORY_REGION((uint8_t *)p - RS_MEM_HDR, RS_MEM_HDR);
#endif
    const mem_hdr h = *(const mem_hdr *)((uint8_t *)p - RS_MEM_HDR);
    if (!h.len) {
        free(h.base);
        return;
    }
#ifdef RS_ASAN
    ASAN_UNPOISON_MEMORY_REGION(h.base, h.len); /* the range may be mapped again, for anything */
#endif
    munmap(h.base, h.len);
}

/* Uploads of at least this many bytes (weights, pushed weights) use non-temporal stores: they
 * skip the read-for-ownership of the destination that a cached store pays, and the data is not
 * read again soon (a model is far larger than the caches). On the reference VM `build/rollout-bench`
 * (its "memory" line) measured 56.7 GB/s of bytes read + written for this upload against 39.7 for
 * memcpy; SSE2 streaming stores were ~8% slower than AVX-512 ones in a one-off test. */
#define RS_STREAM_MIN ((size_t)1 << 20)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

__attribute__((target("avx512f"))) static void stream_copy_avx512(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 256) {
        const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64),
                      c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
        _mm512_stream_si512((void *)(d + i), a);
        _mm512_stream_si512((void *)(d + i + 64), b);
        _mm512_stream_si512((void *)(d + i + 128), c);
        _mm512_stream_si512((void *)(d + i + 192), e);
    }
}

static void stream_copy_sse2(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        const __m128i a = _mm_loadu_si128((const void *)(s + i)), b = _mm_loadu_si128((const void *)(s + i + 16)),
                      c = _mm_loadu_si128((const void *)(s + i + 32)), e = _mm_loadu_si128((const void *)(s + i + 48));
        _mm_stream_si128((void *)(d + i), a);
        _mm_stream_si128((void *)(d + i + 16), b);
        _mm_stream_si128((void *)(d + i + 32), c);
        _mm_stream_si128((void *)(d + i + 48), e);
    }
}

/* memcpy with streaming stores: an unaligned head and tail by memcpy, the 256-byte-multiple body
 * 64-byte aligned at the destination, then a store fence so the data is visible to other threads
 * like a plain memcpy's. */
static void stream_copy(rs_cpu_simd simd, void *dst, const void *src, size_t n) {
    uint8_t *d = dst;
    const uint8_t *s = src;
    const size_t head = RS_MIN(n, (size_t)((64 - ((uintptr_t)d & 63)) & 63));
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    const size_t body = n & ~(size_t)255;
    if (simd == RS_CPU_SIMD_AVX512) stream_copy_avx512(d, s, body);
    else stream_copy_sse2(d, s, body);
    _mm_sfence();
    memcpy(d + body, s + body, n - body);
}
#endif

static void cpu_upload(rs_backend *b, void *dst, const void *src_host, size_t bytes) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (bytes >= RS_STREAM_MIN) {
        stream_copy(rs_cpu_ctx_of(b)->simd, dst, src_host, bytes);
        return;
    }
#else
    (void)b;
#endif
    if (bytes) memcpy(dst, src_host, bytes);
}

static void cpu_copy(rs_backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    memmove(dst, src, bytes);
}

static void cpu_download(rs_backend *b, void *dst_host, const void *src, size_t bytes) {
    (void)b;
    if (bytes) memcpy(dst_host, src, bytes);
}

/* ---- FP8 weight layout ---- */

/* Weights that the AVX-512 VNNI GEMM will read are kept in its layout (fp8_layout.h). */
static rs_layout cpu_fp8_layout(rs_backend *b, int64_t n, int64_t k) {
    const rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    return c->simd == RS_CPU_SIMD_AVX512 && rs_fp8_gemm_isa_supported(RS_FP8_GEMM_ISA_AVX512_VNNI) &&
                   rs_fp8_pairs32_fits(n, k)
               ? RS_LAYOUT_FP8_PAIRS32
               : RS_LAYOUT_ROWS;
}

static void cpu_fp8_pack(rs_backend *b, rs_layout layout, uint8_t *dst, const uint8_t *src, int64_t n, int64_t k) {
    (void)b;
    RS_ASSERT(layout == RS_LAYOUT_FP8_PAIRS32);
    rs_fp8_pairs32_pack(dst, src, n, k);
}

/* ---- numerics ---- */

/* Fast numerics exist for BF16 matmuls on AVX512_BF16 CPUs (rs_cpu_fast_bf16), and for FP8 ones
 * where AMX tiles run them too; elsewhere the CPU backend has only its exact kernels and reports
 * exact. */
static rs_numerics cpu_numerics(const rs_backend *b) {
    return rs_cpu_fast_bf16(rs_cpu_ctx_of((rs_backend *)b)) ? RS_NUMERICS_FAST : RS_NUMERICS_EXACT;
}

static rs_numerics cpu_set_numerics(rs_backend *b, rs_numerics want) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    c->fast = want == RS_NUMERICS_FAST;
    /* the tile state's permission, asked only now (cpu_amx.c); refused: vdpbf16ps */
    if (c->fast && c->amx && !rs_cpu_amx_available()) {
        RS_WARN("cpu backend | the OS refused the AMX tile state: fast numerics' BF16 matmuls run on vdpbf16ps");
        c->amx = false;
    }
    return cpu_numerics(b);
}

/* ---- lifetime ---- */

static void cpu_destroy(rs_backend *b) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    rs_pool_free(c->pool);
    for (int t = 0; t < c->n_threads; t++) free(c->thread_buf[t].p);
    free(c->thread_buf);
    for (size_t i = 0; i < RS_ARRAY_LEN(c->param_buf); i++) free(c->param_buf[i].p);
    free(c->row_seq.p);
    for (size_t i = 0; i < RS_ARRAY_LEN(c->moe); i++) free(c->moe[i].p);
    free(c->fp8_act.p);
    free(c->fp8_rows.p);
    free(c->bf16_act.p);
    free(c->amx_act.p);
    for (int t = 0; t < c->n_threads; t++) free(c->amx_pad[t].p);
    free(c->amx_pad);
    free(c);
    free(b);
}

static const rs_backend_ops cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_memory = true,
    .upload = cpu_upload,
    .download = cpu_download,
    .copy = cpu_copy,
    .fp8_layout = cpu_fp8_layout,
    .fp8_pack = cpu_fp8_pack,
    .embed = rs_cpu_op_embed,
    .rmsnorm = rs_cpu_op_rmsnorm,
    .matmul = rs_cpu_op_matmul,
    .rope = rs_cpu_op_rope,
    .kv_store = rs_cpu_op_kv_store,
    .attention = rs_cpu_op_attention,
    .swiglu = rs_cpu_op_swiglu,
    .add = rs_cpu_op_add,
    .gather_rows = rs_cpu_op_gather_rows,
    .moe = rs_cpu_op_moe,
    .set_numerics = cpu_set_numerics,
    .numerics = cpu_numerics,
    .destroy = cpu_destroy,
};

rs_backend *rs_backend_cpu_init(int n_threads) {
    rs_cpu_ctx *c = rs_xcalloc(1, sizeof *c);
    c->pool = rs_pool_init(n_threads);
    c->n_threads = rs_pool_threads(c->pool);
    c->thread_buf = rs_xcalloc((size_t)c->n_threads, sizeof *c->thread_buf);
    c->simd_max = detect_simd();
    c->gemv_mode = env_gemv();
    c->bf16_dot = c->simd_max == RS_CPU_SIMD_AVX512 && has_avx512_bf16();
    c->amx_pad = rs_xcalloc((size_t)c->n_threads, sizeof *c->amx_pad);
    c->amx = c->bf16_dot && env_amx() && rs_cpu_amx_supported();
    rs_cpu_simd cap = env_simd_cap();
    c->simd = cap < c->simd_max ? cap : c->simd_max;

    rs_backend *b = rs_xcalloc(1, sizeof *b);
    b->ops = &cpu_ops;
    b->ctx = c;
    RS_DEBUG("cpu backend | threads %d | simd %s (cpu supports %s)", c->n_threads, rs_cpu_simd_name(c->simd),
             rs_cpu_simd_name(c->simd_max));
    return b;
}

rs_backend *rs_backend_cpu_init_kernels(int n_threads, const char *kernels, rs_error *err) {
    rs_cpu_simd want = RS_CPU_SIMD_AVX512;
    bool forced = strcmp(kernels, "auto") != 0;
    if (forced) {
        int s = RS_CPU_SIMD_SCALAR;
        while (s <= RS_CPU_SIMD_AVX512 && strcmp(kernels, rs_cpu_simd_name((rs_cpu_simd)s)) != 0) s++;
        if (s > RS_CPU_SIMD_AVX512) {
            rs_error_set(err, RS_EINVAL, "cpu-kernels", "cpu-kernels '%s': expected auto, avx512, avx2 or scalar",
                         kernels);
            return NULL;
        }
        want = (rs_cpu_simd)s;
    }
    rs_backend *b = rs_backend_cpu_init(n_threads);
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    if (forced) {
        if (want > c->simd_max) {
            rs_error_set(err, RS_EUNSUPPORTED, "cpu-kernels", "cpu-kernels %s: this CPU runs %s at most", kernels,
                         rs_cpu_simd_name(c->simd_max));
            rs_backend_free(b);
            return NULL;
        }
        c->simd = want;
    }
    /* the FP8 GEMM's few-rows / padded-tile crossover of this CPU (fp8_gemm.h) */
    rs_fp8_gemm_tune(rs_cpu_fp8_isa(c->simd));
    char line[256];
    RS_INFO("%s%s", rs_backend_cpu_describe(b, line, sizeof line),
            forced ? " (forced by cpu-kernels)" : c->simd < c->simd_max ? " (capped by RS_CPU_SIMD)" : "");
    return b;
}

rs_backend *rs_backend_cpu_init_like(const rs_backend *like, int n_threads) {
    RS_ASSERT(like->ops == &cpu_ops);
    const rs_cpu_ctx *l = like->ctx;
    rs_backend *b = rs_backend_cpu_init(n_threads);
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    c->simd = l->simd; /* the same CPU: simd_max is the same */
    c->amx = l->amx;
    return b;
}

const char *rs_backend_cpu_describe(rs_backend *b, char *buf, size_t n) {
    const rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    const bool vnni = rs_fp8_gemm_isa_supported(RS_FP8_GEMM_ISA_AVX512_VNNI);
    const char *isa = c->simd == RS_CPU_SIMD_SCALAR ? "scalar C"
                      : c->simd == RS_CPU_SIMD_AVX2 ? "avx2 fma f16c"
                      : vnni ? "avx512f avx512bw avx512vl avx512dq avx512vbmi avx512vnni gfni avx2 fma f16c"
                             : "avx512f avx2 fma f16c";
    const int nt = c->simd == RS_CPU_SIMD_AVX512 ? RS_CPU_NT_AVX512 : c->simd == RS_CPU_SIMD_AVX2 ? RS_CPU_NT_AVX2 : 4;
    const rs_fp8_gemm_isa fp8 = rs_cpu_fp8_isa(c->simd);
    const int tile_min = rs_fp8_gemm_row_tile_min(fp8);
    const bool bf16 = c->bf16_dot && c->simd == RS_CPU_SIMD_AVX512;
    /* the AMX FP8 kernel reads the VNNI kernel's weight layout */
    const char *fp8_amx = bf16 && c->amx && fp8 == RS_FP8_GEMM_ISA_AVX512_VNNI ? "; fast numerics: amx tiles" : "";
    char tiles[80] = "";
    if (tile_min > 16) snprintf(tiles, sizeof tiles, " (no padded row tiles%s)", fp8_amx);
    else if (tile_min > 0) snprintf(tiles, sizeof tiles, " (padded row tiles from %d rows%s)", tile_min, fp8_amx);
    snprintf(buf, n, "cpu: %s%s; fp8 kernel %s%s; bf16 tile %dx%d%s; %d threads", isa,
             bf16 ? (c->amx ? " avx512bf16 amx-bf16" : " avx512bf16") : "", rs_fp8_gemm_isa_name(fp8), tiles,
             RS_CPU_NW, nt, bf16 && c->amx ? " (fast numerics: amx tiles)" : "", c->n_threads);
    return buf;
}
