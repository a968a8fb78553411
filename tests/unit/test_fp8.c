/*
 * test_fp8.c — FP8 numerics: codecs, blockwise quantizers and the block-scaled GEMM.
 *
 * Oracles written by someone else where they exist: the expected codes and scales come from
 * tests/fixtures/fp8/ (scripts/make_fp8_vectors.py, NumPy + ml_dtypes). The 10M-sample encode test
 * uses a second, independent oracle written here: nearest value by search over the decode table,
 * ties to the even code, which shares nothing with the bit-twiddling encoder. (All 2^32 inputs vs
 * CUDA's own header are covered by tools/fp8_exhaustive.c, which needs the CUDA headers.) The fast
 * GEMM must be bit-identical to the scalar reference on every ISA this CPU has, with and without
 * threads; the reference itself is checked against a double-precision dequantized matmul.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/pool.h"
#include "../../core/rs.h"
#include "../../kernels/cpu/cpu_fp8_wquant.h"
#include "../../kernels/cpu/fp8_gemm.h"
#include "../../kernels/fp8.h"
#include "test.h"
#include "test_util.h"

/* ---- helpers ---- */

/* splitmix64: a small deterministic generator for the tests */
static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1p-53; }

/* A float with a log-uniform magnitude in [2^lo, 2^hi) and a random sign. */
static float rng_logf(uint64_t *s, double lo, double hi) {
    float v = (float)exp2(lo + (hi - lo) * rng_uniform(s));
    return (rng_next(s) & 1) ? -v : v;
}

typedef struct blob {
    unsigned char *data;
    size_t size, pos;
} blob;

/* Loads tests/fixtures/fp8/<name> and checks its 8-byte magic and version 1. */
static blob load_fixture(const char *name, const char *magic) {
    char path[512];
    snprintf(path, sizeof path, "%s/fp8/%s", rs_test_fixtures_dir(), name);
    FILE *f = fopen(path, "rb");
    if (!f) RS_TEST_FAIL("cannot open %s (run from the repo root; regenerate with "
                         "scripts/make_fp8_vectors.py)", path);
    blob b = {0};
    ASSERT_EQ(fseek(f, 0, SEEK_END), 0);
    long size = ftell(f);
    ASSERT_TRUE(size > 12);
    rewind(f);
    b.size = (size_t)size;
    b.data = malloc(b.size);
    ASSERT_TRUE(b.data != NULL);
    ASSERT_EQ(fread(b.data, 1, b.size, f), b.size);
    fclose(f);
    if (memcmp(b.data, magic, 8) != 0) RS_TEST_FAIL("%s: bad magic", path);
    b.pos = 8;
    return b;
}

static const void *blob_take(blob *b, size_t bytes) {
    if (b->pos + bytes > b->size) RS_TEST_FAIL("fixture truncated (need %zu more bytes)", bytes);
    const void *p = b->data + b->pos;
    b->pos += bytes;
    return p;
}

static uint32_t blob_u32(blob *b) {
    uint32_t v;
    memcpy(&v, blob_take(b, 4), 4);
    return v;
}

/* Copies n elements of `size` bytes out of the blob (the blob has no alignment guarantees). */
static void *blob_array(blob *b, size_t n, size_t size) {
    void *dst = malloc(n * size + 1);
    ASSERT_TRUE(dst != NULL);
    memcpy(dst, blob_take(b, n * size), n * size);
    return dst;
}

static int e4m3_is_nan_code(uint8_t c) { return (c & 0x7f) == 0x7f; }
static int e5m2_is_nan_code(uint8_t c) { return (c & 0x7c) == 0x7c && (c & 3) != 0; }

/* ---- decode ---- */

RS_TEST(fp8_e4m3_decode_all_codes) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = rs_fp8_e4m3_to_f32((uint8_t)c);
        if (e == 15 && m == 7) {
            ASSERT_TRUE(isnan(v));
            ASSERT_TRUE(!signbit(v)); /* canonical +NaN, as CUDA */
            continue;
        }
        float want = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
        if (c & 0x80) want = -want;
        ASSERT_EQ(rs_test_f32_bits(v), rs_test_f32_bits(want)); /* exact, including -0 for 0x80 */
    }
    ASSERT_EQ(rs_test_f32_bits(rs_fp8_e4m3_to_f32(0x7e)), rs_test_f32_bits(448.0f));
    ASSERT_EQ(rs_test_f32_bits(rs_fp8_e4m3_to_f32(0x01)), rs_test_f32_bits(0x1p-9f));
    ASSERT_EQ(rs_test_f32_bits(rs_fp8_e4m3_to_f32(0x80)), rs_test_f32_bits(-0.0f));
}

RS_TEST(fp8_e5m2_decode_all_codes) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 2) & 31, m = c & 3;
        float v = rs_fp8_e5m2_to_f32((uint8_t)c);
        if (e == 31 && m != 0) {
            ASSERT_TRUE(isnan(v));
            ASSERT_TRUE(!signbit(v));
            continue;
        }
        float want = e == 31 ? INFINITY : e ? ldexpf(1.0f + m / 4.0f, e - 15) : ldexpf((float)m, -16);
        if (c & 0x80) want = -want;
        ASSERT_EQ(rs_test_f32_bits(v), rs_test_f32_bits(want));
    }
    ASSERT_EQ(rs_test_f32_bits(rs_fp8_e5m2_to_f32(0x7b)), rs_test_f32_bits(57344.0f));
    ASSERT_EQ(rs_test_f32_bits(rs_fp8_e5m2_to_f32(0xfc)), rs_test_f32_bits(-INFINITY));
}

RS_TEST(fp8_array_conversions) {
    float src[512], back[512];
    uint8_t q4[512], q5[512];
    for (int c = 0; c < 256; c++) {
        src[c] = rs_fp8_e4m3_to_f32((uint8_t)c);
        src[256 + c] = rs_fp8_e5m2_to_f32((uint8_t)c) * 0.75f;
    }
    rs_fp8_e4m3_from_f32_n(q4, src, 512);
    rs_fp8_e5m2_from_f32_n(q5, src, 512);
    for (int i = 0; i < 512; i++) {
        ASSERT_EQ(q4[i], rs_fp8_e4m3_from_f32(src[i]));
        ASSERT_EQ(q5[i], rs_fp8_e5m2_from_f32(src[i]));
    }
    rs_fp8_e4m3_to_f32_n(back, q4, 512);
    for (int i = 0; i < 512; i++) ASSERT_EQ(rs_test_f32_bits(back[i]), rs_test_f32_bits(rs_fp8_e4m3_to_f32(q4[i])));
    rs_fp8_e5m2_to_f32_n(back, q5, 512);
    for (int i = 0; i < 512; i++) ASSERT_EQ(rs_test_f32_bits(back[i]), rs_test_f32_bits(rs_fp8_e5m2_to_f32(q5[i])));
    /* every non-NaN code is its own encoding */
    for (int c = 0; c < 256; c++)
        if (!e4m3_is_nan_code((uint8_t)c)) ASSERT_EQ(q4[c], c);
}

