/*
 * cpu_matmul.c — out[rows][N] = x[rows][K] @ w[N][K]^T (+ bias): the CPU backend's hot op.
 *
 * Decode (rows 1..16) is bound by reading the weights, so each weight row is streamed once and
 * used for every token row while it is in registers: a tile is 4 weight rows by up to NT token
 * rows (NT = 6 with AVX-512, 3 with AVX2), BF16/F16 converted to fp32 in registers. Threads split
 * N, in multiples of the tile. For longer batches (prefill) the loops are blocked so that a block
 * of weight rows stays in L2 while every token tile of a token block passes over it, and the token
 * block stays in L2 while the weight blocks pass: the weights are read from memory once per token
 * block instead of once per token tile.
 *
 * One token row on AVX-512 with BF16/F16/F32 weights runs either the tile or its row-sequential form
 * (the same bits), whichever has been faster lately for that weight shape (gemv_run).
 *
 * The per-ISA tile kernels live in cpu_simd_avx2.c and cpu_simd_avx512.c; the scalar tile here is
 * also the reference (sequential fp32 sums), exposed as rs_cpu_matmul_ref for tests.
 *
 * E4M3 weights are the W8A8 path of docs/design.md "Numerics": the activation rows are quantized per
 * token and 128-group into the context's scratch (cpu_fp8_quant.c, threaded over rows when there
 * are many), fp8_gemm.c does the block-scaled GEMM with the context's pool at the context's SIMD
 * level, then the bias is added in fp32. Every step is deterministic, so the result equals
 * rs_fp8_quantize_act + rs_fp8_gemm_ref + bias bit for bit, whatever the SIMD level and thread
 * count, and a warm call allocates nothing.
 *
 * With --numerics fast on a CPU with AVX512_BF16 (rs_cpu_fast_bf16), BF16 weights take the
 * activation rows rounded to BF16 and the vdpbf16ps tile instead; the blocking and threading are
 * the same, and so is batch invariance (a row's sums never depend on the other rows of its tile).
 * Where the CPU has AMX-BF16 they run on AMX tiles instead (cpu_amx.c), at every row count, and
 * so do E4M3 weights in the VNNI kernel's layout (rs_cpu_matmul_amx_fp8: the same W8A8 formula with
 * fp32 block sums), after the same activation quantization.
 */
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"
#include "cpu_internal.h"
#include "fp8_gemm.h"
#include "fp8_layout.h"

#define NT_SCALAR          4
#define TOKEN_BLOCK_BYTES  (512u << 10) /* x rows of one token block, fp32 */
#define WEIGHT_BLOCK_BYTES (128u << 10) /* weight rows of one block, in their dtype */
#define MIN_PARALLEL_MACS  (1 << 16)    /* below this, one thread: the pool handoff costs more */

/* out[t][j] for one tile: each output a sequential fp32 sum over k from +0, then + bias (the
 * reference arithmetic). The 4 x NT sums advance together, which changes no result but gives the
 * CPU independent chains and converts each weight once for all token rows. Missing weight rows
 * (nw < 4) repeat the last one and are not stored. */
static inline __attribute__((always_inline)) void tile_scalar_body(const rs_cpu_tile *tl, const int NT,
                                                                   const rs_dtype dt) {
    const size_t es = dt == RS_DTYPE_F32 ? 4 : 2;
    const char *wr[RS_CPU_NW];
    const float *xr[NT_SCALAR];
    float s[NT_SCALAR][RS_CPU_NW] = {{0}};
    for (int j = 0; j < RS_CPU_NW; j++)
        wr[j] = (const char *)tl->w + (size_t)((j < tl->nw ? j : tl->nw - 1) * tl->ldw) * es;
    for (int t = 0; t < NT; t++) xr[t] = tl->x + t * tl->ldx;
    for (int64_t i = 0; i < tl->k; i++) {
        float wv[RS_CPU_NW];
#pragma GCC unroll 4
        for (int j = 0; j < RS_CPU_NW; j++) wv[j] = rs_cpu_elem(wr[j], dt, i);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
            for (int j = 0; j < RS_CPU_NW; j++) s[t][j] += xr[t][i] * wv[j];
    }
    for (int t = 0; t < NT; t++)
        for (int j = 0; j < tl->nw; j++)
            tl->out[t * tl->ldo + j] = tl->bias ? s[t][j] + tl->bias[j] : s[t][j];
}

