/*
 * bench_gpu.c — the CUDA backend's matmul speed on one GPU (a `make CUDA=1` build).
 *
 *   bench-gpu copy                                  device-to-device copy bandwidth (the ceiling)
 *   bench-gpu gemm [--shapes N:K,...] [--tokens 512,2048,4096]
 *       cuBLASLt's block-scaled FP8 GEMM and its BF16 GEMM through kernels/cuda/cuda_blas.cu, on
 *       device-resident operands (no activation quantization in the time): TFLOP/s and the
 *       FP8 / BF16 speed ratio per shape. Default shapes: Qwen3-8B's q|k|v, o, gate (= up) and
 *       down projections.
 *   bench-gpu gemv [--shapes N:K,...] [--rows 1,2,4,8,16,32,64]
 *       the matmul op in fast numerics with the GEMV kernels forced on and off (rs_backend_cuda_set_
 *       gemv_rows), FP8 and BF16 weights, fp32 activations as the forward pass hands them over
 *       (FP8: quantized per call): us per call, weight GB/s, and per dtype the largest row count at
 *       which the GEMV is faster (the crossover that RS_CUDA_GEMV_ROWS_FP8 / _BF16 should match).
 *
 *   bench-gpu attention [--rows 1,32,256] [--ctx 1024,4096] [--heads NH:NKV] [--hd 128] [--splits 1,8,32]
 *       the attention op on decode rows (every row its own sequence at context ctx, pages in
 *       order), BF16 and E4M3 (per-head scales) pages, Qwen3-8B's heads by default: us per call and
 *       K/V bytes read per second, in exact numerics (one block walks a row's context) and in fast
 *       numerics (split context) with each kernel of rs_backend_cuda_set_attention_kernel: tiles,
 *       staged tiles, warps, pipelined warps (the default) and mma (tensor cores), for each context split count of --splits (1: the
 *       backend's own choice, two waves of blocks on the GPU; else that many splits). The time
 *       includes the op's copies of the batch's positions and block tables to the device, as in a
 *       step without graphs. GB/s against the copy bandwidth (read + write) is the MBU measure of
 *       the decode benchmarks.
 *   bench-gpu shared [--rows 32,256] [--n 8] [--prompt 1024] [--own 64,256] [--heads NH:NKV] [--hd 128]
 *       the attention op on decode rows forked n at a time from one prompt each (a row's context:
 *       the prompt's pages, shared by its n forks, then `own` positions in pages of its own), BF16
 *       and E4M3 pages, fast numerics at the automatic split count: us per call with the pipelined
 *       warp kernel (the default) and the mma kernel, each without and with the shared-page
 *       kernel (rs_backend_cuda_set_attention_shared), and the same rows with a private copy of
 *       every prompt page (no sharing: what the L2 cache saves when forks read the same pages
 *       shows as the difference). K/V MB is what the rows read without sharing.
 *   bench-gpu sample [--rows 1,32,256] [--vocab 151936]
 *       device sampling (rs_backend_sample, the request copy and the result download included) of
 *       `rows` requests over random logits of a vocab-sized row each: greedy, T = 1 (both spread
 *       over parts of the row in fast numerics) and T = 1 with top_p 0.95 (one block per request),
 *       in exact and fast numerics: us per call.
 *
 * Times are the best of 5 windows of at least 0.05 s, each ending with a synchronizing download;
 * weights are cycled over enough copies to exceed the 50 MB L2 of an H100/H200. One line per
 * measurement, each naming the numerics.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rs.h"
#include "../kernels/backend.h"
#include "../kernels/fp8.h"

#ifdef RS_CUDA
/* hooks in kernels/cuda/cuda_blas.cu */
void rs_cuda_test_attention_splits(rs_backend *b, int n); /* kernels/cuda/cuda_attention.cu */
int rs_cuda_test_blas_gemm(rs_backend *b, int kind, void *out, rs_dtype out_dt, const void *x, const float *xs,
                           const void *w, const float *ws, int t, int n, int k);

#define WINDOWS 5
#define MAX_LIST 16

typedef struct list {
    int v[MAX_LIST][2];
    int n;
} list;

/* "a,b,c" or "n:k,n:k" into l. */
static int parse_list(const char *s, list *l, bool pairs) {
    l->n = 0;
    while (*s && l->n < MAX_LIST) {
        char *end;
        l->v[l->n][0] = (int)strtol(s, &end, 10);
        if (pairs) {
            if (*end != ':') return -1;
            l->v[l->n][1] = (int)strtol(end + 1, &end, 10);
        }
        if (l->v[l->n][0] <= 0 || (pairs && l->v[l->n][1] <= 0)) return -1;
        l->n++;
        if (*end == ',') end++;
        else if (*end) return -1;
        s = end;
    }
    return l->n > 0 ? 0 : -1;
}

