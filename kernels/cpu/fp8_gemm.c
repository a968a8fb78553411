/*
 * fp8_gemm.c — block-scaled E4M3 GEMM on the CPU: the scalar reference and a threaded SIMD path
 * that reproduces it bit-for-bit (contract in fp8_gemm.h).
 *
 * Why a block sum is exact, in double and in any order. Every finite E4M3 value is an integer
 * multiple of 2^-9 (the smallest subnormal) with |v| <= 448 = 1.75 * 2^8, and has at most 4
 * significant bits. So:
 *   - a product of two E4M3 values has at most 8 significant bits and lies in [2^-18, 200704]
 *     (or is 0): it is exact in fp32 (24-bit significand, normal range down to 2^-126) and in
 *     double; it is an integer multiple of 2^-18.
 *   - a sum of at most 128 such products is an integer multiple of 2^-18 with magnitude at most
 *     128 * 200704 = 25690112 < 2^25, i.e. an integer below 2^43 times 2^-18. Every partial sum,
 *     in whatever order or grouping, has the same form, and a double holds any integer below 2^53
 *     times a power of two exactly, so no addition ever rounds: the double result is the exact
 *     sum, independent of order (fma(x, w, acc) is exact too: its exact result is representable).
 *   - zero sums are +0 in every order: accumulators start at +0, and under round-to-nearest an
 *     exact cancellation or +0 + -0 gives +0; -0 + -0 cannot occur from a +0 start.
 *   - the only non-finite products come from the NaN codes (E4M3 has no inf); NaN block sums are
 *     replaced by the canonical NaN, since NaN sign and payload would depend on the order, and so
 *     are NaN outputs (see fp8_gemm.h: which NaN an fmaf returns is not ours to fix).
 * Rounding the exact block sum to fp32 is then one correctly rounded conversion, so the fast path
 * gets the same fp32 block sum as the reference whatever its lane layout or reduction tree, and
 * the rest (`xs * ws` in fp32, the fmaf chain over blocks in order, starting from +0) is the same
 * sequence of correctly rounded operations in both. Hence bit-identity, for any thread count.
 *
 * Fast paths, all giving the same bits. Where the CPU has AVX-512 BW/VL/DQ + VBMI + VNNI + GFNI
 * (Ice Lake, Zen 4 and later), fp8_gemm_vnni.c does the products with exact 16-bit integer digits;
 * on every other x86-64 CPU with AVX2 (Haswell to Comet Lake, Zen 1 to 3, Skylake-X without VBMI),
 * fp8_gemm_avx2.c does the same with vpmaddwd. The generic path here serves the rest.
 *
 * Generic path layout. Work items are (tile of up to 16 rows, chunk of 64 output features);
 * threads take contiguous runs of items from core/pool. Within an item, for each K block: the row
 * tile's activation codes are decoded once to double (the decode table), then for each output
 * feature its weight block is decoded to double and dotted with every row of the tile (exact as
 * shown above), and `out` itself carries the fmaf accumulator across blocks. Nothing is allocated:
 * the tiles (~17 KB) live on the stack. Ragged K blocks are zero-padded to 128, which adds exact
 * +0 terms.
 */
#include "fp8_gemm.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"
#include "fp8_gemm_avx2.h"
#include "fp8_gemm_vnni.h"
#include "fp8_layout.h"


#define BLK RS_FP8_BLOCK
#define ROW_TILE 16  /* rows sharing one decoded weight block; 16 x 1 KB of doubles stays in L1 */
#define COL_CHUNK 64 /* output features per work item */

/* The block sum as fp32: one rounding of the exact value, NaN canonicalized (see above). */
static inline float block_sum_f32(double exact) {
    float f = (float)exact;
    return isnan(f) ? NAN : f;
}

/* An output as stored: NaN canonicalized (fp8_gemm.h). */
static inline float canonical_nan(float v) { return isnan(v) ? NAN : v; }

/* ---------------------------------------------------------------------------------------------
 * Reference
 * ------------------------------------------------------------------------------------------- */

