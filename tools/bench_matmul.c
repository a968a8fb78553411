/*
 * bench_matmul.c — speed of the CPU backend's matmul on one weight shape, for a list of batch sizes.
 *
 *   bench-matmul [N K [dtypes [threads [rows,rows,...]]]]    defaults: 3072 1024 bf16 0 1,2,4,8,16
 *   bench-matmul 3072 1024 fp8gemm,fp8f32 2 1,16,128,512      the exact block sum's cost
 *   bench-matmul 3072 1024 fp8,bf16 1 1,16,32                 FP8 against BF16, one thread
 *   RS_CPU_SIMD=avx2 bench-matmul ...                          cap the SIMD level
 *   RS_BENCH_COPIES=1 bench-matmul 256 1024 fp8gemm 1 64       one weight, cache-resident: the kernel's compute
 *
 * dtypes is a comma list of bf16, bf16fast (BF16 under --numerics fast: activations rounded to
 * BF16, vdpbf16ps; skipped where the CPU lacks AVX512_BF16), f16, f32, fp8 (E4M3 codes with 128x128 block scales: the W8A8
 * path, whose time includes quantizing the activations; in the layout the backend serves them in,
 * RS_LAYOUT_FP8_PAIRS32 on AVX-512 VNNI) and fp8rows (the same kept row-major). With two or more,
 * each line ends with the time of the first relative to the second.
 *
 * Two more dtypes time the FP8 GEMM alone (activations already quantized), to show what the exact
 * block sum costs: fp8gemm is rs_fp8_gemm at the backend's ISA (exact integer block sums, in the
 * backend's weight layout), fp8f32 the same W8A8 product with the block sums accumulated by fp32
 * FMAs instead (codes decoded to fp32 through F16C, a 4 x NT register tile like the BF16 one, AVX2
 * or AVX-512 by the backend's level). fp8f32 is not bit-exact: each line reports its relative
 * error against fp8gemm, the size of fp32 rounding. `bench-matmul 3072 1024 fp8gemm,fp8f32`.
 *
 * Prints, per batch size, the time per call, the weight bytes streamed per second and rows per
 * second (and that as a multiple of batch 1). Weights are random; several copies are cycled when
 * one is small enough to stay in the last-level cache, so "GB/s" means memory, not L3
 * (RS_BENCH_COPIES=N sets the count, 1 to 64: with 1 a small weight stays in L2 and the time is
 * the kernel's compute). The time is the best of 5 windows of at least 0.1 s each, so that a
 * shared machine's noise does not pass for the kernel's speed.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/pool.h"
#include "../core/rs.h"
#include "../kernels/backend.h"
#include "../kernels/cpu/cpu_internal.h"
#include "../kernels/cpu/fp8_gemm.h"
#include "../kernels/fp8.h"

#define MAX_DTYPES 4
#define WINDOWS    5

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

typedef enum bench_kind {
    KIND_MATMUL = 0, /* rs_op_matmul */
    KIND_GEMM,       /* rs_fp8_gemm on quantized activations: exact block sums */
    KIND_GEMM_F32,   /* the same with fp32-accumulated block sums (gemm_f32 below) */
    KIND_MATMUL_FAST, /* rs_op_matmul with the backend's fast numerics (BF16: vdpbf16ps) */
} bench_kind;

static const struct {
    const char *name;
    rs_dtype dt;
    bool rows; /* fp8: kept row-major, not in the backend's layout */
    bench_kind kind;
} dtype_names[] = {{"bf16", RS_DTYPE_BF16, false, KIND_MATMUL}, {"f16", RS_DTYPE_F16, false, KIND_MATMUL},
                   {"f32", RS_DTYPE_F32, false, KIND_MATMUL},   {"fp8", RS_DTYPE_E4M3, false, KIND_MATMUL},
                   {"fp8rows", RS_DTYPE_E4M3, true, KIND_MATMUL}, {"fp8gemm", RS_DTYPE_E4M3, false, KIND_GEMM},
                   {"fp8f32", RS_DTYPE_E4M3, true, KIND_GEMM_F32}, {"bf16fast", RS_DTYPE_BF16, false, KIND_MATMUL_FAST},
                   {"fp8fast", RS_DTYPE_E4M3, false, KIND_MATMUL_FAST}};

/* ---- the fp32-accumulating W8A8 GEMM (fp8f32) ---- */

