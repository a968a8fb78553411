/*
 * cpu_attention.c — writing K/V into the paged cache, and causal attention over it.
 *
 * Pages are [n_blocks][2][RS_KV_BLOCK][n_kv_heads][head_dim] (0 = K, 1 = V), fp32, bf16 (stored
 * round-to-nearest-even) or E4M3 codes. A row r of sequence s at position p attends to positions
 * 0..p of s, found through block table row s; that makes one rule serve decode rows, prefill
 * chunks (each row sees only what precedes it) and mixed batches.
 *
 * E4M3 pages (a code c stands for c * scale):
 *   store  PER_HEAD   code = sat_e4m3(x / scale[h]) with the layer's k_scale / v_scale — a true
 *                     fp32 division, like the weight and activation quantizers (fp8.h) and vLLM's
 *                     reshape_and_cache, so a device kernel reproduces the codes bit for bit;
 *          PER_TOKEN  per token and KV head s = max(amax over head_dim, 1e-10) / 448 (amax skips
 *                     NaN), written to token_scales beside the page, then code = sat_e4m3(x / s).
 *   read   codes are decoded exactly (cpu_attention_simd.c) and the scales are folded in rather
 *          than applied per element: score = (q . codes) * (softmax_scale * k_scale[h]) and
 *          out = (sum_j p_j codes_j) * v_scale[h] for PER_HEAD (softmax(s V) = s softmax(V), the
 *          FlashInfer form); PER_TOKEN multiplies score j by softmax_scale * ks_j and weighs V row
 *          j with p_j * vs_j. The result equals attention over fp32 pages holding code * scale up
 *          to fp32 rounding of the reassociated products.
 *
 * Work items are (run, KV head). A run is up to RUN_HEADS / group consecutive rows of one sequence
 * (a prefill chunk's rows; a decode row is a run of one), and the query heads of all its rows that
 * share the KV head are done together, so each K and V row is read (widened, or decoded) once for
 * all of them, a page at a time through the page kernels of cpu_attention_simd.c, for every page
 * format; a row still computes to the bits it gets alone (attend_run). The next page's slices are
 * prefetched. Items are dealt round-robin to threads, which balances a prefill chunk whose later
 * rows see more context. Softmax is the two-pass form in fp32: scores, max, exp(s - max) and their
 * sum in one vector pass (cpu_exp.c: rs_expf, 16 fixed lanes, so the probabilities do not depend on
 * the SIMD level), probabilities p = e / sum, then out = sum_j p_j v_j. Scores live in per-thread
 * scratch sized before the pool runs.
 *
 * --numerics fast over BF16 pages (rs_cpu_fast_bf16): q is rounded to BF16 once per run and the
 * probabilities once per row after the fp32 softmax, and the scores and P V run on vdpbf16ps
 * (rs_cpu_scores_bf16_dot, rs_cpu_accum_bf16_dot); everything else above holds, batch invariance
 * included. A 2048-token prefill of a Qwen3-0.6B shape spent 25% of its time in attention with the
 * fp32 kernels and 20% with these (perf, Zen 4).
 */
#include <math.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"
#include "cpu_attention_simd.h"
#include "cpu_internal.h"

/* ---- page addressing ---- */

/* Start of the [n_kv_heads][head_dim] row of `slot` in half `kv_idx` (0 = K, 1 = V). */
static char *kv_row(const rs_kv_layer *kv, int64_t slot, int kv_idx, size_t es) {
    int64_t block = slot / RS_KV_BLOCK, off = slot % RS_KV_BLOCK;
    size_t row = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    return (char *)kv->pages + (((size_t)block * 2 + (size_t)kv_idx) * RS_KV_BLOCK + (size_t)off) * row * es;
}

/* PER_TOKEN: the [n_kv_heads] scales of `slot` in half `kv_idx`; token_scales has the pages'
 * layout without the head_dim axis. */
static float *kv_token_scales(const rs_kv_layer *kv, int64_t slot, int kv_idx) {
    int64_t block = slot / RS_KV_BLOCK, off = slot % RS_KV_BLOCK;
    size_t row = ((size_t)block * 2 + (size_t)kv_idx) * RS_KV_BLOCK + (size_t)off;
    return kv->token_scales + row * (size_t)kv->n_kv_heads;
}