static void sync_backend(rs_backend *b, const void *dev) {
    char c;
    rs_backend_download(b, &c, dev, 1);
}

static void *dev_random(rs_backend *b, size_t bytes, uint64_t *seed, bool codes) {
    uint8_t *h = rs_xmalloc(bytes);
    for (size_t i = 0; i < bytes; i++) {
        *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
        uint8_t v = (uint8_t)(*seed >> 56);
        if (codes && (v & 0x7f) == 0x7f) v ^= 1; /* no NaN codes */
        h[i] = codes ? v : (uint8_t)(v & 0xbf); /* bf16 bytes: keep exponents moderate */
    }
    void *d = rs_backend_alloc(b, bytes);
    RS_ASSERT(d);
    rs_backend_upload(b, d, h, bytes);
    free(h);
    return d;
}

static float *dev_scales(rs_backend *b, size_t n) {
    float *h = rs_xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = 1.0f / 64.0f;
    float *d = rs_backend_alloc(b, n * sizeof(float));
    rs_backend_upload(b, d, h, n * sizeof(float));
    free(h);
    return d;
}

static double copy_gbs(rs_backend *b) {
    const size_t n = (size_t)1 << 30;
    char *x = rs_backend_alloc(b, n), *y = rs_backend_alloc(b, n);
    RS_ASSERT(x && y);
    double best = 0;
    for (int rep = 0; rep < 6; rep++) {
        double t0 = rs_now_s();
        rs_backend_copy(b, y, x, n);
        sync_backend(b, y);
        double dt = rs_now_s() - t0;
        if (rep > 0) best = RS_MAX(best, 2.0 * (double)n / dt / 1e9);
    }
    rs_backend_free_mem(b, x), rs_backend_free_mem(b, y);
    return best;
}

/* ---- gemm ---- */

static void bench_gemm(rs_backend *b, const list *shapes, const list *tokens) {
    uint64_t seed = 7;
    printf("cuBLASLt GEMM, operands on the device: out[t][n] = x[t][k] w[n][k]^T, fp32 out, numerics fast\n");
    for (int si = 0; si < shapes->n; si++) {
        const int n = shapes->v[si][0], k = shapes->v[si][1], L = (int)rs_fp8_blocks(k), L4 = (L + 3) / 4 * 4;
        int tmax = 0;
        for (int ti = 0; ti < tokens->n; ti++) tmax = RS_MAX(tmax, tokens->v[ti][0]);
        void *w8 = dev_random(b, (size_t)n * k, &seed, true), *x8 = dev_random(b, (size_t)tmax * k, &seed, true);
        void *w16 = dev_random(b, (size_t)n * k * 2, &seed, false), *x16 = dev_random(b, (size_t)tmax * k * 2, &seed, false);
        float *ws = dev_scales(b, (size_t)rs_fp8_blocks(n) * L4), *xs = dev_scales(b, (size_t)L * tmax);
        float *out = rs_backend_alloc(b, (size_t)tmax * n * sizeof(float));
        for (int ti = 0; ti < tokens->n; ti++) {
            const int t = tokens->v[ti][0];
            double best[2] = {1e30, 1e30};
            for (int kind = 0; kind < 2; kind++) { /* 0 bf16, 1 fp8 (cuda_internal.h RS_CUDA_GEMM_*) */
                for (int win = 0; win < WINDOWS; win++) {
                    int iters = 0;
                    double t0 = rs_now_s(), dt;
                    do {
                        int rc = kind ? rs_cuda_test_blas_gemm(b, 1, out, RS_DTYPE_F32, x8, xs, w8, ws, t, n, k)
                                      : rs_cuda_test_blas_gemm(b, 0, out, RS_DTYPE_F32, x16, NULL, w16, NULL, t, n, k);
                        if (rc != RS_OK) {
                            printf("  n %d k %d t %d %s: refused by cuBLASLt\n", n, k, t, kind ? "fp8" : "bf16");
                            goto next;
                        }
                        iters++;
                        if (iters % 8 == 0) sync_backend(b, out);
                        dt = rs_now_s() - t0;
                    } while (dt < 0.05 || iters < 8);
                    sync_backend(b, out);
                    best[kind] = RS_MIN(best[kind], (rs_now_s() - t0) / iters);
                }
            }
            {
                const double flop = 2.0 * t * (double)n * k;
                printf("  fast n %5d k %5d t %5d: fp8 %8.1f us %7.1f TFLOP/s | bf16 %8.1f us %7.1f TFLOP/s | fp8/bf16 "
                       "speed %.2fx\n",
                       n, k, t, best[1] * 1e6, flop / best[1] / 1e12, best[0] * 1e6, flop / best[0] / 1e12,
                       best[0] / best[1]);
            }
        next:;
        }
        rs_backend_free_mem(b, w8), rs_backend_free_mem(b, x8), rs_backend_free_mem(b, w16), rs_backend_free_mem(b, x16);
        rs_backend_free_mem(b, ws), rs_backend_free_mem(b, xs), rs_backend_free_mem(b, out);
    }
}