/* out[r][o] = sum over blocks b of fmaf-chained (fp32 FMA sum of x * w over the block) * xs * ws:
 * rs_fp8_gemm's recipe with the exact block sum replaced by an fp32 one. Codes become fp32 through
 * F16C: (c & 0x7f) << 7 | (c & 0x80) << 8 is the fp16 whose value is the E4M3 value times 2^-8
 * (subnormals included; NaN codes are not handled: benchmark data has none), and the 2^16 of a
 * product is put back once per block sum (exact). K must be a multiple of the lane count. */
typedef struct f32_job {
    float *out;        /* [rows][n] */
    const float *xf;   /* [rows][k] activation values times 2^-8 */
    const float *xs;   /* [rows][kb] */
    const uint8_t *wq; /* [n][k] row-major */
    const float *ws;   /* [ceil(n/128)][kb] */
    int rows, n, k;
    int64_t kb;
} f32_job;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define F32_NW 4
#define F32_BODY(T, W, NT, LOADW, LOADX, FMA, ZERO, HSUM)                                                    \
    const f32_job *j = ctx;                                                                                  \
    const int64_t k = j->k, kb = j->kb;                                                                      \
    for (int64_t g = g0; g < g1; g++) {                                                                      \
        const int64_t o0 = g * F32_NW;                                                                       \
        const uint8_t *w[F32_NW];                                                                            \
        for (int q = 0; q < F32_NW; q++) w[q] = j->wq + RS_MIN(o0 + q, (int64_t)j->n - 1) * k;             \
        for (int r0 = 0; r0 < j->rows; r0 += NT) {                                                           \
            const int nt = RS_MIN(NT, j->rows - r0);                                                         \
            float acc[NT][F32_NW] = {{0}};                                                                   \
            for (int64_t b = 0; b < kb; b++) {                                                               \
                T s[F32_NW][NT];                                                                             \
                const float *xr[NT];                                                                         \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                       \
                    xr[t] = j->xf + (int64_t)RS_MIN(r0 + t, j->rows - 1) * k;                                \
                    _Pragma("GCC unroll 8") for (int q = 0; q < F32_NW; q++) s[q][t] = ZERO;                 \
                }                                                                                            \
                for (int64_t i = b * 128; i < RS_MIN(k, b * 128 + 128); i += W) {                            \
                    T xv[NT];                                                                                \
                    _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) xv[t] = LOADX(xr[t] + i);          \
                    _Pragma("GCC unroll 8") for (int q = 0; q < F32_NW; q++) {                               \
                        const T wv = LOADW(w[q] + i);                                                        \
                        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) s[q][t] = FMA(wv, xv[t], s[q][t]); \
                    }                                                                                        \
                }                                                                                            \
                for (int q = 0; q < F32_NW; q++) {                                                           \
                    const float sw = j->ws[((o0 + q) / 128) * kb + b];                                       \
                    for (int t = 0; t < nt; t++)                                                             \
                        acc[t][q] = fmaf(HSUM(s[q][t]) * 0x1p16f, j->xs[(int64_t)(r0 + t) * kb + b] * sw, acc[t][q]); \
                }                                                                                            \
            }                                                                                                \
            for (int t = 0; t < nt; t++)                                                                     \
                for (int q = 0; q < F32_NW && o0 + q < j->n; q++) j->out[(int64_t)(r0 + t) * j->n + o0 + q] = acc[t][q]; \
        }                                                                                                    \
    }

__attribute__((target("avx2,fma,f16c"))) static inline __m256 f32_w8(const uint8_t *p) {
    const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7f)), 7),
                                   _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8));
    return _mm256_cvtph_ps(h);
}

