/*
 * test_cpu_matmul.c — the CPU matmul's exact arithmetic at every SIMD level, and batch invariance.
 *
 * BF16/F16/F32 weights: each SIMD level's tile computes every output in one fixed order, written
 * out here in scalar C (tile_sum_ref): lane l of the level's width accumulates fmaf(w[i], x[i], .)
 * over i = l mod width in increasing i from +0, the lanes are added by the tile's tree, then the
 * K tail (k mod width) is added term by term (product, then sum), then the bias. The scalar level
 * is the sequential sum (rs_cpu_matmul_ref). Every level must equal its order bit for bit on
 * ragged shapes, every row count up to 40 and some beyond (every token-tile size and the blocked
 * prefill loops), 1 and 2 threads. A level this CPU cannot run is skipped with its name printed.
 *
 * Batch invariance: a row's outputs are the same bits whatever batch it is computed in (1 to 512
 * rows, first, middle or last), for BF16 and E4M3 weights at every level, since seeded rollouts
 * must not depend on what else runs.
 *
 * The fast numerics (--numerics fast, BF16 weights on AVX512_BF16 CPUs): every output equals, bit
 * for bit, the order vdpbf16ps defines (Intel SDM: per lane, the odd product of a pair added to the
 * accumulator, then the even one, each sum rounded to nearest even) over the activations rounded
 * to BF16, written out in scalar C (dot_bf16_ref); batch invariance as above; and below the AVX-512
 * level, or on a CPU without AVX512_BF16, asking for fast changes nothing (reported exact).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_internal.h"
#include "../../kernels/cpu/fp8_gemm.h"
#include "../../kernels/fp8.h"
#include "test.h"
#include "test_util.h"

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_uniform(uint64_t *s) { /* [-1, 1) */
    return (float)((double)(rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static const rs_cpu_simd levels[] = {RS_CPU_SIMD_SCALAR, RS_CPU_SIMD_AVX2, RS_CPU_SIMD_AVX512};

/* The backend at `level` with `threads`, or NULL (the name printed) when this CPU lacks it. */
static rs_backend *backend_at(int threads, rs_cpu_simd level) {
    rs_backend *b = rs_backend_cpu_init(threads);
    if (rs_cpu_set_simd(b, level) != level) {
        rs_test_note_skip(rs_cpu_simd_name(level));
        rs_backend_free(b);
        return NULL;
    }
    return b;
}

static rs_backend *fast_backend(int threads);
static rs_backend *fast_backend_amx(int threads, bool amx);

/* A [n][k] weight of dt (values in [-1, 1)) and the same values as fp32. */
typedef struct wt {
    rs_tensor t;
    float *f; /* [n][k] */
} wt;

static wt make_weight(rs_dtype dt, int64_t n, int64_t k, uint64_t *s) {
    wt w = {.t = {.dtype = dt, .ndim = 2, .shape = {n, k}}};
    const size_t numel = (size_t)(n * k);
    w.f = malloc(numel * sizeof(float) + 1);
    w.t.data = malloc(numel * rs_dtype_size(dt) + 1);
    for (size_t i = 0; i < numel; i++) {
        const float v = rng_uniform(s);
        if (dt == RS_DTYPE_BF16) {
            ((uint16_t *)w.t.data)[i] = rs_f32_to_bf16(v);
            w.f[i] = rs_bf16_to_f32(((uint16_t *)w.t.data)[i]);
        } else if (dt == RS_DTYPE_F16) {
            ((uint16_t *)w.t.data)[i] = rs_f32_to_f16(v);
            w.f[i] = rs_f16_to_f32(((uint16_t *)w.t.data)[i]);
        } else {
            ((float *)w.t.data)[i] = v;
            w.f[i] = v;
        }
    }
    return w;
}

static void free_weight(wt *w) { free(w->t.data), free(w->f); }

/* The sum a tile of `width` lanes computes for one output (width 1: the sequential sum). */
static float tile_sum_ref(const float *x /* [k] */, const float *w /* [k] */, int64_t k, int width,
                          const float *bias) {
    float s = 0.0f;
    int64_t i = 0;
    if (width > 1) {
        float lane[16] = {0};
        const int64_t kv = k - k % width;
        for (; i < kv; i++) lane[i % width] = fmaf(w[i], x[i], lane[i % width]);
        if (width == 16) /* AVX-512: the two 256-bit halves first */
            for (int l = 0; l < 8; l++) lane[l] = lane[l] + lane[l + 8];
        s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
    for (; i < k; i++) {
        const float p = x[i] * w[i];
        s = s + p;
    }
    return bias ? s + *bias : s;
}

static int level_width(rs_cpu_simd level) {
    return level == RS_CPU_SIMD_AVX512 ? 16 : level == RS_CPU_SIMD_AVX2 ? 8 : 1;
}

/* rs_op_matmul at every level and 1 and 2 threads against tile_sum_ref, bit for bit. */
static void check_order(rs_dtype dt, int64_t n, int64_t k, int rows, bool with_bias, uint64_t *s) {
    wt w = make_weight(dt, n, k, s);
    float *x = malloc((size_t)(rows * k) * sizeof(float) + 1), *bias = malloc((size_t)n * sizeof(float));
    float *got = malloc((size_t)(rows * n) * sizeof(float));
    for (int64_t i = 0; i < rows * k; i++) x[i] = rng_uniform(s);
    for (int64_t i = 0; i < n; i++) bias[i] = rng_uniform(s);
    rs_tensor bt = {.dtype = RS_DTYPE_F32, .ndim = 1, .shape = {n}, .data = bias};
    for (size_t li = 0; li < RS_ARRAY_LEN(levels); li++) {
        for (int threads = 1; threads <= 2; threads++) {
            rs_backend *b = backend_at(threads, levels[li]);
            if (!b) continue;
            memset(got, 0xff, (size_t)(rows * n) * sizeof(float));
            rs_op_matmul(b, got, x, &w.t, with_bias ? &bt : NULL, rows);
            for (int r = 0; r < rows; r++)
                for (int64_t o = 0; o < n; o++) {
                    const float want = tile_sum_ref(x + r * k, w.f + o * k, k, level_width(levels[li]),
                                                    with_bias ? &bias[o] : NULL);
                    if (rs_test_f32_bits(got[r * n + o]) != rs_test_f32_bits(want))
                        RS_TEST_FAIL("%s %s threads %d n %lld k %lld rows %d bias %d: out[%d][%lld] %a, order %a",
                                     rs_dtype_name(dt), rs_cpu_simd_name(levels[li]), threads, (long long)n,
                                     (long long)k, rows, with_bias, r, (long long)o, got[r * n + o], want);
                }
            rs_backend_free(b);
        }
    }
    free(x), free(bias), free(got);
    free_weight(&w);
}

RS_TEST(cpu_matmul_every_level_exact_order) {
    static const rs_dtype dts[] = {RS_DTYPE_BF16, RS_DTYPE_F16, RS_DTYPE_F32};
    static const int64_t shapes[][2] = {{5, 7}, {13, 33}, {67, 100}, {9, 257}, {130, 16}, {6, 1000}};
    uint64_t s = 1;
    for (size_t d = 0; d < RS_ARRAY_LEN(dts); d++)
        for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++)
            for (int rows = 1; rows <= 13; rows++)
                check_order(dts[d], shapes[si][0], shapes[si][1], rows, (rows + si) % 2 == 1, &s);
}

/* Every row count to 40 and beyond on one shape; K big enough (a 512 KiB token block holds 31
 * rows of it) that the blocked prefill loops run. */
RS_TEST(cpu_matmul_every_level_exact_order_all_rows) {
    uint64_t s = 2;
    for (int rows = 1; rows <= 40; rows++) check_order(RS_DTYPE_BF16, 37, 130, rows, rows % 2 == 0, &s);
    check_order(RS_DTYPE_BF16, 21, 4100, 70, true, &s);
    check_order(RS_DTYPE_BF16, 70, 520, 97, false, &s);
}

/* ---- batch invariance ---- */

/* For each level: the probe row x[0..k) alone, then inside batches of 1..512 rows at the first,
 * middle and last position (the other rows random): its outputs must be the same bits. */
static void check_batch_invariance_on(rs_backend *b, const char *what, const rs_tensor *w, int64_t k,
                                      uint64_t *s);

static void check_batch_invariance(const rs_tensor *w, int64_t k, uint64_t *s) {
    for (size_t li = 0; li < RS_ARRAY_LEN(levels); li++) {
        rs_backend *b = backend_at(2, levels[li]);
        if (!b) continue;
        check_batch_invariance_on(b, rs_cpu_simd_name(levels[li]), w, k, s);
        rs_backend_free(b);
    }
    rs_backend *b = w->dtype == RS_DTYPE_BF16 ? fast_backend(2) : NULL;
    if (b) {
        check_batch_invariance_on(b, "avx512 fast", w, k, s);
        rs_backend_free(b);
    }
    b = w->dtype == RS_DTYPE_BF16 || w->layout == RS_LAYOUT_FP8_PAIRS32 ? fast_backend_amx(2, true) : NULL;
    if (b) {
        check_batch_invariance_on(b, "avx512 fast, amx tiles", w, k, s);
        rs_backend_free(b);
    }
}

static void check_batch_invariance_on(rs_backend *b, const char *what, const rs_tensor *w, int64_t k,
                                      uint64_t *s) {
    static const int batches[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 31, 32, 33, 64, 100, 512};
    const int64_t n = w->shape[0], max_rows = 512;
    float *x = malloc((size_t)(max_rows * k) * sizeof(float)), *probe = malloc((size_t)k * sizeof(float));
    float *alone = malloc((size_t)n * sizeof(float)), *got = malloc((size_t)(max_rows * n) * sizeof(float));
    for (int64_t i = 0; i < k; i++) probe[i] = 2.0f * rng_uniform(s);
    {
        rs_op_matmul(b, alone, probe, w, NULL, 1);
        for (size_t bi = 0; bi < RS_ARRAY_LEN(batches); bi++) {
            const int B = batches[bi], at[3] = {0, B / 2, B - 1};
            for (int ai = 0; ai < 3; ai++) {
                for (int64_t i = 0; i < B * k; i++) x[i] = 2.0f * rng_uniform(s);
                memcpy(x + at[ai] * k, probe, (size_t)k * sizeof(float));
                rs_op_matmul(b, got, x, w, NULL, B);
                for (int64_t o = 0; o < n; o++)
                    if (rs_test_f32_bits(got[at[ai] * n + o]) != rs_test_f32_bits(alone[o]))
                        RS_TEST_FAIL("%s %s: batch %d row %d: out[%lld] %a, alone %a", rs_dtype_name(w->dtype),
                                     what, B, at[ai], (long long)o, got[at[ai] * n + o], alone[o]);
            }
        }
    }
    free(x), free(probe), free(alone), free(got);
}

RS_TEST(cpu_matmul_batch_invariant_bf16) {
    uint64_t s = 3;
    wt w = make_weight(RS_DTYPE_BF16, 70, 300, &s);
    check_batch_invariance(&w.t, 300, &s);
    free_weight(&w);
    wt big = make_weight(RS_DTYPE_BF16, 9, 4100, &s); /* blocked: 31 rows a token block */
    check_batch_invariance(&big.t, 4100, &s);
    free_weight(&big);
}

/* Row-major, and in the layout this CPU serves weights in (there, with fast numerics on AMX, the
 * AMX kernel when k % 32 == 0). */
static void check_batch_invariance_fp8(int64_t n, int64_t k, uint64_t seed) {
    uint64_t s = seed;
    wt f = make_weight(RS_DTYPE_F32, n, k, &s);
    rs_tensor w = {.dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = {n, k}, .data = malloc((size_t)(n * k))};
    w.scale_inv = malloc((size_t)(rs_fp8_blocks(n) * rs_fp8_blocks(k)) * sizeof(float));
    ASSERT_EQ(rs_fp8_quantize_weight(&f.t, w.data, w.scale_inv), RS_OK);
    check_batch_invariance(&w, k, &s); /* row-major: every level's own kernel */
    rs_backend *b = rs_backend_cpu_init(1);
    const rs_layout layout = rs_backend_fp8_layout(b, n, k);
    if (layout != RS_LAYOUT_ROWS) { /* and in the layout this CPU serves weights in */
        uint8_t *packed = malloc((size_t)(n * k));
        rs_backend_fp8_pack(b, layout, packed, w.data, n, k);
        free(w.data);
        w.data = packed;
        w.layout = layout;
        check_batch_invariance(&w, k, &s);
    }
    rs_backend_free(b);
    free(w.data), free(w.scale_inv);
    free_weight(&f);
}

RS_TEST(cpu_matmul_batch_invariant_fp8) {
    check_batch_invariance_fp8(96, 300, 4);
    check_batch_invariance_fp8(96, 256, 5);
}

/* rs_op_matmul_group over weights of different dtypes (a q_proj kept BF16 by --quant-ignore beside
 * FP8 k and v; an F16 weight beside BF16 ones) is one matmul per weight, bit for bit. (It asserted
 * one dtype, and the daemon aborted on its first request.) */
RS_TEST(cpu_matmul_group_of_mixed_dtypes) {
    uint64_t s = 17;
    const int64_t n = 64, k = 256;
    wt q = make_weight(RS_DTYPE_BF16, n, k, &s), f = make_weight(RS_DTYPE_F32, n, k, &s);
    wt h = make_weight(RS_DTYPE_F16, n, k, &s);
    rs_tensor e = {.dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = {n, k}, .data = malloc((size_t)(n * k))};
    e.scale_inv = malloc((size_t)(rs_fp8_blocks(n) * rs_fp8_blocks(k)) * sizeof(float));
    ASSERT_EQ(rs_fp8_quantize_weight(&f.t, e.data, e.scale_inv), RS_OK);
    const int rows = 5;
    float *x = malloc(sizeof(float) * (size_t)(rows * k)), *one = malloc(sizeof(float) * (size_t)(rows * n));
    float *outs[3];
    for (int i = 0; i < rows * k; i++) x[i] = rng_uniform(&s);
    for (int i = 0; i < 3; i++) outs[i] = malloc(sizeof(float) * (size_t)(rows * n));
    rs_backend *b = rs_backend_cpu_init(2);
    const rs_tensor *groups[][3] = {{&q.t, &e, &e}, {&e, &q.t, &h.t}, {&q.t, &h.t, &q.t}};
    for (size_t g = 0; g < RS_ARRAY_LEN(groups); g++) {
        rs_op_matmul_group(b, outs, x, groups[g], NULL, 3, rows);
        for (int i = 0; i < 3; i++) {
            rs_op_matmul(b, one, x, groups[g][i], NULL, rows);
            ASSERT_TRUE(memcmp(one, outs[i], sizeof(float) * (size_t)(rows * n)) == 0);
        }
    }
    rs_backend_free(b);
    for (int i = 0; i < 3; i++) free(outs[i]);
    free(x), free(one), free(e.data), free(e.scale_inv);
    free_weight(&q), free_weight(&f), free_weight(&h);
}

/* ---- fast numerics: BF16 x BF16 on vdpbf16ps ---- */

/* The AVX-512 backend with fast numerics in effect, or NULL (the reason printed once) where this
 * CPU has no AVX512_BF16. */
static rs_backend *fast_backend_amx(int threads, bool amx) {
    rs_backend *b = backend_at(threads, RS_CPU_SIMD_AVX512);
    if (!b) return NULL;
    if (rs_backend_set_numerics(b, RS_NUMERICS_FAST) != RS_NUMERICS_FAST) {
        ASSERT_EQ(rs_backend_numerics(b), RS_NUMERICS_EXACT);
        rs_test_note_skip("avx512bf16 (fast numerics)");
        rs_backend_free(b);
        return NULL;
    }
    if (rs_cpu_set_amx(b, amx) != amx) {
        rs_test_note_skip("amx-bf16 (fast numerics on AMX tiles)");
        rs_backend_free(b);
        return NULL;
    }
    return b;
}

/* The vdpbf16ps path (AMX off where the CPU has it). */
static rs_backend *fast_backend(int threads) { return fast_backend_amx(threads, false); }

/* The fast tile's sum for one output: x rounded to BF16 (rs_f32_to_bf16); 16 lanes, lane l takes
 * elements 32s + 2l (even) and 32s + 2l + 1 (odd) of each 32-element step s, elements past k zero;
 * lane = (lane + w_odd x_odd) + w_even x_even in fp32 (the products of two BF16 values are exact);
 * then the tiles' tree (the two 8-lane halves, then pairs), then + bias. */
static float dot_bf16_ref(const float *x /* [k] */, const float *w /* [k] BF16 values */, int64_t k,
                          const float *bias) {
    float lane[16] = {0};
    for (int64_t i = 0; i < k; i += 32)
        for (int l = 0; l < 16; l++) {
            const int64_t e = i + 2 * l, o = e + 1;
            const float po = o < k ? w[o] * rs_bf16_to_f32(rs_f32_to_bf16(x[o])) : 0.0f;
            const float pe = e < k ? w[e] * rs_bf16_to_f32(rs_f32_to_bf16(x[e])) : 0.0f;
            lane[l] = (lane[l] + po) + pe;
        }
    for (int l = 0; l < 8; l++) lane[l] = lane[l] + lane[l + 8];
    const float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    return bias ? s + *bias : s;
}

static void check_fast_order(int64_t n, int64_t k, int rows, bool with_bias, uint64_t *s) {
    wt w = make_weight(RS_DTYPE_BF16, n, k, s);
    float *x = malloc((size_t)(rows * k) * sizeof(float) + 1), *bias = malloc((size_t)n * sizeof(float));
    float *got = malloc((size_t)(rows * n) * sizeof(float));
    for (int64_t i = 0; i < rows * k; i++) x[i] = 4.0f * rng_uniform(s);
    for (int64_t i = 0; i < n; i++) bias[i] = rng_uniform(s);
    rs_tensor bt = {.dtype = RS_DTYPE_F32, .ndim = 1, .shape = {n}, .data = bias};
    for (int threads = 1; threads <= 2; threads++) {
        rs_backend *b = fast_backend(threads);
        if (!b) break;
        memset(got, 0xff, (size_t)(rows * n) * sizeof(float));
        rs_op_matmul(b, got, x, &w.t, with_bias ? &bt : NULL, rows);
        for (int r = 0; r < rows; r++)
            for (int64_t o = 0; o < n; o++) {
                const float want = dot_bf16_ref(x + r * k, w.f + o * k, k, with_bias ? &bias[o] : NULL);
                if (rs_test_f32_bits(got[r * n + o]) != rs_test_f32_bits(want))
                    RS_TEST_FAIL("fast bf16 threads %d n %lld k %lld rows %d bias %d: out[%d][%lld] %a, order %a",
                                 threads, (long long)n, (long long)k, rows, with_bias, r, (long long)o,
                                 got[r * n + o], want);
            }
        rs_backend_free(b);
    }
    free(x), free(bias), free(got);
    free_weight(&w);
}

RS_TEST(cpu_matmul_fast_bf16_order) {
    static const int64_t shapes[][2] = {{5, 7}, {13, 33}, {67, 100}, {9, 257}, {130, 16}, {6, 1000}, {11, 64}};
    uint64_t s = 5;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++)
        for (int rows = 1; rows <= 13; rows++) check_fast_order(shapes[si][0], shapes[si][1], rows, rows % 2 == 1, &s);
    for (int rows = 14; rows <= 40; rows++) check_fast_order(37, 130, rows, rows % 2 == 0, &s);
    check_fast_order(21, 4100, 70, true, &s); /* blocked: a token block of 63 rows */
    check_fast_order(70, 520, 97, false, &s);
}

/* ---- fast numerics on AMX tiles (cpu_amx.c) ----
 *
 * TDPBF16PS's rounding inside a step is the hardware's (neither sequential fp32 nor a fused chain
 * gives its bits), so each output is held to a double-precision sum of the same BF16 products: any
 * order of k fp32 roundings (or truncations) stays within (k + 2) 2^-23 sum |x w|, and the bias
 * adds one more rounding. A tile loaded from the wrong place, a pair misplaced or a row or column
 * of the transposes swapped is off by the size of a product, far outside that. Ragged n (the last
 * chunk's two tiles, 1-31 outputs) and k (a zero-padded copy), one and two token groups, a pair
 * and an odd last group, 1 and 2 threads (the same bits). NaNs follow the last weight row: a tile
 * that read past a row's end (k % 32 != 0) or past row n would make an output NaN (0 x NaN). */
/* got = out[r][o] against a double-precision sum (+ bias) of k products whose magnitudes add to
 * mag: any order of k fp32 roundings stays within (k + 2) 2^-23 mag, and the bias adds one. */
static void check_fp32_sums(const char *what, int64_t n, int64_t k, int rows, int r, int64_t o, float got,
                            double sum, double mag, const float *bias) {
    const double want = bias ? sum + *bias : sum;
    const double tol = (double)(k + 2) * 0x1p-23 * mag + 0x1p-23 * (fabs(want) + (bias ? 1 : 0));
    if (!(fabs((double)got - want) <= tol))
        RS_TEST_FAIL("%s n %lld k %lld rows %d bias %d: out[%d][%lld] %.9g, double sum %.9g (tolerance %.3g)", what,
                     (long long)n, (long long)k, rows, bias != NULL, r, (long long)o, got, want, tol);
}

static void check_amx(int64_t n, int64_t k, int rows, bool with_bias, uint64_t *s) {
    wt w = make_weight(RS_DTYPE_BF16, n, k, s);
    uint16_t *guarded = malloc((size_t)(n * k + 64) * 2); /* the weights, then 64 NaNs */
    memcpy(guarded, w.t.data, (size_t)(n * k) * 2);
    for (int i = 0; i < 64; i++) guarded[n * k + i] = 0x7fc0;
    free(w.t.data);
    w.t.data = guarded;
    float *x = malloc((size_t)(rows * k) * sizeof(float) + 1), *bias = malloc((size_t)n * sizeof(float));
    float *got[2] = {malloc((size_t)(rows * n) * sizeof(float)), malloc((size_t)(rows * n) * sizeof(float))};
    for (int64_t i = 0; i < rows * k; i++) x[i] = 4.0f * rng_uniform(s);
    for (int64_t i = 0; i < n; i++) bias[i] = rng_uniform(s);
    rs_tensor bt = {.dtype = RS_DTYPE_F32, .ndim = 1, .shape = {n}, .data = bias};
    for (int threads = 1; threads <= 2; threads++) {
        rs_backend *b = fast_backend_amx(threads, true);
        if (!b) break;
        memset(got[threads - 1], 0xff, (size_t)(rows * n) * sizeof(float));
        rs_op_matmul(b, got[threads - 1], x, &w.t, with_bias ? &bt : NULL, rows);
        rs_backend_free(b);
        if (threads == 2 && memcmp(got[0], got[1], (size_t)(rows * n) * sizeof(float)) != 0)
            RS_TEST_FAIL("amx n %lld k %lld rows %d: 2 threads differ from 1", (long long)n, (long long)k, rows);
        for (int r = 0; r < rows && threads == 1; r++)
            for (int64_t o = 0; o < n; o++) {
                double sum = 0, mag = 0;
                for (int64_t i = 0; i < k; i++) {
                    const double p = (double)rs_bf16_to_f32(rs_f32_to_bf16(x[r * k + i])) * w.f[o * k + i];
                    sum += p, mag += fabs(p);
                }
                check_fp32_sums("amx bf16", n, k, rows, r, o, got[0][r * n + o], sum, mag, with_bias ? &bias[o] : NULL);
            }
    }
    free(x), free(bias), free(got[0]), free(got[1]);
    free_weight(&w);
}

RS_TEST(cpu_matmul_fast_bf16_amx_tiles) {
    /* n: one tile, a ragged second tile, whole chunks, a ragged last chunk; k: 32-multiples and not */
    static const int64_t shapes[][2] = {{5, 7}, {16, 32}, {17, 64}, {31, 33}, {32, 96}, {64, 100},
                                        {67, 257}, {130, 16}, {96, 1000}};
    uint64_t s = 17;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++)
        for (int rows = 1; rows <= 13; rows += (si % 2) + 1) check_amx(shapes[si][0], shapes[si][1], rows, rows % 2 == 1, &s);
    for (int rows = 14; rows <= 49; rows++) check_amx(37, 130, rows, rows % 2 == 0, &s); /* 1-4 token groups */
    check_amx(200, 512, 97, true, &s);
    check_amx(33, 4100, 70, false, &s);
}

