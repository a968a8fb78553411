/*
 * cpu_attention.c — writing K/V into the paged cache, and causal attention over it.
 *
 * Pages are [n_blocks][2][RS_KV_BLOCK][n_kv_heads][head_dim] (0 = K, 1 = V), fp32 or bf16 (bf16
 * stored round-to-nearest-even). A row r of sequence s at position p attends to positions
 * 0..p of s, found through block table row s; that makes one rule serve decode rows, prefill
 * chunks (each row sees only what precedes it) and mixed batches.
 *
 * Work items are (row, KV head): the n_heads / n_kv_heads query heads of a group are done together
 * so each K and V row is read once for all of them. Items are dealt round-robin to threads, which
 * balances a prefill chunk whose later rows see more context. Softmax is the two-pass form in fp32:
 * scores (q . k * scale), max, exp(s - max) and their sum, probabilities p = e / sum, then
 * out = sum_j p_j v_j. Scores live in per-thread scratch sized before the pool runs.
 */
#include <math.h>
#include <string.h>

#include "../../core/rs.h"
#include "cpu_internal.h"

/* ---- vector helpers, plain C (the other ISAs are in cpu_simd_*.c) ---- */

static float dot_scalar(const float *a, const void *b, rs_dtype bdt, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * rs_cpu_elem(b, bdt, i);
    return s;
}

static void axpy_scalar(float *y, float s, const void *x, rs_dtype xdt, int n) {
    for (int i = 0; i < n; i++) y[i] += s * rs_cpu_elem(x, xdt, i);
}

const rs_cpu_vec rs_cpu_vec_scalar = {.dot = dot_scalar, .axpy = axpy_scalar};

const rs_cpu_vec *rs_cpu_vec_for(rs_cpu_simd s) {
    return s == RS_CPU_SIMD_AVX512 ? &rs_cpu_vec_avx512
           : s == RS_CPU_SIMD_AVX2 ? &rs_cpu_vec_avx2
                                   : &rs_cpu_vec_scalar;
}

/* ---- page addressing ---- */

static size_t kv_es(const rs_kv_layer *kv) {
    RS_ASSERT(kv->dtype == RS_DTYPE_F32 || kv->dtype == RS_DTYPE_BF16);
    return rs_dtype_size(kv->dtype);
}

/* Start of the [n_kv_heads][head_dim] row of `slot` in half `kv_idx` (0 = K, 1 = V). */
static char *kv_row(const rs_kv_layer *kv, int64_t slot, int kv_idx, size_t es) {
    int64_t block = slot / RS_KV_BLOCK, off = slot % RS_KV_BLOCK;
    size_t row = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    return (char *)kv->pages + (((size_t)block * 2 + (size_t)kv_idx) * RS_KV_BLOCK + (size_t)off) * row * es;
}

