/*
 * test_exp.c — rs_expf against libm's exp in double, and every SIMD table against plain C.
 *
 * Accuracy: a dense sweep of [-104, 89] (4M evenly spaced points), every float near 0 and near
 * the overflow and underflow edges, random bit patterns over the range, and the special values,
 * each compared with exp((double)x) in ulps of the fp32 result (ulps of the subnormal grid below
 * 2^-126; a result past FLT_MAX must be inf, one under half the smallest subnormal must be 0).
 * The bound is 2 ulp; the sweep prints the worst case it saw.
 *
 * Identity: the AVX2 and AVX-512 tables (where this CPU has them) must give the bits of the C
 * table for every kernel — exp, max, exp_sum, exp_sum_f64, div, silu_mul — on lengths around the
 * vector widths and on inputs that include NaN, infinities, zeros and subnormal results.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_internal.h"
#include "test.h"

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t bits_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* |got - exp(x)| in ulps of the fp32 result; inf when got is on the wrong side of overflow or
 * underflow to 0. */
static double ulp_error(float got, float x) {
    double want = exp((double)x);
    if (isinf((float)want)) return isinf(got) && got > 0 ? 0.0 : INFINITY;
    if (isinf(got) || isnan(got)) return INFINITY;
    int e;
    frexp(want, &e); /* want = m 2^e, m in [0.5, 1): the fp32 ulp is 2^(e - 24), at least 2^-149 */
    return fabs((double)got - want) / ldexp(1.0, e - 24 < -149 ? -149 : e - 24);
}

/* The tables this CPU runs, plain C first. */
static int exp_tables(const rs_cpu_exp_vec *t[3]) {
    rs_backend *b = rs_backend_cpu_init(1);
    int top = rs_cpu_set_simd(b, RS_CPU_SIMD_AVX512);
    rs_backend_free(b);
    for (int s = 0; s <= top; s++) t[s] = rs_cpu_exp_for((rs_cpu_simd)s);
    return top + 1;
}

/* Worst ulp error of rs_expf over x[0..n) (the tables agree with it bit for bit: tested below). */
static double worst_ulp(const float *x, size_t n, float *worst_x) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double u = ulp_error(rs_expf(x[i]), x[i]);
        if (u > worst) worst = u, *worst_x = x[i];
    }
    return worst;
}

RS_TEST(exp_within_2_ulp_of_libm) {
    enum { N = 1 << 22 };
    float *x = malloc(N * sizeof(float));
    double worst = 0.0;
    float wx = 0.0f;
    /* evenly spaced over [-104, 89] */
    for (int i = 0; i < N; i++) x[i] = (float)(-104.0 + 193.0 * i / (N - 1));
    worst = fmax(worst, worst_ulp(x, N, &wx));
    /* every float within 2^16 patterns of 0, of ln(FLT_MAX) and of ln(2^-149) (where results get
     * subnormal, then 0) */
    const float centers[] = {0.0f, -0.0f, 88.72284f, -103.27893f, -87.33655f};
    for (size_t c = 0; c < sizeof centers / sizeof centers[0]; c++) {
        uint32_t b = bits_of_f32(centers[c]);
        size_t n = 0;
        for (uint32_t d = 0; d < (1u << 17); d++) {
            uint32_t u = b + d - (1u << 16);
            if ((u ^ b) >> 31) continue; /* stay on the center's side of 0 */
            x[n++] = f32_of_bits(u);
        }
        worst = fmax(worst, worst_ulp(x, n, &wx));
    }
    /* random bit patterns with |x| < 104 */
    uint64_t rng = 11;
    for (int i = 0; i < N; i++) {
        float v;
        do v = f32_of_bits((uint32_t)rng_next(&rng));
        while (!(fabsf(v) < 104.0f));
        x[i] = v;
    }
    worst = fmax(worst, worst_ulp(x, N, &wx));
    fprintf(stderr, "  rs_expf: worst %.3f ulp at x = %a (%.9g)\n", worst, wx, wx);
    if (!(worst <= 2.0)) RS_TEST_FAIL("rs_expf is %.3f ulp off at x = %a", worst, wx);
    free(x);
}