/* ---- fast numerics: FP8 (W8A8) on AMX tiles (cpu_amx.c) ---- */

/* A [n][k] FP8 weight in the layout the backend serves it in; NULL data (and a note) when that is
 * not RS_LAYOUT_FP8_PAIRS32, the only one the AMX kernel takes. codes: row-major [n][k] (kept). */
static rs_tensor fp8_weight_served(rs_backend *b, const uint8_t *codes, const float *ws, int64_t n, int64_t k) {
    rs_tensor w = {.dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = {n, k}};
    const rs_layout layout = rs_backend_fp8_layout(b, n, k);
    if (layout != RS_LAYOUT_FP8_PAIRS32) return w;
    w.data = malloc((size_t)(n * k));
    rs_backend_fp8_pack(b, layout, w.data, codes, n, k);
    w.layout = layout;
    w.scale_inv = (void *)ws;
    return w;
}

/* With one non-zero activation code per (row, K block), every block sum is one product, exact in
 * fp32 however the tiles add, so the kernel must give rs_fp8_gemm_ref's bits. Across rows and
 * blocks the activation codes and the weight codes take every non-NaN E4M3 value (subnormals,
 * both zeros, 448), at every position of a 32-output group and of a K step: a wrong decode table
 * entry, a misplaced pair or output, a wrong scale or block boundary changes bits. Called directly
 * (rs_cpu_matmul_amx_fp8), since quantizing fp32 rows cannot give arbitrary codes. */
