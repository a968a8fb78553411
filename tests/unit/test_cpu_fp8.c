/*
 * test_cpu_fp8.c — the CPU backend's W8A8 path: FP8 GEMM kernels, activation quantization, the
 * matmul op with E4M3 weights and the MoE with E4M3 experts.
 *
 * The definition of every result is the scalar reference of kernels/ (rs_fp8_quantize_act,
 * rs_fp8_gemm_ref): each fast path must reproduce it bit for bit, on every instruction set this
 * CPU has and with 1, 2 and 3 threads, on shapes that exercise every tile edge of the kernels
 * (rows 1..4 and 12..16 tiles and their mixes, outputs not a multiple of 4, 64 or 128, K not a
 * multiple of 128 and past a 1024-wide super-block) and on adversarial codes (extremes, subnormals,
 * signed zeros, NaN codes and scales). Sanity checks against plain double arithmetic show that the
 * numbers are W8A8 and not merely self-consistent.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/pool.h"
#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_internal.h"
#include "../../kernels/cpu/fp8_gemm.h"
#include "../../kernels/cpu/fp8_layout.h"
#include "../../kernels/fp8.h"
#include "test.h"
#include "test_util.h"

/* ---- helpers ---- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1p-53; } /* [0, 1) */

static float rng_sym(uint64_t *s) { return (float)(2.0 * rng_unit(s) - 1.0); } /* [-1, 1) */

/* 2^u for u uniform in [lo, hi): scales spread over many binades. */
static float rng_log2(uint64_t *s, double lo, double hi) { return (float)exp2(lo + (hi - lo) * rng_unit(s)); }

static int is_nan_code(uint8_t c) { return (c & 0x7f) == 0x7f; }

static uint8_t rand_code(uint64_t *s) { /* any of the 254 non-NaN codes */
    uint8_t c;
    do c = (uint8_t)rng_next(s);
    while (is_nan_code(c));
    return c;
}

static const rs_fp8_gemm_isa all_isas[] = {RS_FP8_GEMM_ISA_GENERIC, RS_FP8_GEMM_ISA_AVX2,
                                           RS_FP8_GEMM_ISA_AVX512_VNNI, RS_FP8_GEMM_ISA_AUTO};

/* Highest SIMD level of the CPU backend here. */
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

/* ---- GEMM kernels ---- */

typedef struct gcase {
    int rows, n, k;
    uint8_t *xq, *wq; /* [rows][k], [n][k] e4m3 */
    float *xs, *ws;   /* [rows][kb], [ceil(n/128)][kb] */
    float *ref, *got; /* [rows][n] */
} gcase;

static gcase gcase_new(int rows, int n, int k) {
    gcase c = {.rows = rows, .n = n, .k = k};
    size_t kb = (size_t)rs_fp8_blocks(k);
    c.xq = malloc((size_t)rows * (size_t)k + 1);
    c.wq = malloc((size_t)n * (size_t)k + 1);
    c.xs = malloc(((size_t)rows * kb + 1) * sizeof(float));
    c.ws = malloc(((size_t)rs_fp8_blocks(n) * kb + 1) * sizeof(float));
    c.ref = malloc(((size_t)rows * (size_t)n + 1) * sizeof(float));
    c.got = malloc(((size_t)rows * (size_t)n + 1) * sizeof(float));
    ASSERT_TRUE(c.xq && c.wq && c.xs && c.ws && c.ref && c.got);
    return c;
}

static void gcase_free(gcase *c) {
    free(c->xq), free(c->wq), free(c->xs), free(c->ws), free(c->ref), free(c->got);
}

static void gcase_random(gcase *c, uint64_t *s) {
    int64_t kb = rs_fp8_blocks(c->k);
    for (int64_t i = 0; i < (int64_t)c->rows * c->k; i++) c->xq[i] = rand_code(s);
    for (int64_t i = 0; i < (int64_t)c->n * c->k; i++) c->wq[i] = rand_code(s);
    for (int64_t i = 0; i < c->rows * kb; i++) c->xs[i] = rng_log2(s, -20, 4);
    for (int64_t i = 0; i < rs_fp8_blocks(c->n) * kb; i++) c->ws[i] = (rng_next(s) & 1 ? -1 : 1) * rng_log2(s, -20, 4);
}

/* Every ISA this CPU has (others must say RS_EUNSUPPORTED), inline and on 1-, 2- and 3-thread
 * pools: bit-identical to the reference, NaN payloads included. */
static void expect_all_isas_equal_ref(gcase *c) {
    rs_pool *pools[4] = {NULL, rs_pool_init(1), rs_pool_init(2), rs_pool_init(3)};
    rs_fp8_gemm_ref(c->ref, c->xq, c->xs, c->wq, c->ws, c->rows, c->n, c->k);
    size_t no = (size_t)c->rows * (size_t)c->n;
    for (size_t i = 0; i < RS_ARRAY_LEN(all_isas); i++) {
        if (!rs_fp8_gemm_isa_supported(all_isas[i])) {
            ASSERT_EQ(rs_fp8_gemm_with_isa(all_isas[i], NULL, c->got, c->xq, c->xs, c->wq, c->ws, c->rows, c->n,
                                           c->k),
                      RS_EUNSUPPORTED);
            rs_test_note_skip(rs_fp8_gemm_isa_name(all_isas[i]));
            continue;
        }
        for (int p = 0; p < 4; p++) {
            memset(c->got, 0xA5, no * sizeof(float)); /* the kernels must not read out before writing it */
            ASSERT_EQ(rs_fp8_gemm_with_isa(all_isas[i], pools[p], c->got, c->xq, c->xs, c->wq, c->ws, c->rows, c->n,
                                           c->k),
                      RS_OK);
            for (size_t j = 0; j < no; j++)
                if (rs_test_f32_bits(c->got[j]) != rs_test_f32_bits(c->ref[j]))
                    RS_TEST_FAIL("rows %d n %d k %d isa %s threads %d: out[%zu][%zu] %a (0x%08x) vs ref %a (0x%08x)",
                                 c->rows, c->n, c->k, rs_fp8_gemm_isa_name(all_isas[i]), p, j / (size_t)c->n,
                                 j % (size_t)c->n, c->got[j], rs_test_f32_bits(c->got[j]), c->ref[j], rs_test_f32_bits(c->ref[j]));
        }
    }
    /* the same weights in RS_LAYOUT_FP8_PAIRS32: the VNNI kernel only, the same bits */
    if (rs_fp8_pairs32_fits(c->n, c->k)) {
        uint8_t *packed = malloc((size_t)c->n * (size_t)c->k);
        ASSERT_TRUE(packed != NULL);
        rs_fp8_pairs32_pack(packed, c->wq, c->n, c->k);
        for (size_t i = 0; i < RS_ARRAY_LEN(all_isas); i++) {
            const bool ok = rs_fp8_gemm_isa_supported(all_isas[i]) &&
                            (all_isas[i] == RS_FP8_GEMM_ISA_AVX512_VNNI ||
                             (all_isas[i] == RS_FP8_GEMM_ISA_AUTO &&
                              rs_fp8_gemm_detect_isa() == RS_FP8_GEMM_ISA_AVX512_VNNI));
            for (int p = 0; p < 4; p++) {
                memset(c->got, 0xA5, no * sizeof(float));
                ASSERT_EQ(rs_fp8_gemm_layout_with_isa(all_isas[i], pools[p], c->got, c->xq, c->xs, packed,
                                                      RS_LAYOUT_FP8_PAIRS32, c->ws, c->rows, c->n, c->k),
                          ok ? RS_OK : RS_EUNSUPPORTED);
                if (!ok) break;
                for (size_t j = 0; j < no; j++)
                    if (rs_test_f32_bits(c->got[j]) != rs_test_f32_bits(c->ref[j]))
                        RS_TEST_FAIL("pairs32 layout: rows %d n %d k %d threads %d: out[%zu][%zu] %a vs ref %a", c->rows,
                                     c->n, c->k, p, j / (size_t)c->n, j % (size_t)c->n, c->got[j], c->ref[j]);
            }
        }
        free(packed);
    }
    for (int p = 1; p < 4; p++) rs_pool_free(pools[p]);
}

