/*
 * cpu_ops.c — the element-wise and per-row ops: embed, rmsnorm, rope, swiglu, add, gather_rows.
 *
 * embed takes BF16/F16/F32 tables, and E4M3 ones (a tied table served in FP8, --quantize-lm-head)
 * dequantized row by row exactly as rs_fp8_dequantize_weight.
 *
 * These follow the arithmetic of the PyTorch modules the checkpoints were trained with, one
 * rounding at a time (the build has -ffp-contract=off, so nothing is fused behind our back):
 *   rmsnorm  LlamaRMSNorm: variance = mean(x^2) in fp32, x * (1 / sqrt(variance + eps)), then * w;
 *            the sum of squares runs over 16 fixed lanes then a fixed tree, so it is the same on
 *            every CPU whatever SIMD the compiler picks for it.
 *   rope     transformers' rotate-half: angle = inv_freq[i] * pos in fp32, cos/sin of that fp32
 *            angle evaluated in double and rounded once (the correctly rounded value, which
 *            torch's 1-ulp fp32 cos/sin approximate), out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin.
 *   swiglu   silu(g) = g / (1 + exp(-g)) in fp32 (torch's CPU silu), times up; exp is rs_expf
 *            (cpu_exp.c: within 1.02 ulp, vectorized, the same bits at every SIMD level).
 * Work big enough to split goes to the pool by rows (or by elements for the flat ops).
 */
#include <math.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"
#include "cpu_internal.h"
#include "fp8_layout.h"

#define FLAT_GRAIN     16384 /* elements per pool item for the flat ops */
#define ROW_WORK_GRAIN 16384 /* elements of row work below which a row op stays on one thread */

/* Rows per pool item so that one item has about ROW_WORK_GRAIN elements of work. */
static int64_t row_grain(int64_t row_elems) {
    return RS_MAX((int64_t)1, (int64_t)ROW_WORK_GRAIN / RS_MAX((int64_t)1, row_elems));
}

/* ---- embed ---- */

/* Row r of an E4M3 table (--quantize-lm-head on a tied model) dequantized as
 * rs_fp8_dequantize_weight does it: code value times its block's scale_inv, rounded to fp32. */
static void embed_fp8_row(float *o /* [dim] */, const rs_tensor *t, int64_t r) {
    const int64_t vocab = t->shape[0], dim = t->shape[1], kb = rs_fp8_blocks(dim);
    const uint8_t *q = t->data;
    const float *s = t->scale_inv + (r / RS_FP8_BLOCK) * kb;
    for (int64_t d = 0; d < dim; d++) {
        const uint8_t c = t->layout == RS_LAYOUT_FP8_PAIRS32 ? rs_fp8_pairs32_at(q, vocab, dim, r, d) : q[r * dim + d];
        o[d] = rs_fp8_e4m3_f32[c] * s[d / RS_FP8_BLOCK];
    }
}

void rs_cpu_op_embed(rs_backend *b, float *out, const rs_tensor *table, const int32_t *ids, int n) {
    (void)b;
    int64_t vocab = table->shape[0], dim = table->shape[1];
    RS_ASSERT(table->dtype == RS_DTYPE_BF16 || table->dtype == RS_DTYPE_F16 || table->dtype == RS_DTYPE_F32 ||
              (table->dtype == RS_DTYPE_E4M3 && table->scale_inv));
    size_t es = rs_dtype_size(table->dtype);
    for (int i = 0; i < n; i++) {
        RS_ASSERT(ids[i] >= 0 && ids[i] < vocab);
        if (table->dtype == RS_DTYPE_E4M3) {
            embed_fp8_row(out + (size_t)i * (size_t)dim, table, ids[i]);
            continue;
        }
        const void *row = (const char *)table->data + (size_t)ids[i] * (size_t)dim * es;
        float *o = out + (size_t)i * (size_t)dim;
        if (table->dtype == RS_DTYPE_F32) {
            memcpy(o, row, (size_t)dim * sizeof(float));
        } else if (table->dtype == RS_DTYPE_BF16) {
            for (int64_t d = 0; d < dim; d++) o[d] = rs_bf16_to_f32(((const uint16_t *)row)[d]);
        } else {
            for (int64_t d = 0; d < dim; d++) o[d] = rs_f16_to_f32(((const uint16_t *)row)[d]);
        }
    }
}

/* ---- rmsnorm ---- */