__attribute__((target("avx2,fma,f16c"))) static inline float f32_hsum8(__m256 v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

__attribute__((target("avx2,fma,f16c"))) static void f32_range_avx2(void *ctx, int64_t g0, int64_t g1, int tid) {
    (void)tid;
    F32_BODY(__m256, 8, 3, f32_w8, _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_setzero_ps(), f32_hsum8)
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static inline __m512 f32_w16(const uint8_t *p) {
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8));
    return _mm512_cvtph_ps(h);
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static inline float f32_hsum16(__m512 v) {
    return _mm512_reduce_add_ps(v);
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void f32_range_avx512(void *ctx, int64_t g0, int64_t g1,
                                                                            int tid) {
    (void)tid;
    F32_BODY(__m512, 16, 6, f32_w16, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_setzero_ps(), f32_hsum16)
}
#endif

/* The fp8f32 GEMM on `pool`: AVX-512 when `wide`, else AVX2. xf: scratch [rows][k]. */
static void gemm_f32(rs_pool *pool, bool wide, float *out, float *xf, const uint8_t *xq, const float *xs,
                     const rs_tensor *w, int rows) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    const int64_t n = w->shape[0], k = w->shape[1];
    for (int64_t i = 0; i < rows * k; i++) xf[i] = rs_fp8_e4m3_f32[xq[i]] * 0x1p-8f;
    f32_job j = {.out = out, .xf = xf, .xs = xs, .wq = w->data, .ws = w->scale_inv, .rows = rows, .n = (int)n,
                 .k = (int)k, .kb = rs_fp8_blocks(k)};
    rs_pool_run(pool, (n + F32_NW - 1) / F32_NW, 1, wide ? f32_range_avx512 : f32_range_avx2, &j);
#else
    (void)pool, (void)wide, (void)out, (void)xf, (void)xq, (void)xs, (void)w, (void)rows;
    fprintf(stderr, "fp8f32 needs x86-64\n");
    exit(2);
#endif
}

/* The dtype named by s[0..len), or -1. */
static int parse_dtype(const char *s, size_t len) {
    for (size_t i = 0; i < RS_ARRAY_LEN(dtype_names); i++)
        if (strlen(dtype_names[i].name) == len && strncmp(s, dtype_names[i].name, len) == 0) return (int)i;
    return -1;
}

/* `copies` random [n][k] weights of dtype dt in backend memory (fp8: quantized from fp32, in the
 * backend's layout unless `rows`). */
static rs_tensor *make_weights(rs_backend *b, rs_dtype dt, bool rows, int64_t n, int64_t k, int copies,
                               uint64_t *seed) {
    size_t numel = (size_t)n * (size_t)k, wbytes = numel * rs_dtype_size(dt);
    size_t sbytes = (size_t)rs_fp8_blocks(n) * (size_t)rs_fp8_blocks(k) * sizeof(float);
    float *wf = dt == RS_DTYPE_E4M3 ? rs_xmalloc(numel * sizeof(float)) : NULL;
    uint8_t *codes = dt == RS_DTYPE_E4M3 ? rs_xmalloc(numel) : NULL;
    const rs_layout layout = dt == RS_DTYPE_E4M3 && !rows ? rs_backend_fp8_layout(b, n, k) : RS_LAYOUT_ROWS;
    rs_tensor *w = rs_xcalloc((size_t)copies, sizeof *w);
    for (int c = 0; c < copies; c++) {
        w[c] = (rs_tensor){.dtype = dt, .ndim = 2, .shape = {n, k}, .data = rs_backend_alloc(b, wbytes)};
        RS_ASSERT(w[c].data);
        for (size_t i = 0; i < numel; i++) {
            float v = frand(seed);
            if (dt == RS_DTYPE_F32 || dt == RS_DTYPE_E4M3)
                (wf ? wf : (float *)w[c].data)[i] = v;
            else
                ((uint16_t *)w[c].data)[i] = dt == RS_DTYPE_BF16 ? rs_f32_to_bf16(v) : rs_f32_to_f16(v);
        }
        if (wf) {
            rs_tensor src = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {n, k}, .data = wf};
            w[c].scale_inv = rs_backend_alloc(b, sbytes);
            RS_ASSERT(w[c].scale_inv && rs_fp8_quantize_weight(&src, codes, w[c].scale_inv) == RS_OK);
            rs_backend_fp8_pack(b, layout, w[c].data, codes, n, k);
            w[c].layout = layout;
        }
    }
    free(wf);
    free(codes);
    return w;
}

/* Seconds per call: the best of WINDOWS windows, each at least 0.1 s and one pass over the copies. */
/* What a timed call runs. */
typedef struct bench_call {
    bench_kind kind;
    rs_backend *b;
    rs_pool *pool;               /* gemm kinds */
    rs_fp8_gemm_isa isa;         /* KIND_GEMM */
    bool wide;                   /* KIND_GEMM_F32: AVX-512 */
    float *out, *xf;             /* [rows][n], [rows][k] scratch */
    const float *x;              /* [rows][k] */
    const uint8_t *xq;           /* [rows][k] codes of x */
    const float *xs;             /* [rows][kb] */
} bench_call;

static void call_once(const bench_call *c, const rs_tensor *w, int rows) {
    const int n = (int)w->shape[0], k = (int)w->shape[1];
    switch (c->kind) {
    case KIND_MATMUL:
    case KIND_MATMUL_FAST: rs_op_matmul(c->b, c->out, c->x, w, NULL, rows); break;
    case KIND_GEMM:
        RS_ASSERT(rs_fp8_gemm_layout_with_isa(c->isa, c->pool, c->out, c->xq, c->xs, w->data, w->layout,
                                              w->scale_inv, rows, n, k) == RS_OK);
        break;
    case KIND_GEMM_F32: gemm_f32(c->pool, c->wide, c->out, c->xf, c->xq, c->xs, w, rows); break;
    }
}