/* Packing permutes each group's bytes and nothing else: unpack undoes it, every code is where
 * rs_fp8_pairs32_at says, and the slot order is the one the header defines. */
RS_TEST(cpu_fp8_pairs32_pack_round_trip) {
    static const int shapes[][2] = {{32, 2}, {33, 126}, {64, 128}, {95, 1026}, {130, 300}, {200, 66}};
    uint64_t s = 5;
    for (size_t i = 0; i < RS_ARRAY_LEN(shapes); i++) {
        const int n = shapes[i][0], k = shapes[i][1];
        uint8_t *w = malloc((size_t)n * k), *p = malloc((size_t)n * k), *u = malloc((size_t)n * k);
        ASSERT_TRUE(w && p && u);
        for (int j = 0; j < n * k; j++) w[j] = (uint8_t)rng_next(&s);
        rs_fp8_pairs32_pack(p, w, n, k);
        rs_fp8_pairs32_unpack(u, p, n, k);
        ASSERT_TRUE(memcmp(u, w, (size_t)n * k) == 0);
        for (int r = 0; r < n; r++)
            for (int c = 0; c < k; c++) ASSERT_EQ(rs_fp8_pairs32_at(p, n, k, r, c), w[r * k + c]);
        /* group 0, pair 1: slots 0..7 hold rows 0 1 2 3 16 17 18 19, slot 8 row 4 */
        static const int rows8[9] = {0, 1, 2, 3, 16, 17, 18, 19, 4};
        for (int sl = 0; sl < 9 && k >= 4; sl++) {
            ASSERT_EQ(p[64 + 2 * sl], w[rows8[sl] * k + 2]);
            ASSERT_EQ(p[64 + 2 * sl + 1], w[rows8[sl] * k + 3]);
        }
        free(w), free(p), free(u);
    }
}

RS_TEST(cpu_fp8_gemm_every_isa_bit_identical_tile_edges) {
    /* rows: lanes = k tiles of 1..4 rows, lanes = rows tiles of 12..16, and their mixes;
     * n: groups of 4 and chunks of 64 with tails, several 128-row weight blocks;
     * k: tails inside either 64-code half, one block, a 1024 super-block and past it. */
    static const int shapes[][3] = {
        {1, 1, 1},     {1, 3, 5},      {1, 7, 64},     {1, 64, 65},    {1, 130, 128},  {1, 257, 300},
        {1, 200, 1100}, {2, 6, 127},   {2, 129, 256},  {3, 5, 129},    {3, 70, 640},   {4, 9, 200},
        {4, 131, 1030}, {5, 67, 257},  {7, 66, 33},    {8, 40, 384},   {11, 13, 190},  {12, 20, 130},
        {13, 65, 257},  {15, 3, 64},   {16, 64, 128},  {16, 131, 1100}, {17, 70, 257}, {20, 35, 300},
        {27, 129, 100}, {28, 64, 500}, {33, 130, 257}, {40, 5, 129},   {64, 66, 384},
        /* RS_LAYOUT_FP8_PAIRS32 too (k even, n >= 32): whole groups with and without row-major
         * tail rows, 1..3 rows (lanes = outputs, tiles of 2 and 1), many rows, k = 2 */
        {1, 32, 2},    {1, 96, 1024},  {2, 33, 126},  {3, 288, 1280}, {4, 63, 130},   {5, 160, 2},
        {9, 100, 258}, {13, 32, 384},  {17, 96, 1026}, {31, 65, 512}, {45, 64, 256}, {48, 96, 384},
        {77, 130, 128},
        /* many rows and n > 1024: the AVX2 kernel's items of 256 outputs (with a ragged last one) */
        {45, 1100, 257}, {100, 1030, 384}, {130, 520, 130},
    };
    uint64_t s = 11;
    for (size_t i = 0; i < RS_ARRAY_LEN(shapes); i++) {
        gcase c = gcase_new(shapes[i][0], shapes[i][1], shapes[i][2]);
        gcase_random(&c, &s);
        expect_all_isas_equal_ref(&c);
        gcase_free(&c);
    }
}

/* Codes chosen to hit the extremes of the digit arithmetic (block sums up to 128 * 448^2, the
 * largest low- and high-slot digits, the smallest subnormals, exact cancellation, signed zeros),
 * each on a few-rows and a many-rows shape. */
RS_TEST(cpu_fp8_gemm_every_isa_adversarial_codes) {
    static const int shapes[][3] = {{1, 9, 384}, {3, 70, 300}, {16, 67, 384}, {29, 33, 257}};
    static const uint8_t lo_max[] = {0x3f, 0xbf, 0x3e, 0xbe}; /* e = 7: the largest low-slot digits */
    uint64_t s = 4242;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        gcase c = gcase_new(shapes[si][0], shapes[si][1], shapes[si][2]);
        int64_t kb = rs_fp8_blocks(c.k);
        for (int variant = 0; variant < 8; variant++) {
            for (int side = 0; side < 2; side++) {
                uint8_t *q = side ? c.wq : c.xq;
                int64_t len = (int64_t)(side ? c.n : c.rows) * c.k;
                for (int64_t i = 0; i < len; i++) {
                    uint64_t r = rng_next(&s);
                    switch (variant) {
                    case 0: q[i] = (r & 1) ? 0xfe : 0x7e; break;                       /* +-448 */
                    case 1: q[i] = 0x7e; break;                                         /* all 448 */
                    case 2: q[i] = (uint8_t)((r & 0x80) | (1 + r % 7)); break;          /* subnormals */
                    case 3: q[i] = (r & 1) ? 0x00 : 0x80; break;                        /* signed zeros */
                    case 4: q[i] = lo_max[r % 4]; break;                                /* low-slot extremes */
                    case 5: q[i] = (r % 3 == 0) ? 0x7e : (uint8_t)((r & 0x80) | (r >> 8) % 8); break;
                    case 6: q[i] = (uint8_t)((r & 0x80) | (0x40 + (r >> 8) % 0x3f)); break; /* high slot */
                    default: q[i] = (r % 5 == 0) ? (uint8_t)(0x80 | (r >> 8) % 0x7f) : 0x08; break;
                    }
                }
            }
            for (int64_t i = 0; i < c.rows * kb; i++) c.xs[i] = variant == 1 ? 1.0f : rng_log2(&s, -30, 10);
            for (int64_t i = 0; i < rs_fp8_blocks(c.n) * kb; i++) c.ws[i] = variant == 1 ? 1.0f : -rng_log2(&s, -30, 10);
            expect_all_isas_equal_ref(&c);
            if (variant == 1) /* whole blocks of 448 * 448: 128 * 200704 = 25690112 each, exact */
                for (int64_t i = 0; i < (int64_t)c.rows * c.n; i++) {
                    double want = 0.0;
                    for (int64_t b = 0; b < kb; b++) want += 200704.0 * (double)RS_MIN((int64_t)128, c.k - 128 * b);
                    ASSERT_EQ(rs_test_f32_bits(c.ref[i]), rs_test_f32_bits((float)want));
                }
        }
        gcase_free(&c);
    }

    /* 448 * 448 + 2^-9 * 2^-9 - 448 * 448 = 2^-18 exactly (an fp32 running sum would give 0). */
    gcase d = gcase_new(1, 5, 3);
    const uint8_t x3[3] = {0x7e, 0x01, 0x7e}, w3[3] = {0x7e, 0x01, 0xfe};
    memcpy(d.xq, x3, 3);
    for (int o = 0; o < 5; o++) memcpy(d.wq + 3 * o, w3, 3);
    d.xs[0] = 1.0f, d.ws[0] = 1.0f;
    expect_all_isas_equal_ref(&d);
    ASSERT_EQ(rs_test_f32_bits(d.ref[0]), rs_test_f32_bits(0x1p-18f));
    gcase_free(&d);
}

