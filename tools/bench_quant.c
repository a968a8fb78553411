/*
 * bench_quant.c — speed of blockwise FP8 weight quantization (rs_fp8_quantize_weight), per thread.
 *
 *   bench-quant [OUT IN [dtypes [threads [log|normal]]]]   defaults: 4096 7168 bf16,f32 1 log
 *   bench-quant 4096 7168 bf16 2                 two threads, 128-row bands as model/weight_store.c splits
 *   bench-quant 4096 7168 bf16 1 normal          weights like trained ones: normal, std 0.02
 *
 * For each input dtype, prints the time to quantize one [OUT][IN] matrix and the input bytes per
 * second per thread, for the scalar reference and each vectorized level this CPU has (AVX-512 with
 * and without the BF16 table encoder), and checks that every level's codes and scales equal the
 * reference's. The matrix (> the last-level cache at the defaults) is random: "log" spreads the
 * magnitudes log-uniformly over 24 binades (a quarter of them below E4M3's normal range, the table
 * encoder's worst case), "normal" is what trained weights look like. Times are the best of 5 runs.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/pool.h"
#include "../core/rs.h"
#include "../kernels/cpu/cpu_fp8_wquant.h"
#include "../kernels/fp8.h"

#define RUNS 5

typedef struct job {
    rs_cpu_simd simd;
    bool table;         /* the BF16 table encoder (AVX-512 VBMI) */
    rs_tensor w;        /* [out][in] bf16/f32 */
    uint8_t *q;         /* [out][in] e4m3 */
    float *s;           /* [ceil(out/128)][ceil(in/128)] f32 */
} job;

/* Bands [b0, b1) of 128 rows, each quantized as its own tensor (as model/weight_store.c does). */
static void run_bands(void *ctx, int64_t b0, int64_t b1, int tid) {
    (void)tid;
    job *j = ctx;
    const int64_t out = j->w.shape[0], in = j->w.shape[1];
    const size_t esz = rs_dtype_size(j->w.dtype);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t r0 = b * 128, rows = RS_MIN((int64_t)128, out - r0);
        rs_tensor band = {.dtype = j->w.dtype, .ndim = 2, .shape = {rows, in},
                          .data = (char *)j->w.data + (size_t)r0 * (size_t)in * esz};
        float *sb = j->s + b * rs_fp8_blocks(in);
        uint8_t *qb = j->q + (size_t)r0 * (size_t)in;
        int rc = j->simd < 0 ? rs_fp8_quantize_weight_ref(&band, qb, sb)
                             : rs_cpu_fp8_quantize_weight_ex(j->simd, j->table, &band, qb, sb);
        RS_ASSERT(rc == RS_OK);
    }
}

int main(int argc, char **argv) {
    const int64_t out = argc > 1 ? atoll(argv[1]) : 4096, in = argc > 2 ? atoll(argv[2]) : 7168;
    const char *dts = argc > 3 ? argv[3] : "bf16,f32";
    const int threads = argc > 4 ? atoi(argv[4]) : 1;
    const char *dist = argc > 5 ? argv[5] : "log";
    if (out <= 0 || in <= 0 || threads <= 0 || (strcmp(dist, "log") != 0 && strcmp(dist, "normal") != 0)) {
        fprintf(stderr, "usage: bench-quant [OUT IN [bf16,f32 [threads [log|normal]]]]\n");
        return 2;
    }
    rs_pool *pool = threads > 1 ? rs_pool_init(threads) : NULL;
    const size_t n = (size_t)out * (size_t)in, ns = (size_t)(rs_fp8_blocks(out) * rs_fp8_blocks(in));
    const rs_cpu_simd top = rs_cpu_fp8_wquant_simd();
    printf("quantize [%lld][%lld], %d thread%s, cpu level %s%s, %s weights\n", (long long)out, (long long)in,
           threads, threads > 1 ? "s" : "", rs_cpu_simd_name(top), rs_cpu_fp8_wquant_has_table() ? " + VBMI" : "",
           dist);
    for (int d = 0; d < 2; d++) {
        const rs_dtype dt = d == 0 ? RS_DTYPE_BF16 : RS_DTYPE_F32;
        const char *dname = d == 0 ? "bf16" : "f32";
        if (!strstr(dts, dname)) continue;
        const size_t esz = rs_dtype_size(dt);
        void *w = rs_xmalloc(n * esz);
        uint64_t seed = 1;
        for (size_t i = 0; i < n; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            float v;
            if (dist[0] == 'l') {
                v = (float)ldexp((double)(seed >> 40) / (double)(1u << 24) + 0.5, (int)((seed >> 20) % 24) - 16);
                if (seed & (1u << 10)) v = -v;
            } else { /* Box-Muller on two 26-bit uniforms in (0, 1) */
                const double u1 = ((double)(seed >> 38) + 0.5) * 0x1p-26, u2 = ((double)((seed >> 12) & 0x3ffffff) + 0.5) * 0x1p-26;
                v = (float)(0.02 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
            }
            if (dt == RS_DTYPE_BF16) ((uint16_t *)w)[i] = rs_f32_to_bf16(v);
            else ((float *)w)[i] = v;
        }
        uint8_t *q_ref = rs_xmalloc(n), *q = rs_xmalloc(n);
        float *s_ref = rs_xmalloc(ns * sizeof(float)), *s = rs_xmalloc(ns * sizeof(float));
        double t_ref = 0;
        /* -1: the scalar reference; AVX2; AVX-512; AVX-512 with the table encoder */
        for (int level = -1; level <= (int)top + 1; level++) {
            if (level == RS_CPU_SIMD_SCALAR) continue; /* the same code as the reference */
            const bool table = level == (int)top + 1;
            if (table && (top != RS_CPU_SIMD_AVX512 || !rs_cpu_fp8_wquant_has_table())) continue;
            job j = {.simd = table ? top : (rs_cpu_simd)level, .table = table,
                     .w = {.dtype = dt, .ndim = 2, .shape = {out, in}, .data = w},
                     .q = level < 0 ? q_ref : q, .s = level < 0 ? s_ref : s};
            double best = INFINITY;
            for (int r = 0; r < (level < 0 ? 2 : RUNS); r++) {
                double t0 = rs_now_s();
                if (pool) rs_pool_run(pool, rs_fp8_blocks(out), 1, run_bands, &j);
                else run_bands(&j, 0, rs_fp8_blocks(out), 0);
                best = fmin(best, rs_now_s() - t0);
            }
            if (level < 0) t_ref = best;
            const int same = level < 0 || (memcmp(q, q_ref, n) == 0 && memcmp(s, s_ref, ns * sizeof(float)) == 0);
            printf("  %-4s %-14s %8.2f ms  %6.2f GB/s/thread  x%.1f  %s\n", dname,
                   level < 0 ? "scalar" : table ? "avx512+table" : rs_cpu_simd_name((rs_cpu_simd)level), best * 1e3,
                   (double)(n * esz) / best / threads * 1e-9, t_ref / best,
                   level < 0 ? "(reference)" : same ? "bit-identical" : "MISMATCH");
            if (!same) return 1;
        }
        free(w), free(q_ref), free(q), free(s_ref), free(s);
    }
    rs_pool_free(pool);
    return 0;
}
