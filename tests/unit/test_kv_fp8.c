/*
 * test_kv_fp8.c — the FP8 (E4M3) KV cache: codes, scales, attention, the pool, calibration.
 *
 * References, chosen so that a bug cannot hide in both sides:
 *   - codes and per-token scales against rs_fp8_e4m3_from_f32 (itself checked against CUDA's
 *     encoder on all 2^32 inputs) applied to x / scale, bit for bit;
 *   - the vector decoders against the rs_fp8_e4m3_f32 table on all 256 codes;
 *   - attention over E4M3 pages against attention over fp32 pages holding the dequantized values
 *     code * scale (the sharp test: only the folding of the scales differs, so they agree to fp32
 *     rounding), on every SIMD level with 1 and 2 threads and a mixed prefill/decode batch;
 *   - the accuracy of FP8 KV against fp32 KV of the unquantized values (a bound, and the numbers);
 *   - calibration against the pages of an fp32 forward pass run here, with a sort-based percentile.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_attention_simd.h"
#include "../../kernels/cpu/cpu_internal.h"
#include "../../kernels/fp8.h"
#include "../../model/kv_calibrate.h"
#include "../../kvcache/kvcache.h"
#include "../../model/presets.h"
#include "test.h"
#include "test_util.h"

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

static float rng_normal(uint64_t *s) {
    double u1 = ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
    double u2 = ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

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

static bool same_float(float a, float b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0; }

/* ---- a paged layer of any dtype, allocated here (not through the pool) ---- */

static rs_kv_layer layer_new(rs_backend *b, rs_dtype dt, rs_kv_scale_mode mode, int n_blocks, int n_kv, int hd) {
    rs_kv_layer kv = {.dtype = dt, .n_blocks = n_blocks, .n_kv_heads = n_kv, .head_dim = hd, .scale_mode = mode};
    kv.pages = rs_backend_alloc(b, (size_t)n_blocks * 2 * RS_KV_BLOCK * (size_t)n_kv * (size_t)hd * rs_dtype_size(dt));
    if (mode == RS_KV_SCALE_PER_HEAD) {
        kv.k_scale = rs_backend_alloc(b, (size_t)n_kv * sizeof(float));
        kv.v_scale = rs_backend_alloc(b, (size_t)n_kv * sizeof(float));
    } else if (mode == RS_KV_SCALE_PER_TOKEN) {
        kv.token_scales = rs_backend_alloc(b, (size_t)n_blocks * 2 * RS_KV_BLOCK * (size_t)n_kv * sizeof(float));
    }
    return kv;
}

/* Element index of (slot, half, head, i) in the pages; the scale index drops i. */
static size_t page_index(const rs_kv_layer *kv, int64_t slot, int half, int h, int i) {
    size_t block = (size_t)(slot / RS_KV_BLOCK), off = (size_t)(slot % RS_KV_BLOCK);
    return (((block * 2 + (size_t)half) * RS_KV_BLOCK + off) * (size_t)kv->n_kv_heads + (size_t)h) *
               (size_t)kv->head_dim + (size_t)i;
}

static float scale_of(const rs_kv_layer *kv, int64_t slot, int half, int h) {
    if (kv->scale_mode == RS_KV_SCALE_PER_HEAD) return (half ? kv->v_scale : kv->k_scale)[h];
    return kv->token_scales[page_index(kv, slot, half, h, 0) / (size_t)kv->head_dim];
}

/* An fp32 layer holding code * scale for every element of the E4M3 layer src. */
static rs_kv_layer dequantized_copy(rs_backend *b, const rs_kv_layer *src) {
    rs_kv_layer f = layer_new(b, RS_DTYPE_F32, RS_KV_SCALE_NONE, src->n_blocks, src->n_kv_heads, src->head_dim);
    const uint8_t *codes = src->pages;
    for (int64_t slot = 0; slot < (int64_t)src->n_blocks * RS_KV_BLOCK; slot++)
        for (int half = 0; half < 2; half++)
            for (int h = 0; h < src->n_kv_heads; h++) {
                float s = scale_of(src, slot, half, h);
                for (int i = 0; i < src->head_dim; i++) {
                    size_t at = page_index(src, slot, half, h, i);
                    ((float *)f.pages)[at] = rs_fp8_e4m3_f32[codes[at]] * s;
                }
            }
    return f;
}

/* ---- a mixed batch over shuffled pages (as in test_cpu_ops.c): B continues a prefill at 20..52,
 * A decodes at 37, C starts a prefill of 5; step 0 stores the history, step 1 this step's rows ---- */

enum { N_SEQ = 3, MAX_BLOCKS = 4, N_PAGES = 16, MAX_ROWS = 128 };
static const int seq_hist[N_SEQ] = {20, 37, 0};
static const int seq_rows[N_SEQ] = {33, 1, 5};

typedef enum data_kind { DATA_UNIFORM, DATA_OUTLIERS } data_kind;

typedef struct scen {
    int n_kv, hd;
    size_t kvrow;
    int32_t block_tables[N_SEQ * MAX_BLOCKS];
    int32_t pos[2][MAX_ROWS], slot[2][MAX_ROWS], starts[2][N_SEQ + 1], seq_ctx[2][N_SEQ], tokens[MAX_ROWS];
    float *k[2], *v[2]; /* [MAX_ROWS][n_kv][hd] per step */
    rs_batch batch[2];
} scen;

/* DATA_OUTLIERS: Gaussian K with a few channels 10x larger (the K outliers of models without
 * QK-norm) and Gaussian V; DATA_UNIFORM: K in [-1.5, 1.5), V in [-1, 1). */
static float draw(data_kind kind, int half, int i, uint64_t *rng) {
    if (kind == DATA_UNIFORM) return (half ? 1.0f : 1.5f) * rng_uniform(rng);
    float x = rng_normal(rng);
    return half == 0 && i % 32 == 5 ? 10.0f * x : x;
}

static void scen_init(scen *s, int n_kv, int hd, data_kind kind, uint64_t *rng) {
    memset(s, 0, sizeof *s);
    s->n_kv = n_kv, s->hd = hd, s->kvrow = (size_t)n_kv * (size_t)hd;
    int32_t pages[N_PAGES];
    for (int i = 0; i < N_PAGES; i++) pages[i] = i;
    for (int i = N_PAGES - 1; i > 0; i--) {
        int j = (int)(rng_next(rng) % (uint64_t)(i + 1));
        int32_t t = pages[i];
        pages[i] = pages[j], pages[j] = t;
    }
    for (int i = 0; i < N_SEQ * MAX_BLOCKS; i++) s->block_tables[i] = pages[i];
    for (int step = 0; step < 2; step++) {
        s->k[step] = malloc(MAX_ROWS * s->kvrow * sizeof(float));
        s->v[step] = malloc(MAX_ROWS * s->kvrow * sizeof(float));
        int n = 0;
        for (int q = 0; q < N_SEQ; q++) {
            s->starts[step][q] = n;
            int p0 = step == 0 ? 0 : seq_hist[q], p1 = step == 0 ? seq_hist[q] : seq_hist[q] + seq_rows[q];
            for (int p = p0; p < p1; p++, n++) {
                s->pos[step][n] = p;
                s->slot[step][n] = s->block_tables[q * MAX_BLOCKS + p / RS_KV_BLOCK] * RS_KV_BLOCK + p % RS_KV_BLOCK;
                for (size_t i = 0; i < s->kvrow; i++) {
                    s->k[step][(size_t)n * s->kvrow + i] = draw(kind, 0, (int)(i % (size_t)hd), rng);
                    s->v[step][(size_t)n * s->kvrow + i] = draw(kind, 1, (int)(i % (size_t)hd), rng);
                }
            }
            s->seq_ctx[step][q] = p1;
        }
        s->starts[step][N_SEQ] = n;
        s->batch[step] = (rs_batch){.n_tok = n,
                                    .n_seq = N_SEQ,
                                    .tokens = s->tokens,
                                    .pos = s->pos[step],
                                    .slot = s->slot[step],
                                    .seq_start = s->starts[step],
                                    .seq_ctx = s->seq_ctx[step],
                                    .block_tables = s->block_tables,
                                    .max_blocks = MAX_BLOCKS};
    }
}

