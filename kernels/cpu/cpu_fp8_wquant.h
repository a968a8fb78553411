/*
 * cpu_fp8_wquant.h — the CPU's vector E4M3 encoders and its fast weight quantizer.
 *
 * The encoders are shared by the activation quantizer (cpu_fp8_quant.c) and the weight quantizer
 * (cpu_fp8_wquant.c); they are static inline so that each quantizer's loop keeps them in registers.
 * Both are bit-identical to rs_fp8_e4m3_from_f32 (kernels/fp8.c) for every fp32 input: the
 * derivation is in cpu_fp8_quant.c's header comment, and the AVX2 encoder is the same computation
 * eight lanes wide (all 2^32 inputs compared once by hand; the unit tests sample them).
 *
 * The weight quantizer is rs_fp8_quantize_weight_ref, bit for bit, 16 (AVX-512F) or 8 (AVX2) lanes
 * at a time. kernels/fp8.c reaches it through rs_fp8_quantize_weight_fast (fp8.h), defined in
 * cpu_fp8_quant.c; see there why.
 */
#ifndef RS_CPU_FP8_WQUANT_H
#define RS_CPU_FP8_WQUANT_H

#include <stdbool.h>
#include <stdint.h>

#include "../tensor.h"
#include "cpu_internal.h"

/* rs_fp8_quantize_weight_ref, bit for bit, at SIMD level `simd` (scalar: the reference itself).
 * w: validated 2-D BF16/F32 [out][in] (borrowed). Single-threaded; callers split by 128-row bands. */
int rs_cpu_fp8_quantize_weight(rs_cpu_simd simd, const rs_tensor *w /* [out][in] bf16/f32 */,
                               uint8_t *q /* [out][in] e4m3 */,
                               float *scale_inv /* [ceil(out/128)][ceil(in/128)] f32 */);

/* The same with the BF16 table encoder (cpu_fp8_wquant.c) on or off at RS_CPU_SIMD_AVX512; table
 * requires rs_cpu_fp8_wquant_has_table(). rs_cpu_fp8_quantize_weight uses it where the CPU has
 * it; tests run both. */
int rs_cpu_fp8_quantize_weight_ex(rs_cpu_simd simd, bool table, const rs_tensor *w, uint8_t *q, float *scale_inv);

/* Whether this CPU runs the table encoder: AVX-512 BW and VBMI, at the detected level below. */
bool rs_cpu_fp8_wquant_has_table(void);

/* The level the weight quantizer uses without a backend context: what the CPU supports (AVX-512F,
 * else AVX2, else scalar), capped by RS_CPU_SIMD=scalar|avx2|avx512 like the backend's. Detected
 * once; safe to call from any thread. */
rs_cpu_simd rs_cpu_fp8_wquant_simd(void);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RS_CPU_FP8_X86 1

/* E4M3 codes of 16 floats, in the low byte of each dword. */
__attribute__((target("avx512f"))) static inline __m512i rs_cpu_e4m3_encode16(__m512 y) {
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
    return _mm512_mask_mov_epi32(c, nan, _mm512_set1_epi32(0x7f /* RS_FP8_NAN_CODE */));
}

/* The same for 8 floats. |y|'s bits a are < 2^31, so signed compares order them as unsigned ones;
 * the subnormal branch rounds with an explicit round-to-nearest-even, independent of MXCSR. */
__attribute__((target("avx2"))) static inline __m256i rs_cpu_e4m3_encode8(__m256 y) {
    const __m256i u = _mm256_castps_si256(y);
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x3c800000 - 1)); /* >= 2^-6 */
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(a, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7ffff)));
    __m256i cn = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
    cn = _mm256_min_epu32(cn, _mm256_set1_epi32(0x7e));
    const __m256 sub = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(0x1p9f));
    const __m256i cs = _mm256_cvttps_epi32(_mm256_round_ps(sub, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i c = _mm256_blendv_epi8(cs, cn, normal);
    c = _mm256_or_si256(c, _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(c, _mm256_set1_epi32(0x7f /* RS_FP8_NAN_CODE */), nan);
}
#else
#define RS_CPU_FP8_X86 0
#endif

#endif /* RS_CPU_FP8_WQUANT_H */
