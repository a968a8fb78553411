/*
 * cpu_hsum.h — the horizontal sums the x86 tiles share (the matmul tiles of cpu_simd_*.c and the
 * attention page kernels of cpu_attention_simd.c): four vectors summed into the four lanes of one
 * 128-bit vector by one fixed tree, the same for each of the four, so a sum does not depend on
 * which of the four slots it takes. Each function carries its target attribute and is only
 * called from code compiled for that target.
 */
#ifndef RS_CPU_HSUM_H
#define RS_CPU_HSUM_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* Sums of four 8-lane vectors: lane i = sum of the lanes of a_i. */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline)) __m128
rs_hsum4_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The same for 16-lane vectors: each one's halves added, then rs_hsum4_256's tree. */
__attribute__((target("avx512f,avx2,fma,f16c"))) static inline __attribute__((always_inline)) __m128
rs_hsum4_512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
#define RS_HSUM_HALF(a)                                                                                      \
    _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)))
    return rs_hsum4_256(RS_HSUM_HALF(a0), RS_HSUM_HALF(a1), RS_HSUM_HALF(a2), RS_HSUM_HALF(a3));
#undef RS_HSUM_HALF
}

#endif
#endif /* RS_CPU_HSUM_H */