static void check_amx_fp8_decode(rs_backend *b, int64_t n, int64_t k, int64_t kb, int rows) {
    uint8_t *codes = malloc((size_t)(n * k)), *xq = calloc((size_t)rows * (size_t)k, 1);
    float *ws = malloc((size_t)(rs_fp8_blocks(n) * kb) * sizeof(float)), *xs = malloc((size_t)(rows * kb) * sizeof(float));
    float *got = malloc((size_t)(rows * n) * sizeof(float)), *want = malloc((size_t)(rows * n) * sizeof(float));
    uint64_t s = 31;
    int c = 0;
    for (int64_t i = 0; i < n * k; i++) { /* every code but the NaNs, in a shuffled cycle */
        c = (c + 77) % 256;
        codes[i] = (uint8_t)((c & 0x7f) == 0x7f ? 0x00 : c);
    }
    for (int64_t i = 0; i < rs_fp8_blocks(n) * kb; i++) ws[i] = 0.25f + (float)(rng_next(&s) % 1000) * 1e-3f;
    for (int r = 0; r < rows; r++)
        for (int64_t bl = 0; bl < kb; bl++) {
            const int64_t w0 = bl * 128, wn = RS_MIN((int64_t)128, k - w0);
            uint8_t code = (uint8_t)((r * 41 + bl * 13 + 5) % 256);
            if ((code & 0x7f) == 0x7f) code = 0x01;
            xq[r * k + w0 + (int64_t)(rng_next(&s) % (uint64_t)wn)] = code;
            xs[r * kb + bl] = 0.5f + (float)(rng_next(&s) % 1000) * 1e-3f;
        }
    rs_tensor w = fp8_weight_served(b, codes, ws, n, k);
    if (!w.data) {
        rs_test_note_skip("fp8 pairs32 layout (the AMX FP8 kernel's)");
    } else {
        ASSERT_TRUE(rs_cpu_amx_fp8_fits(&w));
        rs_fp8_gemm_ref(want, xq, xs, codes, ws, rows, (int)n, (int)k);
        memset(got, 0xff, (size_t)(rows * n) * sizeof(float));
        rs_cpu_matmul_amx_fp8(rs_cpu_ctx_of(b), got, xq, xs, &w, rows);
        for (int r = 0; r < rows; r++)
            for (int64_t o = 0; o < n; o++)
                if (rs_test_f32_bits(got[r * n + o]) != rs_test_f32_bits(want[r * n + o]))
                    RS_TEST_FAIL("amx fp8 decode: out[%d][%lld] %a, reference %a", r, (long long)o, got[r * n + o],
                                 want[r * n + o]);
    }
    free(w.data), free(codes), free(xq), free(ws), free(xs), free(got), free(want);
}

