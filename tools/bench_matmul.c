/*
 * bench_matmul.c — speed of the CPU backend's matmul on one weight shape, for a list of batch sizes.
 *
 *   bench-matmul [N K [dtypes [threads [rows,rows,...]]]]    defaults: 3072 1024 bf16 0 1,2,4,8,16
 *   bench-matmul 3072 1024 fp8,bf16 1 1,16,32                 FP8 against BF16, one thread
 *   RS_CPU_SIMD=avx2 bench-matmul ...                          cap the SIMD level
 *
 * dtypes is a comma list of bf16, f16, f32, fp8 (E4M3 codes with 128x128 block scales: the W8A8
 * path, whose time includes quantizing the activations; in the layout the backend serves them in,
 * RS_LAYOUT_FP8_PAIRS32 on AVX-512 VNNI) and fp8rows (the same kept row-major). With two or more,
 * each line ends with the time of the first relative to the second.
 *
 * Prints, per batch size, the time per call, the weight bytes streamed per second and rows per
 * second (and that as a multiple of batch 1). Weights are random; several copies are cycled when
 * one is small enough to stay in the last-level cache, so "GB/s" means memory, not L3. The time is
 * the best of 5 windows of at least 0.1 s each, so that a shared machine's noise does not pass for
 * the kernel's speed.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rs.h"
#include "../kernels/backend.h"
#include "../kernels/fp8.h"

#define MAX_DTYPES 4
#define WINDOWS    5

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

static const struct {
    const char *name;
    rs_dtype dt;
    bool rows; /* fp8: kept row-major, not in the backend's layout */
} dtype_names[] = {{"bf16", RS_DTYPE_BF16, false}, {"f16", RS_DTYPE_F16, false}, {"f32", RS_DTYPE_F32, false},
                   {"fp8", RS_DTYPE_E4M3, false},  {"fp8rows", RS_DTYPE_E4M3, true}};

/* The dtype named by s[0..len), or -1. */
static int parse_dtype(const char *s, size_t len) {
    for (size_t i = 0; i < RS_ARRAY_LEN(dtype_names); i++)
        if (strlen(dtype_names[i].name) == len && strncmp(s, dtype_names[i].name, len) == 0) return (int)i;
    return -1;
}

/* `copies` random [n][k] weights of dtype dt in backend memory (fp8: quantized from fp32, in the
 * backend's layout unless `rows`). */
static rs_tensor *make_weights(rs_backend *b, rs_dtype dt, bool rows, int64_t n, int64_t k, int copies,
                               uint64_t *seed) {
    size_t numel = (size_t)n * (size_t)k, wbytes = numel * rs_dtype_size(dt);
    size_t sbytes = (size_t)rs_fp8_blocks(n) * (size_t)rs_fp8_blocks(k) * sizeof(float);
    float *wf = dt == RS_DTYPE_E4M3 ? rs_xmalloc(numel * sizeof(float)) : NULL;
    uint8_t *codes = dt == RS_DTYPE_E4M3 ? rs_xmalloc(numel) : NULL;
    const rs_layout layout = dt == RS_DTYPE_E4M3 && !rows ? rs_backend_fp8_layout(b, n, k) : RS_LAYOUT_ROWS;
    rs_tensor *w = rs_xcalloc((size_t)copies, sizeof *w);
    for (int c = 0; c < copies; c++) {
        w[c] = (rs_tensor){.dtype = dt, .ndim = 2, .shape = {n, k}, .data = rs_backend_alloc(b, wbytes)};
        RS_ASSERT(w[c].data);
        for (size_t i = 0; i < numel; i++) {
            float v = frand(seed);
            if (dt == RS_DTYPE_F32 || dt == RS_DTYPE_E4M3)
                (wf ? wf : (float *)w[c].data)[i] = v;
            else
                ((uint16_t *)w[c].data)[i] = dt == RS_DTYPE_BF16 ? rs_f32_to_bf16(v) : rs_f32_to_f16(v);
        }
        if (wf) {
            rs_tensor src = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {n, k}, .data = wf};
            w[c].scale_inv = rs_backend_alloc(b, sbytes);
            RS_ASSERT(w[c].scale_inv && rs_fp8_quantize_weight(&src, codes, w[c].scale_inv) == RS_OK);
            rs_backend_fp8_pack(b, layout, w[c].data, codes, n, k);
            w[c].layout = layout;
        }
    }
    free(wf);
    free(codes);
    return w;
}