RS_TEST(exp_special_values) {
    ASSERT_TRUE(bits_of_f32(rs_expf(0.0f)) == bits_of_f32(1.0f));
    ASSERT_TRUE(bits_of_f32(rs_expf(-0.0f)) == bits_of_f32(1.0f));
    ASSERT_TRUE(rs_expf(f32_of_bits(1)) == 1.0f);           /* smallest subnormal */
    ASSERT_TRUE(rs_expf(-f32_of_bits(1)) == 1.0f);
    ASSERT_TRUE(isnan(rs_expf(NAN)) && isnan(rs_expf(-NAN)));
    ASSERT_TRUE(isinf(rs_expf(INFINITY)) && rs_expf(INFINITY) > 0);
    ASSERT_TRUE(bits_of_f32(rs_expf(-INFINITY)) == 0);
    ASSERT_TRUE(isinf(rs_expf(88.8f)) && isinf(rs_expf(89.0f)));
    ASSERT_TRUE(isinf(rs_expf(1000.0f)) && isinf(rs_expf(FLT_MAX)));
    ASSERT_TRUE(rs_expf(88.72f) < FLT_MAX && rs_expf(88.72f) > 3.3e38f);
    ASSERT_TRUE(bits_of_f32(rs_expf(-104.0f)) == 0 && bits_of_f32(rs_expf(-200.0f)) == 0 &&
                bits_of_f32(rs_expf(-FLT_MAX)) == 0);
    ASSERT_TRUE(rs_expf(-103.0f) > 0.0f && rs_expf(-103.0f) < FLT_MIN); /* subnormal, not flushed */
    ASSERT_TRUE(rs_expf(1.0f) == (float)exp(1.0));
}

/* Inputs for the identity checks: a spread with the special values at scattered positions. */
static float *identity_inputs(size_t n, uint64_t *rng) {
    static const float special[] = {0.0f, -0.0f, NAN, INFINITY, -INFINITY, -103.5f, -90.0f, 88.7f, 89.5f,
                                    -1e-40f, 1e-30f, -104.5f, FLT_MAX, -FLT_MAX};
    float *x = malloc((n + 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rng_next(rng);
        x[i] = r % 7 == 0 ? special[(r >> 8) % (sizeof special / sizeof special[0])]
                          : (float)((double)(r >> 11) * 0x1p-53 * 220.0 - 120.0);
    }
    return x;
}

static void assert_same_bits(const float *a, const float *b, size_t n, const char *what, int level) {
    for (size_t i = 0; i < n; i++)
        if (bits_of_f32(a[i]) != bits_of_f32(b[i]))
            RS_TEST_FAIL("%s at level %d, n %zu, [%zu]: %a vs plain C %a", what, level, n, i, a[i], b[i]);
}

RS_TEST(exp_simd_tables_match_plain_c) {
    const rs_cpu_exp_vec *t[3];
    int levels = exp_tables(t);
    if (levels == 1) fprintf(stderr, "  only plain C on this CPU: nothing to compare\n");
    static const size_t lengths[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1000, 4099};
    uint64_t rng = 5;
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        size_t n = lengths[li];
        float *x = identity_inputs(n, &rng), *up = identity_inputs(n, &rng);
        float *finite = malloc((n + 1) * sizeof(float)); /* x * 1.3 - 25 spans [-103, 14]: subnormal e too */
        for (size_t i = 0; i < n; i++) finite[i] = (float)((double)(rng_next(&rng) >> 11) * 0x1p-53 * 90.0 - 60.0);
        float *want = malloc((n + 1) * sizeof(float)), *got = malloc((n + 1) * sizeof(float));
        t[0]->exp(want, x, n);
        for (size_t i = 0; i < n; i++) ASSERT_TRUE(bits_of_f32(want[i]) == bits_of_f32(rs_expf(x[i])));
        for (int s = 1; s < levels; s++) {
            t[s]->exp(got, x, n);
            assert_same_bits(got, want, n, "exp", s);

            ASSERT_TRUE(bits_of_f32(t[s]->max(finite, n, 0.7f)) == bits_of_f32(t[0]->max(finite, n, 0.7f)));
            ASSERT_TRUE(bits_of_f32(t[s]->max(x, n, 1.0f)) == bits_of_f32(t[0]->max(x, n, 1.0f)));

            for (int f64 = 0; f64 < 2; f64++) {
                float *e0 = malloc((n + 1) * sizeof(float));
                double s0, s1;
                if (f64) {
                    s0 = t[0]->exp_sum_f64(e0, finite, n, 1.3f, 25.0f);
                    s1 = t[s]->exp_sum_f64(got, finite, n, 1.3f, 25.0f);
                    ASSERT_TRUE(t[s]->exp_sum_f64(NULL, finite, n, 1.3f, 25.0f) == s1);
                } else {
                    s0 = t[0]->exp_sum(e0, finite, n, 1.3f, 25.0f);
                    s1 = t[s]->exp_sum(got, finite, n, 1.3f, 25.0f);
                    ASSERT_TRUE(t[s]->exp_sum(NULL, finite, n, 1.3f, 25.0f) == (float)s1);
                }
                assert_same_bits(got, e0, n, f64 ? "exp_sum_f64 values" : "exp_sum values", s);
                if (!(s0 == s1))
                    RS_TEST_FAIL("exp_sum%s at level %d, n %zu: %a vs %a", f64 ? "_f64" : "", s, n, s1, s0);
                memcpy(e0, x, n * sizeof(float)); /* in place, special values included */
                memcpy(got, x, n * sizeof(float));
                float a0 = t[0]->exp_sum(e0, e0, n, 1.0f, -2.0f);
                float a1 = t[s]->exp_sum(got, got, n, 1.0f, -2.0f);
                assert_same_bits(got, e0, n, "exp_sum in place", s);
                ASSERT_TRUE(bits_of_f32(a0) == bits_of_f32(a1) || (isnan(a0) && isnan(a1)));
                free(e0);
            }

            memcpy(want, finite, n * sizeof(float));
            memcpy(got, finite, n * sizeof(float));
            t[0]->div(want, n, 3.7f);
            t[s]->div(got, n, 3.7f);
            assert_same_bits(got, want, n, "div", s);

            t[0]->silu_mul(want, x, up, n);
            t[s]->silu_mul(got, x, up, n);
            assert_same_bits(got, want, n, "silu_mul", s);
            t[0]->exp(want, x, n); /* leave want as exp(x) for the next level */
        }
        free(x), free(up), free(finite), free(want), free(got);
    }
    /* exp alone over many more points: 4M random bit patterns with |x| < 110 */
    enum { N = 1 << 22 };
    float *x = malloc(N * sizeof(float)), *want = malloc(N * sizeof(float)), *got = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) {
        float v;
        do v = f32_of_bits((uint32_t)rng_next(&rng));
        while (!(fabsf(v) < 110.0f));
        x[i] = v;
    }
    t[0]->exp(want, x, N);
    for (int s = 1; s < levels; s++) {
        t[s]->exp(got, x, N);
        assert_same_bits(got, want, N, "exp", s);
    }
    free(x), free(want), free(got);
}

