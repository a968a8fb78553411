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
 * Work items are (unit, KV head). A unit is a run, up to RUN_HEADS / group consecutive rows of one
 * sequence (a prefill chunk's rows; a decode row is a run of one), or up to as many decode rows of
 * sequences whose block tables start with the same pages: the n samples of one prompt, forked
 * from it, or prompts that hit the same cached prefix. The query heads of all a unit's rows that
 * share the KV head are done together wherever they read the same page, so each K and V row is
 * read (widened, or decoded) once for all of them, a page at a time through the page kernels of
 * cpu_attention_simd.c, for every page format; a row still computes to the bits it gets alone
 * (attend_unit). The next page's slices are prefetched. Items are dealt round-robin to threads,
 * which balances a prefill chunk whose later rows see more context. Softmax is the two-pass form
 * in fp32: scores, max, exp(s - max) and their sum in one vector pass (cpu_exp.c: rs_expf, 16
 * fixed lanes, so the probabilities do not depend on the SIMD level), probabilities p = e / sum,
 * then out = sum_j p_j v_j. Scores live in per-thread scratch sized before the pool runs.
 *
 * --numerics fast over BF16 pages (rs_cpu_fast_bf16): q is rounded to BF16 once per unit and the
 * probabilities once per row after the fp32 softmax, and the scores and P V run on vdpbf16ps
 * (rs_cpu_scores_bf16_dot, rs_cpu_accum_bf16_dot); everything else above holds, batch invariance
 * included. A 2048-token prefill of a Qwen3-0.6B shape spent 25% of its time in attention with the
 * fp32 kernels and 20% with these (perf, Zen 4).
 */
#include <math.h>
#include <stdlib.h>
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

/* One token's K or V row [n_kv_heads][head_dim] as E4M3 codes into `slot` (see the file comment):
 * the quotients x / s, then the SIMD level's encoder (rs_cpu_fp8_encode_n, bit-identical to
 * rs_fp8_e4m3_from_f32). */
static void store_e4m3_row(rs_cpu_simd simd, const rs_kv_layer *kv, int64_t slot, int kv_idx, const float *src) {
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
        float y[256];
        for (int i0 = 0; i0 < hd; i0 += 256) {
            const int n = RS_MIN(256, hd - i0);
            for (int i = 0; i < n; i++) y[i] = x[i0 + i] / s;
            rs_cpu_fp8_encode_n(simd, d + i0, y, (size_t)n);
        }
    }
}

typedef struct store_job {
    rs_cpu_simd simd;
    const rs_kv_layer *kv;
    const float *k, *v; /* [n_tok][n_kv_heads][head_dim] */
    const int32_t *slot;
} store_job;

static void store_e4m3_range(void *arg, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const store_job *j = arg;
    size_t row = (size_t)j->kv->n_kv_heads * (size_t)j->kv->head_dim;
    for (int64_t r = r0; r < r1; r++) {
        store_e4m3_row(j->simd, j->kv, j->slot[r], 0, j->k + (size_t)r * row);
        store_e4m3_row(j->simd, j->kv, j->slot[r], 1, j->v + (size_t)r * row);
    }
}