static void scen_free(scen *s) {
    for (int step = 0; step < 2; step++) free(s->k[step]), free(s->v[step]);
}

static void scen_store(rs_backend *b, scen *s, rs_kv_layer *kv) {
    for (int step = 0; step < 2; step++) rs_op_kv_store(b, kv, s->k[step], s->v[step], &s->batch[step]);
}

/* Per-head amax / 448 over every K (V) row of the scenario. */
static void scen_head_scales(const scen *s, float *ks, float *vs) {
    for (int h = 0; h < s->n_kv; h++) {
        float ka = 0.0f, va = 0.0f;
        for (int step = 0; step < 2; step++)
            for (int r = 0; r < s->batch[step].n_tok; r++)
                for (int i = 0; i < s->hd; i++) {
                    size_t at = (size_t)r * s->kvrow + (size_t)h * (size_t)s->hd + (size_t)i;
                    ka = fmaxf(ka, fabsf(s->k[step][at]));
                    va = fmaxf(va, fabsf(s->v[step][at]));
                }
        ks[h] = ka / RS_FP8_E4M3_MAX;
        vs[h] = va / RS_FP8_E4M3_MAX;
    }
}

/* Attention of the scenario's step-1 rows; returns a new [n_tok][n_heads][hd] buffer. */
static float *scen_attention(rs_backend *b, const scen *s, const rs_kv_layer *kv, int n_heads, const float *q) {
    size_t n = (size_t)s->batch[1].n_tok * (size_t)n_heads * (size_t)s->hd;
    float *out = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) out[i] = NAN; /* every element must be written */
    rs_op_attention(b, out, q, kv, n_heads, 1.0f / sqrtf((float)s->hd), &s->batch[1]);
    return out;
}

typedef struct err_stats {
    double max_abs, rms_err, rms_ref;
} err_stats;

static err_stats compare(const float *got, const float *ref, size_t n) {
    err_stats e = {0};
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - (double)ref[i];
        if (isnan(d)) d = INFINITY;
        e.max_abs = fmax(e.max_abs, fabs(d));
        e.rms_err += d * d;
        e.rms_ref += (double)ref[i] * ref[i];
    }
    e.rms_err = sqrt(e.rms_err / (double)n);
    e.rms_ref = sqrt(e.rms_ref / (double)n);
    return e;
}

/* ---- decoding ---- */

RS_TEST(kv_fp8_decode_matches_table_all_codes) {
    uint8_t codes[256 + 7];
    float got[256 + 7];
    for (int i = 0; i < 256 + 7; i++) codes[i] = (uint8_t)(i * 37 + 11);
    for (int simd = 0; simd <= max_simd(); simd++) {
        const rs_cpu_kv_vec *v = rs_cpu_kv_vec_for((rs_cpu_simd)simd);
        for (int n = 0; n <= 256 + 7; n += (n < 40 ? 1 : 37)) {
            memset(got, 0, sizeof got);
            v->decode(got, codes, n);
            for (int i = 0; i < n; i++)
                if (!same_float(got[i], rs_fp8_e4m3_f32[codes[i]]))
                    RS_TEST_FAIL("simd %d n %d: code 0x%02x decodes to %.9g, table %.9g", simd, n, codes[i],
                                 (double)got[i], (double)rs_fp8_e4m3_f32[codes[i]]);
        }
    }
}

/* scores and accum on one page against double loops over the table, for each page format (the
 * same values as E4M3 codes, BF16 and F32: E4M3 values are exact in both): every head count 1..11
 * (the kernels take 2, 4 or 8 heads at a time), head dims that leave every tail, 1..16 rows, a
 * row stride wider than the head (rows of other heads in between). A row's score is also the same
 * bits when it is scored alone, in a one-row page: no slot or page length changes it. */
RS_TEST(kv_page_kernels_match_reference) {
    enum { MAXG = 11, MAXD = 72, STRIDE = 3 * MAXD, LD = 40, NPAGE = RS_KV_BLOCK * STRIDE };
    uint64_t rng = 3;
    static uint8_t page[NPAGE];
    static uint16_t page_bf16[NPAGE];
    static float page_f32[NPAGE];
    float q[MAXG * MAXD], p[MAXG * LD], sc[MAXG * LD], one[MAXG], out[MAXG * MAXD], out0[MAXG * MAXD];
    for (size_t i = 0; i < NPAGE; i++) {
        uint8_t c = (uint8_t)rng_next(&rng);
        page[i] = (c & 0x7f) == 0x7f ? 0x7e : c; /* finite codes: NaN has its own check below */
        page_f32[i] = rs_fp8_e4m3_f32[page[i]];
        page_bf16[i] = rs_f32_to_bf16(page_f32[i]);
        ASSERT_TRUE(rs_bf16_to_f32(page_bf16[i]) == page_f32[i]);
    }
    for (int i = 0; i < MAXG * MAXD; i++) q[i] = rng_uniform(&rng), out0[i] = rng_uniform(&rng);
    for (int i = 0; i < MAXG * LD; i++) p[i] = 0.5f * (rng_uniform(&rng) + 1.0f);
    static const int dims[] = {1, 7, 8, 15, 16, 17, 24, 33, 64, 72};
    static const rs_dtype dts[] = {RS_DTYPE_E4M3, RS_DTYPE_BF16, RS_DTYPE_F32};
    for (int simd = 0; simd <= max_simd(); simd++) {
        const rs_cpu_kv_vec *v = rs_cpu_kv_vec_for((rs_cpu_simd)simd);
        for (size_t ti = 0; ti < RS_ARRAY_LEN(dts); ti++) {
            const rs_dtype dt = dts[ti];
            const size_t es = rs_dtype_size(dt);
            const char *base = dt == RS_DTYPE_E4M3 ? (const char *)page
                               : dt == RS_DTYPE_BF16 ? (const char *)page_bf16
                                                     : (const char *)page_f32;
            const char *pg = base + 5 * es; /* rows start 5 elements in */
            for (size_t di = 0; di < RS_ARRAY_LEN(dims); di++) {
                int hd = dims[di];
                for (int g = 1; g <= MAXG; g++) {
                    for (int n = 1; n <= RS_KV_BLOCK; n += (n < 3 ? 1 : 6)) {
                        v->scores(sc, LD, q, g, pg, dt, STRIDE, n, hd);
                        memcpy(out, out0, sizeof out);
                        v->accum(out, p, LD, g, pg, dt, STRIDE, n, hd);
                        for (int h = 0; h < g; h++) {
                            for (int t = 0; t < n; t++) {
                                double ref = 0, mag = 0;
                                for (int i = 0; i < hd; i++) {
                                    double x = (double)q[h * hd + i] * rs_fp8_e4m3_f32[page[5 + t * STRIDE + i]];
                                    ref += x, mag += fabs(x);
                                }
                                if (!(fabs(sc[h * LD + t] - ref) <= 1e-6 * mag))
                                    RS_TEST_FAIL("scores simd %d %s hd %d g %d n %d [%d][%d]: %.9g want %.9g", simd,
                                                 rs_dtype_name(dt), hd, g, n, h, t, (double)sc[h * LD + t], ref);
                            }
                            for (int i = 0; i < hd; i++) {
                                double ref = out0[h * hd + i], mag = fabs(ref);
                                for (int t = 0; t < n; t++) {
                                    double x = (double)p[h * LD + t] * rs_fp8_e4m3_f32[page[5 + t * STRIDE + i]];
                                    ref += x, mag += fabs(x);
                                }
                                if (!(fabs(out[h * hd + i] - ref) <= 1e-6 * mag))
                                    RS_TEST_FAIL("accum simd %d %s hd %d g %d n %d [%d][%d]: %.9g want %.9g", simd,
                                                 rs_dtype_name(dt), hd, g, n, h, i, (double)out[h * hd + i], ref);
                            }
                            for (int i = hd; i < MAXD && h == g - 1; i++) /* nothing past the last head */
                                ASSERT_TRUE(out[h * hd + i] == out0[h * hd + i]);
                        }
                        for (int t = 0; t < n; t++) { /* row t alone: the same bits */
                            v->scores(one, 1, q, g, pg + (size_t)t * STRIDE * es, dt, STRIDE, 1, hd);
                            for (int h = 0; h < g; h++)
                                if (!same_float(one[h], sc[h * LD + t]))
                                    RS_TEST_FAIL("scores simd %d %s hd %d g %d: row %d of %d alone %.9g, in the "
                                                 "page %.9g", simd, rs_dtype_name(dt), hd, g, t, n, (double)one[h],
                                                 (double)sc[h * LD + t]);
                        }
                    }
                }
            }
        }
        /* a NaN code poisons what it touches, on every path */
        uint8_t nan_page[2 * 32] = {0};
        nan_page[32 + 20] = 0xff;
        float s2[2], o2[32] = {0}, w[2] = {1.0f, 1.0f};
        v->scores(s2, 1, q, 1, nan_page, RS_DTYPE_E4M3, 32, 2, 32);
        ASSERT_TRUE(!isnan(s2[0]) && isnan(s2[1]));
        v->accum(o2, w, 1, 1, nan_page, RS_DTYPE_E4M3, 32, 2, 32);
        ASSERT_TRUE(isnan(o2[20]) && !isnan(o2[19]));
    }
}

