/*
 * test_cpu_ops.c — every op of the CPU backend against a plain reference written here.
 *
 * References are naive loops in double over the same inputs (weights taken after rounding to
 * their dtype), so they share no code with the kernels. Each op runs on every SIMD level this CPU
 * has (scalar, AVX2, AVX-512 via rs_cpu_set_simd) with 1 and 2 threads, on shapes that are not
 * multiples of any vector width or tile (K = 7, 33, 257, ...; rows 1, 3, 17, ...). Tolerances are
 * relative to the sum of |terms| of each output, the scale of fp32 rounding error in a dot product.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_internal.h"
#include "../../kernels/cpu/fp8_layout.h"
#include "../../kernels/fp8.h"
#include "test.h"

/* ---- helpers ---- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_uniform(uint64_t *s) { /* [-1, 1) */
    return (float)((double)(rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static float *rand_floats(size_t n, uint64_t *rng, float amp) {
    float *x = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++) x[i] = amp * rng_uniform(rng);
    return x;
}

/* A weight tensor of `dt` with random values, and those values (after rounding) in double. */
typedef struct wmat {
    rs_tensor t;
    double *ref; /* [numel] */
} wmat;

static wmat make_tensor(rs_dtype dt, int ndim, int64_t d0, int64_t d1, uint64_t *rng, float amp) {
    wmat m = {.t = {.dtype = dt, .ndim = ndim, .shape = {d0, ndim == 2 ? d1 : 0}}};
    size_t n = (size_t)d0 * (size_t)(ndim == 2 ? d1 : 1);
    m.t.data = malloc(n * rs_dtype_size(dt) + 1);
    m.ref = malloc(n * sizeof(double) + 1);
    for (size_t i = 0; i < n; i++) {
        float v = amp * rng_uniform(rng);
        if (dt == RS_DTYPE_BF16) {
            uint16_t h = rs_f32_to_bf16(v);
            ((uint16_t *)m.t.data)[i] = h;
            m.ref[i] = rs_bf16_to_f32(h);
        } else if (dt == RS_DTYPE_F16) {
            uint16_t h = rs_f32_to_f16(v);
            ((uint16_t *)m.t.data)[i] = h;
            m.ref[i] = rs_f16_to_f32(h);
        } else {
            ((float *)m.t.data)[i] = v;
            m.ref[i] = v;
        }
    }
    return m;
}

static void free_tensor(wmat *m) {
    free(m->t.data);
    free(m->ref);
}

#define ASSERT_FEQ(a, b)                                                                                     \
    do {                                                                                                     \
        float a_ = (a), b_ = (b);                                                                            \
        if (!(a_ == b_)) RS_TEST_FAIL("ASSERT_FEQ(%s, %s): %.9g != %.9g", #a, #b, a_, b_);                   \
    } while (0)

static const rs_dtype weight_dtypes[] = {RS_DTYPE_BF16, RS_DTYPE_F16, RS_DTYPE_F32};

/* Highest SIMD level of this CPU. */
static int max_simd(void) {
    static int s = -1;
    if (s < 0) {
        rs_backend *b = rs_backend_cpu_init(1);
        s = rs_cpu_set_simd(b, RS_CPU_SIMD_AVX512);
        rs_backend_free(b);
    }
    return s;
}

static rs_backend *backend_at(int threads, int simd) {
    rs_backend *b = rs_backend_cpu_init(threads);
    ASSERT_EQ(rs_cpu_set_simd(b, (rs_cpu_simd)simd), simd);
    return b;
}

/* ---- memory ---- */

/* Exact until asked; fast only at the avx512 level of a CPU with AVX512_BF16 (the BF16 matmuls'
 * vdpbf16ps tile, test_cpu_matmul.c), reported as exact wherever it cannot run. */
RS_TEST(cpu_backend_numerics_default_exact) {
    rs_backend *b = rs_backend_cpu_init(1);
    ASSERT_EQ(rs_backend_numerics(b), RS_NUMERICS_EXACT);
    const bool bf16_dot = rs_cpu_ctx_of(b)->bf16_dot;
    const rs_cpu_simd top = rs_cpu_set_simd(b, RS_CPU_SIMD_AVX512);
    ASSERT_EQ(rs_backend_set_numerics(b, RS_NUMERICS_FAST),
              bf16_dot && top == RS_CPU_SIMD_AVX512 ? RS_NUMERICS_FAST : RS_NUMERICS_EXACT);
    if (top >= RS_CPU_SIMD_AVX2) {
        rs_cpu_set_simd(b, RS_CPU_SIMD_AVX2); /* --cpu-kernels avx2: no fast kernels */
        ASSERT_EQ(rs_backend_numerics(b), RS_NUMERICS_EXACT);
    }
    ASSERT_EQ(rs_backend_set_numerics(b, RS_NUMERICS_EXACT), RS_NUMERICS_EXACT);
    rs_cpu_set_simd(b, top);
    ASSERT_EQ(rs_backend_numerics(b), RS_NUMERICS_EXACT);
    rs_numerics n = RS_NUMERICS_EXACT;
    ASSERT_EQ(rs_numerics_parse("fast", &n), RS_OK);
    ASSERT_EQ(n, RS_NUMERICS_FAST);
    ASSERT_STREQ(rs_numerics_name(n), "fast");
    ASSERT_EQ(rs_numerics_parse("Fast", &n), RS_EINVAL);
    ASSERT_EQ(rs_numerics_parse(NULL, &n), RS_EINVAL);
    rs_backend_free(b);
}

RS_TEST(cpu_alloc_is_zeroed_aligned_and_copies) {
    rs_backend *b = rs_backend_cpu_init(2);
    unsigned char *p = rs_backend_alloc(b, 1000);
    ASSERT_TRUE(p != NULL);
    ASSERT_EQ((uintptr_t)p % 64, 0);
    for (int i = 0; i < 1000; i++) ASSERT_EQ(p[i], 0);
    unsigned char src[1000], dst[1000];
    for (int i = 0; i < 1000; i++) src[i] = (unsigned char)(i * 7);
    rs_backend_upload(b, p, src, sizeof src);
    rs_backend_download(b, dst, p, sizeof dst);
    ASSERT_TRUE(memcmp(src, dst, sizeof src) == 0);
    rs_backend_free_mem(b, p);
    rs_backend_free(b);
}

/* Allocations of 2 MiB and more are mappings of their own (backend_cpu.c): 2 MiB aligned, zero
 * however often the size is given back and taken again, every byte writable; a size that cannot be
 * mapped is refused. */
RS_TEST(cpu_alloc_large_is_zeroed_aligned_and_reusable) {
    rs_backend *b = rs_backend_cpu_init(1);
    const size_t n = ((size_t)2 << 20) + 1000;
    for (int round = 0; round < 3; round++) {
        unsigned char *p = rs_backend_alloc(b, n);
        ASSERT_TRUE(p != NULL);
        ASSERT_EQ((uintptr_t)p % ((size_t)2 << 20), 0);
        for (size_t i = 0; i < n; i += 4093) ASSERT_EQ(p[i], 0);
        ASSERT_EQ(p[n - 1], 0);
        memset(p, 0xA5, n); /* dirty it: the next round's allocation must be zero again */
        rs_backend_free_mem(b, p);
    }
    /* sizes whose rounding would wrap are refused, not mapped small */
    ASSERT_TRUE(rs_backend_alloc(b, SIZE_MAX) == NULL);
    ASSERT_TRUE(rs_backend_alloc(b, SIZE_MAX - ((size_t)2 << 20)) == NULL);
    rs_backend_free(b);
}

static int count_mappings(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    int n = 0, c;
    while ((c = fgetc(f)) != EOF) n += c == '\n';
    fclose(f);
    return n;
}

/* A large allocation costs two entries of /proc/self/maps (the mapping, its guard page), not more:
 * a model of thousands of tensors (a MoE's experts) stays far below vm.max_map_count (65530). */
RS_TEST(cpu_alloc_large_takes_two_mappings) {
    enum { N = 32 };
    rs_backend *b = rs_backend_cpu_init(1);
    void *p[N];
    const int before = count_mappings();
    ASSERT_TRUE(before > 0);
    for (int i = 0; i < N; i++) {
        p[i] = rs_backend_alloc(b, ((size_t)2 << 20) + (size_t)i * 12345);
        ASSERT_TRUE(p[i] != NULL);
        memset(p[i], 1, 4096); /* touched, as served weights are */
    }
    const int after = count_mappings();
    for (int i = 0; i < N; i++) rs_backend_free_mem(b, p[i]);
    if (after - before > 2 * N + 4) RS_TEST_FAIL("%d allocations added %d mappings", N, after - before);
    rs_backend_free(b);
}

/* Writes one byte at `at` in a child; its wait status. */
static unsigned char *g_write_at;

static void write_one_byte(void) {
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, 2); /* the expected report is not the runner's business */
    *(volatile unsigned char *)g_write_at = 1;
    _exit(0); /* survived: nothing guards that byte */
}

static int child_writes(unsigned char *at) {
    g_write_at = at;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) write_one_byte();
    int status = 0;
    while (pid > 0 && waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    return pid > 0 ? status : -1;
}

/* One byte past the end of a large allocation: the page after the mapping has no access rights
 * (SIGSEGV). Under ASan the slack up to that page and the header page before are poisoned too, and
 * small allocations keep their redzones, so the first byte before or after any allocation is
 * reported (ASan's report, exit 1; a fault ends in its report too). */
RS_TEST(cpu_alloc_guards_its_ends) {
    rs_backend *b = rs_backend_cpu_init(1);
    const size_t n = ((size_t)2 << 20) + 1000, page = (size_t)sysconf(_SC_PAGESIZE);
    unsigned char *big = rs_backend_alloc(b, n), *small = rs_backend_alloc(b, 1000);
    ASSERT_TRUE(big != NULL && small != NULL);
    int status = child_writes(big + (n + page - 1) / page * page); /* the page after */
#ifdef RS_ASAN
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 1)
        RS_TEST_FAIL("past the page: child status %#x, want ASan's report and exit 1", status);
    /* (a build that compiles kernels/cpu without ASan, as the CUDA emulation's may, poisons nothing) */
    if (rs_cpu_alloc_poisons()) {
        unsigned char *at[] = {big - 1, big + n, small - 1, small + 1000};
        for (int i = 0; i < 4; i++) {
            status = child_writes(at[i]);
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 1)
                RS_TEST_FAIL("byte %d: child status %#x, want ASan's report and exit 1", i, status);
        }
    } else {
        printf("  skipped: the bytes around allocations (this build's CPU backend is not instrumented)\n");
    }