void rs_cpu_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v,
                        const rs_batch *batch) {
    size_t es = rs_kv_layer_check(kv);
    size_t row = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    for (int r = 0; r < batch->n_tok; r++)
        RS_ASSERT(batch->slot[r] >= 0 && batch->slot[r] < (int64_t)kv->n_blocks * RS_KV_BLOCK);
    if (kv->dtype == RS_DTYPE_E4M3) { /* a division per element: spread a prefill chunk over threads */
        if (batch->n_tok == 0) return;
        store_job j = {.simd = rs_cpu_ctx_of(b)->simd, .kv = kv, .k = k, .v = v, .slot = batch->slot};
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

/* Query heads an item gives the page kernels at most. A unit's K and V page slices are read from
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
    const int32_t *row_seq;   /* [n_tok] sequence of each row */
    const int32_t *runs;      /* [n_runs] first row of each run; runs[n_runs] = n_tok */
    const int32_t *members;   /* the runs of every unit, unit by unit */
    const int32_t *unit0;     /* [n_units + 1] each unit's first entry in members */
    const int32_t *shared;    /* [n_units] pages every member reads together (see group_units) */
    const rs_cpu_kv_vec *vec;
    const rs_cpu_exp_vec *ex;
    int n_heads, group; /* group = query heads per KV head */
    float scale;
    bool bf16_dot; /* the fast numerics over BF16 pages: q and p rounded to BF16, vdpbf16ps */
    int64_t n_items; /* n_units * n_kv_heads */
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

/* A run of a unit: nr consecutive rows from r0 of one sequence, its block table, the contexts of
 * its first and last rows, and its first query head h0 among the unit's G. */
typedef struct unit_run {
    int r0, nr, n_min, n_ctx, h0;
    const int32_t *table;
} unit_run;

/* What every page pass of a unit shares: the KV head, the layout, the q and scores buffers. */
typedef struct unit_ctx {
    const attn_job *j;
    int kvh, hd;
    bool per_token;
    float head_mul;
    size_t es, ld, stride, head_off, slice;
    const float *q;
    const uint16_t *q16;
    float *scores;
    uint16_t *p16;
    float *out;
} unit_ctx;

/* Scores of heads [h0, h0 + nh) against positions p0 .. p0 + n - 1 (one page), times softmax_scale
 * and the K scale; prefetches the K slices of page `next` (< 0: none) meanwhile. */
static void page_scores(const unit_ctx *u, int h0, int nh, int32_t page, int p0, int n, int32_t next) {
    const rs_kv_layer *kv = u->j->kv;
    RS_ASSERT(page >= 0 && page < kv->n_blocks);
    if (next >= 0) prefetch_page(kv, next, 0, u->head_off, u->slice, u->es);
    const int64_t slot0 = (int64_t)page * RS_KV_BLOCK;
    const char *k = kv_row(kv, slot0, 0, u->es) + u->head_off;
    float *sc = u->scores + (size_t)h0 * u->ld + (size_t)p0;
    if (u->q16)
        rs_cpu_scores_bf16_dot(sc, u->ld, u->q16 + (size_t)h0 * (size_t)u->hd, nh, (const uint16_t *)(const void *)k,
                               u->stride, n, u->hd);
    else
        u->j->vec->scores(sc, u->ld, u->q + (size_t)h0 * (size_t)u->hd, nh, k, kv->dtype, u->stride, n, u->hd);
    float mul[RS_KV_BLOCK];
    for (int o = 0; o < n; o++)
        mul[o] = u->per_token ? u->j->scale * kv_token_scales(kv, slot0 + o, 0)[u->kvh] : u->head_mul;
    for (int h = 0; h < nh; h++)
        for (int o = 0; o < n; o++) sc[(size_t)h * u->ld + (size_t)o] *= mul[o];
}

/* P V of one page for nr rows of g heads each from head h0, whose first row sees positions
 * < n_min and row i those < n_min + i: one call for all of them where every row sees the whole
 * page, else one per row. PER_TOKEN weighs the probabilities by vs_j first. */
static void page_pv(const unit_ctx *u, int h0, int nr, int n_min, int32_t page, int p0, int n, int32_t next) {
    const rs_kv_layer *kv = u->j->kv;
    const int g = u->j->group;
    if (next >= 0) prefetch_page(kv, next, 1, u->head_off, u->slice, u->es);
    const int64_t slot0 = (int64_t)page * RS_KV_BLOCK;
    if (u->per_token) {
        for (int o = 0; o < n; o++) {
            const float vs = kv_token_scales(kv, slot0 + o, 1)[u->kvh];
            for (int h = h0; h < h0 + nr * g; h++) u->scores[(size_t)h * u->ld + (size_t)(p0 + o)] *= vs;
        }
    }
    const char *v = kv_row(kv, slot0, 1, u->es) + u->head_off;
    const bool whole = p0 + n <= n_min;
    for (int i = 0; i < (whole ? 1 : nr); i++) {
        const int ni = whole ? n : RS_MIN(n, n_min + i - p0), gi = whole ? nr * g : g;
        const size_t hh = (size_t)h0 + (whole ? 0 : (size_t)i * (size_t)g);
        if (ni <= 0) continue;
        if (u->p16)
            rs_cpu_accum_bf16_dot(u->out + hh * (size_t)u->hd, u->p16 + hh * u->ld + (size_t)p0, u->ld, gi,
                                  (const uint16_t *)(const void *)v, u->stride, ni, u->hd);
        else
            u->j->vec->accum(u->out + hh * (size_t)u->hd, u->scores + hh * u->ld + (size_t)p0, u->ld, gi, v, kv->dtype,
                             u->stride, ni, u->hd);
    }
}

/* One pass over a unit's pages (K for scores, kv_idx 0; V for P V, 1): the shared pages with all
 * its G heads, whose rows all see them whole, then each run's own pages with that run's heads. */
static void unit_pass(const unit_ctx *u, const unit_run *ur, int m, int sp, int kv_idx) {
    const int g = u->j->group, G = ur[m - 1].h0 + ur[m - 1].nr * g, n_max = (int)u->ld;
    int n_min_all = ur[0].n_min;
    for (int i = 1; i < m; i++) n_min_all = RS_MIN(n_min_all, ur[i].n_min);
    RS_ASSERT(m == 1 || (sp >= 1 && sp * RS_KV_BLOCK <= n_min_all)); /* shared pages: whole for every row */
    for (int i = -1; i < m; i++) { /* i = -1: the shared pages */
        const unit_run *r = i < 0 ? &ur[0] : &ur[i];
        const int h0 = i < 0 ? 0 : r->h0, nr = i < 0 ? G / g : r->nr, n_min = i < 0 ? n_min_all : r->n_min;
        const int p_end = i < 0 ? sp : (r->n_ctx + RS_KV_BLOCK - 1) / RS_KV_BLOCK, end = i < 0 ? n_max : r->n_ctx;
        for (int p = i < 0 ? 0 : sp; p < p_end; p++) {
            const int p0 = p * RS_KV_BLOCK, n = RS_MIN(RS_KV_BLOCK, end - p0);
            const int32_t next = p + 1 < p_end ? r->table[p + 1] : -1;
            if (kv_idx == 0) page_scores(u, h0, nr * g, r->table[p], p0, n, next);
            else page_pv(u, h0, nr, n_min, r->table[p], p0, n, next);
        }
    }
}

/* Offset in q and out of row r's query heads that share KV head kvh. */
static size_t heads_at(const attn_job *j, int r, int kvh) {
    return ((size_t)r * (size_t)j->n_heads + (size_t)kvh * (size_t)j->group) * (size_t)j->kv->head_dim;
}

/* One unit and one KV head. A unit is either one run (nr consecutive rows of one sequence at
 * positions pos[r0], pos[r0] + 1, ...: a prefill chunk's rows, or a decode row) or several
 * one-row runs of sequences whose block tables start with the same `sp` pages, each inside every
 * member's context (the samples of one prompt, forked from it, or prompts that share a cached
 * prefix). The unit's query heads that share the KV head, G in all, go through the page kernels
 * (cpu_attention_simd.c) together wherever they read the same page: all G over the shared pages,
 * then each member's own over the rest. So each shared K and V row is read once for all G.
 *
 * E4M3 scales are folded as the file comment says: raw q . codes per page, then times
 * softmax_scale * k_scale (or * ks_j); PER_TOKEN weighs the probabilities by vs_j before P V;
 * PER_HEAD multiplies the output by v_scale. F32 and BF16 scores are the dot products times
 * softmax_scale.
 *
 * A row gets the bits it gets alone (a decode row alone is a unit of one run of one row): a score
 * depends only on q and the K row, so the scores a row does not see (past its own position) are
 * computed and ignored; softmax runs over each row's own context; and P V adds a row's products
 * in position order, a page per call, whichever heads share the call.
 * scratch: [G][ld] scores, then [G][hd] q and out when the unit has more than one row (its rows'
 * heads are not adjacent). */
static void attend_unit(const attn_job *j, const int32_t *mem, int m, int sp, int kvh, float *scratch) {
    const rs_kv_layer *kv = j->kv;
    const rs_batch *bt = j->batch;
    const int hd = kv->head_dim, g = j->group;
    const bool fp8 = kv->dtype == RS_DTYPE_E4M3;
    unit_run ur[RUN_HEADS];
    int G = 0, n_max = 0; /* the unit's heads, its longest context */
    RS_ASSERT(m >= 1 && m <= RUN_HEADS);
    for (int i = 0; i < m; i++) {
        const int r0 = j->runs[mem[i]], nr = j->runs[mem[i] + 1] - r0;
        ur[i] = (unit_run){.r0 = r0, .nr = nr, .n_min = bt->pos[r0] + 1, .n_ctx = bt->pos[r0 + nr - 1] + 1, .h0 = G,
                           .table = bt->block_tables + (size_t)j->row_seq[r0] * (size_t)bt->max_blocks};
        G += nr * g;
        n_max = RS_MAX(n_max, ur[i].n_ctx);
    }
    unit_ctx u = {.j = j, .kvh = kvh, .hd = hd, .es = rs_dtype_size(kv->dtype), .ld = (size_t)n_max,
                  .stride = (size_t)kv->n_kv_heads * (size_t)hd, .scores = scratch};
    u.per_token = fp8 && kv->scale_mode == RS_KV_SCALE_PER_TOKEN;
    u.head_mul = u.per_token ? 0.0f : fp8 ? j->scale * kv->k_scale[kvh] : j->scale;
    u.head_off = (size_t)kvh * (size_t)hd * u.es, u.slice = (size_t)hd * u.es; /* bytes */
    const size_t ghd = (size_t)g * (size_t)hd, ghds = (size_t)G * (size_t)hd;
    const bool gathered = G > g;
    u.q = j->q + heads_at(j, ur[0].r0, kvh); /* [G][hd] */
    u.out = j->out + heads_at(j, ur[0].r0, kvh);
    if (gathered) {
        float *qb = scratch + (size_t)G * u.ld;
        for (int i = 0; i < m; i++)
            for (int r = 0; r < ur[i].nr; r++)
                memcpy(qb + (size_t)(ur[i].h0 + r * g) * (size_t)hd, j->q + heads_at(j, ur[i].r0 + r, kvh),
                       ghd * sizeof(float));
        u.q = qb;
        u.out = qb + ghds;
    }
    if (j->bf16_dot) { /* q [G][hd] and p [G][ld] in BF16 */
        uint16_t *q16 = (uint16_t *)(scratch + (size_t)G * u.ld + 2 * ghds);
        u.p16 = q16 + ghds;
        rs_cpu_round_bf16_avx512(q16, u.q, ghds);
        u.q16 = q16;
    }

    unit_pass(&u, ur, m, sp, 0);
    for (int i = 0; i < m; i++)
        for (int r = 0; r < ur[i].nr; r++) {
            float *sc = u.scores + ((size_t)ur[i].h0 + (size_t)r * (size_t)g) * u.ld;
            softmax_rows(j->ex, sc, g, u.ld, ur[i].n_min + r);
            if (u.p16)
                for (int h = 0; h < g; h++)
                    rs_cpu_round_bf16_avx512(u.p16 + (size_t)(sc - u.scores) + (size_t)h * u.ld, sc + (size_t)h * u.ld,
                                             (size_t)(ur[i].n_min + r));
        }
    memset(u.out, 0, ghds * sizeof(float));
    unit_pass(&u, ur, m, sp, 1);
    if (fp8 && !u.per_token) {
        const float vs = kv->v_scale[kvh];
        for (size_t i = 0; i < ghds; i++) u.out[i] *= vs;
    }
    if (gathered)
        for (int i = 0; i < m; i++)
            for (int r = 0; r < ur[i].nr; r++)
                memcpy(j->out + heads_at(j, ur[i].r0 + r, kvh), u.out + (size_t)(ur[i].h0 + r * g) * (size_t)hd,
                       ghd * sizeof(float));
}

/* Worker w takes items w, w + n_workers, ...; item i is unit i / n_kv_heads, KV head i % n_kv_heads. */
static void attn_range(void *arg, int64_t w0, int64_t w1, int tid) {
    const attn_job *j = arg;
    float *scratch = j->c->thread_buf[tid].p;
    int n_kv = j->kv->n_kv_heads;
    for (int64_t w = w0; w < w1; w++) {
        for (int64_t i = w; i < j->n_items; i += j->n_workers) {
            const int64_t un = i / n_kv;
            attend_unit(j, j->members + j->unit0[un], j->unit0[un + 1] - j->unit0[un], j->shared[un], (int)(i % n_kv),
                        scratch);
        }
    }
}

/* The sort key of a one-row run that may share pages: its first page, then its place. */
typedef struct run_key {
    int32_t page, run;
} run_key;

static int run_key_cmp(const void *a, const void *b) {
    const run_key *x = a, *y = b;
    if (x->page != y->page) return x->page < y->page ? -1 : 1;
    return (x->run > y->run) - (x->run < y->run);
}

/* Groups the runs into units (attend_unit), in the order of their first runs: one-row runs whose
 * first page is the same, with at least one whole page inside their contexts, up to `max_members`
 * at a time in batch order, and each other run alone. A group's shared pages are the leading ones
 * that every member's table names alike and that lie whole inside every member's context; a
 * member that would share none starts a unit of its own. keys [n_runs], lead [n_runs]: scratch.
 * Returns the number of units. */
static int group_units(const rs_batch *bt, const int32_t *row_seq, const int32_t *runs, int n_runs, int max_members,
                       run_key *keys, int32_t *lead, int32_t *members, int32_t *unit0, int32_t *shared) {
    int nk = 0;
    for (int r = 0; r < n_runs; r++) {
        lead[r] = r;
        const int r0 = runs[r];
        if (max_members > 1 && runs[r + 1] - r0 == 1 && bt->pos[r0] + 1 >= RS_KV_BLOCK)
            keys[nk++] = (run_key){bt->block_tables[(size_t)row_seq[r0] * (size_t)bt->max_blocks], r};
    }
    qsort(keys, (size_t)nk, sizeof *keys, run_key_cmp);
    /* lead[r]: the first run of r's group; a leader's group is the runs after it in keys */
    for (int a = 0; a < nk;) {
        int b = a + 1;
        while (b < nk && b - a < max_members && keys[b].page == keys[a].page) lead[keys[b++].run] = keys[a].run;
        a = b;
    }
    int n_units = 0, n_mem = 0;
    for (int r = 0; r < n_runs; r++) {
        if (lead[r] != r) continue;
        unit0[n_units] = n_mem;
        members[n_mem++] = r;
        const int32_t *t0 = bt->block_tables + (size_t)row_seq[runs[r]] * (size_t)bt->max_blocks;
        int sp = (bt->pos[runs[r + 1] - 1] + RS_KV_BLOCK) / RS_KV_BLOCK; /* one run: all its pages */
        if (runs[r + 1] - runs[r] == 1) {
            int whole = (bt->pos[runs[r]] + 1) / RS_KV_BLOCK;
            for (int s = r + 1; s < n_runs; s++) { /* the group's other runs, in batch order */
                if (lead[s] != r) continue;
                const int32_t *t = bt->block_tables + (size_t)row_seq[runs[s]] * (size_t)bt->max_blocks;
                const int w = RS_MIN(whole, (bt->pos[runs[s]] + 1) / RS_KV_BLOCK);
                int c = 0;
                while (c < w && t[c] == t0[c]) c++;
                if (c == 0) {
                    lead[s] = s; /* shares nothing whole: a unit of its own, later */
                    continue;
                }
                whole = c;
                members[n_mem++] = s;
            }
            if (n_mem - unit0[n_units] > 1) sp = whole;
        }
        shared[n_units++] = sp;
    }
    unit0[n_units] = n_mem;
    return n_units;
}

void rs_cpu_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                         float scale, const rs_batch *batch) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    rs_kv_layer_check(kv);
    if (batch->n_tok == 0) return;
    RS_ASSERT(kv->n_kv_heads > 0 && n_heads % kv->n_kv_heads == 0);
    const int group = n_heads / kv->n_kv_heads, run_rows = RS_MAX(1, RUN_HEADS / group);
    /* row_seq [n_tok]; the runs' first rows [n_runs + 1]; members, unit0 [n_units + 1], shared,
     * lead [n_runs] each; keys [n_runs] pairs: at most 8 n_tok + 2 */
    const size_t nt = (size_t)batch->n_tok;
    int32_t *row_seq = rs_cpu_scratch(&c->row_seq, (8 * nt + 2) * sizeof(int32_t));
    int32_t *runs = row_seq + nt, *members = runs + nt + 1, *unit0 = members + nt, *shared = unit0 + nt + 1;
    int32_t *lead = shared + nt;
    run_key *keys = (run_key *)(void *)(lead + nt);
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
    /* units of up to run_rows rows, fewer where that would leave under two items a thread */
    int max_members = run_rows;
    while (max_members > 1 && (int64_t)((n_runs + max_members - 1) / max_members) * kv->n_kv_heads < 2 * c->n_threads)
        max_members /= 2;
    const int n_units = group_units(batch, row_seq, runs, n_runs, max_members, keys, lead, members, unit0, shared);
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
        .members = members,
        .unit0 = unit0,
        .shared = shared,
        .vec = rs_cpu_kv_vec_for(c->simd),
        .ex = rs_cpu_exp_for(c->simd),
        .n_heads = n_heads,
        .group = group,
        .scale = scale,
        .bf16_dot = rs_cpu_fast_bf16(c) && kv->dtype == RS_DTYPE_BF16,
        .n_items = (int64_t)n_units * kv->n_kv_heads,
    };
    j.n_workers = (int)RS_MIN((int64_t)c->n_threads, j.n_items);
    rs_pool_run(c->pool, j.n_workers, 1, attn_range, &j);
}
