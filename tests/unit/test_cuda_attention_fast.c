/*
 * test_cuda_attention_fast.c — the fast numerics' attention (kernels/cuda/cuda_attention.cu split
 * decode + combine, cuda_attention_tc.cu tensor-core prefill) against the exact kernel of the same
 * backend (which test_cuda_attention.c ties to the CPU), on every page format: F32, BF16, E4M3
 * with per-head and with per-token scales.
 *
 * A cache of shuffled pages holds four sequences: A (200 positions), B (100), C (1), D (5). A mixed
 * step runs A's decode row, B's prefill chunk of 70 rows (two tensor-core tiles), C's row and D's
 * 5-row chunk; a decode step runs the last row of each. Decode rows go through the split kernels,
 * forced to 1, 3 and 7 splits (ragged and empty splits) and by size with the warp kernel, at 3
 * splits with the tile kernel too, and by size and at 3 with the pipelined warp kernel (the
 * default); their outputs differ from the exact kernel's by the fp32 order of the
 * sums and the combine, and exp2f against expf (tolerance 2e-5). The mma kernel (by size and at 3
 * splits; head sizes up to 128, else its fallback) and the prefill rows are on tensor cores: the
 * prefill rows go through the tensor-core kernel for head sizes 32, 64, 128 and 256 (the split
 * kernel for 48). Q, K and V hold
 * BF16-exact values (exact in either operand type), so what it changes is P rounded to F16
 * (relative 2^-11; BF16 pages: BF16, 2^-8) and fp32 order: within 1e-3 (4e-3) x max |V| of the KV
 * head (outputs are convex combinations of V rows). Group sizes 2, 4, 1, 12, 16 and 6: the warp
 * kernel's chunks of 8 query heads (two full ones at 16), of 4 at head size 256 (a partial one at
 * 6), and 4, 8, 16 and 32 lanes per position (head sizes 32, 64, 128, 256); 48 takes the tile kernel.
 * The exact launch and the tile kernel's 3-split one run again with K/V tiles staged in shared
 * memory (RS_CUDA_ATTENTION_STAGED): the same bits, where the tile fits the stage (every shape here
 * but F32 at head size 128 and 256, which checks the fallback) and where it does not.
 * A second test decodes one 4500-position row (the warp and mma kernels read the page table in
 * slices of 256 pages) in one split and by size.
 *
 * A third decodes rows whose block tables share pages (RS_CUDA_ATTENTION_SHARED: units of rows read
 * their shared pages once): nine rows fork one prompt of 9 pages (six share its first 8, S6 its
 * first 2, S7 and S8 all 9), one row's context ends inside the second prompt page (S11: only the
 * first is whole), and two rows share nothing (one of them inside its first page). Units of
 * 16 / group rows (groups 1, 2, 4 and 8) take different members and shared lengths from the same
 * tables; each of them runs with the warp, pipelined and mma kernels for the rows' own pages, at 1
 * and 3 splits and by size, against the exact kernel under the tensor-core tolerance. Group 16 and
 * head size 48, which the shared kernel does not take, give the bits of the same launch without
 * the option.
 */
#ifdef RS_CUDA
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "test.h"
#include "test_util.h"

void rs_cuda_test_attention_splits(rs_backend *b, int n); /* kernels/cuda/cuda_attention.cu */
unsigned long long rs_cuda_test_attention_shared_runs(rs_backend *b);

enum { NSEQ = 4, NBLK = 48 };
static const int seq_len[NSEQ] = {200, 100, 1, 5};

typedef struct kv_kind {
    rs_dtype dt;
    rs_kv_scale_mode mode;
    const char *name;
} kv_kind;

static const kv_kind kinds[] = {{RS_DTYPE_F32, RS_KV_SCALE_NONE, "f32"},
                                {RS_DTYPE_BF16, RS_KV_SCALE_NONE, "bf16"},
                                {RS_DTYPE_E4M3, RS_KV_SCALE_PER_HEAD, "e4m3 per-head"},
                                {RS_DTYPE_E4M3, RS_KV_SCALE_PER_TOKEN, "e4m3 per-token"}};