static inline __attribute__((always_inline)) void tile_scalar(const rs_cpu_tile *tl, const rs_dtype dt) {
    switch (tl->nt) {
    case 1: tile_scalar_body(tl, 1, dt); break;
    case 2: tile_scalar_body(tl, 2, dt); break;
    case 3: tile_scalar_body(tl, 3, dt); break;
    default: tile_scalar_body(tl, 4, dt); break;
    }
}
_Static_assert(NT_SCALAR == 4, "tile_scalar instantiates nt = 1..4");

/* The scalar tile takes the dtype; the SIMD ones are specialized per dtype. */
static void tile_scalar_bf16(const rs_cpu_tile *t) { tile_scalar(t, RS_DTYPE_BF16); }
static void tile_scalar_f16(const rs_cpu_tile *t) { tile_scalar(t, RS_DTYPE_F16); }
static void tile_scalar_f32(const rs_cpu_tile *t) { tile_scalar(t, RS_DTYPE_F32); }

static rs_cpu_tile_fn tile_for(rs_cpu_simd simd, rs_dtype dt, int *nt_max) {
    switch (simd) {
    case RS_CPU_SIMD_AVX512: *nt_max = RS_CPU_NT_AVX512; return rs_cpu_tile_avx512(dt);
    case RS_CPU_SIMD_AVX2: *nt_max = RS_CPU_NT_AVX2; return rs_cpu_tile_avx2(dt);
    default: break;
    }
    *nt_max = NT_SCALAR;
    return dt == RS_DTYPE_BF16 ? tile_scalar_bf16 : dt == RS_DTYPE_F16 ? tile_scalar_f16 : tile_scalar_f32;
}

typedef struct mm_job {
    float *out;        /* [rows][n] */
    const float *x;    /* [rows][k] */
    const uint16_t *xb; /* [rows][k] BF16 (fast numerics' tile), or NULL */
    const char *w;     /* [n][k] of dtype, es bytes each */
    const float *bias; /* [n] or NULL */
    int64_t n, k;
    size_t es;
    int rows;
    int nt;               /* token rows per tile */
    int token_block;      /* token rows per block, a multiple of nt */
    int64_t weight_block; /* weight rows per block, a multiple of RS_CPU_NW */
    rs_cpu_tile_fn tile;
} mm_job;

/* Weight rows [n0, n1) for every token row. */
static void mm_range(void *arg, int64_t n0, int64_t n1, int tid) {
    (void)tid;
    const mm_job *j = arg;
    for (int tb0 = 0; tb0 < j->rows; tb0 += j->token_block) {
        int tb1 = RS_MIN(tb0 + j->token_block, j->rows);
        for (int64_t nb0 = n0; nb0 < n1; nb0 += j->weight_block) {
            int64_t nb1 = RS_MIN(nb0 + j->weight_block, n1);
            for (int t0 = tb0; t0 < tb1; t0 += j->nt) {
                for (int64_t q = nb0; q < nb1; q += RS_CPU_NW) {
                    /* the same quad of the next weight block: it comes from memory next */
                    int64_t next = q + j->weight_block;
                    rs_cpu_tile tl = {
                        .out = j->out + (size_t)t0 * (size_t)j->n + (size_t)q,
                        .ldo = j->n,
                        .x = j->x + (size_t)t0 * (size_t)j->k,
                        .xb = j->xb ? j->xb + (size_t)t0 * (size_t)j->k : NULL,
                        .ldx = j->k,
                        .w = j->w + (size_t)q * (size_t)j->k * j->es,
                        .ldw = j->k,
                        .k = j->k,
                        .bias = j->bias ? j->bias + q : NULL,
                        .prefetch =
                            next + RS_CPU_NW <= n1 ? j->w + (size_t)next * (size_t)j->k * j->es : NULL,
                        .nw = (int)RS_MIN((int64_t)RS_CPU_NW, nb1 - q),
                        .nt = RS_MIN(j->nt, tb1 - t0),
                    };
                    j->tile(&tl);
                }
            }
        }
    }
}

