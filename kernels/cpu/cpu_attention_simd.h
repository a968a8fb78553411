/*
 * cpu_attention_simd.h — the per-ISA page kernels of attention (cpu_attention_simd.c): q . K and
 * P V over the rows of one KV page, for every page format (F32, BF16, E4M3 codes).
 *
 * Every helper reads the stored values exactly: F32 as is, BF16 widened, an E4M3 code as
 * rs_fp8_e4m3_f32[code] (NaN codes read as a NaN), so the ISAs differ only in fp32 summation
 * order, never in the values summed. One table per ISA, chosen with the backend's SIMD level.
 * Each kernel reads (and widens or decodes) a KV row once for all the query heads of a group and
 * keeps the partial sums in registers across the head dimension (scores) or the page's rows
 * (accum). A row's score depends only on q and that K row, whatever page slot it sits in and
 * however many rows the page has, so a row attends to the same bits in any batch.
 */
#ifndef RS_CPU_ATTENTION_SIMD_H
#define RS_CPU_ATTENTION_SIMD_H

#include <stddef.h>
#include <stdint.h>

#include "cpu_internal.h"

/* The kernels take the rows of one page: n <= RS_KV_BLOCK rows of one KV head, `stride` elements
 * of dtype dt (F32, BF16 or E4M3) apart, and the g query heads that share it. Scales are the
 * caller's (cpu_attention.c folds E4M3 scales in around these calls); g is any positive count. */
typedef struct rs_cpu_kv_vec {
    /* dst[i] = value of E4M3 code src[i] */
    void (*decode)(float *dst /* [n] f32 */, const uint8_t *src /* [n] e4m3 */, int n);
    /* sc[h * ld + t] = sum over i of q[h][i] * k[t * stride + i], for h < g, t < n */
    void (*scores)(float *sc /* [g][ld] */, size_t ld, const float *q /* [g][hd] */, int g,
                   const void *k /* [n] rows of [hd] dt, stride elements apart */, rs_dtype dt, size_t stride,
                   int n, int hd);
    /* out[h][i] += sum over t of p[h * ld + t] * v[t * stride + i], for h < g, i < hd */
    void (*accum)(float *out /* [g][hd] */, const float *p /* [g][ld] */, size_t ld, int g,
                  const void *v /* [n] rows of [hd] dt, stride elements apart */, rs_dtype dt, size_t stride,
                  int n, int hd);
} rs_cpu_kv_vec;

extern const rs_cpu_kv_vec rs_cpu_kv_vec_scalar, rs_cpu_kv_vec_avx2, rs_cpu_kv_vec_avx512;
const rs_cpu_kv_vec *rs_cpu_kv_vec_for(rs_cpu_simd s);

#endif /* RS_CPU_ATTENTION_SIMD_H */