void rs_fp8_gemm_ref(float *out, const uint8_t *xq, const float *xs, const uint8_t *wq, const float *ws,
                     int rows, int n, int k) {
    const int64_t kb = rs_fp8_blocks(k);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *x = xq + r * k;
        for (int64_t o = 0; o < n; o++) {
            const uint8_t *w = wq + o * k;
            const float *sw = ws + (o / BLK) * kb;
            float acc = 0.0f;
            for (int64_t b = 0; b < kb; b++) {
                int64_t j0 = b * BLK, j1 = RS_MIN(j0 + BLK, (int64_t)k);
                double sum = 0.0;
                for (int64_t j = j0; j < j1; j++)
                    sum += (double)(rs_fp8_e4m3_f32[x[j]] * rs_fp8_e4m3_f32[w[j]]); /* exact fp32 product */
                acc = fmaf(block_sum_f32(sum), xs[r * kb + b] * sw[b], acc);
            }
            out[r * n + o] = canonical_nan(acc);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Fast path: the ISA-independent driver
 * ------------------------------------------------------------------------------------------- */

/* dst[j] = value of code src[j], j < 128. */
typedef void (*decode_fn)(double *dst /* [128] f64 */, const uint8_t *src /* [128] e4m3 */);
/* sums[i] = sum_j xd[i][j] * wd[j], exactly, i < nr. */
typedef void (*dot_fn)(double *sums /* [nr] */, const double *wd /* [128] f64 */,
                       const double *xd /* [nr][128] f64 */, int nr);

typedef struct gemm_job {
    float *out;        /* [rows][n] f32 */
    const uint8_t *xq; /* [rows][k] e4m3 */
    const float *xs;   /* [rows][kb] f32 */
    const uint8_t *wq; /* [n][k] e4m3 */
    const float *ws;   /* [ceil(n/128)][kb] f32 */
    int rows, n, k;
    int64_t kb, n_chunks;
} gemm_job;

/* Decodes kw <= 128 codes, zero-padding to 128 (code 0x00 = +0). */
static inline __attribute__((always_inline)) void decode_padded(decode_fn decode, double *dst,
                                                                const uint8_t *src, int64_t kw) {
    if (kw == BLK) {
        decode(dst, src);
    } else {
        uint8_t pad[BLK] = {0};
        memcpy(pad, src, (size_t)kw);
        decode(dst, pad);
    }
}

/* Work items [it0, it1); item = row_tile * n_chunks + column_chunk. Inlined into one function per
 * ISA so that decode, dot and fmaf are direct (and, with FMA, single-instruction) calls. */
static inline __attribute__((always_inline)) void gemm_items(const gemm_job *jb, int64_t it0, int64_t it1,
                                                             decode_fn decode, dot_fn dot) {
    _Alignas(64) double xd[ROW_TILE][BLK]; /* the row tile's K block, decoded */
    _Alignas(64) double wd[BLK];           /* one weight row's K block, decoded */
    double sums[ROW_TILE];
    const int64_t kb = jb->kb, n = jb->n, k = jb->k;
    for (int64_t it = it0; it < it1; it++) {
        int64_t r0 = (it / jb->n_chunks) * ROW_TILE, o0 = (it % jb->n_chunks) * COL_CHUNK;
        int nr = (int)RS_MIN((int64_t)ROW_TILE, jb->rows - r0);
        int64_t o1 = RS_MIN(o0 + COL_CHUNK, n);
        for (int64_t b = 0; b < kb; b++) {
            int64_t j0 = b * BLK, kw = RS_MIN((int64_t)BLK, k - j0);
            for (int i = 0; i < nr; i++) decode_padded(decode, xd[i], jb->xq + (r0 + i) * k + j0, kw);
            for (int64_t o = o0; o < o1; o++) {
                decode_padded(decode, wd, jb->wq + o * k + j0, kw);
                dot(sums, wd, &xd[0][0], nr);
                float sw = jb->ws[(o / BLK) * kb + b];
                for (int i = 0; i < nr; i++) {
                    float *dst = jb->out + (r0 + i) * n + o;
                    float acc = b == 0 ? 0.0f : *dst;
                    acc = fmaf(block_sum_f32(sums[i]), jb->xs[(r0 + i) * kb + b] * sw, acc);
                    *dst = b == kb - 1 ? canonical_nan(acc) : acc;
                }
            }
        }
    }
}

/* ---- generic C ---- */

static void decode_generic(double *dst, const uint8_t *src) {
    for (int j = 0; j < BLK; j++) dst[j] = (double)rs_fp8_e4m3_f32[src[j]];
}

static void dot_generic(double *sums, const double *wd, const double *xd, int nr) {
    for (int i = 0; i < nr; i++) {
        const double *x = xd + (int64_t)i * BLK;
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0; /* independent chains; exact in any order */
        for (int j = 0; j < BLK; j += 4) {
            s0 += x[j] * wd[j];
            s1 += x[j + 1] * wd[j + 1];
            s2 += x[j + 2] * wd[j + 2];
            s3 += x[j + 3] * wd[j + 3];
        }
        sums[i] = (s0 + s1) + (s2 + s3);
    }
}

static void gemm_items_generic(void *ctx, int64_t it0, int64_t it1, int tid) {
    (void)tid;
    gemm_items(ctx, it0, it1, decode_generic, dot_generic);
}

/* Per ISA, the fewest rows past the whole 16-row tiles that the SIMD kernels pad to one more tile
 * (fp8_gemm.h, rs_fp8_gemm_tune); until tuned, the fixed counts the kernels had before. */
static atomic_int row_tile_min[RS_FP8_GEMM_ISA_AVX512_VNNI + 1] = {
    [RS_FP8_GEMM_ISA_AVX2] = 10,
    [RS_FP8_GEMM_ISA_AVX512_VNNI] = 12,
};

/* ---------------------------------------------------------------------------------------------
 * Dispatch
 * ------------------------------------------------------------------------------------------- */

int rs_fp8_gemm_isa_supported(rs_fp8_gemm_isa isa) {
    switch (isa) {
    case RS_FP8_GEMM_ISA_AUTO:
    case RS_FP8_GEMM_ISA_GENERIC: return 1;
    case RS_FP8_GEMM_ISA_AVX2: return rs_fp8_gemm_avx2_supported();
    case RS_FP8_GEMM_ISA_AVX512_VNNI: return rs_fp8_gemm_vnni_supported();
    }
    return 0;
}

rs_fp8_gemm_isa rs_fp8_gemm_detect_isa(void) {
    static const rs_fp8_gemm_isa order[] = {RS_FP8_GEMM_ISA_AVX512_VNNI, RS_FP8_GEMM_ISA_AVX2};
    for (size_t i = 0; i < RS_ARRAY_LEN(order); i++)
        if (rs_fp8_gemm_isa_supported(order[i])) return order[i];
    return RS_FP8_GEMM_ISA_GENERIC;
}

const char *rs_fp8_gemm_isa_name(rs_fp8_gemm_isa isa) {
    switch (isa) {
    case RS_FP8_GEMM_ISA_AUTO: return "auto";
    case RS_FP8_GEMM_ISA_GENERIC: return "generic-exact";
    case RS_FP8_GEMM_ISA_AVX2: return "avx2-exact";
    case RS_FP8_GEMM_ISA_AVX512_VNNI: return "avx512vnni-exact";
    }
    return "?";
}

int rs_fp8_gemm_with_isa(rs_fp8_gemm_isa isa, rs_pool *pool, float *out, const uint8_t *xq, const float *xs,
                         const uint8_t *wq, const float *ws, int rows, int n, int k) {
    return rs_fp8_gemm_layout_with_isa(isa, pool, out, xq, xs, wq, RS_LAYOUT_ROWS, ws, rows, n, k);
}

int rs_fp8_gemm_layout_with_isa(rs_fp8_gemm_isa isa, rs_pool *pool, float *out, const uint8_t *xq,
                                const float *xs, const uint8_t *wq, rs_layout layout, const float *ws, int rows,
                                int n, int k) {
    if (isa == RS_FP8_GEMM_ISA_AUTO) isa = rs_fp8_gemm_detect_isa();
    if (!rs_fp8_gemm_isa_supported(isa)) return RS_EUNSUPPORTED;
    if (layout != RS_LAYOUT_ROWS &&
        (layout != RS_LAYOUT_FP8_PAIRS32 || isa != RS_FP8_GEMM_ISA_AVX512_VNNI || !rs_fp8_pairs32_fits(n, k)))
        return RS_EUNSUPPORTED;
    RS_ASSERT(rows >= 0 && n >= 0 && k >= 0);
    if (rows == 0 || n == 0) return RS_OK;
    if (k == 0) {
        memset(out, 0, (size_t)rows * (size_t)n * sizeof *out);
        return RS_OK;
    }
    if (isa == RS_FP8_GEMM_ISA_AVX512_VNNI) {
        rs_fp8_gemm_vnni(pool, out, xq, xs, wq, layout == RS_LAYOUT_FP8_PAIRS32, ws, rows, n, k,
                         atomic_load_explicit(&row_tile_min[isa], memory_order_relaxed));
        return RS_OK;
    }
    if (isa == RS_FP8_GEMM_ISA_AVX2) {
        rs_fp8_gemm_avx2(pool, out, xq, xs, wq, ws, rows, n, k,
                         atomic_load_explicit(&row_tile_min[isa], memory_order_relaxed));
        return RS_OK;
    }
    gemm_job job = {
        .out = out, .xq = xq, .xs = xs, .wq = wq, .ws = ws, .rows = rows, .n = n, .k = k,
        .kb = rs_fp8_blocks(k), .n_chunks = (n + COL_CHUNK - 1) / COL_CHUNK,
    };
    int64_t items = ((int64_t)rows + ROW_TILE - 1) / ROW_TILE * job.n_chunks;
    if (pool)
        rs_pool_run(pool, items, 1, gemm_items_generic, &job);
    else
        gemm_items_generic(&job, 0, items, 0);
    return RS_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Tuning: where a padded 16-row tile beats the few-row tiles
 * ------------------------------------------------------------------------------------------- */

enum { TUNE_N = 512, TUNE_K = 1024, TUNE_ROWS = 16, TUNE_REPS = 5 };

static bool has_row_tiles(rs_fp8_gemm_isa isa) {
    return (isa == RS_FP8_GEMM_ISA_AVX2 || isa == RS_FP8_GEMM_ISA_AVX512_VNNI) && rs_fp8_gemm_isa_supported(isa);
}

int rs_fp8_gemm_set_row_tile_min(rs_fp8_gemm_isa isa, int rows) {
    if (isa == RS_FP8_GEMM_ISA_AUTO) isa = rs_fp8_gemm_detect_isa();
    if (!has_row_tiles(isa)) return RS_EUNSUPPORTED;
    if (rows < 1 || rows > 17) return RS_EINVAL;
    atomic_store_explicit(&row_tile_min[isa], rows, memory_order_relaxed);
    return RS_OK;
}

int rs_fp8_gemm_row_tile_min(rs_fp8_gemm_isa isa) {
    if (isa == RS_FP8_GEMM_ISA_AUTO) isa = rs_fp8_gemm_detect_isa();
    return has_row_tiles(isa) ? atomic_load_explicit(&row_tile_min[isa], memory_order_relaxed) : 0;
}

/* A standard normal value from a 64-bit LCG (Box-Muller). */
static float tune_gauss(uint64_t *s) {
    double u[2];
    for (int i = 0; i < 2; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        u[i] = ((double)(*s >> 11) + 0.5) * 0x1p-53;
    }
    return (float)(sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
}

/* The count for `isa` (has_row_tiles): RS_FP8_ROW_TILE_MIN, or timed (fp8_gemm.h). Leaves it set. */
static int tune_pick(rs_fp8_gemm_isa isa) {
    const char *env = getenv("RS_FP8_ROW_TILE_MIN");
    if (env && *env) {
        char *end;
        const long v = strtol(env, &end, 10);
        if (*end == '\0' && v >= 1 && v <= 17) {
            rs_fp8_gemm_set_row_tile_min(isa, (int)v);
            return (int)v;
        }
        RS_WARN("RS_FP8_ROW_TILE_MIN='%s' is not 1..17; timing instead", env);
    }
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    float *wf = rs_xmalloc((size_t)TUNE_N * TUNE_K * sizeof *wf), *xf = rs_xmalloc((size_t)TUNE_ROWS * TUNE_K * sizeof *xf);
    uint8_t *codes = rs_xmalloc((size_t)TUNE_N * TUNE_K), *wq = rs_xmalloc((size_t)TUNE_N * TUNE_K);
    uint8_t *xq = rs_xmalloc((size_t)TUNE_ROWS * TUNE_K);
    float *ws = rs_xmalloc((size_t)rs_fp8_blocks(TUNE_N) * rs_fp8_blocks(TUNE_K) * sizeof *ws);
    float *xs = rs_xmalloc((size_t)TUNE_ROWS * rs_fp8_blocks(TUNE_K) * sizeof *xs);
    float *out = rs_xmalloc((size_t)TUNE_ROWS * TUNE_N * sizeof *out);
    for (size_t i = 0; i < (size_t)TUNE_N * TUNE_K; i++) wf[i] = tune_gauss(&seed);
    for (size_t i = 0; i < (size_t)TUNE_ROWS * TUNE_K; i++) xf[i] = tune_gauss(&seed);
    const rs_tensor w = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {TUNE_N, TUNE_K}, .data = wf};
    RS_ASSERT(rs_fp8_quantize_weight(&w, codes, ws) == RS_OK);
    rs_fp8_quantize_act(xf, TUNE_ROWS, TUNE_K, xq, xs);
    /* the layout the CPU backend serves this ISA's weights in */
    const rs_layout layout = isa == RS_FP8_GEMM_ISA_AVX512_VNNI ? RS_LAYOUT_FP8_PAIRS32 : RS_LAYOUT_ROWS;
    if (layout == RS_LAYOUT_FP8_PAIRS32) rs_fp8_pairs32_pack(wq, codes, TUNE_N, TUNE_K);
    else memcpy(wq, codes, (size_t)TUNE_N * TUNE_K);
    /* From 15 rows down, while the padded tile is the faster: the fewest rows where it still is.
     * Calls of the two forms alternate, so that a slow phase of the machine hits both. */
    int pick = 17;
    for (int rows = TUNE_ROWS - 1; rows >= 2; rows--) {
        double best[2] = {INFINITY, INFINITY};
        for (int rep = 0; rep <= TUNE_REPS; rep++)
            for (int pad = 0; pad < 2; pad++) {
                rs_fp8_gemm_set_row_tile_min(isa, pad ? 1 : 17);
                const double t0 = rs_now_s();
                RS_ASSERT(rs_fp8_gemm_layout_with_isa(isa, NULL, out, xq, xs, wq, layout, ws, rows, TUNE_N, TUNE_K) ==
                          RS_OK);
                if (rep > 0) best[pad] = fmin(best[pad], rs_now_s() - t0); /* rep 0 warms the caches */
            }
        if (best[1] >= best[0]) break;
        pick = rows;
    }
    rs_fp8_gemm_set_row_tile_min(isa, pick);
    free(wf), free(xf), free(codes), free(wq), free(xq), free(ws), free(xs), free(out);
    return pick;
}

int rs_fp8_gemm_tune(rs_fp8_gemm_isa isa) {
    if (isa == RS_FP8_GEMM_ISA_AUTO) isa = rs_fp8_gemm_detect_isa();
    if (!has_row_tiles(isa)) return 0;
    /* once per ISA and process: every backend of the process shares the setting */
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static int tuned[RS_FP8_GEMM_ISA_AVX512_VNNI + 1];
    pthread_mutex_lock(&lock);
    if (!tuned[isa]) tuned[isa] = tune_pick(isa);
    const int pick = tuned[isa];
    pthread_mutex_unlock(&lock);
    return pick;
}

void rs_fp8_gemm(rs_pool *pool, float *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                 const float *ws, int rows, int n, int k) {
    RS_ASSERT(rs_fp8_gemm_with_isa(RS_FP8_GEMM_ISA_AUTO, pool, out, xq, xs, wq, ws, rows, n, k) == RS_OK);
}