/* ---- encode ---- */

RS_TEST(fp8_encode_specials) {
    /* E4M3: saturation, the 464 tie, NaN, signed zero, the subnormal edges */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(448.0f), 0x7e);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(464.0f), 0x7e);  /* tie between 448 and (NaN) 480: even, 448 */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(nextafterf(464.0f, 1e9f)), 0x7e); /* saturates */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(1e30f), 0x7e);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(-1e30f), 0xfe);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(INFINITY), 0x7e);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(-INFINITY), 0xfe);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(NAN), 0x7f);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(-NAN), 0x7f);    /* CUDA drops the NaN sign */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(rs_test_f32_from_bits(0xff800001u)), 0x7f);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(-0.0f), 0x80);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(-1e-30f), 0x80);  /* underflow keeps the sign */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(0x1p-10f), 0x00); /* half the smallest subnormal: tie to 0 */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(nextafterf(0x1p-10f, 1.0f)), 0x01);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(1.5f * 0x1p-9f), 0x02); /* tie 1|2 -> even */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(2.5f * 0x1p-9f), 0x02); /* tie 2|3 -> even */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(7.5f * 0x1p-9f), 0x08); /* tie into the first normal */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(1.0f), 0x38);
    ASSERT_EQ(rs_fp8_e4m3_from_f32(1.0625f), 0x38);        /* tie 1|1.125 -> even */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(1.1875f), 0x3a);        /* tie 1.125|1.25 -> even */
    ASSERT_EQ(rs_fp8_e4m3_from_f32(15.5f), 0x58);          /* tie 15|16 -> 16: carry into the exponent */
    /* E5M2: inf and everything rounding to it saturate to 57344 */
    ASSERT_EQ(rs_fp8_e5m2_from_f32(57344.0f), 0x7b);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(nextafterf(61440.0f, 0.0f)), 0x7b);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(61440.0f), 0x7b);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(INFINITY), 0x7b);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(-INFINITY), 0xfb);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(NAN), 0x7f);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(-NAN), 0x7f);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(-0.0f), 0x80);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(0x1p-17f), 0x00);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(nextafterf(0x1p-17f, 1.0f)), 0x01);
    ASSERT_EQ(rs_fp8_e5m2_from_f32(1.0f), 0x3c);
}

RS_TEST(fp8_encode_matches_ml_dtypes_vectors) {
    blob b = load_fixture("codec.bin", "RSFP8VEC");
    ASSERT_EQ(blob_u32(&b), 1);
    uint32_t n = blob_u32(&b);
    ASSERT_TRUE(n > 100000);
    float *x = blob_array(&b, n, 4);
    uint8_t *e4 = blob_array(&b, n, 1), *e5 = blob_array(&b, n, 1);
    ASSERT_EQ(b.pos, b.size);
    int bad = 0, nan_inputs = 0, sat4 = 0, sat5 = 0, sub4 = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t o4 = rs_fp8_e4m3_from_f32(x[i]), o5 = rs_fp8_e5m2_from_f32(x[i]);
        int ok;
        if (isnan(x[i])) {
            /* ml_dtypes: sign|0x7F (e4m3fn), sign|0x7E (e5m2); CUDA and we: 0x7F for both */
            nan_inputs++;
            ok = e4m3_is_nan_code(e4[i]) && e5m2_is_nan_code(e5[i]) && o4 == 0x7f && o5 == 0x7f;
        } else {
            ok = o4 == e4[i] && o5 == e5[i];
        }
        sat4 += (e4[i] & 0x7f) == 0x7e;
        sat5 += (e5[i] & 0x7f) == 0x7b;
        sub4 += (e4[i] & 0x78) == 0 && (e4[i] & 7) != 0;
        if (!ok && bad++ < 10)
            fprintf(stderr, "  x=%a (0x%08x): e4m3 ours 0x%02x ml_dtypes 0x%02x, "
                    "e5m2 ours 0x%02x ml_dtypes 0x%02x\n", x[i], rs_test_f32_bits(x[i]), o4, e4[i], o5, e5[i]);
    }
    ASSERT_EQ(bad, 0);
    /* the file really covers the edges */
    ASSERT_TRUE(nan_inputs >= 16);
    ASSERT_TRUE(sat4 > 1000 && sat5 > 1000 && sub4 > 1000);
    free(x);
    free(e4);
    free(e5);
    free(b.data);
}

/* The independent oracle: the nearest format value to min(|x|, max) by binary search over the
 * decode table (codes 0..maxcode are ascending), ties to the even code; the sign goes on as is. */
static uint8_t oracle_encode(float x, const float *table, int maxcode) {
    if (isnan(x)) return 0x7f;
    double a = fabs((double)x);
    if (a > table[maxcode]) a = table[maxcode];
    int lo = 0, hi = maxcode; /* table[lo] <= a <= table[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if ((double)table[mid] <= a) lo = mid;
        else hi = mid;
    }
    double dlo = a - table[lo], dhi = table[hi] - a;
    int code = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return (uint8_t)((signbit(x) ? 0x80 : 0) | code);
}

RS_TEST(fp8_encode_random_10m_vs_search_oracle) {
    uint64_t s = 12345;
    int bad = 0;
    for (int i = 0; i < 10000000; i++) {
        float x;
        switch (i & 3) {
        case 0: x = rs_test_f32_from_bits((uint32_t)rng_next(&s)); break; /* any bit pattern */
        case 1: x = rng_logf(&s, -20.0, 17.0); break;             /* both formats' ranges */
        case 2: x = rng_logf(&s, -12.0, -5.0); break;             /* e4m3 subnormals */
        default: x = rng_logf(&s, -19.0, -13.0); break;           /* e5m2 subnormals */
        }
        uint8_t o4 = rs_fp8_e4m3_from_f32(x), w4 = oracle_encode(x, rs_fp8_e4m3_f32, 0x7e);
        uint8_t o5 = rs_fp8_e5m2_from_f32(x), w5 = oracle_encode(x, rs_fp8_e5m2_f32, 0x7b);
        if ((o4 != w4 || o5 != w5) && bad++ < 10)
            fprintf(stderr, "  x=%a: e4m3 0x%02x vs 0x%02x, e5m2 0x%02x vs 0x%02x\n", x, o4, w4, o5, w5);
    }
    ASSERT_EQ(bad, 0);
}

/* ---- quantizers ---- */