static float bf16_rand(uint64_t *s) { return rs_bf16_to_f32(rs_f32_to_bf16(rs_test_uniform(s))); }

/* The same launch with K/V staging on: bit for bit the output `want` of the launch without it. */
static void check_staged(rs_backend *g, rs_numerics numerics, const float *q, rs_kv_layer *kv, int n_heads,
                         const rs_batch *batch, const float *want, const char *what);

/* out = attention of `batch` on g in `numerics` (q [n_tok][n_heads][hd] host); malloc'd host copy. */
static float *run(rs_backend *g, rs_numerics numerics, const float *q, rs_kv_layer *kv, int n_heads, const rs_batch *batch) {
    const size_t n = (size_t)batch->n_tok * n_heads * kv->head_dim;
    ASSERT_EQ(rs_backend_set_numerics(g, numerics), numerics);
    float *dq = rs_test_to_backend(g, q, n * 4), *dout = rs_backend_alloc(g, n * 4);
    rs_op_attention(g, dout, dq, kv, n_heads, 1.0f / sqrtf((float)kv->head_dim), batch);
    float *out = rs_test_to_host(g, dout, n * 4);
    rs_backend_free_mem(g, dq), rs_backend_free_mem(g, dout);
    return out;
}

static void check_staged(rs_backend *g, rs_numerics numerics, const float *q, rs_kv_layer *kv, int n_heads,
                         const rs_batch *batch, const float *want, const char *what) {
    rs_backend_cuda_set_attention_kernel(g, RS_CUDA_ATTENTION_STAGED);
    float *got = run(g, numerics, q, kv, n_heads, batch);
    rs_backend_cuda_set_attention_kernel(g, RS_CUDA_ATTENTION_PIPELINED);
    const size_t n = (size_t)batch->n_tok * n_heads * kv->head_dim;
    for (size_t i = 0; i < n; i++)
        if (rs_test_f32_bits(got[i]) != rs_test_f32_bits(want[i]))
            RS_TEST_FAIL("%s, hd %d, %s: staged K/V gives %a at %zu, row by row %a", rs_dtype_name(kv->dtype),
                         kv->head_dim, what, got[i], i, want[i]);
    free(got);
}