/* Seconds per call: the best of WINDOWS windows, each at least 0.1 s and one pass over the copies. */
static double time_call(const bench_call *c, const rs_tensor *w, int copies, int rows) {
    for (int i = 0; i < copies; i++) call_once(c, &w[i], rows); /* warm */
    double best = 1e30;
    for (int win = 0; win < WINDOWS; win++) {
        int iters = 0;
        double t0 = rs_now_s(), dt_s;
        do {
            call_once(c, &w[iters % copies], rows);
            iters++;
            dt_s = rs_now_s() - t0;
        } while (dt_s < 0.1 || iters < copies);
        best = RS_MIN(best, dt_s / iters);
    }
    return best;
}

/* The FP8 GEMM ISA of a backend at the level RS_CPU_SIMD leaves it (its describe line names it). */
static rs_fp8_gemm_isa backend_isa(void) {
    const char *e = getenv("RS_CPU_SIMD");
    if (e && !strcmp(e, "scalar")) return RS_FP8_GEMM_ISA_GENERIC;
    if (e && !strcmp(e, "avx2")) return rs_fp8_gemm_isa_supported(RS_FP8_GEMM_ISA_AVX2) ? RS_FP8_GEMM_ISA_AVX2
                                                                                      : RS_FP8_GEMM_ISA_GENERIC;
    return rs_fp8_gemm_detect_isa();
}

/* ||a - b|| / ||b|| over n values. */
static double rel_err(const float *a, const float *b, size_t n) {
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) e += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), s += (double)b[i] * b[i];
    return s > 0 ? sqrt(e / s) : 0;
}