RS_TEST(fp8_quantize_weight_matches_fixture) {
    blob b = load_fixture("weight.bin", "RSFP8WGT");
    ASSERT_EQ(blob_u32(&b), 1);
    int64_t out = blob_u32(&b), in = blob_u32(&b);
    int64_t nbo = rs_fp8_blocks(out), nbi = rs_fp8_blocks(in);
    ASSERT_TRUE(out % 128 != 0 && in % 128 != 0); /* ragged both ways */
    uint16_t *wb = blob_array(&b, (size_t)(out * in), 2);
    uint8_t *q_want = blob_array(&b, (size_t)(out * in), 1);
    float *s_want = blob_array(&b, (size_t)(nbo * nbi), 4);
    ASSERT_EQ(b.pos, b.size);

    uint8_t *q = malloc((size_t)(out * in));
    float *s = malloc((size_t)(nbo * nbi) * sizeof *s);
    rs_tensor w = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {out, in}, .data = wb};
    ASSERT_EQ(rs_fp8_quantize_weight(&w, q, s), RS_OK);
    for (int64_t i = 0; i < nbo * nbi; i++) ASSERT_EQ(rs_test_f32_bits(s[i]), rs_test_f32_bits(s_want[i]));
    int bad = 0;
    for (int64_t i = 0; i < out * in; i++)
        if (q[i] != q_want[i] && bad++ < 10)
            fprintf(stderr, "  [%lld][%lld] w=%a: 0x%02x vs 0x%02x\n", (long long)(i / in),
                    (long long)(i % in), rs_bf16_to_f32(wb[i]), q[i], q_want[i]);
    ASSERT_EQ(bad, 0);
    ASSERT_EQ(rs_test_f32_bits(s[0 * nbi + 1]), rs_test_f32_bits(1e-10f / 448.0f)); /* the all-zero block */

    /* the same values as an F32 tensor quantize identically */
    float *wf = malloc((size_t)(out * in) * sizeof *wf);
    for (int64_t i = 0; i < out * in; i++) wf[i] = rs_bf16_to_f32(wb[i]);
    rs_tensor w32 = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {out, in}, .data = wf};
    memset(q, 0xAA, (size_t)(out * in));
    ASSERT_EQ(rs_fp8_quantize_weight(&w32, q, s), RS_OK);
    ASSERT_EQ(memcmp(q, q_want, (size_t)(out * in)), 0);
    for (int64_t i = 0; i < nbo * nbi; i++) ASSERT_EQ(rs_test_f32_bits(s[i]), rs_test_f32_bits(s_want[i]));

    /* dequantization is within E4M3's half-ulp: 2^-4 relative, or 2^-10 * scale for subnormals */
    float *deq = malloc((size_t)(out * in) * sizeof *deq);
    rs_fp8_dequantize_weight(q, s, out, in, deq);
    for (int64_t i = 0; i < out * in; i++) {
        float sc = s[(i / in / 128) * nbi + (i % in) / 128];
        ASSERT_NEAR(deq[i], wf[i], fabs(wf[i]) * 0x1p-4 + sc * 0x1p-10 * 1.0001);
    }
    free(deq);
    free(wf);
    free(q);
    free(s);
    free(wb);
    free(q_want);
    free(s_want);
    free(b.data);
}

RS_TEST(fp8_quantize_weight_rejects_bad_tensors) {
    uint16_t data[4] = {0};
    uint8_t q[4];
    float s[1];
    rs_tensor w1 = {.dtype = RS_DTYPE_BF16, .ndim = 1, .shape = {4}, .data = data};
    ASSERT_EQ(rs_fp8_quantize_weight(&w1, q, s), RS_EINVAL);
    rs_tensor w2 = {.dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = {2, 2}, .data = data};
    ASSERT_EQ(rs_fp8_quantize_weight(&w2, q, s), RS_EUNSUPPORTED);
    rs_tensor w3 = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {2, 2}, .data = NULL};
    ASSERT_EQ(rs_fp8_quantize_weight(&w3, q, s), RS_EINVAL);
}

RS_TEST(fp8_quantize_act_matches_fixture) {
    blob b = load_fixture("act.bin", "RSFP8ACT");
    ASSERT_EQ(blob_u32(&b), 1);
    int64_t rows = blob_u32(&b), k = blob_u32(&b), ng = rs_fp8_blocks(k);
    ASSERT_TRUE(k % 128 != 0);
    float *x = blob_array(&b, (size_t)(rows * k), 4);
    uint8_t *q_want = blob_array(&b, (size_t)(rows * k), 1);
    float *s_want = blob_array(&b, (size_t)(rows * ng), 4);
    ASSERT_EQ(b.pos, b.size);
    uint8_t *q = malloc((size_t)(rows * k));
    float *s = malloc((size_t)(rows * ng) * sizeof *s);
    rs_fp8_quantize_act(x, rows, k, q, s);
    for (int64_t i = 0; i < rows * ng; i++) ASSERT_EQ(rs_test_f32_bits(s[i]), rs_test_f32_bits(s_want[i]));
    for (int64_t i = 0; i < rows * k; i++) {
        if (q[i] != q_want[i])
            RS_TEST_FAIL("[%lld] x=%a: 0x%02x vs 0x%02x", (long long)i, x[i], q[i], q_want[i]);
    }
    float *deq = malloc((size_t)(rows * k) * sizeof *deq);
    rs_fp8_dequantize_act(q, s, rows, k, deq);
    for (int64_t i = 0; i < rows * k; i++) {
        float sc = s[(i / k) * ng + (i % k) / 128];
        ASSERT_NEAR(deq[i], x[i], fabs(x[i]) * 0x1p-4 + sc * 0x1p-10 * 1.0001);
    }
    free(deq);
    free(q);
    free(s);
    free(x);
    free(q_want);
    free(s_want);
    free(b.data);
}

/* ---- GEMM ---- */

typedef struct gemm_case {
    int rows, n, k;
    uint8_t *xq, *wq; /* [rows][k], [n][k] e4m3 */
    float *xs, *ws;   /* [rows][kb], [ceil(n/128)][kb] */
    float *ref, *got; /* [rows][n] */
} gemm_case;

static gemm_case gemm_case_alloc(int rows, int n, int k) {
    gemm_case c = {.rows = rows, .n = n, .k = k};
    int64_t kb = rs_fp8_blocks(k);
    c.xq = malloc((size_t)rows * (size_t)k + 1);
    c.wq = malloc((size_t)n * (size_t)k + 1);
    c.xs = malloc(((size_t)rows * (size_t)kb + 1) * sizeof(float));
    c.ws = malloc(((size_t)rs_fp8_blocks(n) * (size_t)kb + 1) * sizeof(float));
    c.ref = malloc(((size_t)rows * (size_t)n + 1) * sizeof(float));
    c.got = malloc(((size_t)rows * (size_t)n + 1) * sizeof(float));
    ASSERT_TRUE(c.xq && c.wq && c.xs && c.ws && c.ref && c.got);
    return c;
}

static void gemm_case_free(gemm_case *c) {
    free(c->xq);
    free(c->wq);
    free(c->xs);
    free(c->ws);
    free(c->ref);
    free(c->got);
}

