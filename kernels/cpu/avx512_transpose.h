/*
 * avx512_transpose.h — the 16 x 16 dword transpose shared by the AVX-512 FP8 code
 * (fp8_gemm_vnni.c, fp8_layout.c). Include only from x86-64 GCC/Clang code; the function inlines
 * into any caller whose target includes avx512f.
 */
#ifndef RS_AVX512_TRANSPOSE_H
#define RS_AVX512_TRANSPOSE_H

#include <immintrin.h>

/* Transposes a 16 x 16 matrix of dwords held as 16 row vectors, in place. */
static inline __attribute__((always_inline, target("avx512f"))) void rs_transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
#pragma GCC unroll 16
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 4; i++) { /* u[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3 */
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < 4; c++) {
        __m512i s0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        __m512i s2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        __m512i s3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
    }
}

#endif /* RS_AVX512_TRANSPOSE_H */