/* Decode-shaped products (1..3 rows) whose activation blocks mostly have every code a multiple
 * of 2^-4 in E4M3 units (exponent field >= 6, or zero: the one-digit form the batch-1 kernels
 * take a shorter loop for), every third block with one small code in a random row, a few NaN
 * weight codes; both weight layouts. */
RS_TEST(cpu_fp8_gemm_every_isa_decode_one_digit_blocks) {
    static const int shapes[][3] = {{1, 96, 1024}, {1, 64, 3072}, {1, 160, 300}, {2, 96, 512}, {3, 64, 256}};
    uint64_t s = 31;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        gcase c = gcase_new(shapes[si][0], shapes[si][1], shapes[si][2]);
        gcase_random(&c, &s);
        for (int64_t i = 0; i < (int64_t)c.rows * c.k; i++) {
            uint8_t v;
            do v = rand_code(&s); while (((v >> 3) & 15) < 6 && (v & 0x7f));
            c.xq[i] = v;
        }
        for (int64_t b = 0; b < rs_fp8_blocks(c.k); b += 3) {
            const int64_t j = b * 128 + (int64_t)(rng_next(&s) % 128);
            if (j < c.k) c.xq[(int64_t)(rng_next(&s) % (uint64_t)c.rows) * c.k + j] = (uint8_t)(rng_next(&s) & 0xaf);
        }
        for (int j = 0; j < 2; j++) /* NaN weight codes */
            c.wq[rng_next(&s) % ((uint64_t)c.n * (uint64_t)c.k)] = (rng_next(&s) & 1) ? 0x7f : 0xff;
        expect_all_isas_equal_ref(&c);
        gcase_free(&c);
    }
}

/* The many-row kernels choose their activation digit per 16-row tile and block (a shift of 4
 * where every row's sum of |X| allows it, else 5): random rows with small codes sprinkled in
 * (remainders with either shift) in tiles next to tiles where, in every other block, one row is
 * all +-448 codes (shift 5 there, for that tile only); on both weight layouts. */
RS_TEST(cpu_fp8_gemm_every_isa_digit_shift_per_tile) {
    static const int shapes[][3] = {{32, 96, 384}, {48, 64, 300}, {29, 70, 257}, {16, 40, 512}};
    uint64_t s = 77;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        gcase c = gcase_new(shapes[si][0], shapes[si][1], shapes[si][2]);
        gcase_random(&c, &s);
        for (int64_t i = 0; i < (int64_t)c.rows * c.k; i++) {
            const uint64_t v = rng_next(&s);
            if (v % 16 == 0) c.xq[i] = (uint8_t)((v >> 8) & 0x8f); /* e <= 1: a remainder with either shift */
        }
        const int64_t kb = rs_fp8_blocks(c.k);
        for (int64_t b = 0; b < kb; b += 2) {
            const int tile = (int)(b / 2) % ((c.rows + 15) / 16);
            const int pick = 16 * tile + (int)(rng_next(&s) % 16); /* RS_MIN evaluates twice */
            const int r = RS_MIN(c.rows - 1, pick);
            for (int64_t j = b * 128; j < RS_MIN((int64_t)c.k, b * 128 + 128); j++)
                c.xq[(int64_t)r * c.k + j] = (rng_next(&s) & 1) ? 0xfe : 0x7e;
        }
        expect_all_isas_equal_ref(&c);
        gcase_free(&c);
    }
}

/* Every code on the x side and on the w side against 1.0 (0x38), with 256 rows (lanes = rows tiles)
 * and with 1 row (lanes = k): each decoder against the decode table, NaN codes included. */
RS_TEST(cpu_fp8_gemm_every_isa_all_256_codes) {
    gcase a = gcase_new(256, 3, 1), w = gcase_new(1, 256, 1);
    for (int c = 0; c < 256; c++) {
        a.xq[c] = (uint8_t)c, a.xs[c] = 1.0f;
        w.wq[c] = (uint8_t)c;
    }
    memset(a.wq, 0x38, 3);
    a.ws[0] = 1.0f;
    w.xq[0] = 0x38, w.xs[0] = 1.0f, w.ws[0] = w.ws[1] = 1.0f;
    expect_all_isas_equal_ref(&a);
    expect_all_isas_equal_ref(&w);
    for (int c = 0; c < 256; c++) {
        float v = rs_fp8_e4m3_to_f32((uint8_t)c);
        uint32_t want = isnan(v) ? rs_test_f32_bits(NAN) : rs_test_f32_bits(v + 0.0f);
        ASSERT_EQ(rs_test_f32_bits(a.ref[c * 3 + 2]), want);
        ASSERT_EQ(rs_test_f32_bits(w.ref[c]), want);
    }
    gcase_free(&a);
    gcase_free(&w);
}

/* NaN codes in x rows of both tile kinds and in weight rows of full and tail groups, NaN scales
 * (one with a payload) and infinite ones (inf * 0 makes x86's negative default NaN): every NaN
 * output is the canonical NaN, in the reference and in every kernel. */
RS_TEST(cpu_fp8_gemm_every_isa_nan_codes_and_scales) {
    static const int shapes[][3] = {{3, 70, 300}, {17, 140, 300}, {1, 133, 1100}};
    uint64_t s = 99;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        gcase c = gcase_new(shapes[si][0], shapes[si][1], shapes[si][2]);
        int64_t kb = rs_fp8_blocks(c.k);
        gcase_random(&c, &s);
        c.xq[(c.rows - 1) * c.k + 5] = 0xff;      /* -NaN code, last row, block 0 */
        c.wq[7 * c.k + c.k - 1] = 0x7f;            /* +NaN code, weight row 7, last (ragged) block */
        c.wq[(c.n - 1) * c.k + 130] = 0xff;        /* the last output: a tail group */
        c.wq[21 * c.k + 64] = 0x7f;                /* an odd slot of a packed group, block 0's second half */
        float nan_a;                               /* a NaN scale with its own payload */
        uint32_t nan_bits = 0x7fc01234u;
        memcpy(&nan_a, &nan_bits, sizeof nan_a);
        c.xs[0 * kb + kb - 1] = nan_a;
        c.ws[0 * kb + 1] = INFINITY;               /* an inf scale: inf * 0 where a block sums to 0 */
        memset(c.wq + 2 * c.k, 0, (size_t)c.k);    /* weight row 2 sums to zero in every block */
        expect_all_isas_equal_ref(&c);
        ASSERT_TRUE(isnan(c.ref[(c.rows - 1) * c.n + 0]) && isnan(c.ref[7]) && isnan(c.ref[c.n - 1]));
        ASSERT_TRUE(isnan(c.ref[2])); /* 0 * inf, then the NaN scale with a payload */
        for (int64_t i = 0; i < (int64_t)c.rows * c.n; i++) /* every NaN output is the canonical NaN */
            if (isnan(c.ref[i])) ASSERT_EQ(rs_test_f32_bits(c.ref[i]), rs_test_f32_bits(NAN));
        gcase_free(&c);
    }
}