/* Random non-NaN codes (all 254 of them) and log-uniform positive or negative scales. */
static void gemm_case_random(gemm_case *c, uint64_t *s) {
    int64_t kb = rs_fp8_blocks(c->k);
    for (int64_t i = 0; i < (int64_t)c->rows * c->k; i++) {
        uint8_t v;
        do v = (uint8_t)rng_next(s); while (e4m3_is_nan_code(v));
        c->xq[i] = v;
    }
    for (int64_t i = 0; i < (int64_t)c->n * c->k; i++) {
        uint8_t v;
        do v = (uint8_t)rng_next(s); while (e4m3_is_nan_code(v));
        c->wq[i] = v;
    }
    for (int64_t i = 0; i < c->rows * kb; i++) c->xs[i] = fabsf(rng_logf(s, -20.0, 2.0));
    for (int64_t i = 0; i < rs_fp8_blocks(c->n) * kb; i++) c->ws[i] = rng_logf(s, -20.0, 2.0);
}

static int run_isa(gemm_case *c, rs_fp8_gemm_isa isa, rs_pool *pool) {
    return rs_fp8_gemm_with_isa(isa, pool, c->got, c->xq, c->xs, c->wq, c->ws, c->rows, c->n, c->k);
}

/* Runs every available ISA, inline and on 1- and 2-thread pools, and demands bit-identity with the
 * reference. Returns the number of variants run. */
static int expect_fast_equals_ref(gemm_case *c, rs_pool *p1, rs_pool *p2) {
    rs_fp8_gemm_ref(c->ref, c->xq, c->xs, c->wq, c->ws, c->rows, c->n, c->k);
    size_t bytes = (size_t)c->rows * (size_t)c->n * sizeof(float);
    static const rs_fp8_gemm_isa isas[] = {RS_FP8_GEMM_ISA_GENERIC, RS_FP8_GEMM_ISA_AVX2,
                                           RS_FP8_GEMM_ISA_AVX512_VNNI, RS_FP8_GEMM_ISA_AUTO};
    rs_pool *pools[] = {NULL, p1, p2};
    int variants = 0;
    for (size_t i = 0; i < RS_ARRAY_LEN(isas); i++) {
        if (!rs_fp8_gemm_isa_supported(isas[i])) {
            ASSERT_EQ(run_isa(c, isas[i], NULL), RS_EUNSUPPORTED);
            rs_test_note_skip(rs_fp8_gemm_isa_name(isas[i]));
            continue;
        }
        for (size_t p = 0; p < RS_ARRAY_LEN(pools); p++) {
            memset(c->got, 0xA5, bytes); /* garbage: the fast path must not read out before writing */
            ASSERT_EQ(run_isa(c, isas[i], pools[p]), RS_OK);
            for (int64_t j = 0; j < (int64_t)c->rows * c->n; j++)
                if (rs_test_f32_bits(c->got[j]) != rs_test_f32_bits(c->ref[j]))
                    RS_TEST_FAIL("rows=%d n=%d k=%d isa=%s threads=%d: out[%lld][%lld] %a (0x%08x) "
                                 "vs ref %a (0x%08x)",
                                 c->rows, c->n, c->k, rs_fp8_gemm_isa_name(isas[i]),
                                 pools[p] ? rs_pool_threads(pools[p]) : 0, (long long)(j / c->n),
                                 (long long)(j % c->n), c->got[j], rs_test_f32_bits(c->got[j]), c->ref[j],
                                 rs_test_f32_bits(c->ref[j]));
            variants++;
        }
    }
    memset(c->got, 0xA5, bytes);
    rs_fp8_gemm(p2, c->got, c->xq, c->xs, c->wq, c->ws, c->rows, c->n, c->k);
    ASSERT_EQ(memcmp(c->got, c->ref, bytes), 0);
    return variants;
}

RS_TEST(fp8_gemm_fast_bit_identical_random_shapes) {
    static const int shapes[][3] = {
        {1, 1, 1},    {1, 7, 5},     {3, 130, 128},  {5, 129, 300},  {33, 70, 257}, {17, 200, 1000},
        {64, 128, 384}, {40, 3, 129}, {2, 300, 127}, {4, 256, 256}, {35, 65, 640}, {1, 520, 900},
        {3, 5, 0},
    };
    rs_pool *p1 = rs_pool_init(1), *p2 = rs_pool_init(2);
    uint64_t s = 777;
    for (size_t i = 0; i < RS_ARRAY_LEN(shapes); i++) {
        gemm_case c = gemm_case_alloc(shapes[i][0], shapes[i][1], shapes[i][2]);
        gemm_case_random(&c, &s);
        ASSERT_TRUE(expect_fast_equals_ref(&c, p1, p2) >= 3);
        gemm_case_free(&c);
    }
    rs_pool_free(p1);
    rs_pool_free(p2);
}

RS_TEST(fp8_gemm_fast_bit_identical_adversarial) {
    rs_pool *p1 = rs_pool_init(1), *p2 = rs_pool_init(2);
    uint64_t s = 4242;
    const int rows = 9, n = 131, k = 384;
    gemm_case c = gemm_case_alloc(rows, n, k);
    int64_t kb = rs_fp8_blocks(k);
    for (int variant = 0; variant < 6; variant++) {
        for (int64_t i = 0; i < (int64_t)rows * k; i++) {
            uint64_t r = rng_next(&s);
            switch (variant) {
            case 0: c.xq[i] = (r & 1) ? 0xfe : 0x7e; break;          /* +-448 only */
            case 1: c.xq[i] = (uint8_t)((r & 0x80) | (1 + r % 7)); break; /* subnormals only */
            case 2: c.xq[i] = (r % 3 == 0) ? 0x7e : (uint8_t)((r & 0x80) | (r >> 8) % 8); break;
            case 3: c.xq[i] = (r & 1) ? 0x00 : 0x80; break;           /* signed zeros */
            case 4: c.xq[i] = 0x7e; break;
            default: c.xq[i] = (uint8_t)(r % 0x7f); break;
            }
        }
        for (int64_t i = 0; i < (int64_t)n * k; i++) {
            uint64_t r = rng_next(&s);
            switch (variant) {
            case 0: c.wq[i] = (r & 1) ? 0xfe : 0x7e; break;
            case 1: c.wq[i] = (uint8_t)((r & 0x80) | (1 + r % 7)); break;
            case 2: c.wq[i] = (r % 5 == 0) ? 0xfe : (uint8_t)((r & 0x80) | (r >> 8) % 8); break;
            case 3: c.wq[i] = (uint8_t)(r % 0x7f); break;
            case 4: c.wq[i] = 0x7e; break;                              /* block sums at 128 * 448^2 */
            default: c.wq[i] = (uint8_t)(0x80 | (r % 0x7f)); break;
            }
        }
        for (int64_t i = 0; i < rows * kb; i++)
            c.xs[i] = variant == 4 ? 1.0f : fabsf(rng_logf(&s, -30.0, 10.0));
        for (int64_t i = 0; i < rs_fp8_blocks(n) * kb; i++)
            c.ws[i] = variant == 4 ? 1.0f : rng_logf(&s, -30.0, 10.0);
        expect_fast_equals_ref(&c, p1, p2);
        if (variant == 4) /* 3 exact blocks of 128 * 448^2 = 25690112: exactly representable */
            for (int64_t i = 0; i < (int64_t)rows * n; i++)
                ASSERT_EQ(rs_test_f32_bits(c.ref[i]), rs_test_f32_bits(3.0f * 25690112.0f));
    }
    gemm_case_free(&c);

    /* Cancellation: 448*448 + 2^-9*2^-9 - 448*448 is exactly 2^-18; an fp32 running sum gives 0. */
    gemm_case d = gemm_case_alloc(1, 1, 3);
    const uint8_t x3[3] = {0x7e, 0x01, 0x7e}, w3[3] = {0x7e, 0x01, 0xfe};
    memcpy(d.xq, x3, 3);
    memcpy(d.wq, w3, 3);
    d.xs[0] = 1.0f;
    d.ws[0] = 1.0f;
    expect_fast_equals_ref(&d, p1, p2);
    ASSERT_EQ(rs_test_f32_bits(d.ref[0]), rs_test_f32_bits(0x1p-18f));
    gemm_case_free(&d);
    rs_pool_free(p1);
    rs_pool_free(p2);
}