/* A prefetch the compiler keeps. GCC 12 (-O1 and up, tree DCE) deletes prefetch_page's loops when
 * their body is only __builtin_prefetch — seen in the generated code, and worth 2-3x at long
 * contexts; an asm statement with a memory operand is never deleted. */
static inline void prefetch_line(const char *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht0 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 3);
#endif
}

/* Pulls the [head_off, head_off + bytes) slice of every row of `page`'s half kv_idx toward L1.
 * An item reads one head's slice of each row: a short run at a stride of the whole row, scattered
 * over pages, which the hardware prefetchers hardly follow; fetching the next page's slices while
 * this page is computed keeps the loads from waiting on memory one row at a time. */
static void prefetch_page(const rs_kv_layer *kv, int32_t page, int kv_idx, size_t head_off, size_t bytes, size_t es) {
    for (int o = 0; o < RS_KV_BLOCK; o++) {
        const char *row = kv_row(kv, (int64_t)page * RS_KV_BLOCK + o, kv_idx, es) + head_off;
        for (size_t b = 0; b < bytes; b += 64) prefetch_line(row + b);
    }
}

/* ---- kv_store ---- */

/* One token's K or V row [n_kv_heads][head_dim] as E4M3 codes into `slot` (see the file comment). */
static void store_e4m3_row(const rs_kv_layer *kv, int64_t slot, int kv_idx, const float *src) {
    const int hd = kv->head_dim;
    uint8_t *dst = (uint8_t *)kv_row(kv, slot, kv_idx, 1);
    float *ts = kv->scale_mode == RS_KV_SCALE_PER_TOKEN ? kv_token_scales(kv, slot, kv_idx) : NULL;
    const float *head_scale = kv_idx == 0 ? kv->k_scale : kv->v_scale;
    for (int h = 0; h < kv->n_kv_heads; h++) {
        const float *x = src + (size_t)h * (size_t)hd;
        uint8_t *d = dst + (size_t)h * (size_t)hd;
        float s;
        if (ts) {
            float amax = 0.0f;
            for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(x[i]));
            s = fmaxf(amax, RS_FP8_AMAX_FLOOR) / RS_FP8_E4M3_MAX;
            ts[h] = s;
        } else {
            s = head_scale[h];
        }
        for (int i = 0; i < hd; i++) d[i] = rs_fp8_e4m3_from_f32(x[i] / s);
    }
}

typedef struct store_job {
    const rs_kv_layer *kv;
    const float *k, *v; /* [n_tok][n_kv_heads][head_dim] */
    const int32_t *slot;
} store_job;

static void store_e4m3_range(void *arg, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const store_job *j = arg;
    size_t row = (size_t)j->kv->n_kv_heads * (size_t)j->kv->head_dim;
    for (int64_t r = r0; r < r1; r++) {
        store_e4m3_row(j->kv, j->slot[r], 0, j->k + (size_t)r * row);
        store_e4m3_row(j->kv, j->slot[r], 1, j->v + (size_t)r * row);
    }
}

void rs_cpu_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v,
                        const rs_batch *batch) {
    size_t es = rs_kv_layer_check(kv);
    size_t row = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    for (int r = 0; r < batch->n_tok; r++)
        RS_ASSERT(batch->slot[r] >= 0 && batch->slot[r] < (int64_t)kv->n_blocks * RS_KV_BLOCK);
    if (kv->dtype == RS_DTYPE_E4M3) { /* the encoder is scalar: spread a prefill chunk over threads */
        if (batch->n_tok == 0) return;
        store_job j = {.kv = kv, .k = k, .v = v, .slot = batch->slot};
        rs_pool_run(rs_cpu_ctx_of(b)->pool, batch->n_tok, 1, store_e4m3_range, &j);
        return;
    }
    for (int r = 0; r < batch->n_tok; r++) {
        int64_t slot = batch->slot[r];
        for (int h = 0; h < 2; h++) {
            const float *src = (h == 0 ? k : v) + (size_t)r * row;
            char *dst = kv_row(kv, slot, h, es);
            if (kv->dtype == RS_DTYPE_F32) {
                memcpy(dst, src, row * sizeof(float));
            } else {
                uint16_t *d = (uint16_t *)dst;
                for (size_t i = 0; i < row; i++) d[i] = rs_f32_to_bf16(src[i]);
            }
        }
    }
}