/* ---- kv_store ---- */

/* The stored codes against the scalar encoder of the true quotient, at every SIMD level (each
 * encodes with its own vector encoder), for head dims below and above the encoder's 256-value
 * pieces, with and without a vector tail. */
static void check_store_codes(int simd, int hd, uint64_t *rng_p) {
    uint64_t rng = *rng_p;
    const int n_kv = 3;
    for (int mode = RS_KV_SCALE_PER_HEAD; mode <= RS_KV_SCALE_PER_TOKEN; mode++) {
        for (int threads = 1; threads <= 2; threads++) {
            scen s;
            scen_init(&s, n_kv, hd, DATA_OUTLIERS, &rng);
            /* edge rows of step 1: all zeros (amax floor), a NaN, huge values, subnormal-range values */
            float *k1 = s.k[1], *v1 = s.v[1];
            for (size_t i = 0; i < (size_t)hd; i++) k1[i] = 0.0f;
            k1[s.kvrow + 3] = NAN;
            for (size_t i = 0; i < (size_t)hd; i++) v1[2 * s.kvrow + i] = 1e30f * (i % 2 ? 1.0f : -1.0f);
            for (size_t i = 0; i < (size_t)hd; i++) v1[3 * s.kvrow + (size_t)hd + i] = 1e-4f * rng_uniform(&rng);
            v1[3 * s.kvrow + (size_t)hd] = 3e-1f;
            rs_backend *b = backend_at(threads, simd);
            rs_kv_layer kv = layer_new(b, RS_DTYPE_E4M3, (rs_kv_scale_mode)mode, N_PAGES, n_kv, hd);
            if (mode == RS_KV_SCALE_PER_HEAD) { /* arbitrary, some so small that values saturate */
                const float ks[3] = {0.01f, 0.003f, 1.0f / 3.0f}, vs[3] = {0.02f, 1e-3f, 7.0f};
                memcpy(kv.k_scale, ks, sizeof ks), memcpy(kv.v_scale, vs, sizeof vs);
            }
            scen_store(b, &s, &kv);
            int n_sat = 0;
            for (int step = 0; step < 2; step++) {
                for (int r = 0; r < s.batch[step].n_tok; r++) {
                    for (int half = 0; half < 2; half++) {
                        const float *x = (half ? s.v[step] : s.k[step]) + (size_t)r * s.kvrow;
                        int64_t slot = s.slot[step][r];
                        for (int h = 0; h < n_kv; h++) {
                            const float *xh = x + (size_t)h * hd;
                            float want_s;
                            if (mode == RS_KV_SCALE_PER_HEAD) {
                                want_s = (half ? kv.v_scale : kv.k_scale)[h];
                            } else {
                                float amax = 0.0f;
                                for (int i = 0; i < hd; i++)
                                    if (!isnan(xh[i])) amax = fabsf(xh[i]) > amax ? fabsf(xh[i]) : amax;
                                want_s = (amax > 1e-10f ? amax : 1e-10f) / 448.0f;
                                ASSERT_TRUE(same_float(scale_of(&kv, slot, half, h), want_s));
                            }
                            for (int i = 0; i < hd; i++) {
                                uint8_t got = ((uint8_t *)kv.pages)[page_index(&kv, slot, half, h, i)];
                                uint8_t want = rs_fp8_e4m3_from_f32(xh[i] / want_s);
                                if (got != want)
                                    RS_TEST_FAIL("simd %d hd %d mode %d step %d row %d half %d head %d [%d]: x %.9g "
                                                 "scale %.9g: code 0x%02x, want 0x%02x",
                                                 simd, hd, mode, step, r, half, h, i, (double)xh[i], (double)want_s,
                                                 got, want);
                                n_sat += (got & 0x7f) == 0x7e;
                            }
                        }
                    }
                }
            }
            /* the NaN becomes the NaN code; the per-head scales above do saturate some values */
            ASSERT_EQ(((uint8_t *)kv.pages)[page_index(&kv, s.slot[1][1], 0, 0, 3)], RS_FP8_NAN_CODE);
            ASSERT_TRUE(n_sat > 0);
            rs_test_kv_layer_free(b, &kv);
            rs_backend_free(b);
            scen_free(&s);
        }
    }
    *rng_p = rng;
}

RS_TEST(kv_fp8_store_codes_bit_exact) {
    uint64_t rng = 5;
    for (int simd = 0; simd <= max_simd(); simd++)
        for (int hd = 40; hd <= 300; hd += 260) check_store_codes(simd, hd, &rng);
}

/* ---- attention ---- */

/* E4M3 pages vs fp32 pages holding exactly code * scale: the scales are folded (k into the logit
 * scale, v into the output, or per token), which only reassociates fp32 products. */