/* Every code through the x side and through the w side (K = 1, the other operand 1.0 = 0x38):
 * checks each ISA's decoder against the table, NaN codes included (canonical NaN out). */
RS_TEST(fp8_gemm_all_256_codes) {
    rs_pool *p1 = rs_pool_init(1), *p2 = rs_pool_init(2);
    gemm_case a = gemm_case_alloc(256, 1, 1), w = gemm_case_alloc(1, 256, 1);
    for (int c = 0; c < 256; c++) {
        a.xq[c] = (uint8_t)c;
        a.xs[c] = 1.0f;
        w.wq[c] = (uint8_t)c;
    }
    a.wq[0] = 0x38;
    a.ws[0] = 1.0f;
    w.xq[0] = 0x38;
    w.xs[0] = 1.0f;
    w.ws[0] = w.ws[1] = 1.0f;
    expect_fast_equals_ref(&a, p1, p2);
    expect_fast_equals_ref(&w, p1, p2);
    for (int c = 0; c < 256; c++) {
        float v = rs_fp8_e4m3_to_f32((uint8_t)c);
        if (isnan(v)) {
            ASSERT_EQ(rs_test_f32_bits(a.ref[c]), rs_test_f32_bits(NAN));
            ASSERT_EQ(rs_test_f32_bits(w.ref[c]), rs_test_f32_bits(NAN));
        } else {
            ASSERT_EQ(rs_test_f32_bits(a.ref[c]), rs_test_f32_bits(v + 0.0f)); /* fmaf(v, 1, +0): -0 becomes +0 */
            ASSERT_EQ(rs_test_f32_bits(w.ref[c]), rs_test_f32_bits(v + 0.0f));
        }
    }
    gemm_case_free(&a);
    gemm_case_free(&w);
    rs_pool_free(p1);
    rs_pool_free(p2);
}

/* Decode-shaped products (1..3 rows, as batch-1 and batch-2 decode run them): activations whose
 * 128-blocks mostly have every code >= 2^-3 in E4M3 units (the one-digit form the few-row kernels
 * take a faster path for), some blocks with a small code in one row (the two-digit form), random
 * weights of every code including NaN ones, whole and ragged last blocks. */
RS_TEST(fp8_gemm_decode_rows_one_digit_blocks) {
    rs_pool *p1 = rs_pool_init(1), *p2 = rs_pool_init(2);
    uint64_t s = 2024;
    static const int shapes[][2] = {{200, 1024}, {130, 1000}, {64, 3072}, {70, 200}};
    for (int rows = 1; rows <= 3; rows++)
        for (size_t i = 0; i < RS_ARRAY_LEN(shapes); i++) {
            const int n = shapes[i][0], k = shapes[i][1];
            gemm_case c = gemm_case_alloc(rows, n, k);
            gemm_case_random(&c, &s);
            for (int64_t j = 0; j < (int64_t)rows * k; j++) { /* e >= 4, or zero */
                uint8_t v;
                do v = (uint8_t)rng_next(&s); while (e4m3_is_nan_code(v) || (((v >> 3) & 15) < 4 && (v & 0x7f)));
                c.xq[j] = v;
            }
            for (int64_t b = 0; b < rs_fp8_blocks(k); b += 3) /* every third block of a random row: a small code */
                c.xq[(int64_t)(rng_next(&s) % (uint64_t)rows) * k + b * 128 + (int64_t)(rng_next(&s) % 100) % (k - b * 128)] =
                    (uint8_t)(rng_next(&s) & 0x9f);
            for (int j = 0; j < 3; j++) c.wq[rng_next(&s) % ((uint64_t)n * (uint64_t)k)] = (rng_next(&s) & 1) ? 0x7f : 0xff;
            expect_fast_equals_ref(&c, p1, p2);
            gemm_case_free(&c);
        }
    rs_pool_free(p1);
    rs_pool_free(p2);
}

RS_TEST(fp8_gemm_nan_codes_bit_identical) {
    rs_pool *p1 = rs_pool_init(1), *p2 = rs_pool_init(2);
    uint64_t s = 99;
    gemm_case c = gemm_case_alloc(6, 140, 300);
    gemm_case_random(&c, &s);
    c.xq[1 * 300 + 5] = 0xff;   /* -NaN code in row 1, block 0 */
    c.wq[7 * 300 + 290] = 0x7f; /* +NaN code in weight row 7, block 2 */
    c.xs[2 * 3 + 1] = NAN;      /* a NaN scale */
    c.ws[1 * 3 + 0] = INFINITY; /* an inf scale */
    expect_fast_equals_ref(&c, p1, p2);
    ASSERT_TRUE(isnan(c.ref[1 * 140 + 0]) && isnan(c.ref[0 * 140 + 7]) && isnan(c.ref[2 * 140 + 3]));
    gemm_case_free(&c);
    rs_pool_free(p1);
    rs_pool_free(p2);
}

/* The reference against the dequantized product in double: the only roundings are the fp32 block
 * sum, the scale product and the fmaf chain, each 2^-24 relative. */
