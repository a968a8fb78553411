/*
 * cpu_attention_simd.h — E4M3 vector helpers for attention over FP8 KV pages (cpu_attention_simd.c).
 *
 * Kept apart from cpu_internal.h's rs_cpu_vec (F32/BF16) so the FP8 KV path does not touch the
 * shared per-ISA files. Every helper decodes exactly: the value of a code is rs_fp8_e4m3_f32[code]
 * (NaN codes decode to a NaN), so the ISAs differ only in fp32 summation order, never in the
 * values summed. One table per ISA, chosen with the backend's SIMD level like rs_cpu_vec_for.
 * Each kernel decodes a code once for all the query heads of a group and keeps the partial sums
 * in registers across the head dimension (scores) or the page's rows (accum).
 */
#ifndef RS_CPU_ATTENTION_SIMD_H
#define RS_CPU_ATTENTION_SIMD_H

#include <stddef.h>
#include <stdint.h>

#include "cpu_internal.h"

/* The kernels take the rows of one page: n <= RS_KV_BLOCK rows of one KV head, `stride` bytes
 * apart, and the g query heads that share it. Scales are the caller's (cpu_attention.c folds them
 * in around these calls); g is any positive count (heads are taken 8 at a time). */
typedef struct rs_cpu_vec_e4m3 {
    /* dst[i] = value of code src[i] */
    void (*decode)(float *dst /* [n] f32 */, const uint8_t *src /* [n] e4m3 */, int n);
    /* sc[h * ld + t] = sum over i of q[h][i] * value(k[t * stride + i]), for h < g, t < n */
    void (*scores)(float *sc /* [g][ld] */, size_t ld, const float *q /* [g][hd] */, int g,
                   const uint8_t *k /* [n] rows of [hd] e4m3, stride bytes apart */, size_t stride, int n, int hd);
    /* out[h][i] += sum over t of p[h * ld + t] * value(v[t * stride + i]), for h < g, i < hd */
    void (*accum)(float *out /* [g][hd] */, const float *p /* [g][ld] */, size_t ld, int g,
                  const uint8_t *v /* [n] rows of [hd] e4m3, stride bytes apart */, size_t stride, int n, int hd);
} rs_cpu_vec_e4m3;

extern const rs_cpu_vec_e4m3 rs_cpu_vec_e4m3_scalar, rs_cpu_vec_e4m3_avx2, rs_cpu_vec_e4m3_avx512;
const rs_cpu_vec_e4m3 *rs_cpu_vec_e4m3_for(rs_cpu_simd s);

#endif /* RS_CPU_ATTENTION_SIMD_H */