/* ---- gemv crossover ---- */

/* The best time per call of fn(ctx, i) (i counting the calls) over WINDOWS windows of at least
 * 0.05 s and `every` calls each, synchronizing on dev every `every` calls and at each window's end. */
static double best_time(rs_backend *b, const void *dev, int every, void (*fn)(void *ctx, int i), void *ctx) {
    double best = 1e30;
    for (int win = 0; win < WINDOWS; win++) {
        int iters = 0;
        double t0 = rs_now_s(), dt;
        do {
            fn(ctx, iters);
            iters++;
            if (iters % every == 0) sync_backend(b, dev);
            dt = rs_now_s() - t0;
        } while (dt < 0.05 || iters < every);
        sync_backend(b, dev);
        best = RS_MIN(best, (rs_now_s() - t0) / iters);
    }
    return best;
}

typedef struct matmul_call {
    rs_backend *b;
    float *out;
    const float *x;
    const rs_tensor *w;
    int copies, rows;
} matmul_call;

static void matmul_once(void *ctx, int i) {
    const matmul_call *m = ctx;
    rs_op_matmul(m->b, m->out, m->x, &m->w[i % m->copies], NULL, m->rows);
}

static double time_op(rs_backend *b, float *out, const float *x, const rs_tensor *w, int copies, int rows) {
    matmul_call m = {b, out, x, w, copies, rows};
    for (int c = 0; c < copies; c++) matmul_once(&m, c);
    sync_backend(b, out);
    return best_time(b, out, copies, matmul_once, &m);
}

static void bench_gemv(rs_backend *b, const list *shapes, const list *rows, double bw) {
    uint64_t seed = 11;
    printf("matmul op, numerics fast: the GEMV kernels (gemv) against cuBLASLt (gemm); weights cycled past L2\n");
    for (int si = 0; si < shapes->n; si++) {
        const int n = shapes->v[si][0], k = shapes->v[si][1];
        for (int fp8 = 1; fp8 >= 0; fp8--) {
            const size_t wbytes = (size_t)n * k * (fp8 ? 1 : 2);
            const int copies = (int)RS_MAX((size_t)2, RS_MIN((size_t)32, ((size_t)256 << 20) / wbytes));
            rs_tensor *w = rs_xcalloc((size_t)copies, sizeof *w);
            for (int c = 0; c < copies; c++) {
                w[c] = (rs_tensor){.dtype = fp8 ? RS_DTYPE_E4M3 : RS_DTYPE_BF16, .ndim = 2, .shape = {n, k},
                                   .data = dev_random(b, wbytes, &seed, fp8)};
                if (fp8) w[c].scale_inv = dev_scales(b, (size_t)rs_fp8_blocks(n) * rs_fp8_blocks(k));
            }
            int rmax = 0;
            for (int ri = 0; ri < rows->n; ri++) rmax = RS_MAX(rmax, rows->v[ri][0]);
            float *hx = rs_xmalloc((size_t)rmax * k * sizeof(float));
            for (size_t i = 0; i < (size_t)rmax * k; i++) hx[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
            float *x = rs_backend_alloc(b, (size_t)rmax * k * sizeof(float)), *out = rs_backend_alloc(b, (size_t)rmax * n * 4);
            rs_backend_upload(b, x, hx, (size_t)rmax * k * sizeof(float));
            int crossover = 0;
            for (int ri = 0; ri < rows->n; ri++) {
                const int r = rows->v[ri][0];
                const rs_dtype wdt = fp8 ? RS_DTYPE_E4M3 : RS_DTYPE_BF16;
                const int keep = rs_backend_cuda_set_gemv_rows(b, wdt, 1 << 20);
                const double tg = time_op(b, out, x, w, copies, r);
                rs_backend_cuda_set_gemv_rows(b, wdt, 0);
                const double tm = time_op(b, out, x, w, copies, r);
                rs_backend_cuda_set_gemv_rows(b, wdt, keep);
                if (tg < tm) crossover = r;
                printf("  fast %-4s n %5d k %5d rows %3d: gemv %7.1f us (%6.0f GB/s, %3.0f%% of copy) | gemm %7.1f us | "
                       "%s\n",
                       fp8 ? "fp8" : "bf16", n, k, r, tg * 1e6, wbytes / tg / 1e9, 100.0 * wbytes / tg / 1e9 / bw,
                       tm * 1e6, tg < tm ? "gemv" : "gemm");
            }
            printf("  fast %-4s n %5d k %5d: GEMV faster up to %d rows (largest measured row count where it won)\n",
                   fp8 ? "fp8" : "bf16", n, k, crossover);
            for (int c = 0; c < copies; c++) {
                rs_backend_free_mem(b, w[c].data);
                if (w[c].scale_inv) rs_backend_free_mem(b, w[c].scale_inv);
            }
            free(w), free(hx);
            rs_backend_free_mem(b, x), rs_backend_free_mem(b, out);
        }
    }
}

/* ---- decode attention ---- */

typedef struct attention_call {
    rs_backend *b;
    float *out;
    const float *q;
    const rs_kv_layer *kv;
    int n_heads;
    const rs_batch *bt;
} attention_call;

static void attention_once(void *ctx, int i) {
    (void)i;
    const attention_call *a = ctx;
    rs_op_attention(a->b, a->out, a->q, a->kv, a->n_heads, 1.0f / sqrtf((float)a->kv->head_dim), a->bt);
}

/* One attention op over the batch: its best time per call. */
static double time_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                             const rs_batch *bt) {
    attention_call a = {b, out, q, kv, n_heads, bt};
    attention_once(&a, 0);
    sync_backend(b, out);
    return best_time(b, out, 8, attention_once, &a);
}