/* Activation codes as the matmul makes them (floats quantized per 1x128 group: few codes below
 * 2^-3, so the AVX2 kernel's one-digit blocks) or random codes (many small ones: its two-digit
 * blocks), chosen per row and block so that a tile holds both kinds. */
static void mixed_activations(gcase *c, uint64_t *s) {
    const int64_t kb = rs_fp8_blocks(c->k);
    float *f = malloc((size_t)c->k * sizeof(float));
    for (int r = 0; r < c->rows; r++) {
        for (int64_t j = 0; j < c->k; j++) f[j] = rng_sym(s) + rng_sym(s) + rng_sym(s);
        rs_fp8_quantize_act(f, 1, c->k, c->xq + (int64_t)r * c->k, c->xs + r * kb);
        for (int64_t b = 0; b < kb; b++)
            if ((rng_next(s) & 3) == 0) /* a quarter of the blocks: random codes */
                for (int64_t j = b * 128; j < RS_MIN(c->k, b * 128 + 128); j++) c->xq[(int64_t)r * c->k + j] = rand_code(s);
    }
    free(f);
}

/* A random case with mixed activations, its reference, and its weights packed (pairs32) in
 * *packed (to free). */
static gcase gcase_mixed(int rows, int n, int k, uint64_t *s, uint8_t **packed) {
    gcase c = gcase_new(rows, n, k);
    gcase_random(&c, s);
    mixed_activations(&c, s);
    rs_fp8_gemm_ref(c.ref, c.xq, c.xs, c.wq, c.ws, rows, n, k);
    *packed = malloc((size_t)n * (size_t)k);
    RS_ASSERT(*packed);
    rs_fp8_pairs32_pack(*packed, c.wq, n, k);
    return c;
}

/* Every row count from 1 to 40 and a few past it: every tile kind of every kernel (lanes = k
 * tiles of 1, 2 and 3..8 rows, lanes = rows tiles of 16 and padded ones from the CPU's timed row
 * count, the next test taking every count, items of 1 to 4 such tiles sharing each weight decode,
 * the VNNI kernel's 4- and 16-row tiles) and their mixes, on ragged n and k, each ISA in turn,
 * inline and on 2 threads, row-major and (VNNI) packed weights (n = 160: every chunk packed, so
 * its many-row items take up to 4 tiles). The reference is per row, so the first R rows of one
 * reference cover every R. */
RS_TEST(cpu_fp8_gemm_every_isa_all_row_counts) {
    static const int shapes[][2] = {{70, 300}, {33, 1030}, {160, 300}};
    uint64_t s = 515;
    rs_pool *pool = rs_pool_init(2);
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        const int n = shapes[si][0], k = shapes[si][1], max_rows = 130;
        uint8_t *packed;
        gcase c = gcase_mixed(max_rows, n, k, &s, &packed);
        for (int rows = 1; rows <= max_rows; rows = rows < 40 ? rows + 1 : rows + 23) {
            for (size_t i = 0; i < RS_ARRAY_LEN(all_isas); i++) {
                if (!rs_fp8_gemm_isa_supported(all_isas[i])) {
                    rs_test_note_skip(rs_fp8_gemm_isa_name(all_isas[i]));
                    continue;
                }
                for (int lay = 0; lay < 2; lay++) {
                    if (lay && all_isas[i] != RS_FP8_GEMM_ISA_AVX512_VNNI) continue;
                    for (int p = 0; p < 2; p++) {
                        memset(c.got, 0xA5, (size_t)rows * (size_t)n * sizeof(float));
                        ASSERT_EQ(rs_fp8_gemm_layout_with_isa(all_isas[i], p ? pool : NULL, c.got, c.xq, c.xs,
                                                              lay ? packed : c.wq,
                                                              lay ? RS_LAYOUT_FP8_PAIRS32 : RS_LAYOUT_ROWS, c.ws,
                                                              rows, n, k),
                                  RS_OK);
                        for (int64_t j = 0; j < (int64_t)rows * n; j++)
                            if (rs_test_f32_bits(c.got[j]) != rs_test_f32_bits(c.ref[j]))
                                RS_TEST_FAIL("rows %d n %d k %d isa %s%s threads %d: out[%lld][%lld] %a vs ref %a",
                                             rows, n, k, rs_fp8_gemm_isa_name(all_isas[i]), lay ? " pairs32" : "",
                                             p ? 2 : 0, (long long)(j / n), (long long)(j % n), c.got[j], c.ref[j]);
                    }
                }
            }
        }
        free(packed);
        gcase_free(&c);
    }
    rs_pool_free(pool);
}

/* The row count from which the SIMD kernels pad a remainder to one more 16-row tile is the CPU's
 * (rs_fp8_gemm_tune): every setting, from "always" (1) to "never" (17), gives the reference's bits
 * at every row count around the tiles, in both weight layouts. */
RS_TEST(cpu_fp8_gemm_every_isa_every_row_tile_min) {
    static const int mins[] = {1, 2, 5, 7, 9, 12, 16, 17};
    static const rs_fp8_gemm_isa tunable[] = {RS_FP8_GEMM_ISA_AVX2, RS_FP8_GEMM_ISA_AVX512_VNNI};
    const int n = 96, k = 300, max_rows = 83;
    uint64_t s = 717;
    uint8_t *packed;
    gcase c = gcase_mixed(max_rows, n, k, &s, &packed);
    rs_pool *pool = rs_pool_init(2);
    ASSERT_EQ(rs_fp8_gemm_row_tile_min(RS_FP8_GEMM_ISA_GENERIC), 0);
    ASSERT_EQ(rs_fp8_gemm_tune(RS_FP8_GEMM_ISA_GENERIC), 0);
    ASSERT_EQ(rs_fp8_gemm_set_row_tile_min(RS_FP8_GEMM_ISA_GENERIC, 5), RS_EUNSUPPORTED);
    for (size_t i = 0; i < RS_ARRAY_LEN(tunable); i++) {
        const rs_fp8_gemm_isa isa = tunable[i];
        if (!rs_fp8_gemm_isa_supported(isa)) {
            ASSERT_EQ(rs_fp8_gemm_tune(isa), 0);
            rs_test_note_skip(rs_fp8_gemm_isa_name(isa));
            continue;
        }
        const int tuned = rs_fp8_gemm_tune(isa);
        ASSERT_TRUE(tuned >= 1 && tuned <= 17); /* 1..17: RS_FP8_ROW_TILE_MIN may set any */
        ASSERT_EQ(rs_fp8_gemm_row_tile_min(isa), tuned);
        ASSERT_EQ(rs_fp8_gemm_set_row_tile_min(isa, 0), RS_EINVAL);
        ASSERT_EQ(rs_fp8_gemm_set_row_tile_min(isa, 18), RS_EINVAL);
        for (size_t mi = 0; mi < RS_ARRAY_LEN(mins); mi++) {
            ASSERT_EQ(rs_fp8_gemm_set_row_tile_min(isa, mins[mi]), RS_OK);
            ASSERT_EQ(rs_fp8_gemm_row_tile_min(isa), mins[mi]);
            for (int rows = 1; rows <= max_rows; rows += rows < 20 ? 1 : rows < 40 ? 3 : 11)
                for (int lay = 0; lay < 1 + (isa == RS_FP8_GEMM_ISA_AVX512_VNNI); lay++) {
                    memset(c.got, 0xA5, (size_t)rows * (size_t)n * sizeof(float));
                    ASSERT_EQ(rs_fp8_gemm_layout_with_isa(isa, pool, c.got, c.xq, c.xs, lay ? packed : c.wq,
                                                          lay ? RS_LAYOUT_FP8_PAIRS32 : RS_LAYOUT_ROWS, c.ws, rows, n, k),
                              RS_OK);
                    for (int64_t j = 0; j < (int64_t)rows * n; j++)
                        if (rs_test_f32_bits(c.got[j]) != rs_test_f32_bits(c.ref[j]))
                            RS_TEST_FAIL("isa %s%s, padded tiles from %d rows: rows %d: out[%lld][%lld] %a vs ref %a",
                                         rs_fp8_gemm_isa_name(isa), lay ? " pairs32" : "", mins[mi], rows,
                                         (long long)(j / n), (long long)(j % n), c.got[j], c.ref[j]);
                }
        }
        ASSERT_EQ(rs_fp8_gemm_set_row_tile_min(isa, tuned), RS_OK);
    }
    rs_pool_free(pool);
    free(packed);
    gcase_free(&c);
}

