/*
 * cpu_simd_avx512.c — AVX-512F kernels: the matmul tile (attention's page kernels are in
 * cpu_attention_simd.c).
 *
 * Compiled for any x86-64 target: every function carries target("avx512f,...") and is only called
 * when init found AVX-512F. A matmul tile keeps 4 weight rows x NT token rows of 16-lane fp32
 * accumulators in registers (NT <= 6: 24 accumulators, 4 weight vectors, 1 x vector of 32 zmm).
 * BF16 widens to fp32 with a zero-extend and a 16-bit shift, F16 with vcvtph2ps. The K tail (k % 16)
 * is summed in scalar after the horizontal reduction. The tile is written once per (NT, dtype)
 * through an always-inline body with constant arguments, so the compiler unrolls and keeps the
 * accumulator arrays in registers.
 */
#include "cpu_hsum.h"
#include "cpu_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T512   __attribute__((target("avx512f,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* 16 weights from element i of row p, as fp32. */
T512 INLINE __m512 load16(const void *p, int64_t i, const rs_dtype dt) {
    if (dt == RS_DTYPE_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == RS_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}

T512 INLINE void tile_body(const rs_cpu_tile *tl, const int NT, const rs_dtype dt) {
    const size_t es = dt == RS_DTYPE_F32 ? 4 : 2;
    const int64_t k = tl->k, ldx = tl->ldx;
    const float *x = tl->x;
    const char *wr[RS_CPU_NW], *pf[RS_CPU_NW];
    for (int j = 0; j < RS_CPU_NW; j++) { /* missing rows repeat the last one; their sums are dropped */
        wr[j] = (const char *)tl->w + (size_t)((j < tl->nw ? j : tl->nw - 1) * tl->ldw) * es;
        pf[j] = tl->prefetch ? (const char *)tl->prefetch + (size_t)(j * tl->ldw) * es : NULL;
    }
    __m512 acc[RS_CPU_NW][RS_CPU_NT_AVX512];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
        for (int j = 0; j < RS_CPU_NW; j++) acc[j][t] = _mm512_setzero_ps();

    const int64_t k16 = k & ~(int64_t)15;
    for (int64_t i = 0; i < k16; i += 16) {
        if (pf[0] && (i * (int64_t)es) % 64 == 0) {
#pragma GCC unroll 4
            for (int j = 0; j < RS_CPU_NW; j++) _mm_prefetch(pf[j] + (size_t)i * es, _MM_HINT_T1);
        }
        __m512 wv[RS_CPU_NW];
#pragma GCC unroll 4
        for (int j = 0; j < RS_CPU_NW; j++) wv[j] = load16(wr[j], i, dt);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            __m512 xv = _mm512_loadu_ps(x + t * ldx + i);
#pragma GCC unroll 4
            for (int j = 0; j < RS_CPU_NW; j++) acc[j][t] = _mm512_fmadd_ps(wv[j], xv, acc[j][t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        float s[4];
        _mm_storeu_ps(s, rs_hsum4_512(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
        const float *xt = x + t * ldx;
        for (int j = 0; j < tl->nw; j++) {
            for (int64_t i = k16; i < k; i++) s[j] += xt[i] * rs_cpu_elem(wr[j], dt, i);
            tl->out[t * tl->ldo + j] = tl->bias ? s[j] + tl->bias[j] : s[j];
        }
    }
}

#define DEFINE_TILE(name, DT)                                                                                \
    T512 static void name(const rs_cpu_tile *t) {                                                            \
        switch (t->nt) {                                                                                     \
        case 1: tile_body(t, 1, DT); break;                                                                  \
        case 2: tile_body(t, 2, DT); break;                                                                  \
        case 3: tile_body(t, 3, DT); break;                                                                  \
        case 4: tile_body(t, 4, DT); break;                                                                  \
        case 5: tile_body(t, 5, DT); break;                                                                  \
        default: tile_body(t, 6, DT); break;                                                                 \
        }                                                                                                    \
    }
DEFINE_TILE(tile_bf16, RS_DTYPE_BF16)
DEFINE_TILE(tile_f16, RS_DTYPE_F16)
DEFINE_TILE(tile_f32, RS_DTYPE_F32)
_Static_assert(RS_CPU_NT_AVX512 == 6, "DEFINE_TILE instantiates nt = 1..6");

rs_cpu_tile_fn rs_cpu_tile_avx512(rs_dtype dt) {
    return dt == RS_DTYPE_BF16 ? tile_bf16 : dt == RS_DTYPE_F16 ? tile_f16 : tile_f32;
}

#else /* not x86: never selected, init reports scalar */

rs_cpu_tile_fn rs_cpu_tile_avx512(rs_dtype dt) {
    (void)dt;
    return NULL;
}

#endif