static void bench_attention(rs_backend *b, const list *rows, const list *ctx, const list *splits, int n_heads, int n_kv,
                            int hd, double bw) {
    uint64_t seed = 13;
    int rmax = 0, cmax = 0;
    for (int i = 0; i < rows->n; i++) rmax = RS_MAX(rmax, rows->v[i][0]);
    for (int i = 0; i < ctx->n; i++) cmax = RS_MAX(cmax, ctx->v[i][0]);
    const int bps = (cmax + RS_KV_BLOCK - 1) / RS_KV_BLOCK; /* pages per sequence */
    printf("attention op, decode rows (one sequence each, pages in order), %d query heads / %d KV heads, head dim %d\n",
           n_heads, n_kv, hd);
    /* q, out; the batch's host arrays for the largest case (a case uses a prefix) */
    const size_t nq = (size_t)rmax * n_heads * hd;
    float *hq = rs_xmalloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) hq[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    float *q = rs_backend_alloc(b, nq * sizeof(float)), *out = rs_backend_alloc(b, nq * sizeof(float));
    RS_ASSERT(q && out);
    rs_backend_upload(b, q, hq, nq * sizeof(float));
    free(hq);
    int32_t *pos = rs_xmalloc((size_t)rmax * 4), *start = rs_xmalloc((size_t)(rmax + 1) * 4);
    int32_t *seq_ctx = rs_xmalloc((size_t)rmax * 4), *tables = rs_xmalloc((size_t)rmax * bps * 4);
    for (int r = 0; r < rmax; r++)
        for (int p = 0; p < bps; p++) tables[(size_t)r * bps + p] = r * bps + p;
    static const rs_dtype dts[] = {RS_DTYPE_BF16, RS_DTYPE_E4M3};
    for (size_t di = 0; di < RS_ARRAY_LEN(dts); di++) {
        const rs_dtype dt = dts[di];
        rs_kv_layer kv = {.dtype = dt, .n_blocks = rmax * bps, .n_kv_heads = n_kv, .head_dim = hd,
                          .scale_mode = dt == RS_DTYPE_E4M3 ? RS_KV_SCALE_PER_HEAD : RS_KV_SCALE_NONE};
        const size_t es = rs_dtype_size(dt), row_bytes = (size_t)n_kv * hd * es; /* one position's K (or V) */
        const size_t page_bytes = (size_t)kv.n_blocks * 2 * RS_KV_BLOCK * row_bytes;
        /* the pages: one random chunk uploaded, copied on the device over the rest */
        const size_t chunk = RS_MIN(page_bytes, (size_t)16 << 20);
        kv.pages = dev_random(b, chunk, &seed, dt == RS_DTYPE_E4M3);
        if (page_bytes > chunk) {
            void *all = rs_backend_alloc(b, page_bytes);
            if (!all) {
                printf("  %s: %zu MB of pages do not fit; skipped\n", rs_dtype_name(dt), page_bytes >> 20);
                rs_backend_free_mem(b, kv.pages);
                continue;
            }
            for (size_t off = 0; off < page_bytes; off += chunk)
                rs_backend_copy(b, (char *)all + off, kv.pages, RS_MIN(chunk, page_bytes - off));
            rs_backend_free_mem(b, kv.pages);
            kv.pages = all;
        }
        if (dt == RS_DTYPE_E4M3) kv.k_scale = dev_scales(b, (size_t)n_kv), kv.v_scale = dev_scales(b, (size_t)n_kv);
        for (int ri = 0; ri < rows->n; ri++)
            for (int ci = 0; ci < ctx->n; ci++) {
                const int R = rows->v[ri][0], C = ctx->v[ci][0];
                for (int r = 0; r < R; r++) pos[r] = C - 1, start[r] = r, seq_ctx[r] = C;
                start[R] = R;
                const rs_batch bt = {.n_tok = R, .n_seq = R, .pos = pos, .seq_start = start, .seq_ctx = seq_ctx,
                                     .block_tables = tables, .max_blocks = bps};
                const double bytes = 2.0 * (double)R * C * (double)row_bytes; /* K and V of every position */
                rs_backend_set_numerics(b, RS_NUMERICS_EXACT);
                const double te = time_attention(b, out, q, &kv, n_heads, &bt);
                printf("  %-13s rows %4d ctx %6d (%7.1f MB K/V): exact %8.1f us %6.0f GB/s\n", rs_dtype_name(dt), R, C,
                       bytes / 1e6, te * 1e6, bytes / te / 1e9);
                rs_backend_set_numerics(b, RS_NUMERICS_FAST);
                for (int si = 0; si < splits->n; si++) {
                    const int sp = splits->v[si][0] == 1 ? 0 : splits->v[si][0]; /* "1" in the list: automatic */
                    rs_cuda_test_attention_splits(b, sp);
                    static const rs_cuda_attention_kernel kern[5] = {RS_CUDA_ATTENTION_TILES, RS_CUDA_ATTENTION_STAGED,
                                                                     RS_CUDA_ATTENTION_WARPS, RS_CUDA_ATTENTION_PIPELINED,
                                                                     RS_CUDA_ATTENTION_MMA};
                    double t[5];
                    for (int ki = 0; ki < 5; ki++) {
                        rs_backend_cuda_set_attention_kernel(b, kern[ki]);
                        t[ki] = time_attention(b, out, q, &kv, n_heads, &bt);
                    }
                    rs_backend_cuda_set_attention_kernel(b, RS_CUDA_ATTENTION_PIPELINED);
                    char what[16];
                    if (sp) snprintf(what, sizeof what, "%d", sp);
                    else snprintf(what, sizeof what, "auto");
                    printf("      fast, splits %-4s tiles %8.1f us %6.0f GB/s | staged %8.1f us %6.0f GB/s | warps %8.1f us "
                           "%6.0f GB/s (%3.0f%% of copy) | pipelined %8.1f us %6.0f GB/s (%3.0f%%) | mma %8.1f us %6.0f GB/s "
                           "(%3.0f%%) | warps/tiles %.2fx\n",
                           what, t[0] * 1e6, bytes / t[0] / 1e9, t[1] * 1e6, bytes / t[1] / 1e9, t[2] * 1e6,
                           bytes / t[2] / 1e9, 100.0 * bytes / t[2] / 1e9 / bw, t[3] * 1e6, bytes / t[3] / 1e9,
                           100.0 * bytes / t[3] / 1e9 / bw, t[4] * 1e6, bytes / t[4] / 1e9,
                           100.0 * bytes / t[4] / 1e9 / bw, t[0] / t[2]);
                }
                rs_cuda_test_attention_splits(b, 0);
            }
        rs_backend_free_mem(b, kv.pages);
        if (kv.k_scale) rs_backend_free_mem(b, kv.k_scale), rs_backend_free_mem(b, kv.v_scale);
    }
    free(pos), free(start), free(seq_ctx), free(tables);
    rs_backend_free_mem(b, q), rs_backend_free_mem(b, out);
}

