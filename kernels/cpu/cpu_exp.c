/*
 * cpu_exp.c — fp32 exp in plain C, AVX2+FMA and AVX-512F, bit-identical, and the softmax and silu
 * loops of attention, the sampler and swiglu built on it.
 *
 * exp(x), Cody-Waite with FMAs:
 *   clamp  x to [-104, 89]: exp(-104) < 2^-150 rounds to 0 and exp(89) overflows to inf, so every
 *          input beyond gives the right 0 or inf through the same arithmetic; NaN passes the clamp
 *          (and then every operation) unchanged.
 *   n      = round(x log2e): fma(x, log2e, 1.5 * 2^23) rounds the exact product once, at integer
 *          granularity, and subtracting 1.5 * 2^23 is exact; n is kept as a float.
 *   r      = x - n ln2 with ln2 = hi + lo, hi the fp32 nearest ln2: fma(n, -hi, x) is exact (the
 *          product is exact inside the FMA and the difference, under 1/2, needs no bit below
 *          2^-24), fma(n, -lo, .) rounds once. |r| <= ln2/2 + a hair.
 *   e^r    = 1 + r + r^2 P(r), P of degree 4 fitted minimax for relative error on [-0.3471, 0.3471]
 *          (2^-27.8 with the fp32 coefficients), Horner in FMAs, then fma(P, r^2, r) and + 1: the
 *          last addition's rounding dominates.
 *   scale  y 2^n rounded once: scalef on AVX-512; elsewhere (y 2^(n/2)) 2^(n - n/2), the first
 *          product exact for every n in [-150, 128], the second rounding to nearest — normal,
 *          subnormal (correctly rounded) or inf alike. Both are RNE(y 2^n).
 * Over every fp32 x in [-104, 88.73] (all 2.24e9 of them) the error against exp in double is at
 * most 1.02 ulp, counting ulps of the subnormal grid below 2^-126, and the three paths agree bit
 * for bit; exp(0) = 1 exactly since r = 0 and y = 1.
 *
 * The same bits on every path: each step is one IEEE operation on the same operands in the same
 * order — the FMAs are fmaf in C (libm's fmaf is exact; -ffp-contract=off keeps the compiler from
 * fusing anything else) — and the two scalings round the same exact product. The tails of the
 * vector loops run the vector body on a masked (AVX-512) or zero-padded (AVX2) block, never libm.
 *
 * Sums (exp_sum, exp_sum_f64) use 16 lanes — lane i % 16 adds e[i] in order of i — then a tree
 * (lane l += lane l + w for w = 8, 4, 2, 1), as cpu_ops.c's sum_squares does: AVX-512 holds the
 * 16 lanes in one register (two of doubles), AVX2 in two (four), C in an array, so a softmax
 * denominator is the same on every ISA, and the sampler's logprobs with it.
 *
 * Compiled for any x86-64 target: each vector function carries its target attribute and is only
 * called when rs_cpu_exp_best or the backend found the feature, like cpu_simd_*.c.
 */
#include "../exp.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#define EXP_LO   -104.0f
#define EXP_HI   89.0f
#define LOG2E    0x1.715476p+0f
#define SHIFTER  0x1.8p23f      /* 1.5 * 2^23: adding it rounds |t| < 2^22 to an integer */
#define LN2_HI   0x1.62e430p-1f /* fp32 nearest ln2 */
#define LN2_LO   -0x1.05c610p-29f /* ln2 - LN2_HI, rounded */
#define C2       0x1.fffffcp-2f
#define C3       0x1.555490p-3f
#define C4       0x1.5558f6p-5f
#define C5       0x1.123abap-7f
#define C6       0x1.6a22cep-10f

/* ---- plain C: the definition ---- */