#else
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGSEGV)
        RS_TEST_FAIL("child status %#x (exit %d), want death by SIGSEGV", status,
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1);
#endif
    rs_backend_free_mem(b, small);
    rs_backend_free_mem(b, big);
    rs_backend_free(b);
}

/* The op profile (kernels/backend.h rs_backend_profile): it counts each op under its own name, the
 * matmul per weight dtype, only while on; turning it on again clears it; the ops' results do not
 * change. */
RS_TEST(backend_op_profile_counts_calls) {
    rs_backend *b = rs_backend_cpu_init(1);
    uint64_t rng = 5;
    float *x = rand_floats(4 * 16, &rng, 1.0f), *y = rand_floats(4 * 16, &rng, 1.0f);
    uint16_t wb[8 * 16];
    for (int i = 0; i < 8 * 16; i++) wb[i] = rs_f32_to_bf16(rng_uniform(&rng));
    rs_tensor w = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {8, 16}, .data = rs_backend_alloc(b, sizeof wb)};
    rs_backend_upload(b, w.data, wb, sizeof wb);
    float *dx = rs_backend_alloc(b, 4 * 16 * sizeof(float)), *dy = rs_backend_alloc(b, 4 * 16 * sizeof(float));
    float *out = rs_backend_alloc(b, 4 * 8 * sizeof(float));
    float plain[4 * 8], profiled[4 * 8];
    rs_backend_upload(b, dx, x, 4 * 16 * sizeof(float));
    rs_op_matmul(b, out, dx, &w, NULL, 4);
    rs_backend_download(b, plain, out, sizeof plain);
    for (int on = 0; on < 2; on++) {
        rs_backend_profile(b, true); /* the second time: the counts of the first are gone */
        rs_backend_upload(b, dy, y, 4 * 16 * sizeof(float));
        for (int i = 0; i < 3; i++) rs_op_add(b, dy, dx, 4 * 16);
        for (int i = 0; i < 2; i++) rs_op_matmul(b, out, dx, &w, NULL, 4);
        rs_backend_download(b, profiled, out, sizeof profiled);
        ASSERT_TRUE(memcmp(plain, profiled, sizeof plain) == 0);
        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        rs_backend_profile_print(b, f, 2);
        fclose(f);
        unsigned long long n_add = 0, n_mm = 0, n_up = 0, n_down = 0;
        const char *p;
        ASSERT_TRUE((p = strstr(text, "\n    add ")) && sscanf(p, " add %llu", &n_add) == 1);
        ASSERT_TRUE((p = strstr(text, "\n    matmul bf16 ")) && sscanf(p, " matmul bf16 %llu", &n_mm) == 1);
        ASSERT_TRUE((p = strstr(text, "\n    upload ")) && sscanf(p, " upload %llu", &n_up) == 1);
        ASSERT_TRUE((p = strstr(text, "\n    download ")) && sscanf(p, " download %llu", &n_down) == 1);
        ASSERT_EQ(n_add, 3);
        ASSERT_EQ(n_mm, 2);
        ASSERT_EQ(n_up, 1);
        ASSERT_EQ(n_down, 1);
        ASSERT_TRUE(strstr(text, "rmsnorm") == NULL && strstr(text, "all ops") != NULL);
        free(text);
    }
    rs_backend_profile(b, false);
    {
        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        rs_op_add(b, dy, dx, 4 * 16);
        rs_backend_profile_print(b, f, 1); /* off: prints nothing */
        fclose(f);
        ASSERT_EQ(len, 0);
        free(text);
    }
    rs_backend_free_mem(b, dx), rs_backend_free_mem(b, dy), rs_backend_free_mem(b, out), rs_backend_free_mem(b, w.data);
    free(x), free(y);
    rs_backend_free(b);
}

/* Uploads of 1 MiB and more take the streaming-store copy (backend_cpu.c): every byte lands, for
 * any source and destination alignment and any length (head, 256-byte body, tail), at every SIMD
 * level, and nothing around the destination range is touched. */
RS_TEST(cpu_upload_streaming_copy) {
    rs_backend *b = rs_backend_cpu_init(1);
    const size_t cap = (2u << 20) + 4096;
    unsigned char *src = malloc(cap), *dev = rs_backend_alloc(b, cap);
    ASSERT_TRUE(src && dev);
    for (size_t i = 0; i < cap; i++) src[i] = (unsigned char)(i * 2654435761u >> 13);
    const size_t lens[] = {(1u << 20), (1u << 20) + 1, (1u << 20) + 255, (1u << 20) + 300, (2u << 20) - 7};
    const size_t offs[] = {0, 1, 13, 63, 64, 200};
    for (int lv = RS_CPU_SIMD_SCALAR; lv <= RS_CPU_SIMD_AVX512; lv++) {
        rs_cpu_set_simd(b, (rs_cpu_simd)lv);
        for (size_t li = 0; li < RS_ARRAY_LEN(lens); li++) {
            for (size_t di = 0; di < RS_ARRAY_LEN(offs); di++) {
                const size_t so = offs[(di + li) % RS_ARRAY_LEN(offs)], d0 = offs[di], n = lens[li];
                memset(dev, 0xEE, cap);
                rs_backend_upload(b, dev + d0, src + so, n);
                if (memcmp(dev + d0, src + so, n) != 0) RS_TEST_FAIL("level %d len %zu dst+%zu src+%zu", lv, n, d0, so);
                for (size_t i = 0; i < d0; i++) ASSERT_EQ(dev[i], 0xEE);
                for (size_t i = d0 + n; i < cap; i++) ASSERT_EQ(dev[i], 0xEE);
            }
        }
    }
    rs_backend_free_mem(b, dev);
    free(src);
    rs_backend_free(b);
}