/* ---- decode attention over pages that forked rows share ---- */

static void bench_shared(rs_backend *b, const list *rows, int n, int prompt, const list *own, int n_heads, int n_kv,
                         int hd, double bw) {
    uint64_t seed = 17;
    int rmax = 0, omax = 0;
    for (int i = 0; i < rows->n; i++) rmax = RS_MAX(rmax, rows->v[i][0]);
    for (int i = 0; i < own->n; i++) omax = RS_MAX(omax, own->v[i][0]);
    const int pp = (prompt + RS_KV_BLOCK - 1) / RS_KV_BLOCK, op = (omax + RS_KV_BLOCK - 1) / RS_KV_BLOCK + 1;
    const int bps = pp + op; /* table width; own pages start after the prompt's (prompt is page-aligned) */
    RS_ASSERT(prompt % RS_KV_BLOCK == 0);
    printf("attention op, decode rows forked %d at a time from %d-position prompts, %d query heads / %d KV heads, "
           "head dim %d, fast numerics\n", n, prompt, n_heads, n_kv, hd);
    const size_t nq = (size_t)rmax * n_heads * hd;
    float *hq = rs_xmalloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) hq[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    float *q = rs_backend_alloc(b, nq * sizeof(float)), *out = rs_backend_alloc(b, nq * sizeof(float));
    RS_ASSERT(q && out);
    rs_backend_upload(b, q, hq, nq * sizeof(float));
    free(hq);
    int32_t *pos = rs_xmalloc((size_t)rmax * 4), *start = rs_xmalloc((size_t)(rmax + 1) * 4);
    int32_t *seq_ctx = rs_xmalloc((size_t)rmax * 4);
    int32_t *t_sh = rs_xmalloc((size_t)rmax * bps * 4), *t_pr = rs_xmalloc((size_t)rmax * bps * 4);
    /* the pool: every row's private layout (rows x bps pages); the shared layout uses its first pages */
    for (int r = 0; r < rmax; r++)
        for (int p = 0; p < bps; p++) {
            t_pr[(size_t)r * bps + p] = r * bps + p;
            t_sh[(size_t)r * bps + p] = p < pp ? (r / n) * pp + p : ((rmax + n - 1) / n) * pp + r * op + (p - pp);
        }
    static const rs_dtype dts[] = {RS_DTYPE_BF16, RS_DTYPE_E4M3};
    for (size_t di = 0; di < RS_ARRAY_LEN(dts); di++) {
        const rs_dtype dt = dts[di];
        rs_kv_layer kv = {.dtype = dt, .n_blocks = rmax * bps, .n_kv_heads = n_kv, .head_dim = hd,
                          .scale_mode = dt == RS_DTYPE_E4M3 ? RS_KV_SCALE_PER_HEAD : RS_KV_SCALE_NONE};
        const size_t es = rs_dtype_size(dt), row_bytes = (size_t)n_kv * hd * es;
        const size_t page_bytes = (size_t)kv.n_blocks * 2 * RS_KV_BLOCK * row_bytes;
        const size_t chunk = RS_MIN(page_bytes, (size_t)16 << 20);
        kv.pages = dev_random(b, chunk, &seed, dt == RS_DTYPE_E4M3);
        if (page_bytes > chunk) {
            void *all = rs_backend_alloc(b, page_bytes);
            if (!all) {
                printf("  %s: %zu MB of pages do not fit; skipped\n", rs_dtype_name(dt), page_bytes >> 20);
                rs_backend_free_mem(b, kv.pages);
                continue;
            }
            for (size_t off = 0; off < page_bytes; off += chunk)
                rs_backend_copy(b, (char *)all + off, kv.pages, RS_MIN(chunk, page_bytes - off));
            rs_backend_free_mem(b, kv.pages);
            kv.pages = all;
        }
        if (dt == RS_DTYPE_E4M3) kv.k_scale = dev_scales(b, (size_t)n_kv), kv.v_scale = dev_scales(b, (size_t)n_kv);
        for (int ri = 0; ri < rows->n; ri++)
            for (int oi = 0; oi < own->n; oi++) {
                const int R = rows->v[ri][0], O = own->v[oi][0], C = prompt + O;
                for (int r = 0; r < R; r++) pos[r] = C - 1, start[r] = r, seq_ctx[r] = C;
                start[R] = R;
                const double bytes = 2.0 * (double)R * C * (double)row_bytes;
                static const rs_cuda_attention_kernel kern[2] = {RS_CUDA_ATTENTION_PIPELINED, RS_CUDA_ATTENTION_MMA};
                double t[2][3]; /* kernel x (private pages, shared pages, shared pages with the shared kernel) */
                for (int ki = 0; ki < 2; ki++) {
                    rs_backend_cuda_set_attention_kernel(b, kern[ki]);
                    for (int m = 0; m < 3; m++) {
                        const rs_batch bt = {.n_tok = R, .n_seq = R, .pos = pos, .seq_start = start, .seq_ctx = seq_ctx,
                                             .block_tables = m == 0 ? t_pr : t_sh, .max_blocks = bps};
                        rs_backend_cuda_set_attention_shared(b, m == 2);
                        t[ki][m] = time_attention(b, out, q, &kv, n_heads, &bt);
                    }
                }
                rs_backend_cuda_set_attention_shared(b, false);
                rs_backend_cuda_set_attention_kernel(b, RS_CUDA_ATTENTION_PIPELINED);
                printf("  %-13s rows %4d ctx %5d + %4d own (%7.1f MB K/V): pipelined: private %8.1f us (%3.0f%% of copy) | "
                       "forked %8.1f us | forked, shared kernel %8.1f us (%.2fx) || mma: private %8.1f | forked %8.1f | "
                       "forked, shared kernel %8.1f us (%.2fx)\n",
                       rs_dtype_name(dt), R, prompt, O, bytes / 1e6, t[0][0] * 1e6, 100.0 * bytes / t[0][0] / 1e9 / bw,
                       t[0][1] * 1e6, t[0][2] * 1e6, t[0][1] / t[0][2], t[1][0] * 1e6, t[1][1] * 1e6, t[1][2] * 1e6,
                       t[1][1] / t[1][2]);
            }
        rs_backend_free_mem(b, kv.pages);
        if (kv.k_scale) rs_backend_free_mem(b, kv.k_scale), rs_backend_free_mem(b, kv.v_scale);
    }
    free(pos), free(start), free(seq_ctx), free(t_sh), free(t_pr);
    rs_backend_free_mem(b, q), rs_backend_free_mem(b, out);
}

