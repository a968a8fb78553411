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

/* The fast numerics over BF16 pages (rs_cpu_fast_bf16: AVX-512 with AVX512_BF16), with q and p
 * already rounded to BF16: scores as above, each a vdpbf16ps sum over 32-element chunks (the tail
 * zero-masked) reduced like the fp32 kernel's; accum adds to out[h][i] the page's sum of
 * p[h][t] * v[t][i], taken two rows at a time (a lone last row pairs with a zero), lanes past the
 * last 32 summed in fp32 in row order. Each depends only on its own q or p row and the page, so
 * batch invariance holds as for the kernels above. */
void rs_cpu_scores_bf16_dot(float *sc /* [g][ld] */, size_t ld, const uint16_t *q /* [g][hd] bf16 */, int g,
                            const uint16_t *k /* [n] rows, stride elements apart */, size_t stride, int n, int hd);
void rs_cpu_accum_bf16_dot(float *out /* [g][hd] */, const uint16_t *p /* [g][ld] bf16 */, size_t ld, int g,
                           const uint16_t *v /* [n] rows, stride elements apart */, size_t stride, int n, int hd);

extern const rs_cpu_kv_vec rs_cpu_kv_vec_scalar, rs_cpu_kv_vec_avx2, rs_cpu_kv_vec_avx512;
const rs_cpu_kv_vec *rs_cpu_kv_vec_for(rs_cpu_simd s);

#endif /* RS_CPU_ATTENTION_SIMD_H */