/* sum of x[i]^2 in fp32: lane i % 16 accumulates in order, lanes are combined as a fixed tree. */
static float sum_squares(const float *x, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += x[i + l] * x[i + l];
    for (int l = 0; i + l < n; l++) acc[l] += x[i + l] * x[i + l];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

typedef struct norm_job {
    float *out;     /* [rows][dim] */
    const float *x; /* [rows][dim] */
    const float *w; /* [dim] */
    int dim;
    float eps;
} norm_job;

static void norm_range(void *arg, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const norm_job *j = arg;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = j->x + (size_t)r * (size_t)j->dim;
        float *o = j->out + (size_t)r * (size_t)j->dim;
        float variance = sum_squares(x, j->dim) / (float)j->dim;
        float inv = 1.0f / sqrtf(variance + j->eps);
        for (int d = 0; d < j->dim; d++) o[d] = j->w[d] * (x[d] * inv);
    }
}

void rs_cpu_op_rmsnorm(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim,
                       float eps) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    norm_job j = {
        .out = out, .x = x, .w = rs_cpu_param_f32(&c->param_buf[1], w, dim), .dim = dim, .eps = eps};
    rs_pool_run(c->pool, rows, row_grain(dim), norm_range, &j);
}

/* ---- rope ---- */

typedef struct rope_job {
    rs_cpu_ctx *c;
    float *x;              /* [rows][n_heads][head_dim] */
    const int32_t *pos;    /* [rows] */
    const float *inv_freq; /* [head_dim / 2] */
    int n_heads, head_dim;
} rope_job;

static void rope_range(void *arg, int64_t r0, int64_t r1, int tid) {
    const rope_job *j = arg;
    int half = j->head_dim / 2;
    float *cs = j->c->thread_buf[tid].p; /* [2][half]: cos, sin */
    float *sn = cs + half;
    for (int64_t r = r0; r < r1; r++) {
        float p = (float)j->pos[r];
        for (int i = 0; i < half; i++) {
            float angle = j->inv_freq[i] * p;
            double s, co;
            sincos((double)angle, &s, &co);
            cs[i] = (float)co;
            sn[i] = (float)s;
        }
        for (int h = 0; h < j->n_heads; h++) {
            float *x = j->x + ((size_t)r * (size_t)j->n_heads + (size_t)h) * (size_t)j->head_dim;
            for (int i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * cs[i] - x2 * sn[i];
                x[i + half] = x2 * cs[i] + x1 * sn[i];
            }
        }
    }
}

void rs_cpu_op_rope(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                    const float *inv_freq) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    for (int t = 0; t < c->n_threads; t++)
        rs_cpu_scratch(&c->thread_buf[t], (size_t)head_dim * sizeof(float));
    rope_job j = {.c = c, .x = x, .pos = pos, .inv_freq = inv_freq, .n_heads = n_heads, .head_dim = head_dim};
    /* sincos dominates: count it as ~16 elements of work per frequency */
    rs_pool_run(c->pool, rows, row_grain((int64_t)n_heads * head_dim + 8 * head_dim), rope_range, &j);
}

/* ---- swiglu, add, gather_rows ---- */

/* MoE calls this without the context: the widest table the CPU runs, which gives the same bits as
 * the one at the backend's level. */
void rs_cpu_swiglu_span(float *out, const float *gate, const float *up, size_t n) {
    rs_cpu_exp_best()->silu_mul(out, gate, up, n);
}

typedef struct flat_job {
    float *out;
    const float *a, *b;
    const rs_cpu_exp_vec *ex; /* swiglu */
} flat_job;

static void swiglu_range(void *arg, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    const flat_job *j = arg;
    j->ex->silu_mul(j->out + i0, j->a + i0, j->b + i0, (size_t)(i1 - i0));
}

void rs_cpu_op_swiglu(rs_backend *b, float *out, const float *gate, const float *up, size_t n) {
    flat_job j = {.out = out, .a = gate, .b = up, .ex = rs_cpu_exp_for(rs_cpu_ctx_of(b)->simd)};
    /* silu (an exp and a division) costs several adds: split 8x finer than the memory-bound ops */
    rs_pool_run(rs_cpu_ctx_of(b)->pool, (int64_t)n, FLAT_GRAIN / 8, swiglu_range, &j);
}

static void add_range(void *arg, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    const flat_job *j = arg;
    float *restrict x = j->out;
    const float *restrict y = j->b;
    for (int64_t i = i0; i < i1; i++) x[i] += y[i];
}

void rs_cpu_op_add(rs_backend *b, float *x, const float *y, size_t n) {
    flat_job j = {.out = x, .b = y};
    rs_pool_run(rs_cpu_ctx_of(b)->pool, (int64_t)n, FLAT_GRAIN, add_range, &j);
}

void rs_cpu_op_gather_rows(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim) {
    (void)b;
    for (int i = 0; i < n; i++) {
        RS_ASSERT(idx[i] >= 0);
        memcpy(out + (size_t)i * (size_t)dim, x + (size_t)idx[i] * (size_t)dim, (size_t)dim * sizeof(float));
    }
}