static float pow2i(int32_t e) { /* 2^e for -126 <= e <= 127 */
    uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float rs_expf(float x) {
    if (x != x) return x + x; /* NaN, quieted as the vector arithmetic quiets it */
    if (x < EXP_LO) x = EXP_LO;
    if (x > EXP_HI) x = EXP_HI;
    float n = fmaf(x, LOG2E, SHIFTER) - SHIFTER;
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float r2 = r * r;
    float p = fmaf(C6, r, C5);
    p = fmaf(p, r, C4);
    p = fmaf(p, r, C3);
    p = fmaf(p, r, C2);
    float y = fmaf(p, r2, r) + 1.0f;
    int32_t k = (int32_t)n, k1 = k / 2; /* any split with both factors normal rounds alike */
    return y * pow2i(k1) * pow2i(k - k1);
}

/* The 16-lane tree of the file comment over acc[16]. */
static float tree16_f32(float *acc) {
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static double tree16_f64(double *acc) {
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static void exp_scalar(float *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = rs_expf(src[i]);
}

static float max_scalar(const float *x, size_t n, float scale) {
    float m = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        float z = x[i] * scale;
        if (z > m) m = z;
    }
    return m;
}

static float exp_sum_scalar(float *dst, const float *x, size_t n, float scale, float shift) {
    float acc[16] = {0};
    for (size_t i = 0; i < n; i++) {
        float e = rs_expf(x[i] * scale - shift);
        if (dst) dst[i] = e;
        acc[i % 16] += e;
    }
    return tree16_f32(acc);
}

static double exp_sum_f64_scalar(float *dst, const float *x, size_t n, float scale, float shift) {
    double acc[16] = {0};
    for (size_t i = 0; i < n; i++) {
        float e = rs_expf(x[i] * scale - shift);
        if (dst) dst[i] = e;
        acc[i % 16] += (double)e;
    }
    return tree16_f64(acc);
}

static void div_scalar(float *x, size_t n, float d) {
    for (size_t i = 0; i < n; i++) x[i] = x[i] / d;
}

static void silu_mul_scalar(float *out, const float *gate, const float *up, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + rs_expf(-g)) * up[i];
    }
}

const rs_cpu_exp_vec rs_cpu_exp_scalar = {.exp = exp_scalar,
                                          .max = max_scalar,
                                          .exp_sum = exp_sum_scalar,
                                          .exp_sum_f64 = exp_sum_f64_scalar,
                                          .div = div_scalar,
                                          .silu_mul = silu_mul_scalar};

const rs_cpu_exp_vec *rs_cpu_exp_for(rs_cpu_simd s) {
    return s == RS_CPU_SIMD_AVX512 ? &rs_cpu_exp_avx512
           : s == RS_CPU_SIMD_AVX2 ? &rs_cpu_exp_avx2
                                   : &rs_cpu_exp_scalar;
}

/* ---- the level for callers outside the backend ---- */

static rs_cpu_simd best_level;
static pthread_once_t best_once = PTHREAD_ONCE_INIT;

/* What the tables need (no F16C, unlike the backend's AVX2 level), capped by RS_CPU_SIMD. */
static void find_best(void) {
    rs_cpu_simd s = RS_CPU_SIMD_SCALAR;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        s = __builtin_cpu_supports("avx512f") ? RS_CPU_SIMD_AVX512 : RS_CPU_SIMD_AVX2;
#endif
    const char *e = getenv("RS_CPU_SIMD");
    for (int c = RS_CPU_SIMD_SCALAR; e && c < (int)s; c++)
        if (strcmp(e, rs_cpu_simd_name((rs_cpu_simd)c)) == 0) s = (rs_cpu_simd)c;
    best_level = s;
}

const rs_cpu_exp_vec *rs_cpu_exp_best(void) {
    pthread_once(&best_once, find_best);
    return rs_cpu_exp_for(best_level);
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T256   __attribute__((target("avx2,fma")))
#define T512   __attribute__((target("avx512f,avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* ---- AVX2 + FMA: 8 lanes, blocks of 16 as two vectors ---- */

T256 INLINE __m256 exp8(__m256 x) {
    /* vmaxps / vminps return their second operand when either is NaN: NaN x stays */
    x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x));
    __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(SHIFTER)),
                             _mm256_set1_ps(SHIFTER));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 r2 = _mm256_mul_ps(r, r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(C6), r, _mm256_set1_ps(C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C2));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
    /* NaN lanes convert to 0x80000000 and scale by garbage; y is NaN there, so is the product */
    __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
}

/* rs_expf(x * scale - shift) */
T256 INLINE __m256 exp_arg8(__m256 x, __m256 scale, __m256 shift) {
    return exp8(_mm256_sub_ps(_mm256_mul_ps(x, scale), shift));
}

/* Lanes < n of the 16 lanes of a block: all ones, the rest zero. */
T256 INLINE void tail_masks256(size_t n, __m256 m[2]) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), nv = _mm256_set1_epi32((int)n);
    m[0] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, lane));
    m[1] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
}

T256 static void exp256(float *dst, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, exp8(_mm256_loadu_ps(src + i)));
    if (i < n) {
        float b[8] = {0};
        memcpy(b, src + i, (n - i) * sizeof(float));
        _mm256_storeu_ps(b, exp8(_mm256_loadu_ps(b)));
        memcpy(dst + i, b, (n - i) * sizeof(float));
    }
}

T256 static float max256(const float *x, size_t n, float scale) {
    __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(-INFINITY);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), m); /* NaN: keeps m */
    float lanes[8], best = max_scalar(x + i, n - i, scale);
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    return best;
}