static void check_weight(const rs_tensor *w) {
    RS_ASSERT(w->ndim == 2 && w->data);
    if (w->dtype == RS_DTYPE_E4M3) {
        if (!w->scale_inv) RS_ERROR("cpu backend | matmul: e4m3 weight without scale_inv");
        RS_ASSERT(w->scale_inv && w->shape[0] <= INT32_MAX && w->shape[1] <= INT32_MAX);
    } else if (w->dtype != RS_DTYPE_BF16 && w->dtype != RS_DTYPE_F16 && w->dtype != RS_DTYPE_F32) {
        RS_ERROR("cpu backend | matmul: weight dtype %s not supported", rs_dtype_name(w->dtype));
        RS_ASSERT(!"supported matmul weight dtype");
    }
}

/* ---- FP8 (W8A8) ---- */

#define QUANT_PARALLEL_ELEMS (1 << 18) /* below this many activations (~50 us), quantize on one thread */

typedef struct quant_job {
    const float *x; /* [rows][k] f32 */
    uint8_t *q;     /* [rows][k] e4m3 */
    float *s;       /* [rows][kb] f32 */
    int64_t k, kb;
    rs_cpu_simd simd;
} quant_job;

static void quant_rows(void *arg, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const quant_job *j = arg;
    rs_cpu_fp8_quantize_act(j->simd, j->x + r0 * j->k, r1 - r0, j->k, j->q + r0 * j->k, j->s + r0 * j->kb);
}

rs_fp8_gemm_isa rs_cpu_fp8_isa(rs_cpu_simd s) {
    switch (s) {
    case RS_CPU_SIMD_AVX512:
        return rs_fp8_gemm_isa_supported(RS_FP8_GEMM_ISA_AVX512_VNNI) ? RS_FP8_GEMM_ISA_AVX512_VNNI
                                                                      : RS_FP8_GEMM_ISA_AVX2;
    case RS_CPU_SIMD_AVX2: return RS_FP8_GEMM_ISA_AVX2;
    default: return RS_FP8_GEMM_ISA_GENERIC;
    }
}

static void add_bias(float *out /* [rows][n] */, const float *bias /* [n] */, int rows, int64_t n) {
    for (int r = 0; r < rows; r++) {
        float *o = out + (size_t)r * (size_t)n;
        for (int64_t i = 0; i < n; i++) o[i] += bias[i];
    }
}

static void matmul_fp8(rs_cpu_ctx *c, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias,
                       int rows) {
    int64_t n = w->shape[0], k = w->shape[1], kb = rs_fp8_blocks(k);
    size_t sbytes = ((size_t)rows * (size_t)kb * sizeof(float) + 63) & ~(size_t)63;
    char *buf = rs_cpu_scratch(&c->fp8_act, sbytes + (size_t)rows * (size_t)k);
    quant_job q = {.x = x, .q = (uint8_t *)buf + sbytes, .s = (float *)buf, .k = k, .kb = kb, .simd = c->simd};
    if ((int64_t)rows * k >= QUANT_PARALLEL_ELEMS)
        rs_pool_run(c->pool, rows, 1, quant_rows, &q);
    else
        quant_rows(&q, 0, rows, 0);
    if (rs_cpu_fast_bf16(c) && c->amx && rs_cpu_amx_fp8_fits(w)) { /* every row count: batch invariance */
        rs_cpu_matmul_amx_fp8(c, out, q.q, q.s, w, rows);
        const float *b = rs_cpu_param_f32(&c->param_buf[0], bias, n);
        if (b) add_bias(out, b, rows, n);
        return;
    }
    rs_pool *pool = n * k * rows < MIN_PARALLEL_MACS ? NULL : c->pool;
    int rc = rs_fp8_gemm_layout_with_isa(rs_cpu_fp8_isa(c->simd), pool, out, q.q, q.s, w->data, w->layout, w->scale_inv,
                                         rows, (int)n, (int)k);
    if (rc == RS_EUNSUPPORTED && w->layout != RS_LAYOUT_ROWS) {
        /* a packed weight at a SIMD level below its kernel's (rs_cpu_set_simd after loading) */
        uint8_t *wr = rs_cpu_scratch(&c->fp8_rows, (size_t)(n * k));
        rs_fp8_pairs32_unpack(wr, w->data, n, k);
        rc = rs_fp8_gemm_with_isa(rs_cpu_fp8_isa(c->simd), pool, out, q.q, q.s, wr, w->scale_inv, rows, (int)n, (int)k);
    }
    RS_ASSERT(rc == RS_OK);
    const float *b = rs_cpu_param_f32(&c->param_buf[0], bias, n);
    if (b) add_bias(out, b, rows, n);
}

