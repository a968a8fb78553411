/*
 * cpu_fp8_quant.c — the W8A8 matmul's per-token activation quantization, 16 lanes at a time.
 *
 * Bit-identical to rs_fp8_quantize_act (kernels/fp8.c), which stays the definition: the same amax
 * (the largest |x| of the 1x128 group, NaN ignored — exact in any order), the same scale
 * (fmaxf(amax, 1e-10f) / 448.0f, one fp32 division) and the same q = e4m3(x / s) with a true fp32
 * division per element. Only the E4M3 encoder is re-derived, from the fp32 bits |y|:
 *   |y| >= 2^-6 (a normal E4M3): round the 23-bit mantissa to 3 bits, to nearest even, by adding
 *     0x7ffff + (bit 20) and shifting right by 20; the exponent carries on overflow of the mantissa,
 *     and subtracting 120 << 3 rebiases it (127 - 7). Codes above 0x7e (448) saturate to 0x7e,
 *     which also maps +-inf to +-448.
 *   |y| <  2^-6: the code is m = |y| * 2^9 rounded to nearest even (the scaling is exact, also for
 *     fp32 subnormals); m = 8 is the smallest normal, 0x08, as it should be.
 *   the sign bit is copied (so -0 -> 0x80); NaN -> 0x7f whatever its sign, as CUDA does.
 * That is fp8_encode's "round with an unbounded exponent, then clamp" case by case; the tests
 * compare the two on every special value, on rounding boundaries and on random bit patterns.
 *
 * Used by the matmul at the AVX-512 level; other levels call rs_fp8_quantize_act itself.
 */
#include <math.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"
#include "cpu_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RS_FP8Q_X86 1
#define RS_TARGET_FP8Q __attribute__((target("avx512f")))

/* E4M3 codes of 16 floats (in the low byte of each dword). */
RS_TARGET_FP8Q static inline __m512i e4m3_encode16(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 normal = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x3c800000)); /* 2^-6 */
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7ffff)));
    __m512i cn = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(120 << 3));
    cn = _mm512_min_epu32(cn, _mm512_set1_epi32(0x7e));
    const __m512 sub = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(0x1p9f));
    const __m512i cs = _mm512_cvt_roundps_epi32(sub, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i c = _mm512_mask_blend_epi32(normal, cs, cn);
    c = _mm512_or_si512(c, _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(c, nan, _mm512_set1_epi32(RS_FP8_NAN_CODE));
}

static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

RS_TARGET_FP8Q static void encode_n_avx512(uint8_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes((int64_t)(n - i));
        _mm512_mask_cvtepi32_storeu_epi8(dst + i, m, e4m3_encode16(_mm512_maskz_loadu_ps(m, src + i)));
    }
}

RS_TARGET_FP8Q static void quantize_avx512(const float *x, int64_t rows, int64_t k, uint8_t *q, float *scale) {
    const int64_t ng = rs_fp8_blocks(k);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < ng; g++) {
            const int64_t j0 = g * RS_FP8_BLOCK, kw = RS_MIN((int64_t)RS_FP8_BLOCK, k - j0);
            const float *xr = x + r * k + j0;
            __m512 amax = _mm512_setzero_ps();
            for (int64_t j = 0; j < kw; j += 16) {
                __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes(kw - j), xr + j));
                amax = _mm512_max_ps(v, amax); /* maxps returns its second operand when one is NaN */
            }
            const float s = fmaxf(_mm512_reduce_max_ps(amax), RS_FP8_AMAX_FLOOR) / RS_FP8_E4M3_MAX;
            scale[r * ng + g] = s;
            const __m512 sv = _mm512_set1_ps(s);
            uint8_t *qr = q + r * k + j0;
            for (int64_t j = 0; j < kw; j += 16) {
                const __mmask16 m = lanes(kw - j);
                const __m512 y = _mm512_div_ps(_mm512_maskz_loadu_ps(m, xr + j), sv);
                _mm512_mask_cvtepi32_storeu_epi8(qr + j, m, e4m3_encode16(y));
            }
        }
    }
}
#else
#define RS_FP8Q_X86 0
#endif

void rs_cpu_fp8_quantize_act(rs_cpu_simd simd, const float *x, int64_t rows, int64_t k, uint8_t *q,
                             float *scale) {
#if RS_FP8Q_X86
    if (simd == RS_CPU_SIMD_AVX512) {
        quantize_avx512(x, rows, k, q, scale);
        return;
    }
#endif
    (void)simd;
    rs_fp8_quantize_act(x, rows, k, q, scale);
}

void rs_cpu_fp8_encode_n(rs_cpu_simd simd, uint8_t *dst, const float *src, size_t n) {
#if RS_FP8Q_X86
    if (simd == RS_CPU_SIMD_AVX512) {
        encode_n_avx512(dst, src, n);
        return;
    }
#endif
    (void)simd;
    rs_fp8_e4m3_from_f32_n(dst, src, n);
}