/* One block of 16: e = exp(x * scale - shift) for lanes 0-7 and 8-15. */
T256 INLINE void exp_block256(__m256 e[2], const float *x, __m256 s, __m256 sh) {
    e[0] = exp_arg8(_mm256_loadu_ps(x), s, sh);
    e[1] = exp_arg8(_mm256_loadu_ps(x + 8), s, sh);
}

/* The blocks of 16 of exp_sum: the e's into dst, their lanes into the caller's accumulators. The
 * last n % 16 go through a zero-padded copy with the extra lanes' e set to +0, which adds nothing. */
#define EXP_SUM_LOOP256(ACCUMULATE)                                                                          \
    __m256 s = _mm256_set1_ps(scale), sh = _mm256_set1_ps(shift), e[2];                                      \
    size_t i = 0;                                                                                            \
    for (; i + 16 <= n; i += 16) {                                                                           \
        exp_block256(e, x + i, s, sh);                                                                       \
        if (dst) _mm256_storeu_ps(dst + i, e[0]), _mm256_storeu_ps(dst + i + 8, e[1]);                       \
        ACCUMULATE;                                                                                          \
    }                                                                                                        \
    if (i < n) {                                                                                             \
        float b[16] = {0};                                                                                   \
        __m256 m[2];                                                                                         \
        memcpy(b, x + i, (n - i) * sizeof(float));                                                           \
        exp_block256(e, b, s, sh);                                                                           \
        tail_masks256(n - i, m);                                                                             \
        e[0] = _mm256_and_ps(e[0], m[0]), e[1] = _mm256_and_ps(e[1], m[1]);                                  \
        _mm256_storeu_ps(b, e[0]), _mm256_storeu_ps(b + 8, e[1]);                                            \
        if (dst) memcpy(dst + i, b, (n - i) * sizeof(float));                                                \
        ACCUMULATE;                                                                                          \
    }

T256 static float exp_sum256(float *dst, const float *x, size_t n, float scale, float shift) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(); /* lanes 0-7, 8-15 */
    EXP_SUM_LOOP256((a0 = _mm256_add_ps(a0, e[0]), a1 = _mm256_add_ps(a1, e[1])))
    __m256 a8 = _mm256_add_ps(a0, a1);
    __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
    __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
    return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
}

T256 static double exp_sum_f64_256(float *dst, const float *x, size_t n, float scale, float shift) {
    __m256d d0 = _mm256_setzero_pd(), d1 = d0, d2 = d0, d3 = d0; /* lanes 0-3, 4-7, 8-11, 12-15 */
    EXP_SUM_LOOP256((d0 = _mm256_add_pd(d0, _mm256_cvtps_pd(_mm256_castps256_ps128(e[0]))),
                     d1 = _mm256_add_pd(d1, _mm256_cvtps_pd(_mm256_extractf128_ps(e[0], 1))),
                     d2 = _mm256_add_pd(d2, _mm256_cvtps_pd(_mm256_castps256_ps128(e[1]))),
                     d3 = _mm256_add_pd(d3, _mm256_cvtps_pd(_mm256_extractf128_ps(e[1], 1)))))
    __m256d a4 = _mm256_add_pd(_mm256_add_pd(d0, d2), _mm256_add_pd(d1, d3));
    __m128d a2 = _mm_add_pd(_mm256_castpd256_pd128(a4), _mm256_extractf128_pd(a4, 1));
    return _mm_cvtsd_f64(_mm_add_sd(a2, _mm_unpackhi_pd(a2, a2)));
}

T256 static void div256(float *x, size_t n, float d) {
    __m256 dv = _mm256_set1_ps(d);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_div_ps(_mm256_loadu_ps(x + i), dv));
    div_scalar(x + i, n - i, d);
}

T256 INLINE __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f))); /* -g: the sign flipped, as C's unary minus */
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

T256 static void silu_mul256(float *out, const float *gate, const float *up, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) {
        float g[8] = {0}, u[8] = {0};
        memcpy(g, gate + i, (n - i) * sizeof(float));
        memcpy(u, up + i, (n - i) * sizeof(float));
        _mm256_storeu_ps(g, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
        memcpy(out + i, g, (n - i) * sizeof(float));
    }
}

const rs_cpu_exp_vec rs_cpu_exp_avx2 = {.exp = exp256,
                                        .max = max256,
                                        .exp_sum = exp_sum256,
                                        .exp_sum_f64 = exp_sum_f64_256,
                                        .div = div256,
                                        .silu_mul = silu_mul256};

/* ---- AVX-512F: 16 lanes, tails masked ---- */

T512 INLINE __mmask16 first_lanes(size_t n) { return (__mmask16)((1u << n) - 1u); } /* n < 16 */

