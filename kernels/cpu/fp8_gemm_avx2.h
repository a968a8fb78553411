/*
 * fp8_gemm_avx2.h — the AVX2 kernel behind RS_FP8_GEMM_ISA_AVX2_EXACT (fp8_gemm_avx2.c).
 *
 * Private to fp8_gemm.c, which dispatches to it: callers go through rs_fp8_gemm /
 * rs_fp8_gemm_with_isa (fp8_gemm.h), whose contract — bit-identical to rs_fp8_gemm_ref, whatever
 * the thread count — this kernel meets.
 */
#ifndef RS_FP8_GEMM_AVX2_H
#define RS_FP8_GEMM_AVX2_H

#include <stdint.h>

#include "../../core/pool.h"

/* 1 when this CPU (and OS) can run the kernel: AVX2 + FMA. */
int rs_fp8_gemm_avx2_supported(void);

/* The GEMM of fp8_gemm.h with rows, n, k >= 1 and row-major weights. Threads split the n output
 * features through `pool` (borrowed; NULL runs on the calling thread). Allocates nothing. Rows
 * past the whole 16-row tiles take one padded 16-row tile (lanes = rows) when there are at least
 * r2_min of them (1..17), else tiles of up to 8 rows (lanes = k): the same bits either way, and
 * the faster from a count that depends on the CPU (rs_fp8_gemm_tune). */
void rs_fp8_gemm_avx2(rs_pool *pool, float *out /* [rows][n] f32 */,
                      const uint8_t *xq /* [rows][k] e4m3 */,
                      const float *xs /* [rows][ceil(k/128)] f32 */,
                      const uint8_t *wq /* [n][k] e4m3 */,
                      const float *ws /* [ceil(n/128)][ceil(k/128)] f32 */,
                      int rows, int n, int k, int r2_min);

#endif /* RS_FP8_GEMM_AVX2_H */