/* Batch invariance: a row's outputs are the same bits whatever batch it is computed in (1 row or
 * 512, first, middle or last), on every ISA: seeded rollouts must not depend on what else runs.
 * Batch sizes cover every tile size of every kernel and tiles past the first. */
RS_TEST(cpu_fp8_gemm_batch_invariant_every_isa) {
    static const int batches[] = {1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 27, 31, 32, 33, 48, 64, 100, 512};
    const int n = 96, k = 260, max_rows = 512;
    uint64_t s = 616;
    gcase c = gcase_new(max_rows, n, k);
    gcase_random(&c, &s);
    mixed_activations(&c, &s);
    const int64_t kb = rs_fp8_blocks(k);
    uint8_t *probe_q = malloc((size_t)k), *packed = malloc((size_t)n * (size_t)k);
    float *probe_s = malloc((size_t)kb * sizeof(float)), *alone = malloc((size_t)n * sizeof(float));
    memcpy(probe_q, c.xq, (size_t)k), memcpy(probe_s, c.xs, (size_t)kb * sizeof(float)); /* row 0 is the probe */
    rs_fp8_pairs32_pack(packed, c.wq, n, k);
    rs_pool *pool = rs_pool_init(2);
    for (size_t i = 0; i < RS_ARRAY_LEN(all_isas); i++) {
        if (!rs_fp8_gemm_isa_supported(all_isas[i])) {
            rs_test_note_skip(rs_fp8_gemm_isa_name(all_isas[i]));
            continue;
        }
        for (int lay = 0; lay < 2; lay++) {
            if (lay && all_isas[i] != RS_FP8_GEMM_ISA_AVX512_VNNI) continue;
            const uint8_t *w = lay ? packed : c.wq;
            const rs_layout layout = lay ? RS_LAYOUT_FP8_PAIRS32 : RS_LAYOUT_ROWS;
            ASSERT_EQ(rs_fp8_gemm_layout_with_isa(all_isas[i], pool, alone, probe_q, probe_s, w, layout, c.ws, 1, n, k),
                      RS_OK);
            for (size_t bi = 0; bi < RS_ARRAY_LEN(batches); bi++) {
                const int B = batches[bi];
                const int at[3] = {0, B / 2, B - 1};
                for (int ai = 0; ai < 3; ai++) {
                    /* the probe at row at[ai] of the batch, the other rows the case's own */
                    uint8_t *xq = malloc((size_t)B * (size_t)k);
                    float *xs = malloc((size_t)B * (size_t)kb * sizeof(float));
                    memcpy(xq, c.xq + (size_t)k, (size_t)(B - 1) * (size_t)k);
                    memcpy(xs, c.xs + kb, (size_t)(B - 1) * (size_t)kb * sizeof(float));
                    memmove(xq + (size_t)(at[ai] + 1) * k, xq + (size_t)at[ai] * k, (size_t)(B - 1 - at[ai]) * k);
                    memmove(xs + (at[ai] + 1) * kb, xs + at[ai] * kb, (size_t)(B - 1 - at[ai]) * kb * sizeof(float));
                    memcpy(xq + (size_t)at[ai] * k, probe_q, (size_t)k);
                    memcpy(xs + at[ai] * kb, probe_s, (size_t)kb * sizeof(float));
                    ASSERT_EQ(rs_fp8_gemm_layout_with_isa(all_isas[i], pool, c.got, xq, xs, w, layout, c.ws, B, n, k),
                              RS_OK);
                    for (int o = 0; o < n; o++)
                        if (rs_test_f32_bits(c.got[(int64_t)at[ai] * n + o]) != rs_test_f32_bits(alone[o]))
                            RS_TEST_FAIL("isa %s%s: batch %d, row %d: out[%d] %a, alone %a", rs_fp8_gemm_isa_name(all_isas[i]),
                                         lay ? " pairs32" : "", B, at[ai], o, c.got[(int64_t)at[ai] * n + o], alone[o]);
                    free(xq), free(xs);
                }
            }
        }
    }
    rs_pool_free(pool);
    free(probe_q), free(probe_s), free(alone), free(packed);
    gcase_free(&c);
}

/* ---- activation quantization ---- */

RS_TEST(cpu_fp8_quantize_act_matches_reference) {
    /* the encoder: special values, the neighbours of every E4M3 rounding boundary, random bits */
    enum { N = 1 << 16 };
    float *f = malloc(N * sizeof(float));
    uint8_t *want = malloc(N), *got = malloc(N);
    size_t n = 0;
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 448.0f, -448.0f, 464.0f, 464.1f,
                              480.0f, 1e30f, 0x1p-6f, 0x1p-7f, 0x1p-9f, 0x1p-10f, 0x1.8p-10f, 0x1p-149f,
                              -0x1p-149f, 0x1p-126f, 3.4e38f};
    for (size_t i = 0; i < RS_ARRAY_LEN(specials); i++) f[n++] = specials[i];
    for (int c = 0; c < 127; c++) { /* midpoints between consecutive codes and their fp32 neighbours */
        float mid = (rs_fp8_e4m3_to_f32((uint8_t)c) + rs_fp8_e4m3_to_f32((uint8_t)(c + 1))) * 0.5f;
        if (c == 126) mid = 464.0f;
        for (int d = -2; d <= 2; d++) {
            float v = mid;
            for (int j = 0; j < (d < 0 ? -d : d); j++) v = nextafterf(v, d < 0 ? 0.0f : INFINITY);
            f[n++] = v, f[n++] = -v;
        }
    }
    uint64_t s = 5;
    while (n < N) {
        uint32_t u = (uint32_t)rng_next(&s);
        memcpy(&f[n++], &u, sizeof u);
    }
    rs_fp8_e4m3_from_f32_n(want, f, N);
    for (int simd = 0; simd <= max_simd(); simd++) {
        memset(got, 0xcc, N);
        rs_cpu_fp8_encode_n((rs_cpu_simd)simd, got, f, N);
        for (size_t i = 0; i < N; i++)
            if (got[i] != want[i])
                RS_TEST_FAIL("simd %s: encode(%a = 0x%08x) 0x%02x, want 0x%02x", rs_cpu_simd_name((rs_cpu_simd)simd),
                             f[i], rs_test_f32_bits(f[i]), got[i], want[i]);
    }
    /* and 64k bit patterns 65521 apart, spread evenly over all of fp32 (all 2^32 were compared once
     * by hand; that takes seconds) */
    for (size_t i = 0; i < N; i++) {
        uint32_t u = (uint32_t)(i * 65521u);
        memcpy(&f[i], &u, sizeof u);
    }
    rs_fp8_e4m3_from_f32_n(want, f, N);
    for (int simd = 0; simd <= max_simd(); simd++) {
        rs_cpu_fp8_encode_n((rs_cpu_simd)simd, got, f, N);
        ASSERT_EQ(memcmp(got, want, N), 0);
    }
    free(f), free(want), free(got);

    /* whole rows: ragged groups, zero groups, NaN and inf elements, outliers, tiny values */
    static const int dims[][2] = {{1, 1}, {1, 127}, {3, 128}, {2, 129}, {5, 1000}, {4, 3072}};
    for (size_t di = 0; di < RS_ARRAY_LEN(dims); di++) {
        int rows = dims[di][0], k = dims[di][1];
        size_t kb = (size_t)rs_fp8_blocks(k);
        float *x = malloc((size_t)rows * k * sizeof(float));
        for (int64_t i = 0; i < (int64_t)rows * k; i++) {
            uint64_t r = rng_next(&s);
            x[i] = rng_sym(&s) * (r % 97 == 0 ? 300.0f : 1.0f) * (r % 89 == 0 ? 1e-38f : 1.0f);
        }
        if (k >= 129) {
            memset(x + 128, 0, sizeof(float) * RS_MIN(128, k - 128)); /* an all-zero group in row 0 */
            x[(rows - 1) * k + 3] = NAN;
            x[(rows - 1) * k + k - 1] = -INFINITY;
            /* a group's largest element, then NaNs in the same vector lane (8 and 16 wide): the
             * NaN must not replace the running maximum */
            x[(rows - 1) * k + 2] = 50.0f;
            x[(rows - 1) * k + 2 + 8] = NAN;
            x[(rows - 1) * k + 2 + 16] = NAN;
        }
        uint8_t *q0 = malloc((size_t)rows * k), *q1 = malloc((size_t)rows * k);
        float *s0 = malloc(kb * rows * sizeof(float)), *s1 = malloc(kb * rows * sizeof(float));
        rs_fp8_quantize_act(x, rows, k, q0, s0);
        for (int simd = 0; simd <= max_simd(); simd++) {
            memset(q1, 0xcc, (size_t)rows * k);
            rs_cpu_fp8_quantize_act((rs_cpu_simd)simd, x, rows, k, q1, s1);
            ASSERT_EQ(memcmp(q0, q1, (size_t)rows * k), 0);
            ASSERT_EQ(memcmp(s0, s1, kb * rows * sizeof(float)), 0);
        }
        free(x), free(q0), free(q1), free(s0), free(s1);
    }
}

