/*
 * cpu_simd_avx2.c — AVX2 + FMA + F16C kernels: the matmul tile (attention's page kernels are in
 * cpu_attention_simd.c).
 *
 * The same shapes as cpu_simd_avx512.c on 8 lanes and 16 registers: a tile is 4 weight rows x
 * NT <= 3 token rows (12 accumulators, the 3 x vectors, 1 weight vector at a time). Every output
 * is computed in the same order whatever NT (lane l sums k = l mod 8 in order, then a fixed tree),
 * so a row's result does not depend on the batch it is in. Every function carries
 * target("avx2,fma,f16c") and is only called when init found those features.
 */
#include "cpu_hsum.h"
#include "cpu_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T256   __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* 8 weights from element i of row p, as fp32. */
T256 INLINE __m256 load8(const void *p, int64_t i, const rs_dtype dt) {
    if (dt == RS_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == RS_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

T256 INLINE void tile_body(const rs_cpu_tile *tl, const int NT, const rs_dtype dt) {
    const size_t es = dt == RS_DTYPE_F32 ? 4 : 2;
    const int64_t k = tl->k, ldx = tl->ldx;
    const float *x = tl->x;
    const char *wr[RS_CPU_NW], *pf[RS_CPU_NW];
    for (int j = 0; j < RS_CPU_NW; j++) { /* missing rows repeat the last one; their sums are dropped */
        wr[j] = (const char *)tl->w + (size_t)((j < tl->nw ? j : tl->nw - 1) * tl->ldw) * es;
        pf[j] = tl->prefetch ? (const char *)tl->prefetch + (size_t)(j * tl->ldw) * es : NULL;
    }
    __m256 acc[RS_CPU_NW][RS_CPU_NT_AVX2];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
        for (int j = 0; j < RS_CPU_NW; j++) acc[j][t] = _mm256_setzero_ps();

    const int64_t k8 = k & ~(int64_t)7;
    for (int64_t i = 0; i < k8; i += 8) {
        if (pf[0] && (i * (int64_t)es) % 64 == 0) {
#pragma GCC unroll 4
            for (int j = 0; j < RS_CPU_NW; j++) _mm_prefetch(pf[j] + (size_t)i * es, _MM_HINT_T1);
        }
        /* the tile's x vectors in registers, one weight vector at a time: NT + 1 + 4 NT registers */
        __m256 xv[RS_CPU_NT_AVX2];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) xv[t] = _mm256_loadu_ps(x + t * ldx + i);
#pragma GCC unroll 4
        for (int j = 0; j < RS_CPU_NW; j++) {
            const __m256 wv = load8(wr[j], i, dt);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) acc[j][t] = _mm256_fmadd_ps(wv, xv[t], acc[j][t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        float s[4];
        _mm_storeu_ps(s, rs_hsum4_256(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
        const float *xt = x + t * ldx;
        for (int j = 0; j < tl->nw; j++) {
            for (int64_t i = k8; i < k; i++) s[j] += xt[i] * rs_cpu_elem(wr[j], dt, i);
            tl->out[t * tl->ldo + j] = tl->bias ? s[j] + tl->bias[j] : s[j];
        }
    }
}

#define DEFINE_TILE(name, DT)                                                                                \
    T256 static void name(const rs_cpu_tile *t) {                                                            \
        switch (t->nt) {                                                                                     \
        case 1: tile_body(t, 1, DT); break;                                                                  \
        case 2: tile_body(t, 2, DT); break;                                                                  \
        default: tile_body(t, 3, DT); break;                                                                 \
        }                                                                                                    \
    }
DEFINE_TILE(tile_bf16, RS_DTYPE_BF16)
DEFINE_TILE(tile_f16, RS_DTYPE_F16)
DEFINE_TILE(tile_f32, RS_DTYPE_F32)
_Static_assert(RS_CPU_NT_AVX2 == 3, "DEFINE_TILE instantiates nt = 1..3");

rs_cpu_tile_fn rs_cpu_tile_avx2(rs_dtype dt) {
    return dt == RS_DTYPE_BF16 ? tile_bf16 : dt == RS_DTYPE_F16 ? tile_f16 : tile_f32;
}

#else /* not x86: never selected, init reports scalar */

rs_cpu_tile_fn rs_cpu_tile_avx2(rs_dtype dt) {
    (void)dt;
    return NULL;
}

#endif