static void one_case(rs_backend *g, const kv_kind *kind, int n_heads, int n_kv, int hd, uint64_t *s) {
    rs_kv_layer kv = {.dtype = kind->dt, .n_blocks = NBLK, .n_kv_heads = n_kv, .head_dim = hd,
                      .scale_mode = kind->mode};
    const size_t page_bytes = (size_t)NBLK * 2 * RS_KV_BLOCK * n_kv * hd * rs_dtype_size(kind->dt);
    kv.pages = rs_backend_alloc(g, page_bytes);
    float ks[16], vs[16];
    for (int h = 0; h < n_kv; h++) ks[h] = 0.004f * (1 + h), vs[h] = 0.003f * (2 + h);
    if (kind->mode == RS_KV_SCALE_PER_HEAD) {
        kv.k_scale = rs_test_to_backend(g, ks, (size_t)n_kv * 4);
        kv.v_scale = rs_test_to_backend(g, vs, (size_t)n_kv * 4);
    } else if (kind->mode == RS_KV_SCALE_PER_TOKEN) {
        kv.token_scales = rs_backend_alloc(g, (size_t)NBLK * 2 * RS_KV_BLOCK * n_kv * 4);
    }
    /* pages: a shuffled permutation, each sequence its run of pages */
    int32_t perm[NBLK], tables[NSEQ][16];
    for (int i = 0; i < NBLK; i++) perm[i] = i;
    for (int i = NBLK - 1; i > 0; i--) {
        int j = (int)(rs_test_rng(s) % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int next = 0;
    for (int q = 0; q < NSEQ; q++)
        for (int b = 0; b < 16; b++) tables[q][b] = b * RS_KV_BLOCK < seq_len[q] ? perm[next++] : 0;
    RS_ASSERT(next <= NBLK);
    /* K, V of every position (BF16-exact values), stored through kv_store */
    int total = 0;
    for (int q = 0; q < NSEQ; q++) total += seq_len[q];
    const size_t row = (size_t)n_kv * hd;
    float *k = malloc((size_t)total * row * 4), *v = malloc((size_t)total * row * 4);
    int32_t *slot = malloc((size_t)total * 4);
    for (int q = 0, r = 0; q < NSEQ; q++)
        for (int p = 0; p < seq_len[q]; p++, r++) slot[r] = tables[q][p / RS_KV_BLOCK] * RS_KV_BLOCK + p % RS_KV_BLOCK;
    for (size_t i = 0; i < (size_t)total * row; i++) k[i] = bf16_rand(s), v[i] = bf16_rand(s);
    if (kind->dt == RS_DTYPE_E4M3 && kind->mode == RS_KV_SCALE_PER_HEAD) /* codes span the range */
        for (size_t i = 0; i < (size_t)total * row; i++) k[i] *= 400 * ks[(i % row) / hd], v[i] *= 400 * vs[(i % row) / hd];
    {
        int32_t st[2] = {0, total};
        rs_batch bt = {.n_tok = total, .n_seq = 1, .slot = slot, .seq_start = st};
        float *dk = rs_test_to_backend(g, k, (size_t)total * row * 4), *dv = rs_test_to_backend(g, v, (size_t)total * row * 4);
        rs_op_kv_store(g, &kv, dk, dv, &bt);
        rs_backend_free_mem(g, dk), rs_backend_free_mem(g, dv);
    }
    /* the steps: [0] mixed, [1] decode */
    for (int step = 0; step < 2; step++) {
        const int from[NSEQ] = {199, step ? 99 : 30, 0, step ? 4 : 0};
        int32_t pos[128], start[NSEQ + 1], ctx[NSEQ];
        int n = 0;
        for (int q = 0; q < NSEQ; q++) {
            start[q] = n;
            for (int p = from[q]; p < seq_len[q]; p++) pos[n++] = p;
            ctx[q] = seq_len[q];
        }
        start[NSEQ] = n;
        rs_batch bt = {.n_tok = n, .n_seq = NSEQ, .pos = pos, .seq_start = start, .seq_ctx = ctx,
                       .block_tables = &tables[0][0], .max_blocks = 16};
        const size_t nq = (size_t)n * n_heads * hd;
        float *qv = malloc(nq * 4);
        for (size_t i = 0; i < nq; i++) qv[i] = bf16_rand(s) * 2;
        float *want = run(g, RS_NUMERICS_EXACT, qv, &kv, n_heads, &bt);
        check_staged(g, RS_NUMERICS_EXACT, qv, &kv, n_heads, &bt, want, "exact");
        float vmax[16] = {0}; /* max |V| per KV head (as stored: the outputs' bound) */
        for (size_t i = 0; i < (size_t)total * row; i++) vmax[(i % row) / hd] = fmaxf(vmax[(i % row) / hd], fabsf(v[i]));
        static const int splits[] = {0, 1, 3, 7};
        for (size_t si = 0; si < RS_ARRAY_LEN(splits) * 4; si++) {
            /* the warp kernel at every count; the tile kernel at 3 splits (its other counts are the
             * fallback's at 48); the pipelined warp kernel and the mma kernel by size and at 3 */
            const int kind_i = (int)(si % 4), n_split = splits[si / 4];
            const bool warps = kind_i != 1;
            if (kind_i == 1 && n_split != 3) continue;
            if (kind_i >= 2 && n_split != 0 && n_split != 3) continue;
            static const rs_cuda_attention_kernel kern[4] = {RS_CUDA_ATTENTION_WARPS, RS_CUDA_ATTENTION_TILES,
                                                             RS_CUDA_ATTENTION_PIPELINED, RS_CUDA_ATTENTION_MMA};
            rs_cuda_test_attention_splits(g, n_split);
            rs_backend_cuda_set_attention_kernel(g, kern[kind_i]);
            float *got = run(g, RS_NUMERICS_FAST, qv, &kv, n_heads, &bt);
            rs_backend_cuda_set_attention_kernel(g, RS_CUDA_ATTENTION_PIPELINED);
            if (!warps && n_split == 3) check_staged(g, RS_NUMERICS_FAST, qv, &kv, n_heads, &bt, got, "fast, 3 splits");
            const bool tc_ok = hd == 32 || hd == 64 || hd == 128 || hd == 256;
            for (int q = 0; q < NSEQ; q++)
                for (int r = start[q]; r < start[q + 1]; r++) {
                    const bool prefill = start[q + 1] - start[q] > 1;
                    /* tensor cores: prefill tiles, and the mma kernel's split rows at head sizes up to 128 */
                    const bool tc = prefill ? tc_ok : kind_i == 3 && (hd == 32 || hd == 64 || hd == 128);
                    /* tensor cores: P rounds to F16 (2^-11) or, on BF16 pages, to BF16 (2^-8) */
                    const double tol = !tc ? 2e-5 : kind->dt == RS_DTYPE_BF16 ? 4e-3 : 1e-3;
                    for (size_t e = 0; e < (size_t)n_heads * hd; e++) {
                        const size_t i = (size_t)r * n_heads * hd + e;
                        const double bound = tc ? vmax[(e / hd) / (n_heads / n_kv)] : 1.0 + fabs(want[i]);
                        if (!(fabs((double)got[i] - want[i]) <= tol * bound))
                            RS_TEST_FAIL("%s heads %d/%d hd %d %s step, %d splits: row %d (seq %d pos %d) head %zu dim %zu: "
                                         "fast %.7g exact %.7g (%s)",
                                         kind->name, n_heads, n_kv, hd, step ? "decode" : "mixed", n_split, r, q,
                                         pos[r], e / hd, e % hd, got[i], want[i],
                                         prefill && tc ? "tensor cores"
                                         : !warps      ? "split, tiles"
                                         : kind_i == 3 ? (tc ? "split, mma" : "split, mma's fallback")
                                         : kind_i == 2 ? "split, pipelined warps"
                                                       : "split, warps");
                    }
                }
            free(got);
        }
        rs_cuda_test_attention_splits(g, 0);
        free(qv), free(want);
    }
    free(k), free(v), free(slot);
    rs_backend_free_mem(g, kv.pages);
    if (kv.k_scale) rs_backend_free_mem(g, kv.k_scale), rs_backend_free_mem(g, kv.v_scale);
    if (kv.token_scales) rs_backend_free_mem(g, kv.token_scales);
}

RS_TEST(cuda_attention_fast_matches_exact) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 131;
    static const int shapes[][3] = {{4, 2, 32}, {8, 2, 64}, {4, 4, 128}, {12, 1, 48}};
    for (size_t ki = 0; ki < RS_ARRAY_LEN(kinds); ki++)
        for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++)
            one_case(g, &kinds[ki], shapes[si][0], shapes[si][1], shapes[si][2], &s);
    rs_backend_free(g);
}

