/*
 * test_weight_checks.c — what a weight conversion refuses in its own pass (model/weight_store.h): a NaN
 * or an infinity anywhere (every served format, every source dtype, across bands and chunks, the
 * first one named), and bytes whose CRC-32C is not the one given; with the CRC-32C itself
 * (core/crc32c.h) and the non-finite scan (kernels/scan.h, kernels/cpu/cpu_scan.h) at every SIMD level.
 *
 * References: the CRC test vectors of RFC 3720 (B.4) and "123456789", ISA-L's baseline table
 * code for whole buffers, and isfinite() on decoded values, element by element.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/crc32c.h"
#include "../../core/pool.h"
#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_scan.h"
#include "../../kernels/fp8.h"
#include "../../model/weight_store.h"
#include "test.h"

static uint64_t rng(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}

RS_TEST(crc32c_vectors_and_combine) {
    uint8_t buf[48];
    ASSERT_EQ(rs_crc32c(0, "123456789", 9), 0xe3069283u);
    memset(buf, 0, 32);
    ASSERT_EQ(rs_crc32c(0, buf, 32), 0x8a9136aau); /* RFC 3720 B.4: 32 bytes of zeros */
    memset(buf, 0xff, 32);
    ASSERT_EQ(rs_crc32c(0, buf, 32), 0x62a8ab43u); /* 32 bytes of ones */
    for (int i = 0; i < 32; i++) buf[i] = (uint8_t)i;
    ASSERT_EQ(rs_crc32c(0, buf, 32), 0x46dd794eu); /* incrementing */
    ASSERT_EQ(rs_crc32c_base(0, buf, 32), 0x46dd794eu);
    uint64_t s = 1;
    const size_t n = (3 << 20) + 77;
    uint8_t *big = malloc(n);
    for (size_t i = 0; i < n; i++) big[i] = (uint8_t)rng(&s);
    const uint32_t whole = rs_crc32c_base(0, big, n);
    ASSERT_EQ(rs_crc32c(0, big, n), whole);
    for (int t = 0; t < 50; t++) { /* any split, combined, is the whole */
        const size_t a = rng(&s) % (n + 1);
        ASSERT_EQ(rs_crc32c_combine(rs_crc32c(0, big, a), rs_crc32c(0, big + a, n - a), n - a), whole);
        ASSERT_EQ(rs_crc32c(rs_crc32c(0, big, a), big + a, n - a), whole);
    }
    ASSERT_EQ(rs_crc32c_combine(whole, rs_crc32c(0, big, 0), 0), whole);
    free(big);
}

/* The first element isfinite() rejects, decoding each dtype by hand. */
static int64_t ref_first(rs_dtype dt, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v;
        uint16_t h;
        switch (dt) {
        case RS_DTYPE_E4M3: v = (p[i] & 0x7f) == 0x7f ? NAN : 0.0f; break;
        case RS_DTYPE_F32: memcpy(&v, p + 4 * i, 4); break;
        default:
            memcpy(&h, p + 2 * i, 2);
            v = dt == RS_DTYPE_BF16 ? rs_bf16_to_f32(h) : rs_f16_to_f32(h);
        }
        if (!isfinite(v)) return (int64_t)i;
    }
    return -1;
}

RS_TEST(cpu_scan_first_nonfinite_every_level) {
    const rs_dtype dts[] = {RS_DTYPE_E4M3, RS_DTYPE_F16, RS_DTYPE_BF16, RS_DTYPE_F32};
    const int top = (int)rs_cpu_scan_simd();
    if (top < RS_CPU_SIMD_AVX512) fprintf(stderr, "  (this CPU or RS_CPU_SIMD stops at %s)\n", rs_cpu_simd_name(top));
    uint64_t s = 9;
    for (size_t di = 0; di < RS_ARRAY_LEN(dts); di++) {
        const size_t esz = rs_dtype_size(dts[di]);
        for (int t = 0; t < 60; t++) {
            const size_t n = 1 + rng(&s) % 9000;
            uint8_t *p = malloc(n * esz + 1) + 1; /* unaligned */
            for (size_t i = 0; i < n * esz; i++) p[i] = (uint8_t)rng(&s);
            /* finite everywhere first (clear the exponent's top bit), then 0..2 offenders */
            for (size_t i = 0; i < n; i++) p[i * esz + esz - 1] &= 0xbf;
            const int k = t % 3;
            for (int j = 0; j < k; j++) {
                const size_t at = rng(&s) % n;
                uint8_t *e = p + at * esz;
                if (esz == 1) e[0] |= 0x7f;
                else if (dts[di] == RS_DTYPE_F16) e[1] |= 0x7c;
                else if (esz == 2) e[1] |= 0x7f, e[0] |= 0x80;
                else e[3] |= 0x7f, e[2] |= 0x80;
            }
            const int64_t want = ref_first(dts[di], p, n);
            ASSERT_EQ(want >= 0, k > 0);
            for (int lv = 0; lv <= top; lv++) ASSERT_EQ(rs_cpu_first_nonfinite_ex((rs_cpu_simd)lv, dts[di], p, n), want);
            ASSERT_EQ(rs_cpu_first_nonfinite(dts[di], p, n), want);
            free(p - 1);
        }
    }
}