void rs_cpu_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v,
                        const rs_batch *batch) {
    (void)b;
    size_t es = kv_es(kv);
    size_t row = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    for (int r = 0; r < batch->n_tok; r++) {
        int64_t slot = batch->slot[r];
        RS_ASSERT(slot >= 0 && slot < (int64_t)kv->n_blocks * RS_KV_BLOCK);
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

typedef struct attn_job {
    rs_cpu_ctx *c;
    float *out;     /* [n_tok][n_heads][head_dim] */
    const float *q; /* [n_tok][n_heads][head_dim] */
    const rs_kv_layer *kv;
    const rs_batch *batch;
    const int32_t *row_seq; /* [n_tok] sequence of each row */
    const rs_cpu_vec *vec;
    int n_heads, group; /* group = query heads per KV head */
    float scale;
    int64_t n_items; /* n_tok * n_kv_heads */
    int n_workers;
} attn_job;

/* One row and one KV head: its `group` query heads over positions 0..pos[r].
 * scores: [group][n_ctx] scratch. */
static void attend_item(const attn_job *j, int r, int kvh, float *scores) {
    const rs_kv_layer *kv = j->kv;
    const rs_batch *bt = j->batch;
    const rs_cpu_vec *vec = j->vec;
    const int hd = kv->head_dim, g = j->group, n_ctx = bt->pos[r] + 1;
    const size_t es = rs_dtype_size(kv->dtype), head_off = (size_t)kvh * (size_t)hd * es;
    const int32_t *table = bt->block_tables + (size_t)j->row_seq[r] * (size_t)bt->max_blocks;
    const size_t first_head = (size_t)r * (size_t)j->n_heads + (size_t)kvh * (size_t)g;
    const float *q = j->q + first_head * (size_t)hd; /* [g][hd] */
    float *out = j->out + first_head * (size_t)hd;   /* [g][hd] */

    for (int p0 = 0; p0 < n_ctx; p0 += RS_KV_BLOCK) {
        int32_t page = table[p0 / RS_KV_BLOCK];
        RS_ASSERT(page >= 0 && page < kv->n_blocks);
        int n = RS_MIN(RS_KV_BLOCK, n_ctx - p0);
        for (int o = 0; o < n; o++) {
            const char *k = kv_row(kv, (int64_t)page * RS_KV_BLOCK + o, 0, es) + head_off;
            for (int h = 0; h < g; h++)
                scores[(size_t)h * (size_t)n_ctx + (size_t)(p0 + o)] =
                    vec->dot(q + (size_t)h * (size_t)hd, k, kv->dtype, hd) * j->scale;
        }
    }
    for (int h = 0; h < g; h++) {
        float *sc = scores + (size_t)h * (size_t)n_ctx;
        float max = sc[0], sum = 0.0f;
        for (int p = 1; p < n_ctx; p++) max = sc[p] > max ? sc[p] : max;
        for (int p = 0; p < n_ctx; p++) {
            sc[p] = expf(sc[p] - max);
            sum += sc[p];
        }
        for (int p = 0; p < n_ctx; p++) sc[p] = sc[p] / sum;
    }
    memset(out, 0, (size_t)g * (size_t)hd * sizeof(float));
    for (int p0 = 0; p0 < n_ctx; p0 += RS_KV_BLOCK) {
        int32_t page = table[p0 / RS_KV_BLOCK];
        int n = RS_MIN(RS_KV_BLOCK, n_ctx - p0);
        for (int o = 0; o < n; o++) {
            const char *v = kv_row(kv, (int64_t)page * RS_KV_BLOCK + o, 1, es) + head_off;
            for (int h = 0; h < g; h++)
                vec->axpy(out + (size_t)h * (size_t)hd, scores[(size_t)h * (size_t)n_ctx + (size_t)(p0 + o)],
                          v, kv->dtype, hd);
        }
    }
}

/* Worker w takes items w, w + n_workers, ... */
static void attn_range(void *arg, int64_t w0, int64_t w1, int tid) {
    const attn_job *j = arg;
    float *scores = j->c->thread_buf[tid].p;
    int n_kv = j->kv->n_kv_heads;
    for (int64_t w = w0; w < w1; w++)
        for (int64_t i = w; i < j->n_items; i += j->n_workers)
            attend_item(j, (int)(i / n_kv), (int)(i % n_kv), scores);
}

void rs_cpu_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                         float scale, const rs_batch *batch) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    kv_es(kv);
    if (batch->n_tok == 0) return;
    int32_t *row_seq = rs_cpu_scratch(&c->row_seq, (size_t)batch->n_tok * sizeof(int32_t));
    int max_ctx = 0;
    for (int s = 0; s < batch->n_seq; s++) {
        for (int r = batch->seq_start[s]; r < batch->seq_start[s + 1]; r++) {
            int p = batch->pos[r];
            RS_ASSERT(p >= 0 && p < batch->seq_ctx[s] && p < batch->max_blocks * RS_KV_BLOCK);
            row_seq[r] = s;
            max_ctx = RS_MAX(max_ctx, p + 1);
        }
    }
    int group = n_heads / kv->n_kv_heads;
    for (int t = 0; t < c->n_threads; t++)
        rs_cpu_scratch(&c->thread_buf[t], (size_t)group * (size_t)max_ctx * sizeof(float));
    attn_job j = {
        .c = c,
        .out = out,
        .q = q,
        .kv = kv,
        .batch = batch,
        .row_seq = row_seq,
        .vec = rs_cpu_vec_for(c->simd),
        .n_heads = n_heads,
        .group = group,
        .scale = scale,
        .n_items = (int64_t)batch->n_tok * kv->n_kv_heads,
    };
    j.n_workers = (int)RS_MIN((int64_t)c->n_threads, j.n_items);
    rs_pool_run(c->pool, j.n_workers, 1, attn_range, &j);
}