static void check_folding(int n_heads, int n_kv, int hd, rs_kv_scale_mode mode, int threads, int simd, uint64_t *rng) {
    scen s;
    scen_init(&s, n_kv, hd, DATA_OUTLIERS, rng);
    rs_backend *b = backend_at(threads, simd);
    rs_kv_layer kv = layer_new(b, RS_DTYPE_E4M3, mode, N_PAGES, n_kv, hd);
    if (mode == RS_KV_SCALE_PER_HEAD) { /* amax / 448 times 0.5..2: some values saturate */
        scen_head_scales(&s, kv.k_scale, kv.v_scale);
        for (int h = 0; h < n_kv; h++) {
            kv.k_scale[h] *= 0.5f + 1.5f * (float)h / (float)n_kv;
            kv.v_scale[h] *= 2.0f - 1.5f * (float)h / (float)n_kv;
        }
    }
    scen_store(b, &s, &kv);
    rs_kv_layer ref = dequantized_copy(b, &kv);
    size_t n = (size_t)s.batch[1].n_tok * (size_t)n_heads * (size_t)hd;
    float *q = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) q[i] = 2.0f * rng_normal(rng);
    float *got = scen_attention(b, &s, &kv, n_heads, q), *want = scen_attention(b, &s, &ref, n_heads, q);
    err_stats e = compare(got, want, n);
    /* fp32 rounding of reassociated products: observed rms <= 1e-6, max <= 2e-5 of the output rms
     * (the scalar path's sequential sums are the loosest); a scale applied to the wrong head, token
     * or half would be off by tens of percent */
    if (!(e.rms_err <= 1e-5 * e.rms_ref && e.max_abs <= 5e-5 * e.rms_ref))
        RS_TEST_FAIL("mode %d heads %d/%d hd %d threads %d simd %d: E4M3 vs fp32(dequantized): rms error %.3g, max "
                     "%.3g, output rms %.3g",
                     (int)mode, n_heads, n_kv, hd, threads, simd, e.rms_err, e.max_abs, e.rms_ref);
    free(got), free(want), free(q);
    rs_test_kv_layer_free(b, &ref);
    rs_test_kv_layer_free(b, &kv);
    rs_backend_free(b);
    scen_free(&s);
}

RS_TEST(kv_fp8_attention_equals_dequantized_f32) {
    uint64_t rng = 17;
    for (int simd = 0; simd <= max_simd(); simd++) {
        for (int threads = 1; threads <= 2; threads++) {
            for (int mode = RS_KV_SCALE_PER_HEAD; mode <= RS_KV_SCALE_PER_TOKEN; mode++) {
                check_folding(6, 2, 24, (rs_kv_scale_mode)mode, threads, simd, &rng);
                check_folding(4, 4, 64, (rs_kv_scale_mode)mode, threads, simd, &rng);
                check_folding(8, 2, 128, (rs_kv_scale_mode)mode, threads, simd, &rng);
                check_folding(16, 2, 128, (rs_kv_scale_mode)mode, threads, simd, &rng);
                check_folding(2, 1, 7, (rs_kv_scale_mode)mode, threads, simd, &rng);
                check_folding(3, 3, 33, (rs_kv_scale_mode)mode, threads, simd, &rng);
            }
        }
    }
}

/* FP8 KV vs fp32 KV of the same (unquantized) K/V: the quantization error of the output, and for
 * scale the error of the stored K/V elements themselves (*elem: rms |code * scale - x| / rms |x|). */
static err_stats fp8_error(int n_heads, int n_kv, int hd, rs_kv_scale_mode mode, data_kind kind, float q_amp,
                           uint64_t *rng, double *elem) {
    scen s;
    scen_init(&s, n_kv, hd, kind, rng);
    rs_backend *b = rs_backend_cpu_init(2);
    rs_kv_layer kv = layer_new(b, RS_DTYPE_E4M3, mode, N_PAGES, n_kv, hd);
    rs_kv_layer f = layer_new(b, RS_DTYPE_F32, RS_KV_SCALE_NONE, N_PAGES, n_kv, hd);
    if (mode == RS_KV_SCALE_PER_HEAD) scen_head_scales(&s, kv.k_scale, kv.v_scale);
    scen_store(b, &s, &kv);
    scen_store(b, &s, &f);
    rs_kv_layer deq = dequantized_copy(b, &kv);
    size_t n_el = (size_t)N_PAGES * 2 * RS_KV_BLOCK * s.kvrow; /* unwritten slots are 0 in both */
    err_stats ee = compare(deq.pages, f.pages, n_el);
    *elem = ee.rms_err / ee.rms_ref;
    size_t n = (size_t)s.batch[1].n_tok * (size_t)n_heads * (size_t)hd;
    float *q = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) q[i] = q_amp * rng_normal(rng);
    float *got = scen_attention(b, &s, &kv, n_heads, q), *want = scen_attention(b, &s, &f, n_heads, q);
    err_stats e = compare(got, want, n);
    free(got), free(want), free(q);
    rs_test_kv_layer_free(b, &deq);
    rs_test_kv_layer_free(b, &f);
    rs_test_kv_layer_free(b, &kv);
    rs_backend_free(b);
    scen_free(&s);
    return e;
}

/* E4M3 keeps 3 mantissa bits: each stored element is off by ~3% rms, and attention over random,
 * uncorrelated V averages the error no better than it averages the values, so the output error
 * sits near that floor (higher when a sharper softmax amplifies score errors). The bounds are
 * that floor with headroom; the numbers are printed. */
RS_TEST(kv_fp8_attention_accuracy_vs_f32) {
    static const char *kinds[] = {"uniform", "gaussian+K outliers"};
    uint64_t rng = 23;
    for (int mode = RS_KV_SCALE_PER_HEAD; mode <= RS_KV_SCALE_PER_TOKEN; mode++) {
        for (int kind = DATA_UNIFORM; kind <= DATA_OUTLIERS; kind++) {
            for (int sharp = 0; sharp <= 1; sharp++) { /* q x3: peaked softmax, score errors amplified */
                double worst = 0, sum = 0, elem = 0;
                for (int rep = 0; rep < 4; rep++) {
                    err_stats e = fp8_error(8, 2, 128, (rs_kv_scale_mode)mode, (data_kind)kind, sharp ? 3.0f : 1.0f,
                                            &rng, &elem);
                    double rel = e.rms_err / e.rms_ref;
                    worst = fmax(worst, rel), sum += rel;
                    if (!(rel < (sharp ? 0.09 : 0.06)))
                        RS_TEST_FAIL("%s, %s, q x%d: rms error %.4f of output rms %.4f (max abs %.4f)",
                                     mode == RS_KV_SCALE_PER_HEAD ? "per-head" : "per-token", kinds[kind],
                                     sharp ? 3 : 1, e.rms_err, e.rms_ref, e.max_abs);
                }
                printf("  fp8 kv %-9s %-20s q x%d: attention rms error %.2f%% of output rms (worst %.2f%%); "
                       "K/V elements %.2f%%\n",
                       mode == RS_KV_SCALE_PER_HEAD ? "per-head" : "per-token", kinds[kind], sharp ? 3 : 1,
                       100 * sum / 4, 100 * worst, 100 * elem);
            }
        }
    }
}

RS_TEST(kv_fp8_bf16_and_f32_pages_unchanged) {
    /* the scale-free path still works next to the new one: BF16 pages against fp32 pages of the
     * bf16-rounded values agree exactly (same kernels, same values) */
    uint64_t rng = 29;
    scen s;
    scen_init(&s, 2, 64, DATA_UNIFORM, &rng);
    for (int step = 0; step < 2; step++)
        for (size_t i = 0; i < MAX_ROWS * s.kvrow; i++) {
            s.k[step][i] = rs_bf16_to_f32(rs_f32_to_bf16(s.k[step][i]));
            s.v[step][i] = rs_bf16_to_f32(rs_f32_to_bf16(s.v[step][i]));
        }
    rs_backend *b = rs_backend_cpu_init(2);
    rs_kv_layer h = layer_new(b, RS_DTYPE_BF16, RS_KV_SCALE_NONE, N_PAGES, 2, 64);
    rs_kv_layer f = layer_new(b, RS_DTYPE_F32, RS_KV_SCALE_NONE, N_PAGES, 2, 64);
    scen_store(b, &s, &h);
    scen_store(b, &s, &f);
    size_t n = (size_t)s.batch[1].n_tok * 4 * 64;
    float *q = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) q[i] = rng_normal(&rng);
    float *a = scen_attention(b, &s, &h, 4, q), *c = scen_attention(b, &s, &f, 4, q);
    err_stats e = compare(a, c, n);
    ASSERT_TRUE(e.max_abs <= 1e-6 * e.rms_ref);
    free(a), free(c), free(q);
    rs_test_kv_layer_free(b, &h), rs_test_kv_layer_free(b, &f);
    rs_backend_free(b);
    scen_free(&s);
}

