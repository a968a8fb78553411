/*
 * cpu_fp8_quant.c — the W8A8 matmul's per-token activation quantization, 16 or 8 lanes at a time.
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
 * Used by the matmul at the AVX-512 (16 lanes) and AVX2 (8 lanes) levels; the scalar level calls
 * rs_fp8_quantize_act itself. The encoders live in cpu_fp8_wquant.h, shared with the weight
 * quantizer.
 *
 * This file also defines rs_fp8_quantize_weight_fast, the hook through which kernels/fp8.c reaches
 * the vectorized weight quantizer (cpu_fp8_wquant.c). fp8.c references the hook weakly, so it links
 * without the CPU backend; and since a weak reference does not pull a member out of a static
 * library, the hook sits in this object, which the CPU matmul references (rs_cpu_fp8_quantize_act):
 * any program with the CPU backend — every rolloutd binary — therefore gets the fast quantizer for
 * model load and weight updates, whichever backend serves.
 */
#include <math.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"
#include "cpu_fp8_wquant.h"
#include "cpu_internal.h"

#if RS_CPU_FP8_X86
#define RS_TARGET_FP8Q __attribute__((target("avx512f")))

static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

RS_TARGET_FP8Q static void encode_n_avx512(uint8_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes((int64_t)(n - i));
        _mm512_mask_cvtepi32_storeu_epi8(dst + i, m, rs_cpu_e4m3_encode16(_mm512_maskz_loadu_ps(m, src + i)));
    }
}

/* The AVX2 encoder (the weight quantizer's at that level), for the tests through rs_cpu_fp8_encode_n. */
__attribute__((target("avx2"))) static void encode_n_avx2(uint8_t *dst, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint32_t c[8];
        _mm256_storeu_si256((__m256i *)c, rs_cpu_e4m3_encode8(_mm256_loadu_ps(src + i)));
        for (int k = 0; k < 8; k++) dst[i + k] = (uint8_t)c[k];
    }
    for (; i < n; i++) dst[i] = rs_fp8_e4m3_from_f32(src[i]);
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
                _mm512_mask_cvtepi32_storeu_epi8(qr + j, m, rs_cpu_e4m3_encode16(y));
            }
        }
    }
}

#define RS_TARGET_FP8Q2 __attribute__((target("avx2")))

/* Lanes [0, n) of 8 (n < 8 loads only those: the rest are zeros). */
RS_TARGET_FP8Q2 static inline __m256 load8_part(const float *p, int64_t n) {
    if (n >= 8) return _mm256_loadu_ps(p);
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx));
}

/* 32 codes (the low bytes of four vectors of dwords) in order. */
RS_TARGET_FP8Q2 static inline __m256i pack32_codes(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

RS_TARGET_FP8Q2 static void quantize_avx2(const float *x, int64_t rows, int64_t k, uint8_t *q, float *scale) {
    const int64_t ng = rs_fp8_blocks(k);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < ng; g++) {
            const int64_t j0 = g * RS_FP8_BLOCK, kw = RS_MIN((int64_t)RS_FP8_BLOCK, k - j0);
            const float *xr = x + r * k + j0;
            __m256 amax = _mm256_setzero_ps();
            for (int64_t j = 0; j < kw; j += 8) /* maxps returns its second operand when one is NaN */
                amax = _mm256_max_ps(_mm256_and_ps(load8_part(xr + j, kw - j), absmask), amax);
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float s = fmaxf(_mm_cvtss_f32(h), RS_FP8_AMAX_FLOOR) / RS_FP8_E4M3_MAX;
            scale[r * ng + g] = s;
            const __m256 sv = _mm256_set1_ps(s);
            uint8_t *qr = q + r * k + j0;
            int64_t j = 0;
            for (; j + 32 <= kw; j += 32) {
                __m256i c[4];
                for (int i = 0; i < 4; i++) c[i] = rs_cpu_e4m3_encode8(_mm256_div_ps(_mm256_loadu_ps(xr + j + 8 * i), sv));
                _mm256_storeu_si256((__m256i *)(qr + j), pack32_codes(c[0], c[1], c[2], c[3]));
            }
            for (; j < kw; j += 8) {
                const __m256i c = rs_cpu_e4m3_encode8(_mm256_div_ps(load8_part(xr + j, kw - j), sv));
                _Alignas(32) uint8_t t[32];
                _mm256_store_si256((__m256i *)t, pack32_codes(c, c, c, c));
                memcpy(qr + j, t, (size_t)RS_MIN(kw - j, (int64_t)8));
            }
        }
    }
}
#endif

void rs_cpu_fp8_quantize_act(rs_cpu_simd simd, const float *x, int64_t rows, int64_t k, uint8_t *q,
                             float *scale) {
#if RS_CPU_FP8_X86
    if (simd == RS_CPU_SIMD_AVX512) {
        quantize_avx512(x, rows, k, q, scale);
        return;
    }
    if (simd == RS_CPU_SIMD_AVX2) {
        quantize_avx2(x, rows, k, q, scale);
        return;
    }
#endif
    (void)simd;
    rs_fp8_quantize_act(x, rows, k, q, scale);
}

void rs_cpu_fp8_encode_n(rs_cpu_simd simd, uint8_t *dst, const float *src, size_t n) {
#if RS_CPU_FP8_X86
    if (simd == RS_CPU_SIMD_AVX512) {
        encode_n_avx512(dst, src, n);
        return;
    }
    if (simd == RS_CPU_SIMD_AVX2) {
        encode_n_avx2(dst, src, n);
        return;
    }
#endif
    (void)simd;
    rs_fp8_e4m3_from_f32_n(dst, src, n);
}

int rs_fp8_quantize_weight_fast(const rs_tensor *w, uint8_t *q, float *scale_inv) {
    const rs_cpu_simd simd = rs_cpu_fp8_wquant_simd();
    if (simd == RS_CPU_SIMD_SCALAR) return RS_EUNSUPPORTED;
    return rs_cpu_fp8_quantize_weight(simd, w, q, scale_inv);
}