/* The softmax pieces against long double: a 152k vocabulary, logits spread like a model's. */
RS_TEST(exp_softmax_sums_are_accurate) {
    enum { V = 152064 };
    uint64_t rng = 3;
    float *x = malloc(V * sizeof(float)), *e = malloc(V * sizeof(float));
    for (int i = 0; i < V; i++) x[i] = (float)((double)(rng_next(&rng) >> 11) * 0x1p-53 * 30.0 - 12.0);
    const rs_cpu_exp_vec *t[3];
    int levels = exp_tables(t);
    for (float inv_t = 0.5f; inv_t <= 4.0f; inv_t *= 2.0f) {
        float mx = t[0]->max(x, V, inv_t);
        long double ref = 0.0L;
        float ref_mx = -INFINITY;
        for (int i = 0; i < V; i++) ref_mx = fmaxf(ref_mx, x[i] * inv_t);
        ASSERT_TRUE(mx == ref_mx);
        for (int i = 0; i < V; i++) ref += expl((long double)(x[i] * inv_t - mx));
        for (int s = 0; s < levels; s++) {
            double sum = t[s]->exp_sum_f64(e, x, V, inv_t, mx);
            ASSERT_NEAR(log(sum), (double)logl(ref), 2e-7);
            /* the fp32 sum (attention's): a context of 4096, 256 terms a lane; bound n/16 + 4 + 2
             * roundings of 2^-24 (lane adds, tree, the exp's own error) */
            long double ref4k = 0.0L;
            for (int i = 0; i < 4096; i++) ref4k += expl((long double)(x[i] * inv_t - mx));
            float sum32 = t[s]->exp_sum(NULL, x, 4096, inv_t, mx);
            ASSERT_NEAR(sum32 / (double)ref4k, 1.0, (4096 / 16 + 6) * 0x1p-24);
            t[s]->div(e, V, (float)sum);
            double mass = 0.0;
            for (int i = 0; i < V; i++) mass += e[i];
            ASSERT_NEAR(mass, 1.0, 1e-6);
        }
    }
    free(x), free(e);
}