/* ---- batch 1: the tile or its row-sequential form (cpu_internal.h rs_cpu_gemv) ---- */

/* The timing entry of a weight shape (dot: the fast numerics' tile), made on first use; NULL when the
 * table is full (that shape then always takes the tile). */
static rs_cpu_gemv_pick *gemv_entry(rs_cpu_ctx *c, int64_t n, int64_t k, int es, bool dot) {
    for (int i = 0; i < RS_CPU_GEMV_SHAPES; i++) {
        rs_cpu_gemv_pick *p = &c->gemv[i];
        if (p->n == n && p->k == k && p->es == es && p->dot == dot) return p;
        if (p->n == 0) {
            *p = (rs_cpu_gemv_pick){.n = n, .k = k, .es = es, .dot = dot};
            return p;
        }
    }
    return NULL;
}

/* One token row through j->tile or rows_tile (the same bits). In auto mode each form is timed on
 * the shape's first calls, then the faster one runs and the other is timed again every
 * RS_CPU_GEMV_PROBE-th call, so the choice follows the machine (its memory bandwidth moved by
 * 30% within minutes on a shared VM, and the better form with it). */
static void gemv_run(rs_cpu_ctx *c, mm_job *j, rs_cpu_tile_fn rows_tile, int64_t grain) {
    rs_cpu_gemv_pick *p = NULL;
    int use; /* 0 the tile, 1 the rows */
    if (c->gemv_mode != RS_CPU_GEMV_AUTO) {
        use = c->gemv_mode == RS_CPU_GEMV_ROWS;
    } else if (!(p = gemv_entry(c, j->n, j->k, (int)j->es, j->xb != NULL))) {
        use = 0;
    } else {
        const uint32_t call = p->calls++;
        if (p->ns_per_byte[0] == 0) use = 0;
        else if (p->ns_per_byte[1] == 0) use = 1;
        else {
            const int best = p->ns_per_byte[1] < p->ns_per_byte[0];
            use = call % RS_CPU_GEMV_PROBE == RS_CPU_GEMV_PROBE - 1 ? !best : best;
        }
    }
    if (use) j->tile = rows_tile;
    const double t0 = p ? rs_now_s() : 0;
    rs_pool_run(c->pool, j->n, grain, mm_range, j);
    if (p) {
        const double v = (rs_now_s() - t0) * 1e9 / (double)(j->n * j->k * (int64_t)j->es);
        double *e = &p->ns_per_byte[use];
        *e = *e == 0 ? v : 0.75 * *e + 0.25 * v;
    }
}