/* ---- the pool ---- */

RS_TEST(kv_fp8_pool_sizes_and_validates) {
    rs_backend *b = rs_backend_cpu_init(1);
    enum { L = 3, H = 2, D = 16 };
    rs_kv_pool p;
    size_t page = 2 * RS_KV_BLOCK * H * D, ts = 2 * RS_KV_BLOCK * H * sizeof(float);

    rs_kv_cache_opts per_token = {RS_DTYPE_E4M3, RS_KV_SCALE_PER_TOKEN};
    ASSERT_EQ(rs_kv_pool_init_ex(&p, b, L, H, D, &per_token, 10 * L * (page + ts) + 5), RS_OK);
    ASSERT_EQ(rs_kv_bytes_per_block(&p), L * (page + ts));
    ASSERT_EQ(p.n_blocks, 10);
    ASSERT_EQ(p.bytes, 10 * L * (page + ts));
    ASSERT_TRUE(p.layers[1].token_scales && !p.layers[1].k_scale && p.layers[1].scale_mode == RS_KV_SCALE_PER_TOKEN);
    float ks[L * H], vs[L * H];
    ASSERT_EQ(rs_kv_pool_get_scales(&p, ks, vs), RS_EINVAL);
    ASSERT_EQ(rs_kv_pool_set_scales(&p, ks, vs), RS_EINVAL);
    rs_kv_pool_free(&p);

    rs_kv_cache_opts per_head = {RS_DTYPE_E4M3, RS_KV_SCALE_PER_HEAD};
    size_t fixed = L * 2 * H * sizeof(float);
    ASSERT_EQ(rs_kv_pool_init_ex(&p, b, L, H, D, &per_head, 10 * L * page + fixed), RS_OK);
    ASSERT_EQ(rs_kv_bytes_per_block(&p), L * page);
    ASSERT_EQ(p.n_blocks, 10);
    ASSERT_EQ(p.bytes, 10 * L * page + fixed);
    ASSERT_EQ(rs_kv_pool_get_scales(&p, ks, vs), RS_OK);
    for (int i = 0; i < L * H; i++) ASSERT_TRUE(ks[i] == 1.0f && vs[i] == 1.0f);

    /* rejected: NaN, 0, negative, inf, in either array; nothing changes */
    float good[L * H], bad[L * H];
    for (int i = 0; i < L * H; i++) good[i] = 0.01f * (float)(i + 1);
    const float poison[] = {NAN, 0.0f, -0.5f, INFINITY, -0.0f};
    for (size_t k = 0; k < RS_ARRAY_LEN(poison); k++) {
        memcpy(bad, good, sizeof bad);
        bad[L * H - 1 - (int)k] = poison[k];
        ASSERT_EQ(rs_kv_pool_set_scales(&p, bad, good), RS_EINVAL);
        ASSERT_EQ(rs_kv_pool_set_scales(&p, good, bad), RS_EINVAL);
    }
    ASSERT_EQ(rs_kv_pool_get_scales(&p, ks, vs), RS_OK);
    for (int i = 0; i < L * H; i++) ASSERT_TRUE(ks[i] == 1.0f && vs[i] == 1.0f);
    /* accepted: uploaded per layer, and the prefix cache (written with the old scales) flushed */
    uint64_t epoch = p.epoch;
    ASSERT_EQ(rs_kv_pool_set_scales(&p, good, good), RS_OK);
    ASSERT_EQ(p.epoch, epoch + 1);
    ASSERT_EQ(rs_kv_pool_get_scales(&p, ks, vs), RS_OK);
    for (int i = 0; i < L * H; i++) ASSERT_TRUE(ks[i] == good[i] && vs[i] == good[i]);
    ASSERT_TRUE(p.layers[2].k_scale[1] == good[2 * H + 1]);
    rs_kv_pool_free(&p);

    /* dtype / scale mode pairs */
    const rs_kv_cache_opts wrong[] = {{RS_DTYPE_F32, RS_KV_SCALE_PER_HEAD},
                                      {RS_DTYPE_BF16, RS_KV_SCALE_PER_TOKEN},
                                      {RS_DTYPE_E4M3, RS_KV_SCALE_NONE},
                                      {RS_DTYPE_E5M2, RS_KV_SCALE_PER_HEAD},
                                      {RS_DTYPE_F16, RS_KV_SCALE_NONE}};
    for (size_t k = 0; k < RS_ARRAY_LEN(wrong); k++)
        ASSERT_EQ(rs_kv_pool_init_ex(&p, b, L, H, D, &wrong[k], 1 << 20), RS_EINVAL);
    ASSERT_EQ(rs_kv_pool_init(&p, b, L, H, D, RS_DTYPE_E4M3, 1 << 20), RS_EINVAL);
    ASSERT_EQ(rs_kv_pool_init(&p, b, L, H, D, RS_DTYPE_BF16, 4 * L * page * 2), RS_OK);
    ASSERT_EQ(p.n_blocks, 4);
    ASSERT_EQ(p.scale_mode, RS_KV_SCALE_NONE);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

RS_TEST(kv_fp8_cow_copies_token_scales) {
    rs_backend *b = rs_backend_cpu_init(1);
    enum { L = 2, H = 2, D = 8 };
    rs_kv_cache_opts o = {RS_DTYPE_E4M3, RS_KV_SCALE_PER_TOKEN};
    rs_kv_pool p;
    rs_kv_pool shape = {.n_layers = L, .n_kv_heads = H, .head_dim = D, .dtype = RS_DTYPE_E4M3,
                        .scale_mode = RS_KV_SCALE_PER_TOKEN};
    ASSERT_EQ(rs_kv_pool_init_ex(&p, b, L, H, D, &o, 8 * rs_kv_bytes_per_block(&shape)), RS_OK);
    ASSERT_EQ(p.n_blocks, 8);
    rs_kv_seq a = {0}, c = {0};
    ASSERT_EQ(rs_kv_seq_reserve(&p, &a, 20), RS_OK); /* blocks 0 (full) and 1 (partial) */
    uint64_t rng = 31;
    float k[20 * H * D], v[20 * H * D];
    for (int i = 0; i < 20 * H * D; i++) k[i] = 4.0f * rng_uniform(&rng), v[i] = rng_uniform(&rng);
    int32_t pos[20], slot[20], start[2] = {0, 20}, ctx[1] = {20}, tok[20] = {0};
    for (int i = 0; i < 20; i++) pos[i] = i, slot[i] = rs_kv_slot(&a, i);
    rs_batch bt = {.n_tok = 20, .n_seq = 1, .tokens = tok, .pos = pos, .slot = slot, .seq_start = start,
                   .seq_ctx = ctx, .block_tables = a.blocks, .max_blocks = a.n_blocks};
    for (int l = 0; l < L; l++) rs_op_kv_store(b, &p.layers[l], k, v, &bt);

    rs_kv_seq_fork(&p, &a, &c);
    int32_t old = c.blocks[1];
    ASSERT_EQ(rs_kv_seq_prepare_write(&p, &c, 20), RS_OK);
    int32_t fresh = c.blocks[1];
    ASSERT_NE(fresh, old);
    size_t ts_block = 2 * RS_KV_BLOCK * H, page = ts_block * D;
    for (int l = 0; l < L; l++) {
        const rs_kv_layer *kv = &p.layers[l];
        ASSERT_EQ(memcmp(kv->token_scales + (size_t)fresh * ts_block, kv->token_scales + (size_t)old * ts_block,
                         ts_block * sizeof(float)),
                  0);
        const uint8_t *codes = kv->pages;
        ASSERT_EQ(memcmp(codes + (size_t)fresh * page, codes + (size_t)old * page, page), 0);
        /* the 4 written tokens of the partial block have nonzero scales, and they came along */
        for (int t = 0; t < 4; t++) ASSERT_TRUE(kv->token_scales[(size_t)fresh * ts_block + (size_t)t * H] > 0.0f);
    }
    /* attention of c's next row over the copy equals a's over the original */
    int32_t slot_c = rs_kv_slot(&c, 20), pos20 = 20, start1[2] = {0, 1}, ctx21[1] = {21};
    float q[4 * D], out_a[4 * D], out_c[4 * D], k20[H * D], v20[H * D];
    for (int i = 0; i < 4 * D; i++) q[i] = rng_uniform(&rng);
    for (int i = 0; i < H * D; i++) k20[i] = rng_uniform(&rng), v20[i] = rng_uniform(&rng);
    ASSERT_EQ(rs_kv_seq_reserve(&p, &a, 21), RS_OK);
    ASSERT_EQ(rs_kv_seq_prepare_write(&p, &a, 20), RS_OK); /* a's block 1 is exclusive again */
    int32_t slot_a = rs_kv_slot(&a, 20);
    rs_batch ba = {.n_tok = 1, .n_seq = 1, .tokens = tok, .pos = &pos20, .slot = &slot_a, .seq_start = start1,
                   .seq_ctx = ctx21, .block_tables = a.blocks, .max_blocks = a.n_blocks};
    rs_batch bc = ba;
    bc.slot = &slot_c, bc.block_tables = c.blocks, bc.max_blocks = c.n_blocks;
    rs_op_kv_store(b, &p.layers[0], k20, v20, &ba);
    rs_op_kv_store(b, &p.layers[0], k20, v20, &bc);
    rs_op_attention(b, out_a, q, &p.layers[0], 4, 0.3f, &ba);
    rs_op_attention(b, out_c, q, &p.layers[0], 4, 0.3f, &bc);
    ASSERT_EQ(memcmp(out_a, out_c, sizeof out_a), 0);
    const rs_kv_seq *live[2] = {&a, &c};
    rs_kv_pool_check(&p, live, 2);
    rs_kv_seq_release(&p, &a);
    rs_kv_seq_release(&p, &c);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

/* ---- calibration ---- */

static void tiny_config(rs_model_config *c) {
    ASSERT_EQ(rs_model_preset("default", c), RS_OK);
    c->vocab_size = 512;
    c->hidden = 128;
    c->intermediate = 256;
    c->n_layers = 3;
    c->n_heads = 4;
    c->n_kv_heads = 2;
    c->head_dim = 32;
    c->max_position = 1024;
}

static rs_model *tiny_model(rs_backend *b) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/model", rs_test_tmpdir());
    rs_error err = {0};
    rs_model_config c;
    tiny_config(&c);
    static int made; /* once per test process (each has its own tmpdir) */
    if (!made) {
        if (rs_testmodel_write(dir, &c, 41, &err) != RS_OK) RS_TEST_FAIL("testmodel: %s", err.message);
        made = 1;
    }
    rs_model *m = NULL;
    if (rs_model_load(dir, b, NULL, &m, &err) != RS_OK) RS_TEST_FAIL("load: %s", err.message);
    return m;
}

/* Runs tokens[0..n) as one sequence through m with an E4M3/F32 pool made from o (scales installed
 * when given), and returns the pool (caller frees) with the sequence's blocks at 0, 1, 2, ... */
static rs_kv_pool run_model(rs_model *m, const rs_kv_cache_opts *o, const float *ks, const float *vs,
                            const int32_t *tokens, int n, float *last_logits /* [vocab] or NULL */) {
    const rs_model_config *c = &m->cfg;
    rs_kv_pool p;
    rs_kv_pool shape = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                        .dtype = o->dtype, .scale_mode = o->scale_mode};
    int nb = (n + RS_KV_BLOCK - 1) / RS_KV_BLOCK;
    ASSERT_EQ(rs_kv_pool_init_ex(&p, m->backend, c->n_layers, c->n_kv_heads, c->head_dim, o,
                                 (size_t)nb * rs_kv_bytes_per_block(&shape) + 4096),
              RS_OK);
    ASSERT_EQ(p.n_blocks, nb);
    if (ks) ASSERT_EQ(rs_kv_pool_set_scales(&p, ks, vs), RS_OK);
    rs_kv_seq s = {0};
    ASSERT_EQ(rs_kv_seq_reserve(&p, &s, n), RS_OK);
    for (int i = 0; i < s.n_blocks; i++) ASSERT_EQ(s.blocks[i], i);
    rs_forward_ctx *f = rs_forward_ctx_init(m, n, 1);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n), *slot = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) pos[i] = i, slot[i] = rs_kv_slot(&s, i);
    int32_t start[2] = {0, n}, ctx[1] = {n}, last = n - 1;
    rs_batch bt = {.n_tok = n, .n_seq = 1, .tokens = tokens, .pos = pos, .slot = slot, .seq_start = start,
                   .seq_ctx = ctx, .block_tables = s.blocks, .max_blocks = s.n_blocks};
    rs_forward(f, &bt, p.layers, &last, last_logits ? 1 : 0, last_logits);
    rs_forward_ctx_free(f);
    free(pos), free(slot);
    rs_kv_seq_release(&p, &s);
    return p;
}