/* Seconds per call: the best of WINDOWS windows, each at least 0.1 s and one pass over the copies. */
static double time_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, int copies, int rows) {
    for (int c = 0; c < copies; c++) rs_op_matmul(b, out, x, &w[c], NULL, rows); /* warm */
    double best = 1e30;
    for (int win = 0; win < WINDOWS; win++) {
        int iters = 0;
        double t0 = rs_now_s(), dt_s;
        do {
            rs_op_matmul(b, out, x, &w[iters % copies], NULL, rows);
            iters++;
            dt_s = rs_now_s() - t0;
        } while (dt_s < 0.1 || iters < copies);
        best = RS_MIN(best, dt_s / iters);
    }
    return best;
}

int main(int argc, char **argv) {
    int64_t n = argc > 1 ? atoll(argv[1]) : 3072, k = argc > 2 ? atoll(argv[2]) : 1024;
    const char *dts = argc > 3 ? argv[3] : "bf16";
    int threads = argc > 4 ? atoi(argv[4]) : 0;
    const char *rows_arg = argc > 5 ? argv[5] : "1,2,4,8,16";
    rs_dtype dt[MAX_DTYPES];
    bool dt_rows[MAX_DTYPES];
    const char *label[MAX_DTYPES];
    int ndt = 0, ok = n > 0 && k > 0;
    for (const char *p = dts; ok && *p;) {
        size_t len = strcspn(p, ",");
        int i = parse_dtype(p, len);
        ok = ndt < MAX_DTYPES && i >= 0;
        if (ok) dt[ndt] = dtype_names[i].dt, dt_rows[ndt] = dtype_names[i].rows, label[ndt++] = dtype_names[i].name;
        p += len + (p[len] == ',');
    }
    if (!ok || ndt == 0) {
        fprintf(stderr, "usage: bench-matmul [N K [bf16|f16|f32|fp8|fp8rows[,...] [threads [rows,...]]]]\n");
        return 2;
    }

    rs_backend *b = rs_backend_cpu_init(threads);
    char line[256];
    printf("%s\n", rs_backend_cpu_describe(b, line, sizeof line));
    rs_tensor *w[MAX_DTYPES];
    int copies[MAX_DTYPES];
    uint64_t seed = 1;
    for (int d = 0; d < ndt; d++) {
        size_t wbytes = (size_t)n * (size_t)k * rs_dtype_size(dt[d]);
        copies[d] = (int)RS_MAX((size_t)1, RS_MIN((size_t)16, ((size_t)256 << 20) / wbytes)); /* > L3 in all */
        w[d] = make_weights(b, dt[d], dt_rows[d], n, k, copies[d], &seed);
        printf("matmul %s [%lld][%lld]%s (%.1f MB, %d cop%s cycled), threads %d\n", rs_dtype_name(dt[d]),
               (long long)n, (long long)k, w[d][0].layout == RS_LAYOUT_FP8_PAIRS32 ? " pairs32 layout" : "",
               wbytes / 1e6, copies[d], copies[d] == 1 ? "y" : "ies", threads);
    }
    int max_rows = 1;
    for (const char *p = rows_arg; *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : p + strlen(p))
        max_rows = RS_MAX(max_rows, atoi(p));
    float *x = rs_xmalloc((size_t)max_rows * (size_t)k * sizeof(float));
    float *out = rs_xmalloc((size_t)max_rows * (size_t)n * sizeof(float));
    for (size_t i = 0; i < (size_t)max_rows * (size_t)k; i++) x[i] = frand(&seed);

    double rate1[MAX_DTYPES] = {0};
    for (const char *p = rows_arg; *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : p + strlen(p)) {
        int rows = atoi(p);
        if (rows <= 0) continue;
        double per[MAX_DTYPES];
        for (int d = 0; d < ndt; d++) {
            per[d] = time_matmul(b, out, x, w[d], copies[d], rows);
            double rate = rows / per[d], wbytes = (double)n * (double)k * (double)rs_dtype_size(dt[d]);
            if (rows == 1) rate1[d] = rate;
            printf("  %-4s rows %3d: %9.1f us/call  %6.1f GB/s  %9.0f rows/s", label[d], rows, per[d] * 1e6,
                   wbytes / per[d] / 1e9, rate);
            if (rate1[d] > 0) printf("  (%.1fx batch 1)", rate / rate1[d]);
            printf("\n");
        }
        if (ndt >= 2)
            printf("  rows %3d: %s / %s time %.2f\n", rows, label[0], label[1], per[0] / per[1]);
    }
    for (int d = 0; d < ndt; d++) {
        for (int c = 0; c < copies[d]; c++) {
            rs_backend_free_mem(b, w[d][c].data);
            if (w[d][c].scale_inv) rs_backend_free_mem(b, w[d][c].scale_inv);
        }
        free(w[d]);
    }
    free(x), free(out);
    rs_backend_free(b);
    return 0;
}