RS_TEST(fp8_gemm_ref_vs_double_dequantized) {
    uint64_t s = 2024;
    gemm_case c = gemm_case_alloc(7, 150, 700);
    gemm_case_random(&c, &s);
    int64_t kb = rs_fp8_blocks(c.k);
    rs_fp8_gemm_ref(c.ref, c.xq, c.xs, c.wq, c.ws, c.rows, c.n, c.k);
    for (int r = 0; r < c.rows; r++) {
        for (int o = 0; o < c.n; o++) {
            double want = 0.0, mag = 0.0;
            for (int j = 0; j < c.k; j++) {
                double t = (double)rs_fp8_e4m3_to_f32(c.xq[r * c.k + j]) * c.xs[r * kb + j / 128] *
                           (double)rs_fp8_e4m3_to_f32(c.wq[o * c.k + j]) * c.ws[(o / 128) * kb + j / 128];
                want += t;
                mag += fabs(t);
            }
            ASSERT_NEAR(c.ref[r * c.n + o], want, mag * 4.0 * (double)kb * 0x1p-24 + 1e-38);
        }
    }
    gemm_case_free(&c);
}

/* End to end: quantize fp32 activations and weights, multiply, compare with the fp32 matmul. */
RS_TEST(fp8_gemm_quantized_matmul_close_to_f32) {
    const int rows = 4, n = 200, k = 520;
    uint64_t s = 31337;
    float *x = malloc(sizeof(float) * rows * k), *w = malloc(sizeof(float) * n * k);
    for (int i = 0; i < rows * k; i++) x[i] = (float)(rng_uniform(&s) * 2.0 - 1.0);
    for (int i = 0; i < n * k; i++) w[i] = (float)((rng_uniform(&s) * 2.0 - 1.0) * 0.05);
    gemm_case c = gemm_case_alloc(rows, n, k);
    rs_fp8_quantize_act(x, rows, k, c.xq, c.xs);
    rs_tensor wt = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {n, k}, .data = w};
    ASSERT_EQ(rs_fp8_quantize_weight(&wt, c.wq, c.ws), RS_OK);
    rs_fp8_gemm(NULL, c.got, c.xq, c.xs, c.wq, c.ws, rows, n, k);
    double err = 0.0, norm = 0.0;
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < n; o++) {
            double want = 0.0;
            for (int j = 0; j < k; j++) want += (double)x[r * k + j] * w[o * k + j];
            err += (c.got[r * n + o] - want) * (c.got[r * n + o] - want);
            norm += want * want;
        }
    ASSERT_TRUE(sqrt(err / norm) < 0.05); /* E4M3 has 3 mantissa bits: a few percent */
    free(x);
    free(w);
    gemm_case_free(&c);
}

/* ---- fast weight quantizer (kernels/cpu/cpu_fp8_wquant.c) vs the scalar definition ---- */

/* Quantizes w in bands of 128 rows on `pool`, each band its own tensor, as model/weight_store.c does. */
typedef struct wq_bands {
    const rs_tensor *w;
    uint8_t *q;
    float *s;
    volatile bool bad;
} wq_bands;

static void wq_band_fn(void *ctx, int64_t b0, int64_t b1, int tid) {
    (void)tid;
    wq_bands *j = ctx;
    const int64_t out = j->w->shape[0], in = j->w->shape[1];
    for (int64_t b = b0; b < b1; b++) {
        const int64_t r0 = b * RS_FP8_BLOCK, rows = RS_MIN((int64_t)RS_FP8_BLOCK, out - r0);
        rs_tensor band = {.dtype = j->w->dtype, .ndim = 2, .shape = {rows, in},
                          .data = (char *)j->w->data + (size_t)(r0 * in) * rs_dtype_size(j->w->dtype)};
        const int rc = rs_fp8_quantize_weight(&band, j->q + r0 * in, j->s + b * rs_fp8_blocks(in));
        ASSERT_TRUE(rc == RS_OK || rc == RS_EFORMAT);
        if (rc == RS_EFORMAT) j->bad = true; /* any band: the matrix holds a non-finite value */
    }
}

/* Every way of quantizing w — each SIMD level this CPU has, the dispatching rs_fp8_quantize_weight,
 * and that on 2 threads in 128-row bands — gives rs_fp8_quantize_weight_ref's codes and scales,
 * and its answer: RS_EFORMAT exactly when w holds a NaN or an infinity (checked here element by
 * element with isfinite). */
static void check_weight_paths(const rs_tensor *w, const char *what) {
    const int64_t out = w->shape[0], in = w->shape[1];
    const size_t n = (size_t)(out * in), ns = (size_t)(rs_fp8_blocks(out) * rs_fp8_blocks(in));
    uint8_t *q_ref = malloc(n), *q = malloc(n); /* exact sizes: ASan sees any write past the end */
    float *s_ref = malloc(ns * sizeof(float)), *s = malloc(ns * sizeof(float));
    ASSERT_TRUE(q_ref && q && s_ref && s);
    bool finite = true;
    for (size_t i = 0; i < n; i++)
        finite &= isfinite(w->dtype == RS_DTYPE_BF16 ? rs_bf16_to_f32(((const uint16_t *)w->data)[i])
                                                     : ((const float *)w->data)[i]);
    const int want_rc = finite ? RS_OK : RS_EFORMAT;
    ASSERT_EQ(rs_fp8_quantize_weight_ref(w, q_ref, s_ref), want_rc);
    static rs_pool *pool;
    if (!pool) pool = rs_pool_init(2);
    const int top = (int)rs_cpu_fp8_wquant_simd(), table = rs_cpu_fp8_wquant_has_table();
    /* levels 0..top without the BF16 table encoder, then with it (if this CPU has it), then the
     * dispatch, then 2 threads */
    for (int path = 0; path <= top + 3; path++) {
        memset(q, 0xcc, n);
        memset(s, 0xcc, ns * sizeof(float));
        const char *name;
        if (path <= top) {
            name = rs_cpu_simd_name((rs_cpu_simd)path);
            ASSERT_EQ(rs_cpu_fp8_quantize_weight_ex((rs_cpu_simd)path, false, w, q, s), want_rc);
        } else if (path == top + 1) {
            if (!table) continue;
            name = "avx512 + table";
            ASSERT_EQ(rs_cpu_fp8_quantize_weight_ex(RS_CPU_SIMD_AVX512, true, w, q, s), want_rc);
        } else if (path == top + 2) {
            name = "rs_fp8_quantize_weight";
            ASSERT_EQ(rs_fp8_quantize_weight(w, q, s), want_rc);
        } else {
            name = "2 threads";
            wq_bands j = {w, q, s, false};
            rs_pool_run(pool, rs_fp8_blocks(out), 1, wq_band_fn, &j);
            ASSERT_EQ(j.bad ? RS_EFORMAT : RS_OK, want_rc);
        }
        for (size_t i = 0; i < ns; i++)
            if (rs_test_f32_bits(s[i]) != rs_test_f32_bits(s_ref[i]))
                RS_TEST_FAIL("%s %s [%lld][%lld] %s: scale[%zu] %a vs %a", what, w->dtype == RS_DTYPE_BF16 ? "bf16" : "f32",
                             (long long)out, (long long)in, name, i, s[i], s_ref[i]);
        for (size_t i = 0; i < n; i++)
            if (q[i] != q_ref[i]) {
                float v = w->dtype == RS_DTYPE_BF16 ? rs_bf16_to_f32(((const uint16_t *)w->data)[i])
                                                    : ((const float *)w->data)[i];
                RS_TEST_FAIL("%s %s [%lld][%lld] %s: q[%lld][%lld] (w=%a) 0x%02x vs 0x%02x", what,
                             w->dtype == RS_DTYPE_BF16 ? "bf16" : "f32", (long long)out, (long long)in, name,
                             (long long)(i / (size_t)in), (long long)(i % (size_t)in), v, q[i], q_ref[i]);
            }
    }
    free(q_ref), free(q), free(s_ref), free(s);
}