/* The calibration set rs_kv_calibrate uses when given no tokens. */
static int32_t *default_set(const rs_model_config *c, int n) {
    int32_t *t = malloc(sizeof(int32_t) * (size_t)n);
    rs_kv_calib_default_tokens(c->vocab_size, t, n);
    t[0] = c->bos_token_id;
    return t;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* kv_calibrate.h's rule, written out again: max(stat * margin, 1e-6) / 448, nudged up to fit. */
static float want_scale(float stat, float margin) {
    float a = fmaxf(stat * margin, 1e-6f), s = a / 448.0f;
    while (a / s > 448.0f) s = nextafterf(s, INFINITY);
    return s;
}

RS_TEST(kv_fp8_calibrate_matches_pages_and_is_deterministic) {
    rs_backend *b1 = rs_backend_cpu_init(1), *b2 = rs_backend_cpu_init(2);
    rs_model *m1 = tiny_model(b1), *m2 = tiny_model(b2);
    const rs_model_config *c = &m1->cfg;
    const int n = 300, hd = c->head_dim; /* 300 tokens: two forward chunks of calibration */
    enum { LH = 6 }; /* layers x kv heads of tiny_config */
    ASSERT_EQ(c->n_layers * c->n_kv_heads, LH);
    float k1[LH], v1[LH], k2[LH], v2[LH], k3[LH], v3[LH];
    rs_error err = {0};
    rs_kv_calib_opts o = {.tokens = NULL, .n_tokens = n, .percentile = 1.0f, .margin = 1.0f};
    ASSERT_EQ(rs_kv_calibrate(m1, &o, k1, v1, &err), RS_OK);
    ASSERT_EQ(rs_kv_calibrate(m1, &o, k2, v2, &err), RS_OK);
    ASSERT_EQ(memcmp(k1, k2, sizeof k1), 0);
    ASSERT_EQ(memcmp(v1, v2, sizeof v1), 0);
    ASSERT_EQ(rs_kv_calibrate(m2, &o, k3, v3, &err), RS_OK); /* thread count does not matter */
    ASSERT_EQ(memcmp(k1, k3, sizeof k1), 0);
    ASSERT_EQ(memcmp(v1, v3, sizeof v1), 0);
    for (int i = 0; i < LH; i++) ASSERT_TRUE(isfinite(k1[i]) && k1[i] > 0 && isfinite(v1[i]) && v1[i] > 0);

    /* against the pages of an fp32 run over the same tokens: amax and the 99.9th percentile by sort,
     * and no value beyond 448 * scale */
    int32_t *tokens = default_set(c, n);
    o.tokens = tokens;
    ASSERT_EQ(rs_kv_calibrate(m1, &o, k2, v2, &err), RS_OK); /* the same set, given explicitly */
    ASSERT_EQ(memcmp(k1, k2, sizeof k1), 0);
    rs_kv_calib_opts o999 = {.tokens = tokens, .n_tokens = n, .percentile = 0.999f, .margin = 1.25f};
    ASSERT_EQ(rs_kv_calibrate(m1, &o999, k3, v3, &err), RS_OK);
    rs_kv_cache_opts f32 = {RS_DTYPE_F32, RS_KV_SCALE_NONE};
    rs_kv_pool p = run_model(m1, &f32, NULL, NULL, tokens, n, NULL);
    float *vals = malloc(sizeof(float) * (size_t)n * (size_t)hd);
    int n_at_max = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const rs_kv_layer *kv = &p.layers[l];
        for (int half = 0; half < 2; half++) {
            for (int h = 0; h < c->n_kv_heads; h++) {
                float sc = (half ? v1 : k1)[l * c->n_kv_heads + h];
                size_t m = 0;
                for (int t = 0; t < n; t++)
                    for (int i = 0; i < hd; i++) {
                        float x = ((float *)kv->pages)[page_index(kv, t, half, h, i)];
                        vals[m++] = fabsf(x);
                        ASSERT_TRUE(fabsf(x) / sc <= 448.0f);
                        n_at_max += rs_fp8_e4m3_from_f32(x / sc) == 0x7e;
                    }
                qsort(vals, m, sizeof(float), cmp_float);
                ASSERT_TRUE(same_float(sc, want_scale(vals[m - 1], 1.0f)));
                size_t rank = (size_t)ceil(0.999 * (double)m) - 1;
                ASSERT_TRUE(same_float((half ? v3 : k3)[l * c->n_kv_heads + h], want_scale(vals[rank], 1.25f)));
            }
        }
    }
    ASSERT_TRUE(n_at_max >= 1); /* the amax itself lands on 448 (or next to it) */
    free(vals);

    /* the pipeline: calibrate -> set_scales -> forward with E4M3 pages. Layer 0's K/V do not depend on
     * the cache, so its codes are exactly sat_e4m3(x / scale) of the fp32 run's values. */
    rs_kv_cache_opts e4m3 = {RS_DTYPE_E4M3, RS_KV_SCALE_PER_HEAD};
    rs_kv_pool q = run_model(m1, &e4m3, k1, v1, tokens, n, NULL);
    for (int half = 0; half < 2; half++)
        for (int h = 0; h < c->n_kv_heads; h++)
            for (int t = 0; t < n; t++)
                for (int i = 0; i < hd; i++) {
                    size_t at = page_index(&p.layers[0], t, half, h, i);
                    float x = ((float *)p.layers[0].pages)[at];
                    ASSERT_EQ(((uint8_t *)q.layers[0].pages)[at], rs_fp8_e4m3_from_f32(x / (half ? v1 : k1)[h]));
                }
    rs_kv_pool_free(&q);
    rs_kv_pool_free(&p);
    free(tokens);
    rs_model_free(m1), rs_model_free(m2);
    rs_backend_free(b1), rs_backend_free(b2);
}