/* ---- matmul ---- */

static void ref_matmul(double *out, const float *x, const wmat *w, const wmat *bias, int rows, double *tol) {
    int64_t n = w->t.shape[0], k = w->t.shape[1];
    for (int t = 0; t < rows; t++) {
        for (int64_t i = 0; i < n; i++) {
            double s = 0, a = 0;
            for (int64_t j = 0; j < k; j++) {
                double p = (double)x[t * k + j] * w->ref[i * k + j];
                s += p;
                a += fabs(p);
            }
            if (bias) {
                s += bias->ref[i];
                a += fabs(bias->ref[i]);
            }
            out[t * n + i] = s;
            tol[t * n + i] = 2e-6 * a + 1e-30;
        }
    }
}

/* One shape on every SIMD level and thread count, against the double reference; the scalar path
 * must equal rs_cpu_matmul_ref bit for bit, and every path must not depend on the thread count. */
static void check_matmul(rs_dtype dt, int64_t n, int64_t k, int rows, int with_bias, uint64_t *rng) {
    wmat w = make_tensor(dt, 2, n, k, rng, 1.0f);
    wmat bias = make_tensor(with_bias == 2 ? RS_DTYPE_BF16 : RS_DTYPE_F32, 1, n, 0, rng, 1.0f);
    const wmat *bp = with_bias ? &bias : NULL;
    float *x = rand_floats((size_t)rows * k, rng, 1.0f);
    size_t no = (size_t)rows * (size_t)n;
    double *want = malloc(no * sizeof(double)), *tol = malloc(no * sizeof(double));
    float *got = malloc(no * sizeof(float)), *ref = malloc(no * sizeof(float)),
          *t1 = malloc(no * sizeof(float));
    ref_matmul(want, x, &w, bp, rows, tol);
    rs_cpu_matmul_ref(ref, x, &w.t, bp ? &bias.t : NULL, rows);
    for (size_t i = 0; i < no; i++) ASSERT_NEAR(ref[i], want[i], tol[i]);

    for (int simd = 0; simd <= max_simd(); simd++) {
        for (int threads = 1; threads <= 2; threads++) {
            rs_backend *b = backend_at(threads, simd);
            memset(got, 0xff, no * sizeof(float));
            rs_op_matmul(b, got, x, &w.t, bp ? &bias.t : NULL, rows);
            for (size_t i = 0; i < no; i++) {
                if (!(fabs(got[i] - want[i]) <= tol[i]))
                    RS_TEST_FAIL(
                        "matmul %s simd %s threads %d N %lld K %lld rows %d bias %d: out[%zu] %.9g want %.9g",
                        rs_dtype_name(dt), rs_cpu_simd_name((rs_cpu_simd)simd), threads, (long long)n,
                        (long long)k, rows, with_bias, i, got[i], want[i]);
            }
            if (simd == RS_CPU_SIMD_SCALAR) ASSERT_TRUE(memcmp(got, ref, no * sizeof(float)) == 0);
            if (threads == 1)
                memcpy(t1, got, no * sizeof(float));
            else
                ASSERT_TRUE(memcmp(got, t1, no * sizeof(float)) == 0);
            rs_backend_free(b);
        }
    }
    free(x), free(want), free(tol), free(got), free(ref), free(t1);
    free_tensor(&w);
    free_tensor(&bias);
}

RS_TEST(cpu_matmul_odd_shapes_all_dtypes) {
    uint64_t rng = 1;
    static const struct {
        int64_t n, k;
    } shapes[] = {{1, 1}, {5, 7}, {13, 33}, {67, 100}, {130, 257}, {9, 1000}};
    static const int rows[] = {1, 3, 6, 7, 17};
    for (size_t d = 0; d < RS_ARRAY_LEN(weight_dtypes); d++)
        for (size_t s = 0; s < RS_ARRAY_LEN(shapes); s++)
            for (size_t r = 0; r < RS_ARRAY_LEN(rows); r++)
                check_matmul(weight_dtypes[d], shapes[s].n, shapes[s].k, rows[r], (int)((s + r) % 3), &rng);
}

/* K large enough that a token block (512 KiB of x) and a weight block (128 KiB) hold fewer rows
 * than the call: exercises the blocked loops. */
RS_TEST(cpu_matmul_blocked_prefill) {
    uint64_t rng = 2;
    check_matmul(RS_DTYPE_BF16, 37, 4100, 70, 1, &rng);
    check_matmul(RS_DTYPE_F32, 21, 3000, 50, 0, &rng);
}

/* ---- embed, rmsnorm, rope, swiglu, add, gather ---- */

RS_TEST(cpu_embed_converts_rows) {
    uint64_t rng = 3;
    for (size_t d = 0; d < RS_ARRAY_LEN(weight_dtypes); d++) {
        wmat table = make_tensor(weight_dtypes[d], 2, 11, 37, &rng, 2.0f);
        int32_t ids[] = {10, 0, 3, 3, 7};
        float out[5 * 37];
        rs_backend *b = rs_backend_cpu_init(2);
        rs_op_embed(b, out, &table.t, ids, 5);
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < 37; j++) ASSERT_FEQ(out[i * 37 + j], (float)table.ref[ids[i] * 37 + j]);
        rs_backend_free(b);
        free_tensor(&table);
    }
}

/* An E4M3 table (a tied table under --quantize-lm-head): each row dequantized like
 * rs_fp8_dequantize_weight, bit for bit, row-major and in RS_LAYOUT_FP8_PAIRS32; ragged blocks. */
RS_TEST(cpu_embed_fp8_rows) {
    uint64_t rng = 4;
    const int64_t vocab = 200, dim = 130;
    wmat src = make_tensor(RS_DTYPE_F32, 2, vocab, dim, &rng, 3.0f);
    rs_tensor t = {.dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = {vocab, dim}, .data = malloc((size_t)(vocab * dim))};
    t.scale_inv = malloc((size_t)(rs_fp8_blocks(vocab) * rs_fp8_blocks(dim)) * sizeof(float));
    ASSERT_EQ(rs_fp8_quantize_weight(&src.t, t.data, t.scale_inv), RS_OK);
    float *deq = malloc((size_t)(vocab * dim) * sizeof(float));
    rs_fp8_dequantize_weight(t.data, t.scale_inv, vocab, dim, deq);
    uint8_t *packed = malloc((size_t)(vocab * dim));
    rs_fp8_pairs32_pack(packed, t.data, vocab, dim);
    const int32_t ids[] = {199, 0, 127, 128, 31, 32, 64};
    float out[7 * 130];
    rs_backend *b = rs_backend_cpu_init(1);
    for (int lay = 0; lay < 2; lay++) {
        rs_tensor v = t;
        if (lay) v.data = packed, v.layout = RS_LAYOUT_FP8_PAIRS32;
        rs_op_embed(b, out, &v, ids, 7);
        for (int i = 0; i < 7; i++)
            for (int64_t d = 0; d < dim; d++) ASSERT_FEQ(out[i * dim + d], deq[ids[i] * dim + d]);
    }
    rs_backend_free(b);
    free(t.data), free(t.scale_inv), free(deq), free(packed);
    free_tensor(&src);
}