/* Runs check_weight_paths on wf [out][in] as F32, and rounded to BF16. */
static void check_weight_both_dtypes(const float *wf, int64_t out, int64_t in, const char *what) {
    const size_t n = (size_t)(out * in);
    float *f = malloc(n * sizeof *f + 1);
    uint16_t *b = malloc(n * sizeof *b + 1);
    memcpy(f, wf, n * sizeof *f);
    for (size_t i = 0; i < n; i++) b[i] = rs_f32_to_bf16(wf[i]);
    rs_tensor t32 = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {out, in}, .data = f};
    rs_tensor t16 = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {out, in}, .data = b};
    check_weight_paths(&t32, what);
    check_weight_paths(&t16, what);
    free(f), free(b);
}

RS_TEST(fp8_quantize_weight_fast_bit_identical_random_shapes) {
    static const int64_t shapes[][2] = {{1, 1},     {1, 7},     {1, 15},    {2, 17},    {3, 33},
                                        {5, 127},   {128, 128}, {127, 129}, {129, 127}, {130, 255},
                                        {257, 300}, {300, 1000}, {64, 2049}, {256, 512},
                                        /* past the row-major kernel's 128 block columns: the
                                         * block-by-block one */
                                        {3, 16384 + 130}};
    uint64_t seed = 77;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        const int64_t out = shapes[si][0], in = shapes[si][1];
        float *w = malloc((size_t)(out * in) * sizeof *w);
        /* each block gets its own magnitude range, so the scales spread over many binades */
        for (int64_t o = 0; o < out; o++)
            for (int64_t i = 0; i < in; i++) {
                const double lo = -40.0 + (double)((o / 128 * 7 + i / 128 * 13) % 50);
                w[o * in + i] = rng_logf(&seed, lo, lo + 12.0 + (double)(rng_next(&seed) % 8));
            }
        check_weight_both_dtypes(w, out, in, "random");
        free(w);
    }
}

/* v moved by d units in the last place of its dtype (fp32, or bf16 when bf16), away from zero for
 * d > 0. Stays a value of that dtype. */
static float nudge(float v, int d, int bf16) {
    uint32_t u = rs_test_f32_bits(v);
    if (bf16) return rs_bf16_to_f32((uint16_t)((u >> 16) + (uint32_t)d));
    return rs_test_f32_from_bits(u + (uint32_t)d);
}

/* Fills block (bo, bi) of w [out][in] in one of 11 adversarial styles. */
static void fill_adversarial(float *w, int64_t out, int64_t in, int64_t bo, int64_t bi, int style, int bf16,
                             uint64_t *seed) {
    const int64_t o0 = bo * 128, o1 = RS_MIN(o0 + 128, out), i0 = bi * 128, i1 = RS_MIN(i0 + 128, in);
    /* styles 0-2: amax = 448 * 2^k, so scale_inv = 2^k and w / scale_inv is exact: every E4M3
     * midpoint (the ties of round-to-nearest-even, 464 = the saturation tie) and its neighbours */
    static const int ks[3] = {0, -20, 17};
    int64_t cnt = 0;
    for (int64_t o = o0; o < o1; o++)
        for (int64_t i = i0; i < i1; i++, cnt++) {
            float v;
            const uint64_t r = rng_next(seed);
            switch (style) {
            case 0: case 1: case 2: {
                const float p = ldexpf(1.0f, ks[style]);
                if (cnt == 0) { v = 448.0f * p; break; }
                const int c = (int)(cnt / 6 % 127), d = (int)(cnt % 6 % 3) - 1; /* c: 0..126 */
                float mid = c == 126 ? 464.0f : (rs_fp8_e4m3_to_f32((uint8_t)c) + rs_fp8_e4m3_to_f32((uint8_t)(c + 1))) * 0.5f;
                v = nudge(mid * p, d, bf16);
                if (cnt % 6 >= 3) v = -v;
                if (fabsf(v) > 448.0f * p) v = copysignf(448.0f * p, v); /* keep amax */
                break;
            }
            case 3: v = (r & 1) ? -0.0f : 0.0f; break;                             /* all-zero block */
            case 4: v = rng_logf(seed, -60.0, -36.6); break;                        /* amax < 1e-10 */
            case 5: v = rng_logf(seed, bf16 ? -133.0 : -149.0, -127.0); break;      /* subnormal amax */
            case 6:                                                                /* NaNs, ignored */
                v = r % 3 == 0 ? rs_test_f32_from_bits((r & 0x80000000u) | 0x7f800001u | ((uint32_t)(r >> 8) & 0x7fffffu))
                               : rng_logf(seed, -5.0, 5.0);
                if (bf16 && isnan(v)) v = rs_test_f32_from_bits((rs_test_f32_bits(v) | 0x10000u) & 0xffff0000u);
                break;
            case 7: v = (r & 1) ? -NAN : NAN; break;                               /* all NaN */
            case 8: v = r % 50 == 0 ? ((r & 2) ? -INFINITY : INFINITY) : rng_logf(seed, -5.0, 5.0); break;
            case 9: v = rng_logf(seed, -140.0, 120.0); break;                       /* huge range */
            default: v = r % 7 == 0 ? ((r & 2) ? -3.4028235e38f : 3.4028235e38f) : rng_logf(seed, -149.0, -100.0);
            }
            w[o * in + i] = v;
        }
}