void rs_cpu_matmul(rs_cpu_ctx *c, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias,
                   int rows) {
    check_weight(w);
    RS_ASSERT((const float *)out != x); /* tiles read x after writing earlier outputs */
    int64_t n = w->shape[0], k = w->shape[1];
    if (rows <= 0 || n <= 0) return;
    if (w->dtype == RS_DTYPE_E4M3) {
        matmul_fp8(c, out, x, w, bias, rows);
        return;
    }
    mm_job j = {
        .out = out,
        .x = x,
        .w = w->data,
        .n = n,
        .k = k,
        .es = rs_dtype_size(w->dtype),
        .rows = rows,
        .bias = rs_cpu_param_f32(&c->param_buf[0], bias, n),
    };
    int64_t xes = 4; /* bytes of an activation as the tiles read it */
    if (w->dtype == RS_DTYPE_BF16 && rs_cpu_fast_bf16(c)) {
        uint16_t *xb = rs_cpu_scratch(&c->bf16_act, (size_t)rows * (size_t)k * sizeof(uint16_t));
        rs_cpu_round_bf16_avx512(xb, x, (size_t)rows * (size_t)k);
        if (c->amx) { /* every row count, so that a row's bits never depend on its batch */
            rs_cpu_matmul_amx_bf16(c, out, xb, w->data, j.bias, rows, n, k);
            return;
        }
        j.xb = xb;
        j.tile = rs_cpu_tile_avx512_bf16_dot();
        j.nt = RS_CPU_NT_AVX512;
        xes = 2;
    } else {
        j.tile = tile_for(c->simd, w->dtype, &j.nt);
    }
    int64_t tb = (int64_t)TOKEN_BLOCK_BYTES / (k * xes > 0 ? k * xes : 1);
    j.token_block = (int)RS_MAX((int64_t)j.nt, tb - tb % j.nt);
    int64_t wb = (int64_t)WEIGHT_BLOCK_BYTES / (k * (int64_t)j.es > 0 ? k * (int64_t)j.es : 1);
    j.weight_block = RS_MAX((int64_t)RS_CPU_NW, wb - wb % RS_CPU_NW);

    int64_t macs = n * k * rows;
    int64_t grain = macs < MIN_PARALLEL_MACS ? n : RS_CPU_NW;
    rs_cpu_tile_fn rows_tile = NULL; /* the row-sequential form of j.tile, where there is one */
    if (rows == 1 && c->simd == RS_CPU_SIMD_AVX512)
        rows_tile = j.xb ? rs_cpu_gemv_avx512_bf16_dot() : rs_cpu_gemv_avx512(w->dtype);
    if (!rows_tile) {
        rs_pool_run(c->pool, n, grain, mm_range, &j);
        return;
    }
    gemv_run(c, &j, rows_tile, grain);
}

void rs_cpu_matmul_ref(float *out, const float *x, const rs_tensor *w, const rs_tensor *bias, int rows) {
    check_weight(w);
    int64_t n = w->shape[0], k = w->shape[1];
    if (w->dtype == RS_DTYPE_E4M3) {
        int64_t kb = rs_fp8_blocks(k);
        uint8_t *xq = rs_xmalloc((size_t)rows * (size_t)k + 1);
        float *xs = rs_xmalloc(((size_t)rows * (size_t)kb + 1) * sizeof(float));
        rs_fp8_quantize_act(x, rows, k, xq, xs);
        uint8_t *wr = NULL;
        if (w->layout == RS_LAYOUT_FP8_PAIRS32) {
            wr = rs_xmalloc((size_t)(n * k) + 1);
            rs_fp8_pairs32_unpack(wr, w->data, n, k);
        }
        rs_fp8_gemm_ref(out, xq, xs, wr ? wr : w->data, w->scale_inv, rows, (int)n, (int)k);
        free(wr);
        if (rs_tensor_present(bias))
            for (int t = 0; t < rows; t++)
                for (int64_t i = 0; i < n; i++) out[t * n + i] += rs_cpu_elem(bias->data, bias->dtype, i);
        free(xq);
        free(xs);
        return;
    }
    for (int t = 0; t < rows; t++) {
        for (int64_t i = 0; i < n; i++) {
            float s = 0.0f;
            for (int64_t j = 0; j < k; j++) s += x[t * k + j] * rs_cpu_elem(w->data, w->dtype, i * k + j);
            if (rs_tensor_present(bias)) s += rs_cpu_elem(bias->data, bias->dtype, i);
            out[t * n + i] = s;
        }
    }
}

void rs_cpu_op_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias,
                      int rows) {
    rs_cpu_matmul(rs_cpu_ctx_of(b), out, x, w, bias, rows);
}