RS_TEST(cpu_rmsnorm_matches_double_and_aliases) {
    uint64_t rng = 4;
    static const int dims[] = {7, 128, 1000};
    static const int rows[] = {1, 3, 17};
    for (size_t di = 0; di < RS_ARRAY_LEN(dims); di++) {
        for (size_t ri = 0; ri < RS_ARRAY_LEN(rows); ri++) {
            int dim = dims[di], nr = rows[ri];
            wmat w = make_tensor(ri == 1 ? RS_DTYPE_BF16 : RS_DTYPE_F32, 1, dim, 0, &rng, 1.5f);
            float *x = rand_floats((size_t)nr * dim, &rng, 3.0f);
            float *out = malloc((size_t)nr * dim * sizeof(float)),
                  *first = malloc((size_t)nr * dim * sizeof(float));
            for (int simd = 0; simd <= max_simd(); simd++) {
                for (int threads = 1; threads <= 2; threads++) {
                    rs_backend *b = backend_at(threads, simd);
                    memcpy(out, x, (size_t)nr * dim * sizeof(float));
                    rs_op_rmsnorm(b, out, out, &w.t, nr, dim, 1e-6f); /* in place */
                    for (int r = 0; r < nr; r++) {
                        double ss = 0;
                        for (int i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
                        double inv = 1.0 / sqrt(ss / dim + 1e-6);
                        for (int i = 0; i < dim; i++) {
                            double want = x[r * dim + i] * inv * w.ref[i];
                            ASSERT_NEAR(out[r * dim + i], want, 1e-6 * fabs(want) + 1e-30);
                        }
                    }
                    /* identical on every SIMD level and thread count */
                    if (simd == 0 && threads == 1)
                        memcpy(first, out, (size_t)nr * dim * sizeof(float));
                    else
                        ASSERT_TRUE(memcmp(first, out, (size_t)nr * dim * sizeof(float)) == 0);
                    rs_backend_free(b);
                }
            }
            free(x), free(out), free(first);
            free_tensor(&w);
        }
    }
}

RS_TEST(cpu_rope_rotate_half) {
    uint64_t rng = 5;
    static const int hds[] = {6, 64, 128};
    for (size_t hi = 0; hi < RS_ARRAY_LEN(hds); hi++) {
        int hd = hds[hi], nh = 3, rows = 17;
        float inv_freq[64];
        for (int i = 0; i < hd / 2; i++) inv_freq[i] = (float)(1.0 / pow(1000000.0, 2.0 * i / hd));
        int32_t pos[17];
        for (int r = 0; r < rows; r++) pos[r] = r < 10 ? r : 1000 * r + 7;
        float *x = rand_floats((size_t)rows * nh * hd, &rng, 2.0f);
        float *y = malloc((size_t)rows * nh * hd * sizeof(float));
        for (int threads = 1; threads <= 2; threads++) {
            rs_backend *b = rs_backend_cpu_init(threads);
            memcpy(y, x, (size_t)rows * nh * hd * sizeof(float));
            rs_op_rope(b, y, rows, nh, hd, pos, inv_freq);
            for (int r = 0; r < rows; r++) {
                for (int h = 0; h < nh; h++) {
                    const float *xr = x + ((size_t)r * nh + h) * hd;
                    const float *yr = y + ((size_t)r * nh + h) * hd;
                    for (int i = 0; i < hd / 2; i++) {
                        float angle = inv_freq[i] * (float)pos[r]; /* fp32, as transformers */
                        double c = cos((double)angle), s = sin((double)angle);
                        double o1 = xr[i] * c - xr[i + hd / 2] * s, o2 = xr[i + hd / 2] * c + xr[i] * s;
                        ASSERT_NEAR(yr[i], o1, 1e-6);
                        ASSERT_NEAR(yr[i + hd / 2], o2, 1e-6);
                    }
                }
            }
            rs_backend_free(b);
        }
        free(x), free(y);
    }
}

RS_TEST(cpu_swiglu_add_gather) {
    uint64_t rng = 6;
    size_t n = 100003;
    float *g = rand_floats(n, &rng, 8.0f), *u = rand_floats(n, &rng, 2.0f), *o = malloc(n * sizeof(float));
    for (int threads = 1; threads <= 2; threads++) {
        rs_backend *b = rs_backend_cpu_init(threads);
        rs_op_swiglu(b, o, g, u, n);
        for (size_t i = 0; i < n; i++) {
            double want = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
            ASSERT_NEAR(o[i], want, 6e-7 * fabs(want) + 1e-30);
        }
        memcpy(o, g, n * sizeof(float));
        rs_op_swiglu(b, o, o, u, n); /* out aliases gate */
        for (size_t i = 0; i < n; i++) ASSERT_NEAR(o[i], g[i] / (1.0 + exp(-(double)g[i])) * u[i], 1e-5);

        memcpy(o, g, n * sizeof(float));
        rs_op_add(b, o, u, n);
        for (size_t i = 0; i < n; i++) ASSERT_FEQ(o[i], g[i] + u[i]);

        int32_t idx[] = {5, 0, 5, 2};
        float rowsout[4 * 9];
        rs_op_gather_rows(b, rowsout, g, idx, 4, 9);
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 9; j++) ASSERT_FEQ(rowsout[i * 9 + j], g[idx[i] * 9 + j]);
        rs_backend_free(b);
    }
    free(g), free(u), free(o);
}

/* ---- paged KV cache and attention ---- */

static float round_kv(float v, rs_dtype dt) {
    return dt == RS_DTYPE_BF16 ? rs_bf16_to_f32(rs_f32_to_bf16(v)) : v;
}

/* Three sequences in one step, in this order: B continues a prefill (rows at positions 20..52
 * after 0..19 were stored by an earlier step), A decodes one row at position 37, C starts a
 * prefill at 0 (5 rows). Pages are handed out from a shuffled list. */
enum { N_SEQ = 3, MAX_BLOCKS = 4, N_PAGES = 16 };
static const int seq_hist[N_SEQ] = {20, 37, 0}; /* positions stored before this step */
static const int seq_rows[N_SEQ] = {33, 1, 5};  /* rows in this step */

/* fast: the backend at --numerics fast (BF16 pages only): the reference takes q rounded to BF16,
 * and each output may be off by 2^-8 of sum_j p_j |v_j| (the kernel's probabilities are BF16). */