RS_TEST(fp8_quantize_weight_fast_bit_identical_adversarial) {
    static const int64_t shapes[][2] = {{131, 300}, {300, 131}, {11 * 128, 128}, {128, 11 * 128 + 5}};
    uint64_t seed = 4242;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        const int64_t out = shapes[si][0], in = shapes[si][1];
        const int64_t nbo = rs_fp8_blocks(out), nbi = rs_fp8_blocks(in);
        float *w = malloc((size_t)(out * in) * sizeof *w);
        for (int bf16 = 0; bf16 <= 1; bf16++) {
            for (int64_t bo = 0; bo < nbo; bo++)
                for (int64_t bi = 0; bi < nbi; bi++)
                    fill_adversarial(w, out, in, bo, bi, (int)((bo * nbi + bi + (int64_t)si) % 11), bf16, &seed);
            const size_t n = (size_t)(out * in);
            float *f = malloc(n * sizeof *f);
            uint16_t *b = malloc(n * sizeof *b);
            for (size_t i = 0; i < n; i++) b[i] = rs_f32_to_bf16(f[i] = w[i]);
            rs_tensor t = bf16 ? (rs_tensor){.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {out, in}, .data = b}
                               : (rs_tensor){.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {out, in}, .data = f};
            check_weight_paths(&t, "adversarial");
            free(f), free(b);
        }
        free(w);
    }
    /* the midpoint blocks did hit ties: a block of exact midpoints at scale 1 encodes to even codes */
    float mids[126];
    for (int c = 0; c < 126; c++) mids[c] = (rs_fp8_e4m3_to_f32((uint8_t)c) + rs_fp8_e4m3_to_f32((uint8_t)(c + 1))) * 0.5f;
    float row[128] = {448.0f};
    memcpy(row + 1, mids, sizeof mids);
    uint8_t q[128];
    float s;
    rs_tensor t = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {1, 127}, .data = row};
    ASSERT_EQ(rs_cpu_fp8_quantize_weight(rs_cpu_fp8_wquant_simd(), &t, q, &s), RS_OK);
    ASSERT_EQ(rs_test_f32_bits(s), rs_test_f32_bits(1.0f));
    for (int c = 0; c < 126; c++) ASSERT_EQ(q[1 + c], (uint8_t)((c + 1) & ~1)); /* ties to the even code */
}

/* The BF16 table encoder against the reference on every BF16 value a block can hold: for each of
 * 60 block maxima (binades from the amax floor to the largest finite BF16, 448 * 2^k where the
 * quotients are exact and hit every tie, and random ones), a [128][512] matrix whose four blocks
 * hold all 2 x 32768 signed magnitudes folded below that maximum (bits m -> m mod (amax + 1)),
 * zeros and BF16 subnormals included. */
RS_TEST(fp8_quantize_weight_table_every_bf16_value) {
    if (!rs_cpu_fp8_wquant_has_table()) RS_TEST_SKIP("no AVX-512 VBMI");
    enum { OUT = 128, IN = 512, N = OUT * IN };
    uint16_t *w = malloc(N * sizeof *w);
    uint8_t *q = malloc(N), *q_ref = malloc(N);
    float s[4], s_ref[4];
    uint64_t seed = 99;
    for (int k = 0; k < 60; k++) {
        uint16_t amax;
        if (k < 20) amax = rs_f32_to_bf16(ldexpf(1.0f, -40 + 9 * k));                /* binades */
        else if (k < 40) amax = rs_f32_to_bf16(448.0f * ldexpf(1.0f, -70 + 7 * (k - 20))); /* exact */
        else amax = (uint16_t)(rng_next(&seed) % 0x7f80u);                            /* random */
        if (k == 19) amax = 0x7f7f;                                                   /* largest finite */
        for (int i = 0; i < N; i++) {
            const uint16_t m = (uint16_t)(i & 0x7fff);
            w[i] = (uint16_t)((i & 0x8000) | (m % (amax + 1u)));
        }
        w[0] = amax;
        rs_tensor t = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {OUT, IN}, .data = w};
        ASSERT_EQ(rs_fp8_quantize_weight_ref(&t, q_ref, s_ref), RS_OK);
        ASSERT_EQ(rs_cpu_fp8_quantize_weight_ex(RS_CPU_SIMD_AVX512, true, &t, q, s), RS_OK);
        for (int b = 0; b < 4; b++)
            if (rs_test_f32_bits(s[b]) != rs_test_f32_bits(s_ref[b]))
                RS_TEST_FAIL("amax 0x%04x block %d: scale %a vs %a", amax, b, s[b], s_ref[b]);
        for (int i = 0; i < N; i++)
            if (q[i] != q_ref[i])
                RS_TEST_FAIL("amax 0x%04x: w[%d] = 0x%04x (%a): 0x%02x vs 0x%02x", amax, i, w[i],
                             rs_bf16_to_f32(w[i]), q[i], q_ref[i]);
    }
    free(w), free(q), free(q_ref);
}

/* A signaling NaN is ignored like a quiet one, wherever it sits in the block: the scale is that of
 * the other elements (glibc's fmaxf returns NaN for a signaling NaN, which once made the amax
 * forget the elements before it). Weights and activations, scalar and vector; the weight
 * quantizer also says the weight holds a non-finite value (RS_EFORMAT). */
RS_TEST(fp8_quantize_ignores_signaling_nan) {
    const float snan = rs_test_f32_from_bits(0xff800001u), qnan = rs_test_f32_from_bits(0x7fc00000u);
    ASSERT_TRUE(isnan(snan));
    for (int pos = 0; pos < 3; pos++) {
        float x[3] = {5.0f, -1.0f, 0.25f};
        x[pos] = snan; /* replaces one finite value: the max stays 5 unless it replaced the 5 */
        const float amax = pos == 0 ? 1.0f : 5.0f;
        uint8_t q[3], q2[3];
        float s, s2;
        rs_tensor t = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {1, 3}, .data = x};
        ASSERT_EQ(rs_fp8_quantize_weight_ref(&t, q, &s), RS_EFORMAT);
        ASSERT_EQ(rs_test_f32_bits(s), rs_test_f32_bits(amax / 448.0f));
        ASSERT_EQ(q[pos], RS_FP8_NAN_CODE);
        ASSERT_EQ(rs_fp8_quantize_weight(&t, q2, &s2), RS_EFORMAT);
        ASSERT_EQ(rs_test_f32_bits(s2), rs_test_f32_bits(s));
        ASSERT_EQ(memcmp(q, q2, 3), 0);
        rs_fp8_quantize_act(x, 1, 3, q2, &s2);
        ASSERT_EQ(rs_test_f32_bits(s2), rs_test_f32_bits(s));
        ASSERT_EQ(memcmp(q, q2, 3), 0);
        for (int simd = 0; simd <= (int)rs_cpu_fp8_wquant_simd(); simd++) {
            rs_cpu_fp8_quantize_act((rs_cpu_simd)simd, x, 1, 3, q2, &s2);
            ASSERT_EQ(rs_test_f32_bits(s2), rs_test_f32_bits(s));
            ASSERT_EQ(memcmp(q, q2, 3), 0);
        }
        x[pos] = qnan;
        ASSERT_EQ(rs_fp8_quantize_weight_ref(&t, q2, &s2), RS_EFORMAT);
        ASSERT_EQ(rs_test_f32_bits(s2), rs_test_f32_bits(s));
    }
}
