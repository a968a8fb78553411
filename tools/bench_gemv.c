/*
 * bench_gemv.c — batch-1 decode's matmuls on the CPU, each tile form in turn, in one process.
 *
 *   bench-gemv [--steps 30] [--threads 2] [--fast]
 *
 * A batch-1 matmul with BF16 weights on AVX-512 has two tile forms that give the same bits
 * (kernels/cpu/cpu_internal.h rs_cpu_gemv): the four weight rows of a tile read together ("tile"),
 * or one after another ("rows"); by default the backend times both per weight shape and runs the
 * faster ("auto"). This runs the matmuls of one decode step of a Qwen3-0.6B-shaped model (28
 * layers of q, k, v, o, gate, up and down projections, then the 151936 x 1024 lm_head: 1.19 GB of
 * BF16, distinct weights, one token row) with each form in turn, step after step, so that the
 * machine's drift and the process's memory placement hit all three alike; the first step of each
 * is not counted. Prints ms per step and weight GB/s per form, and the ratios. --fast: BF16
 * activations and vdpbf16ps (--numerics fast; where the CPU lacks AVX512_BF16 it stays exact).
 * RS_CPU_SIMD=avx2 runs the AVX2 level, which has only the tile form.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rs.h"
#include "../kernels/backend.h"
#include "../kernels/cpu/cpu_internal.h"

static void usage(void) {
    fprintf(stderr, "usage: bench-gemv [--steps N (>= 2)] [--threads N] [--fast]\n");
    exit(2);
}

int main(int argc, char **argv) {
    int steps = 30, threads = 2;
    bool fast = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--fast")) fast = true;
        else usage();
    }
    if (steps < 2 || threads < 1) usage();
    rs_log_min_level = RS_LOG_LEVEL_WARN;
    rs_backend *b = rs_backend_cpu_init(threads);
    if (fast) rs_backend_set_numerics(b, RS_NUMERICS_FAST);
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    static const int64_t layer[7][2] = {{2048, 1024}, {1024, 1024}, {1024, 1024}, {1024, 2048},
                                        {3072, 1024}, {3072, 1024}, {1024, 3072}}; /* q k v o gate up down */
    const int nw = 28 * 7 + 1;
    rs_tensor *w = rs_xcalloc((size_t)nw, sizeof *w);
    double bytes = 0;
    uint64_t seed = 1;
    for (int i = 0; i < nw; i++) {
        const int64_t n = i < nw - 1 ? layer[i % 7][0] : 151936, k = i < nw - 1 ? layer[i % 7][1] : 1024;
        uint16_t *h = rs_xmalloc((size_t)(n * k) * 2);
        for (int64_t e = 0; e < n * k; e++) { /* BF16 values in [-2, 2) */
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            h[e] = (uint16_t)(0x3f80u | (seed >> 56 & 0x7fu) | (seed >> 48 & 0x8000u));
        }
        void *d = rs_backend_alloc(b, (size_t)(n * k) * 2);
        RS_ASSERT(d);
        rs_backend_upload(b, d, h, (size_t)(n * k) * 2);
        free(h);
        w[i] = (rs_tensor){.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {n, k}, .data = d};
        bytes += (double)(n * k) * 2;
    }
    float *x = rs_backend_alloc(b, 3072 * sizeof(float)), *out = rs_backend_alloc(b, 151936 * sizeof(float));
    for (int i = 0; i < 3072; i++) x[i] = (float)(i % 7) - 3.0f;
    static const rs_cpu_gemv forms[3] = {RS_CPU_GEMV_TILE, RS_CPU_GEMV_ROWS, RS_CPU_GEMV_AUTO};
    static const char *const names[3] = {"tile", "rows", "auto"};
    double t[3] = {0};
    for (int s = 0; s < steps; s++)
        for (int f = 0; f < 3; f++) {
            rs_cpu_set_gemv(b, forms[f]); /* auto keeps what it has timed between its steps */
            const double t0 = rs_now_s();
            for (int i = 0; i < nw; i++) rs_op_matmul(b, out, x, &w[i], NULL, 1);
            if (s > 0) t[f] += rs_now_s() - t0;
        }
    printf("cpu: %s, %d threads, numerics %s; %d steps of %d batch-1 matmuls (%.0f MB of BF16 weights)\n",
           rs_cpu_simd_name(c->simd), threads, rs_backend_numerics(b) == RS_NUMERICS_FAST ? "fast" : "exact", steps - 1,
           nw, bytes / 1e6);
    for (int f = 0; f < 3; f++)
        printf("  %-4s %7.2f ms/step %6.1f GB/s  (tile / %s: %.2fx)\n", names[f], t[f] / (steps - 1) * 1e3,
               bytes * (steps - 1) / t[f] / 1e9, names[f], t[0] / t[f]);
    for (int i = 0; i < nw; i++) rs_backend_free_mem(b, w[i].data);
    free(w);
    rs_backend_free_mem(b, x), rs_backend_free_mem(b, out);
    rs_backend_free(b);
    return 0;
}