static void check_attention(rs_dtype kv_dt, int n_heads, int n_kv, int hd, int threads, int simd, bool fast,
                            uint64_t *rng) {
    int32_t pages[N_PAGES];
    for (int i = 0; i < N_PAGES; i++) pages[i] = i;
    for (int i = N_PAGES - 1; i > 0; i--) {
        int j = (int)(rng_next(rng) % (uint64_t)(i + 1));
        int32_t t = pages[i];
        pages[i] = pages[j], pages[j] = t;
    }
    int32_t block_tables[N_SEQ * MAX_BLOCKS];
    for (int i = 0; i < N_SEQ * MAX_BLOCKS; i++) block_tables[i] = pages[i];

    size_t kvrow = (size_t)n_kv * hd;
    float *kall[N_SEQ], *vall[N_SEQ]; /* [ctx][n_kv][hd] per sequence */
    int ctx[N_SEQ];
    for (int s = 0; s < N_SEQ; s++) {
        ctx[s] = seq_hist[s] + seq_rows[s];
        kall[s] = rand_floats((size_t)ctx[s] * kvrow, rng, 1.5f);
        vall[s] = rand_floats((size_t)ctx[s] * kvrow, rng, 1.0f);
    }
    rs_backend *b = backend_at(threads, simd);
    if (fast) ASSERT_EQ(rs_backend_set_numerics(b, RS_NUMERICS_FAST), RS_NUMERICS_FAST);
    rs_kv_layer kv = {.dtype = kv_dt, .n_blocks = N_PAGES, .n_kv_heads = n_kv, .head_dim = hd};
    kv.pages = rs_backend_alloc(b, (size_t)N_PAGES * 2 * RS_KV_BLOCK * kvrow * rs_dtype_size(kv_dt));

    /* two steps: the history, then this step's rows; K/V rows gathered per step */
    int32_t pos[128], slot[128], starts[N_SEQ + 1], seq_ctx[N_SEQ], tokens[128] = {0};
    float *kstep = malloc(128 * kvrow * sizeof(float)), *vstep = malloc(128 * kvrow * sizeof(float));
    rs_batch batch = {0};
    for (int step = 0; step < 2; step++) {
        int n = 0;
        for (int s = 0; s < N_SEQ; s++) {
            starts[s] = n;
            int p0 = step == 0 ? 0 : seq_hist[s], p1 = step == 0 ? seq_hist[s] : ctx[s];
            for (int p = p0; p < p1; p++, n++) {
                pos[n] = p;
                slot[n] = block_tables[s * MAX_BLOCKS + p / RS_KV_BLOCK] * RS_KV_BLOCK + p % RS_KV_BLOCK;
                memcpy(kstep + n * kvrow, kall[s] + p * kvrow, kvrow * sizeof(float));
                memcpy(vstep + n * kvrow, vall[s] + p * kvrow, kvrow * sizeof(float));
            }
            seq_ctx[s] = p1;
        }
        starts[N_SEQ] = n;
        batch = (rs_batch){.n_tok = n,
                           .n_seq = N_SEQ,
                           .tokens = tokens,
                           .pos = pos,
                           .slot = slot,
                           .seq_start = starts,
                           .seq_ctx = seq_ctx,
                           .block_tables = block_tables,
                           .max_blocks = MAX_BLOCKS};
        rs_op_kv_store(b, &kv, kstep, vstep, &batch);
    }
    /* the documented page layout: [block][2][16][n_kv][hd] */
    for (int s = 0; s < N_SEQ; s++) {
        for (int p = 0; p < ctx[s]; p++) {
            size_t page = (size_t)block_tables[s * MAX_BLOCKS + p / RS_KV_BLOCK];
            for (size_t i = 0; i < kvrow; i++) {
                size_t ko = ((page * 2 + 0) * RS_KV_BLOCK + (size_t)(p % RS_KV_BLOCK)) * kvrow + i;
                size_t vo = ((page * 2 + 1) * RS_KV_BLOCK + (size_t)(p % RS_KV_BLOCK)) * kvrow + i;
                float kg = kv_dt == RS_DTYPE_F32 ? ((float *)kv.pages)[ko]
                                                 : rs_bf16_to_f32(((uint16_t *)kv.pages)[ko]);
                float vg = kv_dt == RS_DTYPE_F32 ? ((float *)kv.pages)[vo]
                                                 : rs_bf16_to_f32(((uint16_t *)kv.pages)[vo]);
                ASSERT_FEQ(kg, round_kv(kall[s][p * kvrow + i], kv_dt));
                ASSERT_FEQ(vg, round_kv(vall[s][p * kvrow + i], kv_dt));
            }
        }
    }

    int n_tok = batch.n_tok, group = n_heads / n_kv;
    float scale = 1.0f / sqrtf((float)hd);
    float *q = rand_floats((size_t)n_tok * n_heads * hd, rng, 1.0f);
    float *out = malloc((size_t)n_tok * n_heads * hd * sizeof(float));
    rs_op_attention(b, out, q, &kv, n_heads, scale, &batch);

    double *sc = malloc(64 * sizeof(double));
    for (int s = 0; s < N_SEQ; s++) {
        for (int r = starts[s]; r < starts[s + 1]; r++) {
            for (int h = 0; h < n_heads; h++) {
                const float *qh = q + ((size_t)r * n_heads + h) * hd;
                int kvh = h / group, n_ctx = pos[r] + 1;
                double max = -INFINITY, sum = 0;
                for (int j = 0; j < n_ctx; j++) {
                    double d = 0;
                    for (int i = 0; i < hd; i++)
                        d += (double)(fast ? round_kv(qh[i], RS_DTYPE_BF16) : qh[i]) *
                             round_kv(kall[s][j * kvrow + kvh * hd + i], kv_dt);
                    sc[j] = d * scale;
                    max = sc[j] > max ? sc[j] : max;
                }
                for (int j = 0; j < n_ctx; j++) sum += (sc[j] = exp(sc[j] - max));
                for (int i = 0; i < hd; i++) {
                    double o = 0, a = 0;
                    for (int j = 0; j < n_ctx; j++) {
                        double t = sc[j] / sum * round_kv(vall[s][j * kvrow + kvh * hd + i], kv_dt);
                        o += t, a += fabs(t);
                    }
                    float got = out[((size_t)r * n_heads + h) * hd + i];
                    if (!(fabs(got - o) <= (fast ? a / 256 + 2e-6 : 2e-6)))
                        RS_TEST_FAIL("attention kv %s heads %d/%d hd %d threads %d simd %d%s: seq %d row %d "
                                     "head %d [%d]: %.9g want %.9g",
                                     rs_dtype_name(kv_dt), n_heads, n_kv, hd, threads, simd, fast ? " fast" : "", s,
                                     r, h, i, got, o);
                }
            }
        }
    }
    free(sc), free(q), free(out), free(kstep), free(vstep);
    for (int s = 0; s < N_SEQ; s++) free(kall[s]), free(vall[s]);
    rs_backend_free_mem(b, kv.pages);
    rs_backend_free(b);
}

RS_TEST(cpu_attention_paged_mixed_batch) {
    uint64_t rng = 7;
    for (int simd = 0; simd <= max_simd(); simd++) {
        for (int threads = 1; threads <= 2; threads++) {
            check_attention(RS_DTYPE_F32, 6, 2, 24, threads, simd, false, &rng);
            check_attention(RS_DTYPE_F32, 4, 4, 64, threads, simd, false, &rng);
            check_attention(RS_DTYPE_BF16, 8, 2, 128, threads, simd, false, &rng);
            check_attention(RS_DTYPE_BF16, 2, 1, 7, threads, simd, false, &rng);
        }
    }
}

static bool fast_attention_runs(void) {
    rs_backend *b = rs_backend_cpu_init(1);
    bool ok = rs_cpu_set_simd(b, RS_CPU_SIMD_AVX512) == RS_CPU_SIMD_AVX512 &&
              rs_backend_set_numerics(b, RS_NUMERICS_FAST) == RS_NUMERICS_FAST;
    rs_backend_free(b);
    if (!ok) rs_test_note_skip("avx512bf16 (fast numerics' attention)");
    return ok;
}

/* --numerics fast over BF16 pages (q and p in BF16 on vdpbf16ps) against the double reference of
 * the same inputs; F32 pages stay on the exact kernels. Head dims with and without a 32-lane tail,
 * groups of 1 to 4. */
RS_TEST(cpu_attention_fast_bf16_pages) {
    if (!fast_attention_runs()) RS_TEST_SKIP("--numerics fast attention needs AVX-512 with AVX512_BF16");
    uint64_t rng = 9;
    const int avx512 = (int)RS_CPU_SIMD_AVX512;
    for (int threads = 1; threads <= 2; threads++) {
        check_attention(RS_DTYPE_BF16, 8, 2, 128, threads, avx512, true, &rng);
        check_attention(RS_DTYPE_BF16, 4, 4, 64, threads, avx512, true, &rng);
        check_attention(RS_DTYPE_BF16, 6, 2, 40, threads, avx512, true, &rng);
        check_attention(RS_DTYPE_BF16, 4, 1, 7, threads, avx512, true, &rng);
        check_attention(RS_DTYPE_BF16, 8, 8, 96, threads, avx512, true, &rng);
        check_attention(RS_DTYPE_F32, 8, 2, 128, threads, avx512, true, &rng);
    }
}