int main(int argc, char **argv) {
    int64_t n = argc > 1 ? atoll(argv[1]) : 3072, k = argc > 2 ? atoll(argv[2]) : 1024;
    const char *dts = argc > 3 ? argv[3] : "bf16";
    int threads = argc > 4 ? atoi(argv[4]) : 0;
    const char *rows_arg = argc > 5 ? argv[5] : "1,2,4,8,16";
    rs_dtype dt[MAX_DTYPES];
    bool dt_rows[MAX_DTYPES];
    bench_kind kind[MAX_DTYPES];
    const char *label[MAX_DTYPES];
    int ndt = 0, ok = n > 0 && k > 0;
    for (const char *p = dts; ok && *p;) {
        size_t len = strcspn(p, ",");
        int i = parse_dtype(p, len);
        ok = ndt < MAX_DTYPES && i >= 0 && (dtype_names[i].kind != KIND_GEMM_F32 || k % 16 == 0);
        if (ok) {
            dt[ndt] = dtype_names[i].dt, dt_rows[ndt] = dtype_names[i].rows, kind[ndt] = dtype_names[i].kind;
            label[ndt++] = dtype_names[i].name;
        }
        p += len + (p[len] == ',');
    }
    if (!ok || ndt == 0) {
        fprintf(stderr, "usage: bench-matmul [N K [bf16|bf16fast|f16|f32|fp8|fp8rows|fp8gemm|fp8f32[,...] [threads "
                        "[rows,...]]]]\n"
                        "       (fp8f32 needs K a multiple of 16)\n");
        return 2;
    }
    long copies_env = 0; /* RS_BENCH_COPIES, or 0: as many as outgrow the L3 */
    const char *cenv = getenv("RS_BENCH_COPIES");
    if (cenv && *cenv) {
        char *end;
        copies_env = strtol(cenv, &end, 10);
        if (*end || copies_env < 1 || copies_env > 64) {
            fprintf(stderr, "bench-matmul: RS_BENCH_COPIES=%s: want 1 to 64\n", cenv);
            return 2;
        }
    }

    rs_backend *b = rs_backend_cpu_init(threads);
    rs_fp8_gemm_tune(rs_cpu_fp8_isa(rs_cpu_ctx_of(b)->simd)); /* as the daemon does at start */
    rs_pool *pool = rs_pool_init(threads);
    char line[256];
    printf("%s\n", rs_backend_cpu_describe(b, line, sizeof line));
    rs_tensor *w[MAX_DTYPES];
    int copies[MAX_DTYPES];
    uint64_t seed = 1;
    for (int d = 0; d < ndt; d++) {
        size_t wbytes = (size_t)n * (size_t)k * rs_dtype_size(dt[d]);
        copies[d] = copies_env ? (int)copies_env
                               : (int)RS_MAX((size_t)1, RS_MIN((size_t)16, ((size_t)256 << 20) / wbytes)); /* > L3 */
        w[d] = make_weights(b, dt[d], dt_rows[d], n, k, copies[d], &seed);
        printf("%s %s [%lld][%lld]%s (%.1f MB, %d cop%s cycled), threads %d\n", kind[d] == KIND_MATMUL ? "matmul" : "gemm",
               rs_dtype_name(dt[d]), (long long)n, (long long)k,
               w[d][0].layout == RS_LAYOUT_FP8_PAIRS32 ? " pairs32 layout" : "", wbytes / 1e6, copies[d],
               copies[d] == 1 ? "y" : "ies", threads);
    }
    int max_rows = 1;
    for (const char *p = rows_arg; *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : p + strlen(p))
        max_rows = RS_MAX(max_rows, atoi(p));
    float *x = rs_xmalloc((size_t)max_rows * (size_t)k * sizeof(float));
    float *out = rs_xmalloc((size_t)max_rows * (size_t)n * sizeof(float));
    float *exact = rs_xmalloc((size_t)max_rows * (size_t)n * sizeof(float));
    float *xf = rs_xmalloc((size_t)max_rows * (size_t)k * sizeof(float));
    uint8_t *xq = rs_xmalloc((size_t)max_rows * (size_t)k);
    float *xs = rs_xmalloc((size_t)max_rows * (size_t)rs_fp8_blocks(k) * sizeof(float));
    for (size_t i = 0; i < (size_t)max_rows * (size_t)k; i++) x[i] = frand(&seed);
    rs_fp8_quantize_act(x, max_rows, k, xq, xs);
    const rs_fp8_gemm_isa isa = backend_isa();
    const bool wide = isa == RS_FP8_GEMM_ISA_AVX512_VNNI || (!getenv("RS_CPU_SIMD") && __builtin_cpu_supports("avx512f"));

    double rate1[MAX_DTYPES] = {0};
    for (const char *p = rows_arg; *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : p + strlen(p)) {
        int rows = atoi(p);
        if (rows <= 0) continue;
        double per[MAX_DTYPES];
        for (int d = 0; d < ndt; d++) {
            bench_call c = {.kind = kind[d], .b = b, .pool = pool, .isa = isa, .wide = wide, .out = out, .xf = xf,
                            .x = x, .xq = xq, .xs = xs};
            const rs_numerics num = rs_backend_set_numerics(b, kind[d] == KIND_MATMUL_FAST ? RS_NUMERICS_FAST
                                                                                            : RS_NUMERICS_EXACT);
            if (kind[d] == KIND_MATMUL_FAST && num != RS_NUMERICS_FAST) {
                printf("  %-7s rows %3d: skipped: this CPU (or RS_CPU_SIMD) has no fast BF16 kernel (AVX512_BF16)\n",
                       label[d], rows);
                per[d] = NAN;
                continue;
            }
            per[d] = time_call(&c, w[d], copies[d], rows);
            double rate = rows / per[d], wbytes = (double)n * (double)k * (double)rs_dtype_size(dt[d]);
            if (rows == 1) rate1[d] = rate;
            printf("  %-7s rows %3d: %9.1f us/call  %6.1f GB/s  %9.0f rows/s", label[d], rows, per[d] * 1e6,
                   wbytes / per[d] / 1e9, rate);
            if (rate1[d] > 0) printf("  (%.1fx batch 1)", rate / rate1[d]);
            if (kind[d] == KIND_GEMM_F32) { /* what the fp32 sums change, against the exact GEMM */
                call_once(&c, w[d], rows);
                RS_ASSERT(rs_fp8_gemm_with_isa(isa, pool, exact, xq, xs, w[d][0].data, w[d][0].scale_inv, rows,
                                               (int)n, (int)k) == RS_OK);
                printf("  (rel. error vs exact %.1e)", rel_err(out, exact, (size_t)rows * (size_t)n));
            }
            printf("\n");
        }
        if (ndt >= 2)
            printf("  rows %3d: %s / %s time %.2f\n", rows, label[0], label[1], per[0] / per[1]);
    }
    for (int d = 0; d < ndt; d++) {
        for (int c = 0; c < copies[d]; c++) {
            rs_backend_free_mem(b, w[d][c].data);
            if (w[d][c].scale_inv) rs_backend_free_mem(b, w[d][c].scale_inv);
        }
        free(w[d]);
    }
    free(x), free(out), free(exact), free(xf), free(xq), free(xs);
    rs_pool_free(pool);
    rs_backend_free(b);
    return 0;
}