/* ---- the matmul op with E4M3 weights ---- */

typedef struct fp8w {
    rs_tensor t;  /* [n][k] e4m3 with scale_inv */
    float *wf;    /* [n][k] the fp32 weights it was quantized from */
} fp8w;

static fp8w make_fp8_weight(int64_t n, int64_t k, float amp, uint64_t *s) {
    fp8w w = {.t = {.dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = {n, k}}};
    w.wf = malloc((size_t)(n * k + 1) * sizeof(float));
    for (int64_t i = 0; i < n * k; i++) w.wf[i] = amp * rng_sym(s) * (rng_next(s) % 50 == 0 ? 8.0f : 1.0f);
    w.t.data = malloc((size_t)(n * k + 1));
    w.t.scale_inv = malloc(((size_t)(rs_fp8_blocks(n) * rs_fp8_blocks(k)) + 1) * sizeof(float));
    rs_tensor src = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {n, k}, .data = w.wf};
    ASSERT_EQ(rs_fp8_quantize_weight(&src, w.t.data, w.t.scale_inv), RS_OK);
    return w;
}

static void free_fp8_weight(fp8w *w) { free(w->wf), free(w->t.data), free(w->t.scale_inv); }

/* out = gemm_ref(quantize_act(x)) + bias, written here from the kernels/ references. */
static void fp8_matmul_expected(float *out, const float *x, const rs_tensor *w, const rs_tensor *bias, int rows) {
    int64_t n = w->shape[0], k = w->shape[1], kb = rs_fp8_blocks(k);
    uint8_t *xq = malloc((size_t)(rows * k + 1));
    float *xs = malloc((size_t)(rows * kb + 1) * sizeof(float));
    rs_fp8_quantize_act(x, rows, k, xq, xs);
    rs_fp8_gemm_ref(out, xq, xs, w->data, w->scale_inv, rows, (int)n, (int)k);
    if (bias)
        for (int r = 0; r < rows; r++)
            for (int64_t o = 0; o < n; o++)
                out[r * n + o] += bias->dtype == RS_DTYPE_BF16 ? rs_bf16_to_f32(((const uint16_t *)bias->data)[o])
                                                               : ((const float *)bias->data)[o];
    free(xq), free(xs);
}

RS_TEST(cpu_matmul_fp8_bit_identical_to_reference) {
    static const struct {
        int64_t n, k;
    } shapes[] = {{1, 1}, {5, 7}, {67, 100}, {130, 257}, {200, 1000}, {64, 1100}};
    static const int rows_list[] = {1, 3, 17, 33};
    uint64_t s = 21;
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        int64_t n = shapes[si].n, k = shapes[si].k;
        fp8w w = make_fp8_weight(n, k, 0.05f, &s);
        float *bf = malloc((size_t)n * sizeof(float));
        uint16_t *bb = malloc((size_t)n * sizeof(uint16_t));
        for (int64_t i = 0; i < n; i++) bf[i] = rng_sym(&s), bb[i] = rs_f32_to_bf16(rng_sym(&s));
        rs_tensor bias_f = {.dtype = RS_DTYPE_F32, .ndim = 1, .shape = {n}, .data = bf};
        rs_tensor bias_b = {.dtype = RS_DTYPE_BF16, .ndim = 1, .shape = {n}, .data = bb};
        for (size_t ri = 0; ri < RS_ARRAY_LEN(rows_list); ri++) {
            int rows = rows_list[ri];
            const rs_tensor *bias = (si + ri) % 3 == 0 ? NULL : (si + ri) % 3 == 1 ? &bias_f : &bias_b;
            size_t no = (size_t)rows * (size_t)n;
            float *x = malloc((size_t)(rows * k) * sizeof(float));
            for (int64_t i = 0; i < rows * k; i++) x[i] = rng_sym(&s) * (rng_next(&s) % 64 == 0 ? 20.0f : 1.0f);
            float *want = malloc(no * sizeof(float)), *got = malloc(no * sizeof(float));
            fp8_matmul_expected(want, x, &w.t, bias, rows);
            rs_cpu_matmul_ref(got, x, &w.t, bias, rows);
            ASSERT_EQ(memcmp(got, want, no * sizeof(float)), 0);
            /* the same weight in RS_LAYOUT_FP8_PAIRS32, as the backend keeps it on AVX-512 VNNI; at
             * lower SIMD levels the matmul unpacks it, and the reference reads it through the layout */
            rs_tensor wp = w.t;
            if (rs_fp8_pairs32_fits(n, k)) {
                wp.data = malloc((size_t)(n * k));
                rs_fp8_pairs32_pack(wp.data, w.t.data, n, k);
                wp.layout = RS_LAYOUT_FP8_PAIRS32;
                rs_cpu_matmul_ref(got, x, &wp, bias, rows);
                ASSERT_EQ(memcmp(got, want, no * sizeof(float)), 0);
            }
            for (int simd = 0; simd <= max_simd(); simd++) {
                for (int threads = 1; threads <= 2; threads++) {
                    rs_backend *b = backend_at(threads, simd);
                    for (int rep = 0; rep < 4; rep++) { /* rep 1, 3: warm scratch; 2, 3: packed */
                        if (rep >= 2 && wp.layout == RS_LAYOUT_ROWS) break;
                        memset(got, 0xA5, no * sizeof(float));
                        rs_op_matmul(b, got, x, rep < 2 ? &w.t : &wp, bias, rows);
                        for (size_t i = 0; i < no; i++)
                            if (rs_test_f32_bits(got[i]) != rs_test_f32_bits(want[i]))
                                RS_TEST_FAIL("fp8 matmul simd %s threads %d N %lld K %lld rows %d bias %s%s: out[%zu] "
                                             "%a vs %a",
                                             rs_cpu_simd_name((rs_cpu_simd)simd), threads, (long long)n, (long long)k,
                                             rows, bias ? rs_dtype_name(bias->dtype) : "none",
                                             rep >= 2 ? " pairs32" : "", i, got[i], want[i]);
                    }
                    rs_backend_free(b);
                }
            }
            if (wp.data != w.t.data) free(wp.data);
            free(x), free(want), free(got);
        }
        free(bf), free(bb);
        free_fp8_weight(&w);
    }
}