/* ---- attention ---- */

/* Query heads an item gives the page kernels at most. A run's K and V page slices are read from
 * memory once and then from L1 by every pass of the kernels (AVX-512: 4 heads a scores pass, 8 an
 * accum pass). 16 against 8: the same at a 512-token prefill, 3-6% faster at 2048; 32 no better
 * (rollout-bench --prefill 512,2048, BF16 pages, Zen 4). */
#define RUN_HEADS 16

typedef struct attn_job {
    rs_cpu_ctx *c;
    float *out;     /* [n_tok][n_heads][head_dim] */
    const float *q; /* [n_tok][n_heads][head_dim] */
    const rs_kv_layer *kv;
    const rs_batch *batch;
    const int32_t *row_seq; /* [n_tok] sequence of each row */
    const int32_t *runs;    /* [n_runs] first row of each run; runs[n_runs] = n_tok */
    const rs_cpu_kv_vec *vec;
    const rs_cpu_exp_vec *ex;
    int n_heads, group; /* group = query heads per KV head */
    float scale;
    bool bf16_dot; /* the fast numerics over BF16 pages: q and p rounded to BF16, vdpbf16ps */
    int64_t n_items; /* n_runs * n_kv_heads */
    int n_workers;
} attn_job;

/* In place over the [g][ld] scores, first n of each: p = exp(s - max) / sum, with the exp and the
 * 16-lane sum of cpu_exp.c (the same bits at every SIMD level). */
static void softmax_rows(const rs_cpu_exp_vec *ex, float *scores, int g, size_t ld, int n) {
    for (int h = 0; h < g; h++) {
        float *sc = scores + (size_t)h * ld;
        float max = ex->max(sc, (size_t)n, 1.0f);
        float sum = ex->exp_sum(sc, sc, (size_t)n, 1.0f, max);
        ex->div(sc, (size_t)n, sum);
    }
}

/* One run of nr consecutive rows r0.. of one sequence (positions pos[r0], pos[r0] + 1, ...) and
 * one KV head: its nr x group query heads, G in all, over positions 0..pos[r0 + nr - 1], a page at
 * a time through the page kernels (cpu_attention_simd.c), which read each K and V row once for all
 * G. E4M3 scales are folded as the file comment says: raw q . codes per page, then times
 * softmax_scale * k_scale (or * ks_j); PER_TOKEN weighs the probabilities by vs_j before P V;
 * PER_HEAD multiplies the output by v_scale. F32 and BF16 scores are the dot products times
 * softmax_scale.
 *
 * A row gets the bits it gets alone (a decode row is a run of one): a score depends only on q and
 * the K row, so the scores a row does not see (past its own position) are computed and ignored;
 * softmax runs over each row's own context; and P V adds a row's products in position order, one
 * call for the pages every row of the run sees in full and one call per row for the last ones.
 * scratch: [G][ld] scores, then [G][hd] q and out when nr > 1 (the rows' heads are not adjacent). */