/* The backend (threads, simd, fast numerics or not) and a KV layer of proto's format with `pages`
 * pages of head_dim hd, for the batch-invariance checks below; per-head scales in ks, vs [16]. */
static rs_backend *invariance_backend(const rs_kv_layer *proto, int pages, int hd, int threads, int simd, bool fast,
                                      rs_kv_layer *kv, float *ks, float *vs) {
    const int n_kv = proto->n_kv_heads;
    rs_backend *b = backend_at(threads, simd);
    if (fast) ASSERT_EQ(rs_backend_set_numerics(b, RS_NUMERICS_FAST), RS_NUMERICS_FAST);
    *kv = *proto;
    kv->n_blocks = pages;
    kv->head_dim = hd;
    const size_t page_bytes = 2 * RS_KV_BLOCK * (size_t)n_kv * (size_t)hd * rs_dtype_size(kv->dtype);
    kv->pages = rs_backend_alloc(b, (size_t)pages * page_bytes);
    for (int h = 0; h < n_kv; h++) ks[h] = 0.01f + 0.003f * (float)h, vs[h] = 0.005f + 0.002f * (float)h;
    if (kv->scale_mode == RS_KV_SCALE_PER_HEAD) kv->k_scale = ks, kv->v_scale = vs;
    if (kv->scale_mode == RS_KV_SCALE_PER_TOKEN)
        kv->token_scales = rs_backend_alloc(b, (size_t)pages * 2 * RS_KV_BLOCK * (size_t)n_kv * sizeof(float));
    return b;
}

static void invariance_free(rs_backend *b, rs_kv_layer *kv) {
    if (kv->token_scales) rs_backend_free_mem(b, kv->token_scales);
    rs_backend_free_mem(b, kv->pages);
    rs_backend_free(b);
}

/* Batch invariance of attention: a prefill step computes runs of consecutive rows of a sequence
 * together (cpu_attention.c), and every row must still get the bits it gets as a decode row alone
 * (the engine's chunking invariance rests on it). Two sequences share the step: A prefills rows
 * at positions 3..L-1 after 0..2 were stored, B decodes one row; then each of A's rows is
 * recomputed alone, as a one-row step at its position, and compared bit for bit. Every SIMD level,
 * 1 and 2 threads, every page format, and groups of 1, 2, 3, 8 and 16 query heads per KV head
 * (runs of 16, 8, 5, 2 and 1 rows). */
static void check_attention_runs(const rs_kv_layer *proto, int n_heads, int hd, int threads, int simd, bool fast,
                                 uint64_t *rng) {
    enum { L = 45, H0 = 3, PAGES = 8 };
    const int n_kv = proto->n_kv_heads;
    const size_t kvrow = (size_t)n_kv * hd, qrow = (size_t)n_heads * hd;
    float ks[16], vs[16];
    rs_kv_layer kv;
    rs_backend *b = invariance_backend(proto, PAGES, hd, threads, simd, fast, &kv, ks, vs);
    /* A owns pages 5, 2, 7 (out of order), B pages 0, 1 */
    int32_t tables[2 * 4] = {5, 2, 7, 3, /* B: */ 0, 1, 4, 6};
    float *k = rand_floats((size_t)(L + 20) * kvrow, rng, 1.5f), *v = rand_floats((size_t)(L + 20) * kvrow, rng, 1.0f);
    float *q = rand_floats((size_t)(L + 1) * qrow, rng, 1.0f);
    int32_t pos[64], slot[64], tok[64] = {0}, ctx[2], starts[3];
    /* store A's positions 0..L-1 and B's 0..19 */
    for (int s = 0; s < 2; s++) {
        int n = s == 0 ? L : 20;
        for (int p = 0; p < n; p++) pos[p] = p, slot[p] = tables[s * 4 + p / RS_KV_BLOCK] * RS_KV_BLOCK + p % RS_KV_BLOCK;
        int32_t st[2] = {0, n}, c1 = n;
        rs_batch bt = {.n_tok = n, .n_seq = 1, .tokens = tok, .pos = pos, .slot = slot, .seq_start = st,
                       .seq_ctx = &c1, .block_tables = tables + s * 4, .max_blocks = 4};
        rs_op_kv_store(b, &kv, k + (size_t)(s == 0 ? 0 : L) * kvrow, v + (size_t)(s == 0 ? 0 : L) * kvrow, &bt);
    }
    /* one step: A's rows H0..L-1, then B's row at 19 */
    int n = 0;
    starts[0] = 0;
    for (int p = H0; p < L; p++) pos[n++] = p;
    starts[1] = n;
    pos[n++] = 19;
    starts[2] = n;
    ctx[0] = L, ctx[1] = 20;
    rs_batch bt = {.n_tok = n, .n_seq = 2, .tokens = tok, .pos = pos, .slot = slot, .seq_start = starts,
                   .seq_ctx = ctx, .block_tables = tables, .max_blocks = 4};
    float *out = malloc((size_t)n * qrow * sizeof(float)), *one = malloc(qrow * sizeof(float));
    rs_op_attention(b, out, q, &kv, n_heads, 0.125f, &bt);
    for (int r = 0; r < n; r++) {
        int s = r < starts[1] ? 0 : 1;
        int32_t p1 = pos[r], st[2] = {0, 1}, c1 = p1 + 1;
        rs_batch b1 = {.n_tok = 1, .n_seq = 1, .tokens = tok, .pos = &p1, .slot = slot, .seq_start = st,
                       .seq_ctx = &c1, .block_tables = tables + s * 4, .max_blocks = 4};
        rs_op_attention(b, one, q + (size_t)r * qrow, &kv, n_heads, 0.125f, &b1);
        for (size_t i = 0; i < qrow; i++) {
            uint32_t x, y;
            memcpy(&x, &out[(size_t)r * qrow + i], 4), memcpy(&y, &one[i], 4);
            if (x != y)
                RS_TEST_FAIL("attention runs kv %s mode %d heads %d/%d hd %d threads %d simd %d%s: row at position "
                             "%d, element %zu: %.9g in the step, %.9g alone",
                             rs_dtype_name(kv.dtype), (int)kv.scale_mode, n_heads, n_kv, hd, threads, simd,
                             fast ? " fast" : "", p1, i,
                             out[(size_t)r * qrow + i], one[i]);
        }
    }
    free(k), free(v), free(q), free(out), free(one);
    invariance_free(b, &kv);
}

/* Calls check for every page format (F32, BF16, E4M3 per head and per token), SIMD level (and,
 * past the top, AVX-512 at --numerics fast where the CPU has it), 1 and 2 threads, and each of
 * the n_groups query heads per KV head, with head dims of 128 and, alternately, others (no 32-lane
 * multiple). */
typedef void (*attention_case_fn)(const rs_kv_layer *proto, int n_heads, int hd, int threads, int simd, bool fast,
                                  uint64_t *rng);