/* W8A8 and not garbage: the result against double arithmetic on the dequantized operands (only
 * the fp32 block sums, scale products and fmaf chain round), and against the unquantized fp32
 * matmul (E4M3 keeps 3 mantissa bits: a few percent). */
RS_TEST(cpu_matmul_fp8_close_to_double) {
    const int rows = 5;
    const int64_t n = 150, k = 700, kb = rs_fp8_blocks(k);
    uint64_t s = 77;
    fp8w w = make_fp8_weight(n, k, 0.03f, &s);
    float *x = malloc((size_t)(rows * k) * sizeof(float)), *got = malloc((size_t)(rows * n) * sizeof(float));
    for (int64_t i = 0; i < rows * k; i++) x[i] = rng_sym(&s) * 2.0f;
    uint8_t *xq = malloc((size_t)(rows * k));
    float *xs = malloc((size_t)(rows * kb) * sizeof(float));
    rs_fp8_quantize_act(x, rows, k, xq, xs);
    rs_backend *b = rs_backend_cpu_init(2);
    rs_op_matmul(b, got, x, &w.t, NULL, rows);
    double err = 0.0, norm = 0.0;
    for (int r = 0; r < rows; r++) {
        for (int64_t o = 0; o < n; o++) {
            double deq = 0.0, mag = 0.0, exact = 0.0;
            for (int64_t j = 0; j < k; j++) {
                double t = (double)rs_fp8_e4m3_to_f32(xq[r * k + j]) * xs[r * kb + j / 128] *
                           (double)rs_fp8_e4m3_to_f32(((uint8_t *)w.t.data)[o * k + j]) *
                           w.t.scale_inv[(o / 128) * kb + j / 128];
                deq += t, mag += fabs(t);
                exact += (double)x[r * k + j] * w.wf[o * k + j];
            }
            ASSERT_NEAR(got[r * n + o], deq, mag * 4.0 * (double)kb * 0x1p-24 + 1e-30);
            err += (got[r * n + o] - exact) * (got[r * n + o] - exact);
            norm += exact * exact;
        }
    }
    ASSERT_TRUE(sqrt(err / norm) < 0.05); /* ~3-4%: E4M3 keeps 3 mantissa bits on both sides */
    rs_backend_free(b);
    free(x), free(got), free(xq), free(xs);
    free_fp8_weight(&w);
}

/* ---- MoE with E4M3 experts ---- */

typedef struct fp8moe {
    int n_exp, top_k, hidden, inter;
    float *router_w;  /* [n_exp][hidden] */
    rs_tensor router; /* F32 or BF16 */
    fp8w *gate, *up, *down;
    rs_tensor *gt, *ut, *dt;
    rs_moe_weights w;
} fp8moe;

static void make_fp8moe(fp8moe *m, int n_exp, int top_k, int hidden, int inter, rs_dtype router_dt, bool norm,
                        uint64_t *s) {
    *m = (fp8moe){.n_exp = n_exp, .top_k = top_k, .hidden = hidden, .inter = inter};
    size_t rn = (size_t)n_exp * (size_t)hidden;
    m->router_w = malloc(rn * sizeof(float));
    for (size_t i = 0; i < rn; i++) m->router_w[i] = 0.5f * rng_sym(s);
    m->router = (rs_tensor){.dtype = router_dt, .ndim = 2, .shape = {n_exp, hidden}, .data = m->router_w};
    if (router_dt == RS_DTYPE_BF16) {
        uint16_t *h = malloc(rn * sizeof(uint16_t));
        for (size_t i = 0; i < rn; i++) h[i] = rs_f32_to_bf16(m->router_w[i]);
        m->router.data = h;
    }
    m->gate = calloc((size_t)n_exp, sizeof(fp8w)), m->up = calloc((size_t)n_exp, sizeof(fp8w));
    m->down = calloc((size_t)n_exp, sizeof(fp8w));
    m->gt = calloc((size_t)n_exp, sizeof(rs_tensor)), m->ut = calloc((size_t)n_exp, sizeof(rs_tensor));
    m->dt = calloc((size_t)n_exp, sizeof(rs_tensor));
    for (int e = 0; e < n_exp; e++) {
        m->gate[e] = make_fp8_weight(inter, hidden, 0.4f, s), m->gt[e] = m->gate[e].t;
        m->up[e] = make_fp8_weight(inter, hidden, 0.4f, s), m->ut[e] = m->up[e].t;
        m->down[e] = make_fp8_weight(hidden, inter, 0.4f, s), m->dt[e] = m->down[e].t;
    }
    m->w = (rs_moe_weights){.router = &m->router, .gate = m->gt, .up = m->ut, .down = m->dt, .n_experts = n_exp,
                            .top_k = top_k, .norm_topk_prob = norm};
}

/* The experts the op sees (not the references' copies) in RS_LAYOUT_FP8_PAIRS32 where it fits. */
static void pack_fp8moe(fp8moe *m) {
    rs_tensor *all[3] = {m->gt, m->ut, m->dt};
    for (int i = 0; i < 3; i++)
        for (int e = 0; e < m->n_exp; e++) {
            rs_tensor *t = &all[i][e];
            if (!rs_fp8_pairs32_fits(t->shape[0], t->shape[1])) continue;
            uint8_t *p = malloc((size_t)(t->shape[0] * t->shape[1]));
            rs_fp8_pairs32_pack(p, t->data, t->shape[0], t->shape[1]);
            t->data = p;
            t->layout = RS_LAYOUT_FP8_PAIRS32;
        }
}

static void free_fp8moe(fp8moe *m) {
    for (int e = 0; e < m->n_exp; e++) {
        if (m->gt[e].data != m->gate[e].t.data) free(m->gt[e].data);
        if (m->ut[e].data != m->up[e].t.data) free(m->ut[e].data);
        if (m->dt[e].data != m->down[e].t.data) free(m->dt[e].data);
    }
    if (m->router.data != m->router_w) free(m->router.data);
    free(m->router_w);
    for (int e = 0; e < m->n_exp; e++)
        free_fp8_weight(&m->gate[e]), free_fp8_weight(&m->up[e]), free_fp8_weight(&m->down[e]);
    free(m->gate), free(m->up), free(m->down), free(m->gt), free(m->ut), free(m->dt);
}

/* The MoE block rebuilt from the references, one row at a time: the router logits from the
 * backend's own matmul (its fp32 summation order is the router's definition on that backend),
 * softmax and top-k as Qwen3MoeSparseMoeBlock, then per selected expert in ascending order
 * quantize_act + gemm_ref for gate and up, SwiGLU, quantize_act + gemm_ref for down, and
 * out += y * weight. */