RS_TEST(cpu_matmul_fast_fp8_amx_decode_exact) {
    rs_backend *b = fast_backend_amx(1, true);
    if (!b) return;
    const int64_t n = 96, k = 288, kb = rs_fp8_blocks(k); /* a last block of 32: one step */
    for (int rows = 20; rows <= 45; rows += 25) /* a pair of token groups (decoded block by block), then three */
        check_amx_fp8_decode(b, n, k, kb, rows);
    rs_backend_free(b);
}

/* Through rs_op_matmul on random rows (bias or not): each output within the rounding of the
 * fp32 block sums of a double-precision W8A8 sum of the same codes (the activations quantized as
 * the backend does, rs_fp8_quantize_act): (k + 2) 2^-23 sum |x w scales|, as for BF16 above; 1 and
 * 2 threads give the same bits. Shapes the kernel does not take (n or k not a multiple of 32) must
 * give the exact kernels' bits instead. */
static void check_amx_fp8(int64_t n, int64_t k, int rows, bool with_bias, uint64_t *s) {
    const int64_t kb = rs_fp8_blocks(k);
    wt f = make_weight(RS_DTYPE_F32, n, k, s);
    for (int64_t i = 0; i < n * k; i++) f.f[i] *= ldexpf(1.0f, (int)(rng_next(s) % 12) - 8); /* subnormal codes too */
    uint8_t *codes = malloc((size_t)(n * k)), *xq = malloc((size_t)rows * (size_t)k);
    float *ws = malloc((size_t)(rs_fp8_blocks(n) * kb) * sizeof(float)), *xs = malloc((size_t)(rows * kb) * sizeof(float));
    ASSERT_EQ(rs_fp8_quantize_weight(&f.t, codes, ws), RS_OK);
    float *x = malloc((size_t)(rows * k) * sizeof(float)), *bias = malloc((size_t)n * sizeof(float));
    float *got[2] = {malloc((size_t)(rows * n) * sizeof(float)), malloc((size_t)(rows * n) * sizeof(float))};
    float *exact = malloc((size_t)(rows * n) * sizeof(float));
    for (int64_t i = 0; i < rows * k; i++) x[i] = 4.0f * rng_uniform(s) * ldexpf(1.0f, (int)(rng_next(s) % 12) - 8);
    for (int64_t i = 0; i < n; i++) bias[i] = rng_uniform(s);
    rs_fp8_quantize_act(x, rows, k, xq, xs);
    rs_tensor bt = {.dtype = RS_DTYPE_F32, .ndim = 1, .shape = {n}, .data = bias};
    const bool fits = n % 32 == 0 && k % 32 == 0 && n >= 32;
    bool ran = false; /* whether one thread count ran the kernel: none where the CPU has no AMX */
    for (int threads = 1; threads <= 2; threads++) {
        rs_backend *b = fast_backend_amx(threads, true);
        if (!b) break;
        rs_tensor w = fp8_weight_served(b, codes, ws, n, k);
        if (!w.data) {
            rs_test_note_skip("fp8 pairs32 layout (the AMX FP8 kernel's)");
            rs_backend_free(b);
            break;
        }
        ran = true;
        ASSERT_EQ(rs_cpu_amx_fp8_fits(&w), fits);
        memset(got[threads - 1], 0xff, (size_t)(rows * n) * sizeof(float));
        rs_op_matmul(b, got[threads - 1], x, &w, with_bias ? &bt : NULL, rows);
        free(w.data);
        rs_backend_free(b);
        if (threads == 2 && memcmp(got[0], got[1], (size_t)(rows * n) * sizeof(float)) != 0)
            RS_TEST_FAIL("amx fp8 n %lld k %lld rows %d: 2 threads differ from 1", (long long)n, (long long)k, rows);
    }
    if (ran && !fits) { /* the exact kernels' bits: the reference, then + bias */
        rs_fp8_gemm_ref(exact, xq, xs, codes, ws, rows, (int)n, (int)k);
        for (int r = 0; r < rows; r++)
            for (int64_t o = 0; o < n; o++) {
                const float want = with_bias ? exact[r * n + o] + bias[o] : exact[r * n + o];
                if (rs_test_f32_bits(got[0][r * n + o]) != rs_test_f32_bits(want))
                    RS_TEST_FAIL("fp8 fast n %lld k %lld (not the AMX kernel's shape) rows %d: out[%d][%lld] %a, exact %a",
                                 (long long)n, (long long)k, rows, r, (long long)o, got[0][r * n + o], want);
            }
    }
    for (int r = 0; r < rows && ran && fits; r++)
        for (int64_t o = 0; o < n; o++) {
            double sum = 0, mag = 0;
            for (int64_t bl = 0; bl < kb; bl++) {
                const double sc = (double)(xs[r * kb + bl] * ws[(o / 128) * kb + bl]);
                for (int64_t i = bl * 128; i < RS_MIN(k, bl * 128 + 128); i++) {
                    const double p = (double)rs_fp8_e4m3_f32[xq[r * k + i]] * rs_fp8_e4m3_f32[codes[o * k + i]] * sc;
                    sum += p, mag += fabs(p);
                }
            }
            check_fp32_sums("amx fp8", n, k, rows, r, o, got[0][r * n + o], sum, mag, with_bias ? &bias[o] : NULL);
        }
    free(codes), free(xq), free(ws), free(xs), free(x), free(bias), free(got[0]), free(got[1]), free(exact);
    free_weight(&f);
}