static void attend_run(const attn_job *j, int r0, int nr, int kvh, float *scratch) {
    const rs_kv_layer *kv = j->kv;
    const rs_batch *bt = j->batch;
    const rs_cpu_kv_vec *vec = j->vec;
    const int hd = kv->head_dim, g = j->group, G = nr * g;
    const int n_min = bt->pos[r0] + 1, n_ctx = bt->pos[r0 + nr - 1] + 1; /* contexts of the first and last row */
    const bool fp8 = kv->dtype == RS_DTYPE_E4M3, per_token = fp8 && kv->scale_mode == RS_KV_SCALE_PER_TOKEN;
    const size_t es = rs_dtype_size(kv->dtype), ld = (size_t)n_ctx, ghd = (size_t)g * (size_t)hd;
    const size_t head_off = (size_t)kvh * (size_t)hd * es, slice = (size_t)hd * es; /* bytes */
    const size_t stride = (size_t)kv->n_kv_heads * (size_t)hd; /* elements from one row to the next */
    const size_t row_elems = (size_t)j->n_heads * (size_t)hd; /* one row of q or out */
    const int32_t *table = bt->block_tables + (size_t)j->row_seq[r0] * (size_t)bt->max_blocks;
    const size_t first = ((size_t)r0 * (size_t)j->n_heads + (size_t)kvh * (size_t)g) * (size_t)hd;
    const float head_mul = per_token ? 0.0f : fp8 ? j->scale * kv->k_scale[kvh] : j->scale;
    const size_t ghds = (size_t)G * (size_t)hd;
    float *scores = scratch;
    const float *q = j->q + first; /* [G][hd] */
    float *out = j->out + first;   /* [G][hd] */
    if (nr > 1) {
        float *qb = scratch + (size_t)G * ld;
        for (int i = 0; i < nr; i++) memcpy(qb + (size_t)i * ghd, q + (size_t)i * row_elems, ghd * sizeof(float));
        q = qb;
        out = qb + ghds;
    }
    uint16_t *q16 = NULL, *p16 = NULL; /* bf16_dot: q [G][hd] and p [G][ld] in BF16 */
    if (j->bf16_dot) {
        q16 = (uint16_t *)(scratch + (size_t)G * ld + 2 * ghds);
        p16 = q16 + ghds;
        rs_cpu_round_bf16_avx512(q16, q, ghds);
    }

    for (int p0 = 0; p0 < n_ctx; p0 += RS_KV_BLOCK) {
        int32_t page = table[p0 / RS_KV_BLOCK];
        RS_ASSERT(page >= 0 && page < kv->n_blocks);
        if (p0 + RS_KV_BLOCK < n_ctx) prefetch_page(kv, table[p0 / RS_KV_BLOCK + 1], 0, head_off, slice, es);
        int n = RS_MIN(RS_KV_BLOCK, n_ctx - p0);
        int64_t slot0 = (int64_t)page * RS_KV_BLOCK;
        const char *k = kv_row(kv, slot0, 0, es) + head_off;
        if (q16)
            rs_cpu_scores_bf16_dot(scores + p0, ld, q16, G, (const uint16_t *)(const void *)k, stride, n, hd);
        else
            vec->scores(scores + p0, ld, q, G, k, kv->dtype, stride, n, hd);
        float mul[RS_KV_BLOCK];
        for (int o = 0; o < n; o++) mul[o] = per_token ? j->scale * kv_token_scales(kv, slot0 + o, 0)[kvh] : head_mul;
        for (int h = 0; h < G; h++)
            for (int o = 0; o < n; o++) scores[(size_t)h * ld + (size_t)(p0 + o)] *= mul[o];
    }
    for (int i = 0; i < nr; i++) softmax_rows(j->ex, scores + (size_t)i * (size_t)g * ld, g, ld, n_min + i);
    if (p16)
        for (int h = 0; h < G; h++)
            rs_cpu_round_bf16_avx512(p16 + (size_t)h * ld, scores + (size_t)h * ld, (size_t)(n_min + h / g));
    memset(out, 0, (size_t)G * (size_t)hd * sizeof(float));
    for (int p0 = 0; p0 < n_ctx; p0 += RS_KV_BLOCK) {
        int32_t page = table[p0 / RS_KV_BLOCK];
        if (p0 + RS_KV_BLOCK < n_ctx) prefetch_page(kv, table[p0 / RS_KV_BLOCK + 1], 1, head_off, slice, es);
        int n = RS_MIN(RS_KV_BLOCK, n_ctx - p0);
        int64_t slot0 = (int64_t)page * RS_KV_BLOCK;
        if (per_token) {
            for (int o = 0; o < n; o++) {
                float vs = kv_token_scales(kv, slot0 + o, 1)[kvh];
                for (int h = 0; h < G; h++) scores[(size_t)h * ld + (size_t)(p0 + o)] *= vs;
            }
        }
        const char *v = kv_row(kv, slot0, 1, es) + head_off;
        /* every row sees the whole piece, or row i sees positions < n_min + i */
        const bool whole = p0 + n <= n_min;
        for (int i = 0; i < (whole ? 1 : nr); i++) {
            const int ni = whole ? n : RS_MIN(n, n_min + i - p0), gi = whole ? G : g;
            const size_t h0 = whole ? 0 : (size_t)i * (size_t)g;
            if (ni <= 0) continue;
            if (p16)
                rs_cpu_accum_bf16_dot(out + h0 * (size_t)hd, p16 + h0 * ld + p0, ld, gi,
                                      (const uint16_t *)(const void *)v, stride, ni, hd);
            else
                vec->accum(out + h0 * (size_t)hd, scores + h0 * ld + p0, ld, gi, v, kv->dtype, stride, ni, hd);
        }
    }
    if (fp8 && !per_token) {
        float vs = kv->v_scale[kvh];
        for (size_t i = 0; i < (size_t)G * (size_t)hd; i++) out[i] *= vs;
    }
    if (nr > 1)
        for (int i = 0; i < nr; i++)
            memcpy(j->out + first + (size_t)i * row_elems, out + (size_t)i * ghd, ghd * sizeof(float));
}