static void fp8moe_expected(rs_backend *b, float *out, const float *x, int rows, const fp8moe *m) {
    int H = m->hidden, I = m->inter, E = m->n_exp;
    float *logits = malloc((size_t)rows * E * sizeof(float));
    rs_op_matmul(b, logits, x, &m->router, NULL, rows);
    float *g = malloc((size_t)I * sizeof(float)), *u = malloc((size_t)I * sizeof(float));
    float *y = malloc((size_t)H * sizeof(float));
    for (int r = 0; r < rows; r++) {
        float *p = logits + (size_t)r * E, max = p[0], sum = 0.0f;
        for (int e = 1; e < E; e++) max = p[e] > max ? p[e] : max;
        for (int e = 0; e < E; e++) {
            p[e] = expf(p[e] - max);
            sum += p[e];
        }
        for (int e = 0; e < E; e++) p[e] = p[e] / sum;
        int sel[16];
        float wsel[16], wsum = 0.0f;
        for (int i = 0; i < m->top_k; i++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                bool taken = false;
                for (int j = 0; j < i; j++) taken |= sel[j] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            sel[i] = best, wsel[i] = p[best];
        }
        if (m->w.norm_topk_prob) {
            for (int i = 0; i < m->top_k; i++) wsum += wsel[i];
            for (int i = 0; i < m->top_k; i++) wsel[i] = wsel[i] / wsum;
        }
        float *o = out + (size_t)r * H;
        for (int d = 0; d < H; d++) o[d] = 0.0f;
        for (int e = 0; e < E; e++) {
            int i = 0;
            while (i < m->top_k && sel[i] != e) i++;
            if (i == m->top_k) continue;
            fp8_matmul_expected(g, x + (size_t)r * H, &m->gate[e].t, NULL, 1);
            fp8_matmul_expected(u, x + (size_t)r * H, &m->up[e].t, NULL, 1);
            rs_cpu_swiglu_span(g, g, u, (size_t)I);
            fp8_matmul_expected(y, g, &m->down[e].t, NULL, 1);
            for (int d = 0; d < H; d++) o[d] += y[d] * wsel[i];
        }
    }
    free(logits), free(g), free(u), free(y);
}

RS_TEST(cpu_moe_fp8_bit_identical_to_reference) {
    uint64_t s = 31;
    static const int rows_list[] = {1, 5, 17};
    for (int variant = 0; variant < 3; variant++) {
        fp8moe m;
        if (variant == 0)
            make_fp8moe(&m, 6, 2, 40, 24, RS_DTYPE_F32, true, &s);
        else if (variant == 1)
            make_fp8moe(&m, 5, 3, 130, 70, RS_DTYPE_BF16, false, &s);
        else /* big enough for the expert matmuls to split over threads and use lanes = rows tiles */
            make_fp8moe(&m, 4, 2, 264, 300, RS_DTYPE_BF16, true, &s);
        if (variant > 0) pack_fp8moe(&m); /* as the backend keeps them on AVX-512 VNNI */
        for (size_t ri = 0; ri < RS_ARRAY_LEN(rows_list); ri++) {
            if (variant == 2 && ri == 1) continue;
            int rows = variant == 2 && ri == 2 ? 33 : rows_list[ri];
            size_t nx = (size_t)rows * (size_t)m.hidden;
            float *x = malloc(nx * sizeof(float)), *got = malloc(nx * sizeof(float)),
                  *want = malloc(nx * sizeof(float));
            for (size_t i = 0; i < nx; i++) x[i] = rng_sym(&s);
            for (int simd = 0; simd <= max_simd(); simd++) {
                for (int threads = 1; threads <= 2; threads++) {
                    rs_backend *b = backend_at(threads, simd);
                    fp8moe_expected(b, want, x, rows, &m);
                    memcpy(got, x, nx * sizeof(float));
                    rs_op_moe(b, got, got, rows, m.hidden, &m.w); /* out aliases x */
                    for (size_t i = 0; i < nx; i++)
                        if (rs_test_f32_bits(got[i]) != rs_test_f32_bits(want[i]))
                            RS_TEST_FAIL("fp8 moe variant %d simd %s threads %d rows %d: out[%zu] %a vs %a", variant,
                                         rs_cpu_simd_name((rs_cpu_simd)simd), threads, rows, i, got[i], want[i]);
                    rs_backend_free(b);
                }
            }
            free(x), free(got), free(want);
        }
        free_fp8moe(&m);
    }
}

/* The FP8 MoE against the same MoE with the fp32 weights the experts were quantized from: W8A8
 * error only (a few percent per matmul). */
RS_TEST(cpu_moe_fp8_close_to_f32_weights) {
    uint64_t s = 32;
    fp8moe m;
    make_fp8moe(&m, 6, 2, 128, 96, RS_DTYPE_F32, true, &s);
    rs_tensor *gf = calloc(6, sizeof(rs_tensor)), *uf = calloc(6, sizeof(rs_tensor)), *df = calloc(6, sizeof(rs_tensor));
    for (int e = 0; e < 6; e++) {
        gf[e] = (rs_tensor){.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {96, 128}, .data = m.gate[e].wf};
        uf[e] = (rs_tensor){.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {96, 128}, .data = m.up[e].wf};
        df[e] = (rs_tensor){.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {128, 96}, .data = m.down[e].wf};
    }
    rs_moe_weights wf = m.w;
    wf.gate = gf, wf.up = uf, wf.down = df;
    const int rows = 9;
    float *x = malloc(rows * 128 * sizeof(float)), *o8 = malloc(rows * 128 * sizeof(float)),
          *o32 = malloc(rows * 128 * sizeof(float));
    for (int i = 0; i < rows * 128; i++) x[i] = rng_sym(&s);
    rs_backend *b = rs_backend_cpu_init(2);
    rs_op_moe(b, o8, x, rows, 128, &m.w);
    rs_op_moe(b, o32, x, rows, 128, &wf);
    double err = 0.0, norm = 0.0;
    for (int i = 0; i < rows * 128; i++) {
        err += ((double)o8[i] - o32[i]) * ((double)o8[i] - o32[i]);
        norm += (double)o32[i] * o32[i];
    }
    /* ~5% per quantized matmul, three in a row and a product: ~6% here; garbage would be ~100% */
    ASSERT_TRUE(norm > 0.0 && sqrt(err / norm) < 0.12);
    rs_backend_free(b);
    free(x), free(o8), free(o32), free(gf), free(uf), free(df);
    free_fp8moe(&m);
}

/* ---- a rough speed print (not an assertion): FP8 vs BF16 [3072][1024], batch 1 and 16 ---- */

RS_TEST(cpu_matmul_fp8_speed_print) {
    uint64_t s = 10;
    const int64_t n = 3072, k = 1024;
    fp8w w8 = make_fp8_weight(n, k, 0.05f, &s);
    uint16_t *wb = malloc((size_t)(n * k) * sizeof(uint16_t));
    for (int64_t i = 0; i < n * k; i++) wb[i] = rs_f32_to_bf16(w8.wf[i]);
    rs_tensor w16 = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {n, k}, .data = wb};
    float *x = malloc(16 * k * sizeof(float)), *out = malloc(16 * n * sizeof(float));
    for (int64_t i = 0; i < 16 * k; i++) x[i] = rng_sym(&s);
    rs_backend *b = rs_backend_cpu_init(0);
    for (int rows = 1; rows <= 16; rows *= 16) {
        double t[2];
        for (int v = 0; v < 2; v++) {
            const rs_tensor *w = v ? &w16 : &w8.t;
            rs_op_matmul(b, out, x, w, NULL, rows);
            int iters = rows == 1 ? 100 : 10;
            double t0 = rs_now_s();
            for (int i = 0; i < iters; i++) rs_op_matmul(b, out, x, w, NULL, rows);
            t[v] = (rs_now_s() - t0) / iters;
        }
        printf("  matmul 3072x1024 rows %2d: fp8 %7.1f us  bf16 %7.1f us  (fp8/bf16 %.2f, weights in cache)\n", rows,
               t[0] * 1e6, t[1] * 1e6, t[0] / t[1]);
    }
    rs_backend_free(b);
    free(x), free(out), free(wb);
    free_fp8_weight(&w8);
}