RS_TEST(cpu_matmul_fast_fp8_amx_tiles) {
    /* n: one group, several, and a last 128-row block of 32; k: one step, a ragged last block,
     * whole blocks; then shapes the kernel leaves to the exact ones */
    static const int64_t shapes[][2] = {{32, 32}, {64, 96}, {160, 256}, {96, 1056}, {32, 2048},
                                        {40, 256}, {64, 48}, {33, 64}};
    uint64_t s = 23;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++)
        for (int rows = 1; rows <= 13; rows += (si % 2) + 1) check_amx_fp8(shapes[si][0], shapes[si][1], rows, rows % 2 == 1, &s);
    for (int rows = 14; rows <= 49; rows++) check_amx_fp8(64, 128, rows, rows % 2 == 0, &s); /* 1-4 token groups */
    check_amx_fp8(128, 512, 97, true, &s);
}

/* Batch 1 on AVX-512 has two tile forms (cpu_internal.h rs_cpu_gemv): the four weight rows read
 * together, and one after another. They must give the same bits (the order tests above hold the
 * first to its order), with every dtype, in exact and fast numerics, on ragged shapes (a last tile
 * of 1-3 weight rows, K tails, weights long enough for the next block's prefetch), with 1 and 2
 * threads; and the automatic choice, which alternates the forms by timing, must too. */