/* Worker w takes items w, w + n_workers, ...; item i is run i / n_kv_heads, KV head i % n_kv_heads. */
static void attn_range(void *arg, int64_t w0, int64_t w1, int tid) {
    const attn_job *j = arg;
    float *scratch = j->c->thread_buf[tid].p;
    int n_kv = j->kv->n_kv_heads;
    for (int64_t w = w0; w < w1; w++) {
        for (int64_t i = w; i < j->n_items; i += j->n_workers) {
            int64_t run = i / n_kv;
            attend_run(j, j->runs[run], j->runs[run + 1] - j->runs[run], (int)(i % n_kv), scratch);
        }
    }
}

void rs_cpu_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                         float scale, const rs_batch *batch) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    rs_kv_layer_check(kv);
    if (batch->n_tok == 0) return;
    RS_ASSERT(kv->n_kv_heads > 0 && n_heads % kv->n_kv_heads == 0);
    const int group = n_heads / kv->n_kv_heads, run_rows = RS_MAX(1, RUN_HEADS / group);
    /* row_seq [n_tok], then the runs' first rows [n_runs + 1] (at most n_tok + 1) */
    int32_t *row_seq = rs_cpu_scratch(&c->row_seq, (2 * (size_t)batch->n_tok + 1) * sizeof(int32_t));
    int32_t *runs = row_seq + batch->n_tok;
    int max_ctx = 0, n_runs = 0;
    for (int s = 0; s < batch->n_seq; s++) {
        for (int r = batch->seq_start[s]; r < batch->seq_start[s + 1]; r++) {
            int p = batch->pos[r];
            RS_ASSERT(p >= 0 && p < batch->seq_ctx[s] && p < batch->max_blocks * RS_KV_BLOCK);
            row_seq[r] = s;
            max_ctx = RS_MAX(max_ctx, p + 1);
            /* a run is up to run_rows rows of one sequence at consecutive positions */
            if (r == batch->seq_start[s] || r - runs[n_runs - 1] == run_rows || p != batch->pos[r - 1] + 1)
                runs[n_runs++] = r;
        }
    }
    runs[n_runs] = batch->n_tok;
    size_t heads = (size_t)run_rows * (size_t)group;
    for (int t = 0; t < c->n_threads; t++)
        rs_cpu_scratch(&c->thread_buf[t], heads * ((size_t)max_ctx + 2 * (size_t)kv->head_dim) * sizeof(float) +
                                              heads * ((size_t)max_ctx + (size_t)kv->head_dim) * sizeof(uint16_t));
    attn_job j = {
        .c = c,
        .out = out,
        .q = q,
        .kv = kv,
        .batch = batch,
        .row_seq = row_seq,
        .runs = runs,
        .vec = rs_cpu_kv_vec_for(c->simd),
        .ex = rs_cpu_exp_for(c->simd),
        .n_heads = n_heads,
        .group = group,
        .scale = scale,
        .bf16_dot = rs_cpu_fast_bf16(c) && kv->dtype == RS_DTYPE_BF16,
        .n_items = (int64_t)n_runs * kv->n_kv_heads,
    };
    j.n_workers = (int)RS_MIN((int64_t)c->n_threads, j.n_items);
    rs_pool_run(c->pool, j.n_workers, 1, attn_range, &j);
}