RS_TEST(kv_fp8_calibrate_rejects_bad_options) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_model *m = tiny_model(b);
    float ks[6], vs[6];
    rs_error err = {0};
    int32_t toks[4] = {1, 2, 3, 512};
    const rs_kv_calib_opts bad[] = {
        {.n_tokens = 64, .percentile = 0.0f, .margin = 1.0f},
        {.n_tokens = 64, .percentile = 1.5f, .margin = 1.0f},
        {.n_tokens = 64, .percentile = NAN, .margin = 1.0f},
        {.n_tokens = 64, .percentile = 1.0f, .margin = 0.0f},
        {.n_tokens = 64, .percentile = 1.0f, .margin = INFINITY},
        {.n_tokens = 2000, .percentile = 1.0f, .margin = 1.0f}, /* > max_position */
        {.tokens = toks, .n_tokens = 4, .percentile = 1.0f, .margin = 1.0f}, /* id 512 = vocab */
        {.tokens = toks, .n_tokens = 0, .percentile = 1.0f, .margin = 1.0f},
    };
    for (int i = 0; i < 6; i++) ks[i] = vs[i] = -1.0f;
    for (size_t i = 0; i < RS_ARRAY_LEN(bad); i++) ASSERT_EQ(rs_kv_calibrate(m, &bad[i], ks, vs, &err), RS_EINVAL);
    for (int i = 0; i < 6; i++) ASSERT_TRUE(ks[i] == -1.0f && vs[i] == -1.0f); /* untouched on failure */
    /* the default length, percentile < 1 and a margin give smaller / larger scales as they should */
    rs_kv_calib_opts o = {.percentile = 1.0f, .margin = 1.0f};
    float k1[6], v1[6], k2[6], v2[6];
    ASSERT_EQ(rs_kv_calibrate(m, &o, k1, v1, &err), RS_OK);
    o.margin = 2.0f;
    ASSERT_EQ(rs_kv_calibrate(m, &o, k2, v2, &err), RS_OK);
    for (int i = 0; i < 6; i++) ASSERT_NEAR(k2[i] / k1[i], 2.0, 1e-6);
    o.margin = 1.0f, o.percentile = 0.99f;
    ASSERT_EQ(rs_kv_calibrate(m, &o, k2, v2, &err), RS_OK);
    for (int i = 0; i < 6; i++) ASSERT_TRUE(k2[i] <= k1[i] && v2[i] <= v1[i] && k2[i] > 0.0f);
    rs_model_free(m);
    rs_backend_free(b);
}

RS_TEST(kv_fp8_default_tokens_fixed_with_repeats) {
    int32_t a[700], c[700];
    rs_kv_calib_default_tokens(1000, a, 700);
    rs_kv_calib_default_tokens(1000, c, 300); /* a prefix of the longer set */
    ASSERT_EQ(memcmp(a, c, 300 * sizeof(int32_t)), 0);
    for (int i = 0; i < 700; i++) ASSERT_TRUE(a[i] >= 0 && a[i] < 1000);
    for (int seg = 0; seg + 128 <= 700; seg += 128) {
        /* 24 copied ids equal an earlier span; 8 equal ids close the segment */
        int found = 0;
        for (int src = 0; src + 24 <= seg + 96 && !found; src++)
            found = memcmp(a + src, a + seg + 96, 24 * sizeof(int32_t)) == 0;
        ASSERT_TRUE(found);
        for (int i = seg + 121; i < seg + 128; i++) ASSERT_EQ(a[i], a[seg + 120]);
    }
    /* fixed across builds and machines (integer arithmetic only): pinned values */
    int32_t big[200];
    rs_kv_calib_default_tokens(151936, big, 200);
    static const int32_t head[8] = {93968, 73970, 8215, 4854, 68924, 146011, 116160, 122925};
    ASSERT_EQ(memcmp(big, head, sizeof head), 0);
    ASSERT_EQ(big[96], 86285);
    ASSERT_EQ(big[120], 36449);
    ASSERT_EQ(big[199], 5914);
}