static void each_attention_case(attention_case_fn check, const int *groups, size_t n_groups, uint64_t seed) {
    uint64_t rng = seed;
    const rs_kv_layer protos[] = {{.dtype = RS_DTYPE_F32, .n_kv_heads = 2},
                                  {.dtype = RS_DTYPE_BF16, .n_kv_heads = 2},
                                  {.dtype = RS_DTYPE_E4M3, .n_kv_heads = 2, .scale_mode = RS_KV_SCALE_PER_HEAD},
                                  {.dtype = RS_DTYPE_E4M3, .n_kv_heads = 2, .scale_mode = RS_KV_SCALE_PER_TOKEN}};
    const bool fast = fast_attention_runs();
    for (int simd = 0; simd <= max_simd() + (fast ? 1 : 0); simd++)
        for (int threads = 1; threads <= 2; threads++)
            for (size_t pi = 0; pi < sizeof protos / sizeof protos[0]; pi++)
                for (size_t gi = 0; gi < n_groups; gi++)
                    check(&protos[pi], 2 * groups[gi], gi % 2 ? 128 : 40 + (int)gi, threads, RS_MIN(simd, max_simd()),
                          simd > max_simd(), &rng);
}

RS_TEST(cpu_attention_runs_batch_invariant) {
    static const int groups[] = {1, 2, 3, 8, 16};
    each_attention_case(check_attention_runs, groups, sizeof groups / sizeof groups[0], 11);
}
/* Batch invariance where decode rows share pages: the samples of one prompt (forked) and prompts
 * with a common cached prefix read their shared leading pages together (cpu_attention.c,
 * group_units). Eight sequences over 16 pages, in batch order s0, s4, s1, s7, s2, s6, s3, s5:
 * s1 and s5 share s0's first three pages, s2 two, s3 one; s4 shares nothing; s6 sees only part of
 * s0's first page; s7 prefills a run of rows in the same step. Every row is recomputed alone as
 * a one-row step and compared bit for bit. Every page format, SIMD level, 1 and 2 threads, and
 * groups of 1, 2, 4, 8 and 16 query heads per KV head (units of up to 16, 8, 4, 2 and 1 rows). */
static void check_attention_shared(const rs_kv_layer *proto, int n_heads, int hd, int threads, int simd, bool fast,
                                   uint64_t *rng) {
    enum { PAGES = 16, MB = 5, NS = 8 };
    static const int32_t tables[NS][MB] = {{3, 9, 12, 1, 0}, {3, 9, 12, 4, 0}, {3, 9, 5, 6, 0}, {3, 7, 0, 0, 0},
                                           {8, 10, 0, 0, 0}, {3, 9, 12, 2, 0}, {3, 11, 0, 0, 0}, {13, 14, 0, 0, 0}};
    static const int ctx[NS] = {60, 52, 40, 20, 30, 48, 10, 26};
    static const int order[NS] = {0, 4, 1, 7, 2, 6, 3, 5};
    const int n_kv = proto->n_kv_heads, s7_first = 10; /* s7's rows: positions 10..25 */
    const size_t kvrow = (size_t)n_kv * hd, qrow = (size_t)n_heads * hd;
    float ks[16], vs[16];
    rs_kv_layer kv;
    rs_backend *b = invariance_backend(proto, PAGES, hd, threads, simd, fast, &kv, ks, vs);
    /* every slot of every page gets its own K and V row, stored in one step */
    enum { SLOTS = PAGES * RS_KV_BLOCK };
    float *k = rand_floats((size_t)SLOTS * kvrow, rng, 1.5f), *v = rand_floats((size_t)SLOTS * kvrow, rng, 1.0f);
    int32_t pos[SLOTS], slot[SLOTS], tok[SLOTS] = {0}, table_all[NS * MB], st[NS + 1], seq_ctx[NS];
    for (int i = 0; i < SLOTS; i++) pos[i] = i % RS_KV_BLOCK, slot[i] = i;
    int32_t st1[2] = {0, SLOTS}, c1 = RS_KV_BLOCK, t1[1] = {0};
    rs_batch all = {.n_tok = SLOTS, .n_seq = 1, .tokens = tok, .pos = pos, .slot = slot, .seq_start = st1,
                    .seq_ctx = &c1, .block_tables = t1, .max_blocks = 1};
    rs_op_kv_store(b, &kv, k, v, &all);
    /* the step: one decode row per sequence at its last position, s7 a run of rows */
    int n = 0;
    for (int i = 0; i < NS; i++) {
        const int s = order[i];
        memcpy(table_all + i * MB, tables[s], sizeof tables[s]);
        st[i] = n;
        for (int p = s == 7 ? s7_first : ctx[s] - 1; p < ctx[s]; p++) pos[n++] = p;
        seq_ctx[i] = ctx[s];
    }
    st[NS] = n;
    rs_batch bt = {.n_tok = n, .n_seq = NS, .tokens = tok, .pos = pos, .slot = slot, .seq_start = st,
                   .seq_ctx = seq_ctx, .block_tables = table_all, .max_blocks = MB};
    float *q = rand_floats((size_t)n * qrow, rng, 1.0f);
    float *out = malloc((size_t)n * qrow * sizeof(float)), *one = malloc(qrow * sizeof(float));
    rs_op_attention(b, out, q, &kv, n_heads, 0.125f, &bt);
    for (int i = 0; i < NS; i++) {
        for (int r = st[i]; r < st[i + 1]; r++) {
            int32_t p1 = pos[r], s1[2] = {0, 1}, cx = p1 + 1;
            rs_batch b1 = {.n_tok = 1, .n_seq = 1, .tokens = tok, .pos = &p1, .slot = slot, .seq_start = s1,
                           .seq_ctx = &cx, .block_tables = table_all + i * MB, .max_blocks = MB};
            rs_op_attention(b, one, q + (size_t)r * qrow, &kv, n_heads, 0.125f, &b1);
            if (memcmp(out + (size_t)r * qrow, one, qrow * sizeof(float)) != 0)
                RS_TEST_FAIL("attention shared pages kv %s mode %d heads %d/%d hd %d threads %d simd %d%s: "
                             "sequence s%d, row at position %d differs from the row alone",
                             rs_dtype_name(kv.dtype), (int)kv.scale_mode, n_heads, n_kv, hd, threads, simd,
                             fast ? " fast" : "", order[i], p1);
        }
    }
    free(k), free(v), free(q), free(out), free(one);
    invariance_free(b, &kv);
}

RS_TEST(cpu_attention_shared_pages_batch_invariant) {
    static const int groups[] = {1, 2, 4, 8, 16};
    each_attention_case(check_attention_shared, groups, sizeof groups / sizeof groups[0], 13);
}
/* ---- MoE ---- */

typedef struct moe_case {
    int n_exp, top_k, hidden, inter;
    wmat router, *gate, *up, *down;
    rs_tensor *gt, *ut, *dt;
    rs_moe_weights w;
} moe_case;

/* Fills *mp in place: m.w points into it. */
static void make_moe(moe_case *mp, int n_exp, int top_k, int hidden, int inter, rs_dtype dt, bool norm,
                     uint64_t *rng) {
    moe_case m = {.n_exp = n_exp, .top_k = top_k, .hidden = hidden, .inter = inter};
    m.router = make_tensor(RS_DTYPE_F32, 2, n_exp, hidden, rng, 0.5f);
    m.gate = calloc((size_t)n_exp, sizeof(wmat)), m.up = calloc((size_t)n_exp, sizeof(wmat));
    m.down = calloc((size_t)n_exp, sizeof(wmat));
    m.gt = calloc((size_t)n_exp, sizeof(rs_tensor)), m.ut = calloc((size_t)n_exp, sizeof(rs_tensor));
    m.dt = calloc((size_t)n_exp, sizeof(rs_tensor));
    for (int e = 0; e < n_exp; e++) {
        m.gate[e] = make_tensor(dt, 2, inter, hidden, rng, 0.4f), m.gt[e] = m.gate[e].t;
        m.up[e] = make_tensor(dt, 2, inter, hidden, rng, 0.4f), m.ut[e] = m.up[e].t;
        m.down[e] = make_tensor(dt, 2, hidden, inter, rng, 0.4f), m.dt[e] = m.down[e].t;
    }
    *mp = m;
    mp->w = (rs_moe_weights){.router = &mp->router.t,
                             .gate = m.gt,
                             .up = m.ut,
                             .down = m.dt,
                             .n_experts = n_exp,
                             .top_k = top_k,
                             .norm_topk_prob = norm};
}