static void check_gemv_forms(rs_backend *b, const char *what, const rs_tensor *w, uint64_t *s) {
    const int64_t n = w->shape[0], k = w->shape[1];
    float *x = malloc((size_t)k * sizeof(float)), *out[3];
    for (int m = 0; m < 3; m++) out[m] = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < k; i++) x[i] = 2.0f * rng_uniform(s);
    static const rs_cpu_gemv modes[3] = {RS_CPU_GEMV_TILE, RS_CPU_GEMV_ROWS, RS_CPU_GEMV_AUTO};
    for (int m = 0; m < 3; m++) {
        rs_cpu_set_gemv(b, modes[m]);
        for (int rep = 0; rep < (modes[m] == RS_CPU_GEMV_AUTO ? 3 * RS_CPU_GEMV_PROBE : 1); rep++) {
            rs_op_matmul(b, out[m], x, w, NULL, 1);
            for (int64_t o = 0; o < n && m > 0; o++)
                if (rs_test_f32_bits(out[m][o]) != rs_test_f32_bits(out[0][o]))
                    RS_TEST_FAIL("%s %s [%lld][%lld]: out[%lld] %a with %s, %a with the tile", rs_dtype_name(w->dtype),
                                 what, (long long)n, (long long)k, (long long)o, out[m][o],
                                 modes[m] == RS_CPU_GEMV_ROWS ? "the rows" : "the automatic choice", out[0][o]);
        }
    }
    rs_cpu_set_gemv(b, RS_CPU_GEMV_AUTO);
    for (int m = 0; m < 3; m++) free(out[m]);
    free(x);
}