/* The same for the warp kernel's query-head chunks: two of 8 (group 16), and at head size 256 one of
 * 4 and one of 2 (group 6). The chunking does not depend on the page format, which the test above
 * covers: BF16 and E4M3 with per-token scales here. */
RS_TEST(cuda_attention_fast_head_chunks) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 137;
    static const int shapes[][3] = {{16, 1, 64}, {6, 1, 256}};
    for (size_t ki = 1; ki < RS_ARRAY_LEN(kinds); ki += 2)
        for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++)
            one_case(g, &kinds[ki], shapes[si][0], shapes[si][1], shapes[si][2], &s);
    rs_backend_free(g);
}

/* One decode row over 4500 positions: the warp kernel's page-table slices (AW_TABLE pages). */
RS_TEST(cuda_attention_warps_long_context) {
    rs_backend *g = rs_test_cuda_or_skip();
    enum { LEN = 4500, HD = 32, NH = 2, NBLOCKS = (LEN + RS_KV_BLOCK - 1) / RS_KV_BLOCK };
    uint64_t s = 7;
    rs_kv_layer kv = {.dtype = RS_DTYPE_BF16, .n_blocks = NBLOCKS, .n_kv_heads = 1, .head_dim = HD,
                      .scale_mode = RS_KV_SCALE_NONE};
    kv.pages = rs_backend_alloc(g, (size_t)NBLOCKS * 2 * RS_KV_BLOCK * HD * 2);
    int32_t *table = malloc(NBLOCKS * 4), *slot = malloc(LEN * 4);
    for (int i = 0; i < NBLOCKS; i++) table[i] = NBLOCKS - 1 - i; /* pages in reverse */
    for (int p = 0; p < LEN; p++) slot[p] = table[p / RS_KV_BLOCK] * RS_KV_BLOCK + p % RS_KV_BLOCK;
    float *k = malloc((size_t)LEN * HD * 4), *v = malloc((size_t)LEN * HD * 4), q[NH * HD];
    for (size_t i = 0; i < (size_t)LEN * HD; i++) k[i] = bf16_rand(&s), v[i] = bf16_rand(&s);
    for (int i = 0; i < NH * HD; i++) q[i] = bf16_rand(&s) * 3;
    {
        int32_t st[2] = {0, LEN};
        rs_batch bt = {.n_tok = LEN, .n_seq = 1, .slot = slot, .seq_start = st};
        float *dk = rs_test_to_backend(g, k, (size_t)LEN * HD * 4), *dv = rs_test_to_backend(g, v, (size_t)LEN * HD * 4);
        rs_op_kv_store(g, &kv, dk, dv, &bt);
        rs_backend_free_mem(g, dk), rs_backend_free_mem(g, dv);
    }
    int32_t pos = LEN - 1, start[2] = {0, 1}, ctx = LEN;
    rs_batch bt = {.n_tok = 1, .n_seq = 1, .pos = &pos, .seq_start = start, .seq_ctx = &ctx, .block_tables = table,
                   .max_blocks = NBLOCKS};
    float *want = run(g, RS_NUMERICS_EXACT, q, &kv, NH, &bt);
    static const int splits[] = {1, 0};
    static const rs_cuda_attention_kernel kern[3] = {RS_CUDA_ATTENTION_WARPS, RS_CUDA_ATTENTION_PIPELINED,
                                                     RS_CUDA_ATTENTION_MMA};
    static const char *kname[3] = {"warps", "pipelined", "mma"};
    for (size_t si = 0; si < RS_ARRAY_LEN(splits) * 3; si++) {
        const int ki = (int)(si % 3);
        rs_cuda_test_attention_splits(g, splits[si / 3]);
        rs_backend_cuda_set_attention_kernel(g, kern[ki]);
        float *got = run(g, RS_NUMERICS_FAST, q, &kv, NH, &bt);
        for (int i = 0; i < NH * HD; i++) {
            /* tensor cores round P to BF16: within 4e-3 of max |V| (< 1), as the prefill kernel */
            const double tol = ki == 2 ? 4e-3 : 2e-5 * (1.0 + fabs(want[i]));
            if (!(fabs((double)got[i] - want[i]) <= tol))
                RS_TEST_FAIL("%d splits, %s: head %d dim %d: fast %.7g exact %.7g", splits[si / 3], kname[ki], i / HD,
                             i % HD, got[i], want[i]);
        }
        free(got);
    }
    rs_backend_cuda_set_attention_kernel(g, RS_CUDA_ATTENTION_PIPELINED);
    rs_cuda_test_attention_splits(g, 0);
    free(want), free(table), free(slot), free(k), free(v);
    rs_backend_free_mem(g, kv.pages);
    rs_backend_free(g);
}
/* Rows whose tables share pages (see the file comment): the page pool holds random K/V in every
 * slot, so a shared page has the same contents for every row that reads it. */
