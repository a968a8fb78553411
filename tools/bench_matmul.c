/*
 * bench_matmul.c — speed of the CPU backend's matmul on one weight shape, for a list of batch sizes.
 *
 *   bench-matmul [N K [dtype [threads [rows,rows,...]]]]     defaults: 3072 1024 bf16 0 1,2,4,8,16
 *   RS_CPU_SIMD=avx2 bench-matmul ...                          cap the SIMD level
 *
 * Prints, per batch size, the time per call, the weight bytes streamed per second and rows per
 * second (and that as a multiple of batch 1). Weights are random; several copies are cycled when
 * one is small enough to stay in the last-level cache, so "GB/s" means memory, not L3.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rs.h"
#include "../kernels/backend.h"

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

int main(int argc, char **argv) {
    int64_t n = argc > 1 ? atoll(argv[1]) : 3072, k = argc > 2 ? atoll(argv[2]) : 1024;
    const char *dts = argc > 3 ? argv[3] : "bf16";
    int threads = argc > 4 ? atoi(argv[4]) : 0;
    const char *rows_arg = argc > 5 ? argv[5] : "1,2,4,8,16";
    rs_dtype dt = strcmp(dts, "f32") == 0   ? RS_DTYPE_F32
                  : strcmp(dts, "f16") == 0 ? RS_DTYPE_F16
                                            : RS_DTYPE_BF16;
    if (n <= 0 || k <= 0) {
        fprintf(stderr, "usage: bench-matmul [N K [bf16|f16|f32 [threads [rows,...]]]]\n");
        return 2;
    }

    size_t wbytes = (size_t)n * (size_t)k * rs_dtype_size(dt);
    int copies = (int)RS_MAX((size_t)1, RS_MIN((size_t)16, ((size_t)256 << 20) / wbytes)); /* > L3 in all */
    rs_backend *b = rs_backend_cpu_init(threads);
    rs_tensor *w = rs_xcalloc((size_t)copies, sizeof *w);
    uint64_t seed = 1;
    for (int c = 0; c < copies; c++) {
        w[c] = (rs_tensor){.dtype = dt, .ndim = 2, .shape = {n, k}, .data = rs_backend_alloc(b, wbytes)};
        RS_ASSERT(w[c].data);
        for (size_t i = 0; i < (size_t)n * (size_t)k; i++) {
            float v = frand(&seed);
            if (dt == RS_DTYPE_F32)
                ((float *)w[c].data)[i] = v;
            else
                ((uint16_t *)w[c].data)[i] = dt == RS_DTYPE_BF16 ? rs_f32_to_bf16(v) : rs_f32_to_f16(v);
        }
    }
    int max_rows = 1;
    for (const char *p = rows_arg; *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : p + strlen(p))
        max_rows = RS_MAX(max_rows, atoi(p));
    float *x = rs_xmalloc((size_t)max_rows * (size_t)k * sizeof(float));
    float *out = rs_xmalloc((size_t)max_rows * (size_t)n * sizeof(float));
    for (size_t i = 0; i < (size_t)max_rows * (size_t)k; i++) x[i] = frand(&seed);

    printf("matmul %s [%lld][%lld] (%.1f MB, %d cop%s cycled), threads %d\n", rs_dtype_name(dt), (long long)n,
           (long long)k, wbytes / 1e6, copies, copies == 1 ? "y" : "ies", threads);
    double rate1 = 0;
    for (const char *p = rows_arg; *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : p + strlen(p)) {
        int rows = atoi(p);
        if (rows <= 0) continue;
        for (int c = 0; c < copies; c++) rs_op_matmul(b, out, x, &w[c], NULL, rows); /* warm */
        int iters = 0;
        double t0 = rs_now_s(), dt_s;
        do {
            rs_op_matmul(b, out, x, &w[iters % copies], NULL, rows);
            iters++;
            dt_s = rs_now_s() - t0;
        } while (dt_s < 0.5 || iters < copies);
        double per = dt_s / iters, rate = rows / per;
        if (rows == 1) rate1 = rate;
        printf("  rows %3d: %9.1f us/call  %6.1f GB/s  %9.0f rows/s", rows, per * 1e6, wbytes / per / 1e9,
               rate);
        if (rate1 > 0) printf("  (%.1fx batch 1)", rate / rate1);
        printf("\n");
    }
    for (int c = 0; c < copies; c++) rs_backend_free_mem(b, w[c].data);
    free(w), free(x), free(out);
    rs_backend_free(b);
    return 0;
}