RS_TEST(kv_fp8_end_to_end_logits_print) {
    /* FP8 KV (calibrated per head, and per token) vs fp32 KV on fresh tokens: the logits the sampler
     * sees. A loose bound; the numbers go to the report. */
    rs_backend *b = rs_backend_cpu_init(2);
    rs_model *m = tiny_model(b);
    const rs_model_config *c = &m->cfg;
    float ks[6], vs[6];
    rs_error err = {0};
    rs_kv_calib_opts o = {.percentile = 1.0f, .margin = 1.0f};
    ASSERT_EQ(rs_kv_calibrate(m, &o, ks, vs, &err), RS_OK);
    const int n = 400;
    int32_t tokens[400];
    uint64_t rng = 77;
    for (int i = 0; i < n; i++) tokens[i] = (int32_t)(rng_next(&rng) % (uint64_t)c->vocab_size);
    float *ref = malloc(sizeof(float) * (size_t)c->vocab_size), *got = malloc(sizeof(float) * (size_t)c->vocab_size);
    rs_kv_cache_opts f32 = {RS_DTYPE_F32, RS_KV_SCALE_NONE};
    rs_kv_pool p = run_model(m, &f32, NULL, NULL, tokens, n, ref);
    rs_kv_pool_free(&p);
    const rs_kv_cache_opts modes[] = {{RS_DTYPE_E4M3, RS_KV_SCALE_PER_HEAD}, {RS_DTYPE_E4M3, RS_KV_SCALE_PER_TOKEN},
                                      {RS_DTYPE_BF16, RS_KV_SCALE_NONE}};
    for (size_t k = 0; k < RS_ARRAY_LEN(modes); k++) {
        bool ph = modes[k].scale_mode == RS_KV_SCALE_PER_HEAD;
        p = run_model(m, &modes[k], ph ? ks : NULL, ph ? vs : NULL, tokens, n, got);
        rs_kv_pool_free(&p);
        err_stats e = compare(got, ref, (size_t)c->vocab_size);
        /* KL(ref || got) of the softmax */
        double mr = -INFINITY, mg = -INFINITY, zr = 0, zg = 0, kl = 0;
        for (int i = 0; i < c->vocab_size; i++) mr = fmax(mr, ref[i]), mg = fmax(mg, got[i]);
        for (int i = 0; i < c->vocab_size; i++) zr += exp(ref[i] - mr), zg += exp(got[i] - mg);
        for (int i = 0; i < c->vocab_size; i++) {
            double lr = ref[i] - mr - log(zr), lg = got[i] - mg - log(zg);
            kl += exp(lr) * (lr - lg);
        }
        printf("  kv %s %-9s vs f32 kv, last of %d tokens: logits max |d| %.3g (rms %.3g of %.3g), KL %.3g\n",
               rs_dtype_name(modes[k].dtype), k == 0 ? "per-head" : k == 1 ? "per-token" : "", n, e.max_abs,
               e.rms_err, e.rms_ref, kl);
        ASSERT_TRUE(e.rms_err < 0.05 * e.rms_ref);
    }
    free(ref), free(got);
    rs_model_free(m);
    rs_backend_free(b);
}

/* ---- a rough speed print (not an assertion): one decode row per sequence at 4k context,
 * 8 KV heads x 128, 32 query heads, over F32 / BF16 / E4M3 pages ---- */

RS_TEST(kv_fp8_attention_speed_print) {
    enum { N_KV = 8, HD = 128, CTX = 4096, NB_SEQ = CTX / RS_KV_BLOCK, MAX_SEQ = 4 };
    static const char *names[] = {"f32", "bf16", "e4m3 per-head", "e4m3 per-token"};
    rs_backend *b = rs_backend_cpu_init(0);
    uint64_t rng = 99;
    for (int n_seq = 1; n_seq <= MAX_SEQ; n_seq *= 4) {
        int n_blocks = NB_SEQ * n_seq;
        int32_t *tables = malloc(sizeof(int32_t) * (size_t)n_blocks);
        for (int i = 0; i < n_blocks; i++) tables[i] = i;
        for (int i = n_blocks - 1; i > 0; i--) { /* pages scattered like a long-running pool's */
            int j = (int)(rng_next(&rng) % (uint64_t)(i + 1));
            int32_t t = tables[i];
            tables[i] = tables[j], tables[j] = t;
        }
        int32_t pos[MAX_SEQ], slot[MAX_SEQ], start[MAX_SEQ + 1], sctx[MAX_SEQ], tok[MAX_SEQ] = {0};
        for (int s = 0; s < n_seq; s++) pos[s] = CTX - 1, start[s] = s, sctx[s] = CTX, slot[s] = 0;
        start[n_seq] = n_seq;
        rs_batch bt = {.n_tok = n_seq, .n_seq = n_seq, .tokens = tok, .pos = pos, .slot = slot, .seq_start = start,
                       .seq_ctx = sctx, .block_tables = tables, .max_blocks = NB_SEQ};
        float *q = malloc(sizeof(float) * MAX_SEQ * 32 * HD), *out = malloc(sizeof(float) * MAX_SEQ * 32 * HD);
        for (int i = 0; i < MAX_SEQ * 32 * HD; i++) q[i] = rng_normal(&rng);
        double t_f32[2] = {0, 0};
        for (int cfg = 0; cfg < 4; cfg++) {
            rs_dtype dt = cfg == 0 ? RS_DTYPE_F32 : cfg == 1 ? RS_DTYPE_BF16 : RS_DTYPE_E4M3;
            rs_kv_scale_mode mode = cfg < 2    ? RS_KV_SCALE_NONE
                                    : cfg == 2 ? RS_KV_SCALE_PER_HEAD
                                               : RS_KV_SCALE_PER_TOKEN;
            rs_kv_layer kv = layer_new(b, dt, mode, n_blocks, N_KV, HD);
            size_t elems = (size_t)n_blocks * 2 * RS_KV_BLOCK * N_KV * HD, n_ts = elems / HD;
            for (size_t i = 0; i < elems; i++) {
                uint64_t r = rng_next(&rng);
                float x = (float)(int)(r % 201) / 100.0f - 1.0f;
                if (dt == RS_DTYPE_F32) ((float *)kv.pages)[i] = x;
                else if (dt == RS_DTYPE_BF16) ((uint16_t *)kv.pages)[i] = rs_f32_to_bf16(x);
                else ((uint8_t *)kv.pages)[i] = (uint8_t)(r % 0x7e) | (uint8_t)((r >> 8) & 0x80); /* finite codes */
            }
            if (mode == RS_KV_SCALE_PER_HEAD)
                for (int h = 0; h < N_KV; h++) kv.k_scale[h] = kv.v_scale[h] = 1.0f / 448.0f;
            if (mode == RS_KV_SCALE_PER_TOKEN)
                for (size_t i = 0; i < n_ts; i++) kv.token_scales[i] = 1.0f / 448.0f;
            for (int heads = 16; heads <= 32; heads *= 2) {
                float scale = 1.0f / sqrtf((float)HD);
                rs_op_attention(b, out, q, &kv, heads, scale, &bt);
                double dt_s = INFINITY, t_end = rs_now_s() + 0.3; /* best call: the machine may be shared */
                for (int it = 0; it < 200 && rs_now_s() < t_end; it++) {
                    double t0 = rs_now_s();
                    rs_op_attention(b, out, q, &kv, heads, scale, &bt);
                    dt_s = fmin(dt_s, rs_now_s() - t0);
                }
                if (cfg == 0) t_f32[heads / 32] = dt_s;
                double bytes = (double)n_seq * CTX * N_KV * HD * 2 * (double)rs_dtype_size(dt);
                printf("  attention decode ctx %d x %d seq, %2d/%d heads x %d, %d threads, %-14s: %8.1f us  %6.1f GB/s"
                       "  (%.2fx f32)\n",
                       CTX, n_seq, heads, N_KV, HD, rs_cpu_ctx_of(b)->n_threads, names[cfg], dt_s * 1e6,
                       bytes / dt_s / 1e9, t_f32[heads / 32] / dt_s);
            }
            rs_test_kv_layer_free(b, &kv);
        }
        free(q), free(out);
        free(tables);
    }
    rs_backend_free(b);
}