/* ---- sample ---- */

typedef struct sample_call {
    rs_backend *b;
    const float *logits;
    int vocab, n;
    rs_sample_req *req;
    rs_sample_res *res;
} sample_call;

static void sample_once(void *ctx, int i) {
    sample_call *a = ctx;
    for (int r = 0; r < a->n; r++) a->req[r].position = (uint64_t)i; /* a new draw each call */
    rs_backend_sample(a->b, a->logits, a->vocab, a->req, a->n, a->res);
}

static void bench_sample(rs_backend *b, const list *rows, int vocab) {
    int rmax = 0;
    for (int i = 0; i < rows->n; i++) rmax = RS_MAX(rmax, rows->v[i][0]);
    const size_t nl = (size_t)rmax * vocab;
    float *h = rs_xmalloc(nl * sizeof(float));
    uint64_t seed = 7;
    for (size_t i = 0; i < nl; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        h[i] = (float)(seed >> 40) / (float)(1 << 24) * 12.0f - 6.0f; /* spread like a model's logits */
    }
    float *logits = rs_backend_alloc(b, nl * sizeof(float));
    RS_ASSERT(logits);
    rs_backend_upload(b, logits, h, nl * sizeof(float));
    free(h);
    rs_sample_req *req = rs_xcalloc((size_t)rmax, sizeof *req);
    rs_sample_res *res = rs_xcalloc((size_t)rmax, sizeof *res);
    printf("device sampling, vocab %d, us per call (request upload and result download included)\n", vocab);
    static const struct {
        const char *name;
        float t, top_p;
    } kinds[] = {{"greedy", 0.0f, 1.0f}, {"T=1", 1.0f, 1.0f}, {"T=1 top_p 0.95", 1.0f, 0.95f}};
    for (int ri = 0; ri < rows->n; ri++) {
        const int n = rows->v[ri][0];
        for (size_t k = 0; k < RS_ARRAY_LEN(kinds); k++) {
            for (int r = 0; r < n; r++)
                req[r] = (rs_sample_req){.row = r, .temperature = kinds[k].t, .top_p = kinds[k].top_p, .top_k = -1,
                                         .seed = 1234, .sample_index = (uint64_t)r};
            sample_call a = {b, logits, vocab, n, req, res};
            double t[2];
            for (int e = 0; e < 2; e++) {
                rs_backend_set_numerics(b, e == 0 ? RS_NUMERICS_EXACT : RS_NUMERICS_FAST);
                sample_once(&a, 0);
                t[e] = best_time(b, logits, 1, sample_once, &a);
            }
            printf("  rows %4d %-15s exact %9.1f us | fast %9.1f us | exact/fast %.2fx\n", n, kinds[k].name, t[0] * 1e6,
                   t[1] * 1e6, t[0] / t[1]);
        }
    }
    rs_backend_set_numerics(b, RS_NUMERICS_FAST);
    free(req), free(res);
    rs_backend_free_mem(b, logits);
}