/* ---- conversions ---- */

typedef struct conv_env {
    rs_backend *b;
    rs_pool *pool;
    rs_weight_store *ws;
} conv_env;

static conv_env conv_open(void) {
    conv_env v = {.b = rs_backend_cpu_init(1), .pool = rs_pool_init(2)};
    v.ws = rs_weight_store_new(v.b);
    rs_weight_store_set_pool(v.ws, v.pool);
    return v;
}

static void conv_close(conv_env *v) {
    rs_weight_store_free(v->ws);
    rs_pool_free(v->pool);
    rs_backend_free(v->b);
}

/* rows x cols of dtype dt with values of trained weights, bad (a float) at element `at` (-1: none). */
static void *tensor_with(rs_dtype dt, int64_t rows, int64_t cols, int64_t at, float bad, uint64_t seed) {
    const size_t n = (size_t)(rows * cols);
    uint8_t *p = malloc(n * rs_dtype_size(dt) + 1);
    for (size_t i = 0; i < n; i++) {
        const float v = i == (size_t)at ? bad : (float)((int64_t)(rng(&seed) % 2001) - 1000) * 2e-5f;
        if (dt == RS_DTYPE_F32) memcpy(p + 4 * i, &v, 4);
        else if (dt == RS_DTYPE_BF16) ((uint16_t *)p)[i] = rs_f32_to_bf16(v);
        else if (dt == RS_DTYPE_F16) ((uint16_t *)p)[i] = rs_f32_to_f16(v);
        else p[i] = rs_fp8_e4m3_from_f32(v * 100.0f); /* E4M3: a NaN float encodes to 0x7f */
    }
    return p;
}

static int convert(conv_env *v, rs_dtype served, rs_dtype src_dt, int64_t rows, int64_t cols, const void *data,
                   const uint32_t *crc, rs_error *err) {
    rs_weight_src src = {.dtype = src_dt, .ndim = rows ? 2 : 1, .shape = {rows ? rows : cols, rows ? cols : 0},
                         .data = data, .has_crc32c = crc != NULL, .crc32c = crc ? *crc : 0};
    static const float zero_scales[1 << 12] = {0};
    if (src_dt == RS_DTYPE_E4M3 && served == RS_DTYPE_E4M3) {
        src.scale_inv = zero_scales; /* scales of 0 are allowed (>= 0, finite) */
        src.scale_dtype = RS_DTYPE_F32;
    }
    rs_tensor out;
    const size_t before = rs_weight_store_count(v->ws);
    const int rc = rs_weight_convert(v->ws, "w", served, &src, &out, err);
    if (rc != RS_OK) ASSERT_EQ(rs_weight_store_count(v->ws), before); /* nothing left allocated */
    else {
        rs_weight_store_release(v->ws, out.data);
        rs_weight_store_release(v->ws, out.scale_inv);
    }
    return rc;
}

typedef struct conv_case {
    rs_dtype served, src;
    int64_t rows, cols; /* rows 0: a vector of cols */
} conv_case;

/* FP8 slots fed BF16 / F16 / F32 (one band, several, ragged; VBMI, fp32 and block-by-block
 * kernels) or E4M3 codes; BF16 and F32 slots fed the same or another float dtype; vectors.
 * Shapes over 256 Ki elements span several chunks. */
static const conv_case cases[] = {
    {RS_DTYPE_E4M3, RS_DTYPE_BF16, 300, 1000}, {RS_DTYPE_E4M3, RS_DTYPE_F32, 130, 200},
    {RS_DTYPE_E4M3, RS_DTYPE_F16, 129, 260},   {RS_DTYPE_E4M3, RS_DTYPE_BF16, 2, 16500},
    {RS_DTYPE_E4M3, RS_DTYPE_E4M3, 260, 1100}, {RS_DTYPE_BF16, RS_DTYPE_BF16, 700, 512},
    {RS_DTYPE_BF16, RS_DTYPE_F32, 300, 96},    {RS_DTYPE_F32, RS_DTYPE_BF16, 0, 3000},
    {RS_DTYPE_F32, RS_DTYPE_F32, 0, 96},       {RS_DTYPE_BF16, RS_DTYPE_F16, 64, 64},
};