T512 INLINE __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(EXP_HI), _mm512_max_ps(_mm512_set1_ps(EXP_LO), x)); /* as exp8 */
    __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(SHIFTER)),
                             _mm512_set1_ps(SHIFTER));
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 r2 = _mm512_mul_ps(r, r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(C6), r, _mm512_set1_ps(C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C2));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n); /* y 2^n, one rounding; NaN n or y gives NaN */
}

T512 INLINE __m512 exp_arg16(__m512 x, __m512 scale, __m512 shift) {
    return exp16(_mm512_sub_ps(_mm512_mul_ps(x, scale), shift));
}

T512 static void exp512(float *dst, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, exp16(_mm512_loadu_ps(src + i)));
    if (i < n) {
        __mmask16 m = first_lanes(n - i);
        _mm512_mask_storeu_ps(dst + i, m, exp16(_mm512_maskz_loadu_ps(m, src + i)));
    }
}

T512 static float max512(const float *x, size_t n, float scale) {
    __m512 s = _mm512_set1_ps(scale), m = _mm512_set1_ps(-INFINITY);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), s), m); /* NaN: keeps m */
    if (i < n) {
        __mmask16 k = first_lanes(n - i);
        m = _mm512_mask_max_ps(m, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), s), m);
    }
    return _mm512_reduce_max_ps(m);
}

/* As EXP_SUM_LOOP256 on one vector per block; the tail's extra lanes get e = +0. */
#define EXP_SUM_LOOP512(ACCUMULATE)                                                                          \
    __m512 s = _mm512_set1_ps(scale), sh = _mm512_set1_ps(shift), e;                                         \
    size_t i = 0;                                                                                            \
    for (; i + 16 <= n; i += 16) {                                                                           \
        e = exp_arg16(_mm512_loadu_ps(x + i), s, sh);                                                        \
        if (dst) _mm512_storeu_ps(dst + i, e);                                                               \
        ACCUMULATE;                                                                                          \
    }                                                                                                        \
    if (i < n) {                                                                                             \
        __mmask16 k = first_lanes(n - i);                                                                    \
        e = _mm512_maskz_mov_ps(k, exp_arg16(_mm512_maskz_loadu_ps(k, x + i), s, sh));                       \
        if (dst) _mm512_mask_storeu_ps(dst + i, k, e);                                                       \
        ACCUMULATE;                                                                                          \
    }

T512 static float exp_sum512(float *dst, const float *x, size_t n, float scale, float shift) {
    __m512 acc = _mm512_setzero_ps();
    EXP_SUM_LOOP512(acc = _mm512_add_ps(acc, e))
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
    __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
    return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
}

T512 static double exp_sum_f64_512(float *dst, const float *x, size_t n, float scale, float shift) {
    __m512d lo = _mm512_setzero_pd(), hi = lo; /* lanes 0-7, 8-15 */
    EXP_SUM_LOOP512((lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e))),
                     hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(
                                                _mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))))))
    __m512d a8 = _mm512_add_pd(lo, hi);
    __m256d a4 = _mm256_add_pd(_mm512_castpd512_pd256(a8), _mm512_extractf64x4_pd(a8, 1));
    __m128d a2 = _mm_add_pd(_mm256_castpd256_pd128(a4), _mm256_extractf128_pd(a4, 1));
    return _mm_cvtsd_f64(_mm_add_sd(a2, _mm_unpackhi_pd(a2, a2)));
}

T512 static void div512(float *x, size_t n, float d) {
    __m512 dv = _mm512_set1_ps(d);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_div_ps(_mm512_loadu_ps(x + i), dv));
    if (i < n) {
        __mmask16 k = first_lanes(n - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), dv));
    }
}

T512 INLINE __m512 silu_mul16(__m512 g, __m512 u) {
    __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
    __m512 e = exp16(neg);
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

T512 static void silu_mul512(float *out, const float *gate, const float *up, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, silu_mul16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
    if (i < n) {
        __mmask16 k = first_lanes(n - i);
        _mm512_mask_storeu_ps(out + i, k,
                              silu_mul16(_mm512_maskz_loadu_ps(k, gate + i), _mm512_maskz_loadu_ps(k, up + i)));
    }
}

const rs_cpu_exp_vec rs_cpu_exp_avx512 = {.exp = exp512,
                                          .max = max512,
                                          .exp_sum = exp_sum512,
                                          .exp_sum_f64 = exp_sum_f64_512,
                                          .div = div512,
                                          .silu_mul = silu_mul512};

#else /* not x86: never selected, the level found is scalar */

const rs_cpu_exp_vec rs_cpu_exp_avx2 = {0};
const rs_cpu_exp_vec rs_cpu_exp_avx512 = {0};

#endif