RS_TEST(cpu_matmul_batch1_forms_same_bits) {
    static const rs_dtype dts[] = {RS_DTYPE_BF16, RS_DTYPE_F16, RS_DTYPE_F32};
    /* n % 4 = 1, 2, 3, 0; k with and without a 16- or 32-lane tail; 700 x 300 spans several
     * 128 KiB weight blocks, so the next block's prefetch runs */
    static const int64_t shapes[][2] = {{5, 7}, {6, 33}, {7, 100}, {12, 257}, {130, 64}, {700, 300}, {9, 1000}};
    uint64_t s = 11;
    for (int threads = 1; threads <= 2; threads++) {
        rs_backend *b = backend_at(threads, RS_CPU_SIMD_AVX512);
        if (!b) return;
        rs_backend *f = fast_backend(threads);
        for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++)
            for (size_t d = 0; d < RS_ARRAY_LEN(dts); d++) {
                wt w = make_weight(dts[d], shapes[si][0], shapes[si][1], &s);
                check_gemv_forms(b, "exact", &w.t, &s);
                if (f && dts[d] == RS_DTYPE_BF16) check_gemv_forms(f, "fast", &w.t, &s);
                free_weight(&w);
            }
        rs_backend_free(b);
        rs_backend_free(f);
    }
}

/* The activations' rounding: rs_f32_to_bf16's bits for ties (both ways), NaNs, infinities,
 * denormals, the largest finite values and random floats, in runs of every length mod 16. */
RS_TEST(cpu_round_bf16_matches_scalar) {
    rs_backend *b = fast_backend(1);
    if (!b) return;
    rs_backend_free(b);
    static const uint32_t special[] = {0x00000000, 0x80000000, 0x3f808000, 0x3f818000, 0x3f80ffff, 0x3f817fff,
                                       0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x7f800001, 0x7fffffff,
                                       0x00000001, 0x807fffff, 0x00008000, 0x7f7fffff, 0xff7f8000, 0x7f7f7fff};
    enum { N = 1000 };
    float src[N];
    uint16_t got[N];
    uint64_t s = 7;
    for (int i = 0; i < N; i++) {
        uint32_t u = i < (int)RS_ARRAY_LEN(special) ? special[i] : (uint32_t)rng_next(&s);
        memcpy(&src[i], &u, 4);
    }
    for (int n = 0; n <= N; n += n < 40 ? 1 : 97) {
        memset(got, 0xab, sizeof got);
        rs_cpu_round_bf16_avx512(got, src, (size_t)n);
        for (int i = 0; i < n; i++) ASSERT_EQ(got[i], rs_f32_to_bf16(src[i]));
    }
}