static void free_moe(moe_case *m) {
    free_tensor(&m->router);
    for (int e = 0; e < m->n_exp; e++)
        free_tensor(&m->gate[e]), free_tensor(&m->up[e]), free_tensor(&m->down[e]);
    free(m->gate), free(m->up), free(m->down), free(m->gt), free(m->ut), free(m->dt);
}

/* Dense reference in double: every expert on every row, then the top-k combination. tol gets
 * 1e-5 of the sum of |terms| of each output (the scale of its fp32 rounding error). */
static void ref_moe(double *out, double *tol, const float *x, int rows, const moe_case *m) {
    int H = m->hidden, I = m->inter, E = m->n_exp;
    double *y = malloc((size_t)E * H * sizeof(double)), *act = malloc((size_t)I * sizeof(double));
    double *ya = malloc((size_t)E * H * sizeof(double));
    double *prob = malloc((size_t)E * sizeof(double));
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * H;
        double max = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++) {
            double l = 0;
            for (int i = 0; i < H; i++) l += xr[i] * m->router.ref[e * H + i];
            prob[e] = l;
            max = l > max ? l : max;
        }
        for (int e = 0; e < E; e++) sum += (prob[e] = exp(prob[e] - max));
        for (int e = 0; e < E; e++) {
            prob[e] /= sum;
            for (int i = 0; i < I; i++) {
                double g = 0, u = 0;
                for (int j = 0; j < H; j++) {
                    g += xr[j] * m->gate[e].ref[i * H + j];
                    u += xr[j] * m->up[e].ref[i * H + j];
                }
                act[i] = g / (1 + exp(-g)) * u;
            }
            for (int i = 0; i < H; i++) {
                double d = 0, a = 0;
                for (int j = 0; j < I; j++) {
                    d += act[j] * m->down[e].ref[i * I + j];
                    a += fabs(act[j] * m->down[e].ref[i * I + j]);
                }
                y[e * H + i] = d;
                ya[e * H + i] = a;
            }
        }
        int sel[16];
        double w[16], wsum = 0;
        for (int k = 0; k < m->top_k; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int j = 0; j < k; j++) taken |= sel[j] == e;
                if (!taken && (best < 0 || prob[e] > prob[best])) best = e;
            }
            sel[k] = best, w[k] = prob[best], wsum += prob[best];
        }
        for (int i = 0; i < H; i++) {
            double o = 0, a = 0;
            for (int k = 0; k < m->top_k; k++) {
                double wk = m->w.norm_topk_prob ? w[k] / wsum : w[k];
                o += wk * y[sel[k] * H + i];
                a += wk * ya[sel[k] * H + i];
            }
            out[(size_t)r * H + i] = o;
            tol[(size_t)r * H + i] = 1e-5 * a + 1e-7;
        }
    }
    free(y), free(act), free(prob), free(ya);
}

RS_TEST(cpu_moe_matches_dense_reference) {
    uint64_t rng = 8;
    static const int rows_list[] = {1, 5, 17};
    for (int variant = 0; variant < 4; variant++) {
        rs_dtype dt = variant & 1 ? RS_DTYPE_F32 : RS_DTYPE_BF16;
        bool norm = variant & 2;
        moe_case m; /* the last variant is big enough for the expert matmuls to use both threads */
        if (variant < 3)
            make_moe(&m, 6, 2 + variant % 2, 40, 24, dt, norm, &rng);
        else
            make_moe(&m, 8, 3, 264, 100, dt, norm, &rng);
        for (size_t ri = 0; ri < RS_ARRAY_LEN(rows_list); ri++) {
            int rows = rows_list[ri];
            size_t n = (size_t)rows * m.hidden;
            float *x = rand_floats(n, &rng, 1.0f);
            double *want = malloc(n * sizeof(double)), *tol = malloc(n * sizeof(double));
            float *got = malloc(n * sizeof(float)), *first = malloc(n * sizeof(float));
            ref_moe(want, tol, x, rows, &m);
            for (int simd = 0; simd <= max_simd(); simd++) {
                for (int threads = 1; threads <= 2; threads++) {
                    rs_backend *b = backend_at(threads, simd);
                    memcpy(got, x, n * sizeof(float));
                    rs_op_moe(b, got, got, rows, m.hidden, &m.w); /* out aliases x */
                    for (size_t i = 0; i < n; i++) ASSERT_NEAR(got[i], want[i], tol[i]);
                    if (threads == 1)
                        memcpy(first, got, n * sizeof(float));
                    else
                        ASSERT_TRUE(memcmp(first, got, n * sizeof(float)) ==
                                    0); /* thread-count independent */
                    rs_backend_free(b);
                }
            }
            free(x), free(want), free(tol), free(got), free(first);
        }
        free_moe(&m);
    }
}

/* A zero router gives equal probabilities: top-k must be experts 0..k-1 (lower index first). */
RS_TEST(cpu_moe_ties_pick_lower_experts) {
    uint64_t rng = 9;
    moe_case m;
    make_moe(&m, 5, 2, 24, 8, RS_DTYPE_F32, false, &rng);
    memset(m.router.t.data, 0, 5 * 24 * sizeof(float));
    memset(m.router.ref, 0, 5 * 24 * sizeof(double));
    float *x = rand_floats(3 * 24, &rng, 1.0f), out[3 * 24];
    double want[3 * 24], tol[3 * 24];
    ref_moe(want, tol, x, 3, &m);
    rs_backend *b = rs_backend_cpu_init(2);
    rs_op_moe(b, out, x, 3, 24, &m.w);
    for (int i = 0; i < 3 * 24; i++) ASSERT_NEAR(out[i], want[i], tol[i]);
    /* and the expected experts really are 0 and 1 with weight 1/5 each */
    for (int e = 2; e < 5; e++) memset(m.down[e].t.data, 0, 24 * 8 * sizeof(float));
    float out2[3 * 24];
    rs_op_moe(b, out2, x, 3, 24, &m.w);
    for (int i = 0; i < 3 * 24; i++) ASSERT_FEQ(out2[i], out[i]);
    rs_backend_free(b);
    free(x);
    free_moe(&m);
}

/* ---- a rough speed print (not an assertion): BF16 [3072][1024] at batch 1 and 16 ---- */

RS_TEST(cpu_matmul_speed_print) {
    uint64_t rng = 10;
    wmat w = make_tensor(RS_DTYPE_BF16, 2, 3072, 1024, &rng, 1.0f);
    float *x = rand_floats(16 * 1024, &rng, 1.0f), *out = malloc(16 * 3072 * sizeof(float));
    rs_backend *b = rs_backend_cpu_init(0);
    double t_b1 = 0;
    for (int rows = 1; rows <= 16; rows *= 4) {
        int iters = rows == 1 ? 200 : 50;
        rs_op_matmul(b, out, x, &w.t, NULL, rows);
        double t0 = rs_now_s();
        for (int i = 0; i < iters; i++) rs_op_matmul(b, out, x, &w.t, NULL, rows);
        double dt = (rs_now_s() - t0) / iters;
        if (rows == 1) t_b1 = dt;
        printf("  matmul bf16 3072x1024 rows %2d: %7.1f us  %6.1f GB/s  %8.0f rows/s (%.1fx batch 1)\n", rows,
               dt * 1e6, 3072.0 * 1024 * 2 / dt / 1e9, rows / dt, rows / dt * t_b1);
    }
    rs_backend_free(b);
    free(x), free(out);
    free_tensor(&w);
}