enum { SH_SEQ = 12, SH_BLK = 64, SH_MAXB = 12, SH_OWN = 50 };

static void shared_case(rs_backend *g, const kv_kind *kind, int n_heads, int n_kv, int hd, uint64_t *s) {
    rs_kv_layer kv = {.dtype = kind->dt, .n_blocks = SH_BLK, .n_kv_heads = n_kv, .head_dim = hd,
                      .scale_mode = kind->mode};
    kv.pages = rs_backend_alloc(g, (size_t)SH_BLK * 2 * RS_KV_BLOCK * n_kv * hd * rs_dtype_size(kind->dt));
    float ks[16], vs[16];
    for (int h = 0; h < n_kv; h++) ks[h] = 0.004f * (1 + h), vs[h] = 0.003f * (2 + h);
    if (kind->mode == RS_KV_SCALE_PER_HEAD) {
        kv.k_scale = rs_test_to_backend(g, ks, (size_t)n_kv * 4);
        kv.v_scale = rs_test_to_backend(g, vs, (size_t)n_kv * 4);
    } else if (kind->mode == RS_KV_SCALE_PER_TOKEN) {
        kv.token_scales = rs_backend_alloc(g, (size_t)SH_BLK * 2 * RS_KV_BLOCK * n_kv * 4);
    }
    const int total = SH_BLK * RS_KV_BLOCK;
    const size_t row = (size_t)n_kv * hd;
    float *k = malloc((size_t)total * row * 4), *v = malloc((size_t)total * row * 4);
    int32_t *slot = malloc((size_t)total * 4);
    for (int i = 0; i < total; i++) slot[i] = i;
    for (size_t i = 0; i < (size_t)total * row; i++) k[i] = bf16_rand(s), v[i] = bf16_rand(s);
    if (kind->dt == RS_DTYPE_E4M3 && kind->mode == RS_KV_SCALE_PER_HEAD)
        for (size_t i = 0; i < (size_t)total * row; i++) k[i] *= 400 * ks[(i % row) / hd], v[i] *= 400 * vs[(i % row) / hd];
    {
        int32_t st[2] = {0, total};
        rs_batch bt = {.n_tok = total, .n_seq = 1, .slot = slot, .seq_start = st};
        float *dk = rs_test_to_backend(g, k, (size_t)total * row * 4), *dv = rs_test_to_backend(g, v, (size_t)total * row * 4);
        rs_op_kv_store(g, &kv, dk, dv, &bt);
        rs_backend_free_mem(g, dk), rs_backend_free_mem(g, dv);
    }
    float vmax[16] = {0};
    for (size_t i = 0; i < (size_t)total * row; i++) vmax[(i % row) / hd] = fmaxf(vmax[(i % row) / hd], fabsf(v[i]));
    /* the prompt's pages 50..58 (in a shuffled order), then each sequence's own pages below 50 */
    static const int len[SH_SEQ] = {129, 145, 158, 173, 144, 131, 50, 150, 160, 40, 10, 20};
    static const int shares[SH_SEQ] = {8, 8, 8, 8, 8, 8, 2, 9, 9, 0, 0, 2}; /* leading prompt pages */
    static const int prompt[9] = {53, 50, 57, 51, 55, 58, 52, 56, 54};
    int32_t tables[SH_SEQ][SH_MAXB], pos[SH_SEQ], start[SH_SEQ + 1], ctx[SH_SEQ];
    int next = 0;
    for (int q = 0; q < SH_SEQ; q++) {
        for (int b = 0; b < SH_MAXB; b++)
            tables[q][b] = b * RS_KV_BLOCK >= len[q] ? 0 : b < shares[q] ? prompt[b] : (next++ * 7) % SH_OWN;
        pos[q] = len[q] - 1, start[q] = q, ctx[q] = len[q];
    }
    RS_ASSERT(next <= SH_OWN);
    start[SH_SEQ] = SH_SEQ;
    rs_batch bt = {.n_tok = SH_SEQ, .n_seq = SH_SEQ, .pos = pos, .seq_start = start, .seq_ctx = ctx,
                   .block_tables = &tables[0][0], .max_blocks = SH_MAXB};
    const size_t nq = (size_t)SH_SEQ * n_heads * hd;
    float *qv = malloc(nq * 4);
    for (size_t i = 0; i < nq; i++) qv[i] = bf16_rand(s) * 2;
    float *want = run(g, RS_NUMERICS_EXACT, qv, &kv, n_heads, &bt);
    const int group = n_heads / n_kv;
    const bool takes = (hd == 32 || hd == 64 || hd == 128) && group <= 8;
    static const rs_cuda_attention_kernel kern[3] = {RS_CUDA_ATTENTION_WARPS, RS_CUDA_ATTENTION_PIPELINED,
                                                     RS_CUDA_ATTENTION_MMA};
    static const char *kname[3] = {"warps", "pipelined", "mma"};
    static const int splits[] = {0, 1, 3};
    for (size_t ci = 0; ci < 3 * RS_ARRAY_LEN(splits); ci++) {
        const int ki = (int)(ci % 3), n_split = splits[ci / 3];
        rs_cuda_test_attention_splits(g, n_split);
        rs_backend_cuda_set_attention_kernel(g, kern[ki]);
        float *plain = takes ? NULL : run(g, RS_NUMERICS_FAST, qv, &kv, n_heads, &bt);
        const unsigned long long runs0 = rs_cuda_test_attention_shared_runs(g);
        rs_backend_cuda_set_attention_shared(g, true);
        float *got = run(g, RS_NUMERICS_FAST, qv, &kv, n_heads, &bt);
        rs_backend_cuda_set_attention_shared(g, false);
        if ((rs_cuda_test_attention_shared_runs(g) != runs0) != takes)
            RS_TEST_FAIL("%s heads %d/%d hd %d %s: the shared kernel %s", kind->name, n_heads, n_kv, hd, kname[ki],
                         takes ? "did not run" : "ran");
        for (size_t i = 0; i < nq; i++) {
            if (!takes) {
                if (rs_test_f32_bits(got[i]) != rs_test_f32_bits(plain[i]))
                    RS_TEST_FAIL("%s heads %d/%d hd %d %s: %a at %zu, %a without the option", kind->name, n_heads, n_kv,
                                 hd, kname[ki], got[i], i, plain[i]);
                continue;
            }
            const size_t r = i / ((size_t)n_heads * hd), e = i % ((size_t)n_heads * hd);
            const double tol = kind->dt == RS_DTYPE_BF16 ? 4e-3 : 1e-3;
            if (!(fabs((double)got[i] - want[i]) <= tol * vmax[(e / hd) / group]))
                RS_TEST_FAIL("%s heads %d/%d hd %d, %s, %d splits: row %zu (pos %d) head %zu dim %zu: shared %.7g exact %.7g",
                             kind->name, n_heads, n_kv, hd, kname[ki], n_split, r, pos[r], e / hd, e % hd, got[i], want[i]);
        }
        free(got), free(plain);
    }
    rs_backend_cuda_set_attention_kernel(g, RS_CUDA_ATTENTION_PIPELINED);
    rs_cuda_test_attention_splits(g, 0);
    free(qv), free(want), free(k), free(v), free(slot);
    rs_backend_free_mem(g, kv.pages);
    if (kv.k_scale) rs_backend_free_mem(g, kv.k_scale), rs_backend_free_mem(g, kv.v_scale);
    if (kv.token_scales) rs_backend_free_mem(g, kv.token_scales);
}

RS_TEST(cuda_attention_shared_pages_match_exact) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 139;
    /* groups 1, 2, 4, 8 (units of 16, 8, 4, 2 rows); group 16 and head size 48 run without it */
    static const int shapes[][3] = {{2, 2, 32}, {4, 2, 64}, {8, 2, 128}, {8, 1, 32}, {16, 1, 64}, {4, 2, 48}};
    for (size_t ki = 0; ki < RS_ARRAY_LEN(kinds); ki++)
        for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++)
            shared_case(g, &kinds[ki], shapes[si][0], shapes[si][1], shapes[si][2], &s);
    rs_backend_free(g);
}
#endif