/* The fast numerics change BF16 matmuls only there: below the AVX-512 level the exact order holds
 * with fast asked, and E4M3 weights off AMX tiles (fast_backend) stay bit-identical to the reference. */
RS_TEST(cpu_matmul_fast_numerics_scope) {
    uint64_t s = 6;
    rs_backend *b = fast_backend(1);
    if (!b) return;
    ASSERT_EQ(rs_cpu_set_simd(b, RS_CPU_SIMD_AVX2), RS_CPU_SIMD_AVX2);
    ASSERT_EQ(rs_backend_numerics(b), RS_NUMERICS_EXACT); /* reported as what runs */
    const int64_t n = 19, k = 300;
    const int rows = 5;
    wt w = make_weight(RS_DTYPE_BF16, n, k, &s);
    float *x = malloc((size_t)(rows * k) * sizeof(float)), *got = malloc((size_t)(rows * n) * sizeof(float));
    float *want = malloc((size_t)(rows * n) * sizeof(float));
    for (int64_t i = 0; i < rows * k; i++) x[i] = rng_uniform(&s);
    rs_op_matmul(b, got, x, &w.t, NULL, rows);
    for (int r = 0; r < rows; r++)
        for (int64_t o = 0; o < n; o++)
            ASSERT_EQ(rs_test_f32_bits(got[r * n + o]), rs_test_f32_bits(tile_sum_ref(x + r * k, w.f + o * k, k, 8, NULL)));
    ASSERT_EQ(rs_cpu_set_simd(b, RS_CPU_SIMD_AVX512), RS_CPU_SIMD_AVX512);
    ASSERT_EQ(rs_backend_numerics(b), RS_NUMERICS_FAST);
    /* E4M3 weights: the exact W8A8 GEMM whatever the numerics */
    rs_tensor q = {.dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = {n, k}, .data = malloc((size_t)(n * k))};
    q.scale_inv = malloc((size_t)(rs_fp8_blocks(n) * rs_fp8_blocks(k)) * sizeof(float));
    ASSERT_EQ(rs_fp8_quantize_weight(&w.t, q.data, q.scale_inv), RS_OK);
    rs_op_matmul(b, got, x, &q, NULL, rows);
    rs_cpu_matmul_ref(want, x, &q, NULL, rows);
    ASSERT_EQ(memcmp(got, want, (size_t)(rows * n) * sizeof(float)), 0);
    rs_backend_free(b);
    free(q.data), free(q.scale_inv), free(x), free(got), free(want);
    free_weight(&w);
}

/* ---- the kernel class setting (--cpu-kernels) ---- */

RS_TEST(cpu_kernels_setting_forces_the_dispatch) {
    rs_error err = {0};
    ASSERT_TRUE(rs_backend_cpu_init_kernels(1, "avx9", &err) == NULL);
    ASSERT_EQ(err.code, RS_EINVAL);
    ASSERT_STREQ(err.param, "cpu-kernels");
    char line[256];
    rs_backend *b = rs_backend_cpu_init_kernels(1, "scalar", &err);
    ASSERT_TRUE(b != NULL);
    ASSERT_STREQ(rs_backend_cpu_describe(b, line, sizeof line), "cpu: scalar C; fp8 kernel generic-exact; bf16 tile 4x4; 1 threads");
    rs_backend_free(b);
    rs_backend *top = rs_backend_cpu_init(1);
    const rs_cpu_simd max = rs_cpu_set_simd(top, RS_CPU_SIMD_AVX512);
    rs_backend_free(top);
    b = rs_backend_cpu_init_kernels(1, "avx2", &err);
    if (max < RS_CPU_SIMD_AVX2) {
        ASSERT_TRUE(b == NULL);
        ASSERT_EQ(err.code, RS_EUNSUPPORTED);
        rs_test_note_skip("avx2");
    } else {
        ASSERT_TRUE(b != NULL);
        /* with the padded-tile row count rs_fp8_gemm_tune timed for this CPU */
        const int tiles = rs_fp8_gemm_row_tile_min(RS_FP8_GEMM_ISA_AVX2);
        ASSERT_TRUE(tiles >= 1 && tiles <= 17);
        char want[256];
        if (tiles > 16)
            snprintf(want, sizeof want, "cpu: avx2 fma f16c; fp8 kernel avx2-exact (no padded row tiles); bf16 tile 4x3; 1 threads");
        else
            snprintf(want, sizeof want,
                     "cpu: avx2 fma f16c; fp8 kernel avx2-exact (padded row tiles from %d rows); bf16 tile 4x3; 1 threads",
                     tiles);
        ASSERT_STREQ(rs_backend_cpu_describe(b, line, sizeof line), want);
        rs_backend_free(b);
    }
    b = rs_backend_cpu_init_kernels(1, "avx512", &err);
    ASSERT_EQ(b != NULL, max == RS_CPU_SIMD_AVX512);
    if (b) {
        ASSERT_TRUE(strstr(rs_backend_cpu_describe(b, line, sizeof line), "cpu: avx512f") == line);
        rs_backend_free(b);
    } else {
        ASSERT_EQ(err.code, RS_EUNSUPPORTED);
        rs_test_note_skip("avx512");
    }
    b = rs_backend_cpu_init_kernels(1, "auto", &err);
    ASSERT_TRUE(b != NULL);
    ASSERT_EQ(rs_cpu_set_simd(b, RS_CPU_SIMD_AVX512), max);
    rs_backend_free(b);
}