RS_TEST(weight_convert_refuses_nonfinite_everywhere) {
    conv_env v = conv_open();
    const float bads[] = {NAN, INFINITY, -INFINITY};
    uint64_t s = 3;
    for (size_t ci = 0; ci < RS_ARRAY_LEN(cases); ci++) {
        const conv_case *c = &cases[ci];
        const int64_t rows = c->rows ? c->rows : 1, n = rows * c->cols;
        void *ok = tensor_with(c->src, rows, c->cols, -1, 0, 5);
        rs_error err = {0};
        if (convert(&v, c->served, c->src, c->rows, c->cols, ok, NULL, &err) != RS_OK)
            RS_TEST_FAIL("case %zu: a finite tensor refused: %s", ci, err.message);
        free(ok);
        for (size_t bi = 0; bi < RS_ARRAY_LEN(bads); bi++) {
            if (c->src == RS_DTYPE_E4M3 && bi > 0) continue; /* E4M3FN has no infinity */
            /* a late one alone, then an earlier one beside it: the first is named */
            const int64_t late = n - 1 - (int64_t)(rng(&s) % (uint64_t)RS_MIN(n, 1000)), early = (int64_t)(rng(&s) % (uint64_t)late);
            for (int pass = 0; pass < 2; pass++) {
                void *p = tensor_with(c->src, rows, c->cols, late, bads[bi], 5);
                if (pass == 1) { /* poke the earlier one */
                    void *q = tensor_with(c->src, rows, c->cols, early, bads[bi], 5);
                    const size_t esz = rs_dtype_size(c->src);
                    memcpy((uint8_t *)p + (size_t)early * esz, (uint8_t *)q + (size_t)early * esz, esz);
                    free(q);
                }
                const int64_t at = pass ? early : late;
                err = (rs_error){0};
                ASSERT_EQ(convert(&v, c->served, c->src, c->rows, c->cols, p, NULL, &err), RS_EFORMAT);
                char where[64];
                if (c->rows) snprintf(where, sizeof where, "at [%lld][%lld] (element %lld)", (long long)(at / c->cols),
                                      (long long)(at % c->cols), (long long)at);
                else snprintf(where, sizeof where, "at [%lld] (element %lld)", (long long)at, (long long)at);
                const char *what = c->src == RS_DTYPE_E4M3 || isnan(bads[bi]) ? "NaN" : bads[bi] > 0 ? "+inf" : "-inf";
                if (!strstr(err.message, where) || !strstr(err.message, what) || strcmp(err.param, "w"))
                    RS_TEST_FAIL("case %zu: want '%s' %s, got [%s] %s", ci, what, where, err.param, err.message);
                free(p);
            }
        }
    }
    /* a finite F32 that a BF16 slot cannot hold is an infinity there */
    float big[4] = {1.0f, FLT_MAX, 2.0f, 3.0f};
    rs_error err = {0};
    ASSERT_EQ(convert(&v, RS_DTYPE_BF16, RS_DTYPE_F32, 2, 2, big, NULL, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "+inf at [0][1]") != NULL);
    conv_close(&v);
}

RS_TEST(weight_convert_checks_crc32c) {
    conv_env v = conv_open();
    for (size_t ci = 0; ci < RS_ARRAY_LEN(cases); ci++) {
        const conv_case *c = &cases[ci];
        const int64_t rows = c->rows ? c->rows : 1;
        const size_t bytes = (size_t)(rows * c->cols) * rs_dtype_size(c->src);
        void *p = tensor_with(c->src, rows, c->cols, -1, 0, 11 + ci);
        const uint32_t right = rs_crc32c_base(0, p, bytes), wrong = right ^ 0x400u;
        rs_error err = {0};
        if (convert(&v, c->served, c->src, c->rows, c->cols, p, &right, &err) != RS_OK)
            RS_TEST_FAIL("case %zu: the right CRC refused: %s", ci, err.message);
        err = (rs_error){0};
        ASSERT_EQ(convert(&v, c->served, c->src, c->rows, c->cols, p, &wrong, &err), RS_EFORMAT);
        char want[64];
        snprintf(want, sizeof want, "is 0x%08x, the manifest says 0x%08x", right, wrong);
        if (!strstr(err.message, want) || strcmp(err.param, "w")) RS_TEST_FAIL("case %zu: %s", ci, err.message);
        /* one flipped bit in the data, anywhere, is caught */
        ((uint8_t *)p)[bytes / 3] ^= 0x10;
        ASSERT_EQ(convert(&v, c->served, c->src, c->rows, c->cols, p, &right, &err), RS_EFORMAT);
        free(p);
    }
    conv_close(&v);
}