static void usage(void) {
    fprintf(stderr, "usage: bench-gpu copy | gemm [--shapes N:K,...] [--tokens T,...] | gemv [--shapes N:K,...] "
                    "[--rows R,...] | attention [--rows R,...] [--ctx C,...] [--heads NH:NKV] [--hd D] [--splits S,...] | "
                    "shared [--rows R,...] [--n N] [--prompt P] [--own O,...] [--heads NH:NKV] [--hd D] | "
                    "sample [--rows R,...] [--vocab V]\n");
    exit(2);
}

int main(int argc, char **argv) {
    if (argc < 2) usage();
    const char *what = argv[1];
    const bool att = !strcmp(what, "attention"), smp = !strcmp(what, "sample"), shr = !strcmp(what, "shared");
    list shapes, tokens, rows, ctx, heads, hd, splits, vocab, fork_n, prompt, own;
    parse_list("6144:4096,4096:4096,12288:4096,4096:12288", &shapes, true); /* Qwen3-8B q|k|v, o, gate, down */
    parse_list("512,2048,4096", &tokens, false);
    parse_list(shr ? "32,256" : att || smp ? "1,32,256" : "1,2,4,8,12,16,24,32,64", &rows, false);
    parse_list("8", &fork_n, false);
    parse_list("1024", &prompt, false);
    parse_list("64,256", &own, false);
    parse_list("151936", &vocab, false); /* Qwen3's */
    parse_list("1024,4096", &ctx, false);
    parse_list("32:8", &heads, true); /* Qwen3-8B */
    parse_list("128", &hd, false);
    parse_list("1,8,32", &splits, false); /* 1: the backend's own choice */
    for (int i = 2; i < argc; i += 2) {
        if (i + 1 >= argc) usage();
        if (!strcmp(argv[i], "--shapes")) {
            if (parse_list(argv[i + 1], &shapes, true)) usage();
        } else if (!strcmp(argv[i], "--tokens")) {
            if (parse_list(argv[i + 1], &tokens, false)) usage();
        } else if (!strcmp(argv[i], "--rows")) {
            if (parse_list(argv[i + 1], &rows, false)) usage();
        } else if (!strcmp(argv[i], "--ctx")) {
            if (parse_list(argv[i + 1], &ctx, false)) usage();
        } else if (!strcmp(argv[i], "--heads")) {
            if (parse_list(argv[i + 1], &heads, true) || heads.n != 1 || heads.v[0][0] % heads.v[0][1]) usage();
        } else if (!strcmp(argv[i], "--splits")) {
            if (parse_list(argv[i + 1], &splits, false)) usage();
            for (int j = 0; j < splits.n; j++)
                if (splits.v[j][0] > 64) usage();
        } else if (!strcmp(argv[i], "--vocab")) {
            if (parse_list(argv[i + 1], &vocab, false) || vocab.n != 1) usage();
        } else if (!strcmp(argv[i], "--n")) {
            if (parse_list(argv[i + 1], &fork_n, false) || fork_n.n != 1 || fork_n.v[0][0] < 1) usage();
        } else if (!strcmp(argv[i], "--prompt")) {
            if (parse_list(argv[i + 1], &prompt, false) || prompt.n != 1 || prompt.v[0][0] < RS_KV_BLOCK ||
                prompt.v[0][0] % RS_KV_BLOCK)
                usage();
        } else if (!strcmp(argv[i], "--own")) {
            if (parse_list(argv[i + 1], &own, false)) usage();
            for (int j = 0; j < own.n; j++)
                if (own.v[j][0] < 1) usage();
        } else if (!strcmp(argv[i], "--hd")) {
            if (parse_list(argv[i + 1], &hd, false) || hd.n != 1) usage();
        } else usage();
    }
    rs_log_min_level = RS_LOG_LEVEL_WARN;
    rs_backend *b = rs_backend_cuda_init(0);
    if (!b) {
        fprintf(stderr, "no CUDA device\n");
        return 1;
    }
    rs_backend_set_numerics(b, RS_NUMERICS_FAST);
    if (!strcmp(what, "copy")) printf("device-to-device copy: %.1f GB/s (read + write)\n", copy_gbs(b));
    else if (!strcmp(what, "gemm")) bench_gemm(b, &shapes, &tokens);
    else if (!strcmp(what, "gemv")) {
        const double bw = copy_gbs(b);
        printf("device-to-device copy: %.1f GB/s (read + write)\n", bw);
        bench_gemv(b, &shapes, &rows, bw);
    } else if (att) {
        const double bw = copy_gbs(b);
        printf("device-to-device copy: %.1f GB/s (read + write)\n", bw);
        bench_attention(b, &rows, &ctx, &splits, heads.v[0][0], heads.v[0][1], hd.v[0][0], bw);
    } else if (shr) {
        const double bw = copy_gbs(b);
        printf("device-to-device copy: %.1f GB/s (read + write)\n", bw);
        bench_shared(b, &rows, fork_n.v[0][0], prompt.v[0][0], &own, heads.v[0][0], heads.v[0][1], hd.v[0][0], bw);
    } else if (smp) bench_sample(b, &rows, vocab.v[0][0]);
    else usage();
    rs_backend_free(b);
    return 0;
}
#else
int main(void) {
    fprintf(stderr, "bench-gpu needs a CUDA build (make CUDA=1)\n");
    return 2;
}
#endif
