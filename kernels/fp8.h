/*
 * fp8.h — the FP8 numerics both backends share: E4M3FN / E5M2 codecs and the blockwise quantizers.
 *
 * Codec. Encoding is round-to-nearest-even with __NV_SATFINITE saturation, bit-exact with CUDA's
 * `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3 / __NV_E5M2)` for all 2^32 float inputs
 * (tools/fp8_exhaustive.c checks that against the header's host path):
 *
 *   E4M3FN  bias 7,  max 448   (0x7E), no inf, NaN = S.1111.111. |x| > 448 and ±inf -> ±448.
 *   E5M2    bias 15, max 57344 (0x7B), inf = S.11111.00.  |x| >= 61440 and ±inf -> ±57344.
 *
 * Both are "round to nearest even with an unbounded exponent, then clamp to ±max", so they equal
 * ml_dtypes' (non-saturating) casts applied after clamping the input to ±max — except for NaN:
 * CUDA canonicalizes a NaN input to +NaN before converting, so every NaN (either sign, any payload)
 * encodes to 0x7F in both formats. ml_dtypes keeps the sign and, for E5M2, uses 0x7E (S.11111.10).
 * We follow CUDA, since the CUDA backend is what our codes must match bit-for-bit.
 * Signed zeros and underflow keep their sign (-1e-30 -> 0x80).
 *
 * Decoding is exact (every FP8 value is an fp32 value) and goes through a 256-entry table.
 *
 * Blockwise quantization (DeepSeek-V3 style, docs/design.md "Numerics"):
 *   weights     [out][in], one fp32 scale per 128x128 block, partial blocks at ragged edges:
 *               scale_inv = max(amax, 1e-10f) / 448.0f,  q = sat_e4m3(w / scale_inv)
 *   activations [rows][k], one fp32 scale per row and 128-wide group of k (last group ragged):
 *               s = max(amax, 1e-10f) / 448.0f,           q = sat_e4m3(x / s)
 * amax ignores NaN (fmaxf semantics, as CUDA's fmaxf). Every step is a correctly rounded fp32
 * operation, so the CUDA kernels reproduce the codes and scales bit-for-bit.
 */
#ifndef RS_FP8_H
#define RS_FP8_H

#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

#define RS_FP8_E4M3_MAX 448.0f
#define RS_FP8_E5M2_MAX 57344.0f
#define RS_FP8_NAN_CODE 0x7F    /* what the encoders return for any NaN, both formats */
#define RS_FP8_BLOCK 128        /* weight blocks are 128x128, activation groups 1x128 */
#define RS_FP8_AMAX_FLOOR 1e-10f /* scale = max(amax, floor) / 448: an all-zero block stays finite */

/* Decode tables, indexed by code. Exact; NaN codes (either sign) decode to +NaN like CUDA's
 * __nv_cvt_fp8_to_halfraw; E5M2 0x7C / 0xFC decode to ±inf. */
extern const float rs_fp8_e4m3_f32[256];
extern const float rs_fp8_e5m2_f32[256];

uint8_t rs_fp8_e4m3_from_f32(float x);
uint8_t rs_fp8_e5m2_from_f32(float x);
static inline float rs_fp8_e4m3_to_f32(uint8_t c) { return rs_fp8_e4m3_f32[c]; }
static inline float rs_fp8_e5m2_to_f32(uint8_t c) { return rs_fp8_e5m2_f32[c]; }

/* Array versions: dst[i] = convert(src[i]) for i < n. dst and src must not overlap. */
void rs_fp8_e4m3_from_f32_n(uint8_t *dst /* [n] e4m3 */, const float *src /* [n] f32 */, size_t n);
void rs_fp8_e5m2_from_f32_n(uint8_t *dst /* [n] e5m2 */, const float *src /* [n] f32 */, size_t n);
void rs_fp8_e4m3_to_f32_n(float *dst /* [n] f32 */, const uint8_t *src /* [n] e4m3 */, size_t n);
void rs_fp8_e5m2_to_f32_n(float *dst /* [n] f32 */, const uint8_t *src /* [n] e5m2 */, size_t n);

/* Number of 128-wide blocks covering n elements. */
static inline int64_t rs_fp8_blocks(int64_t n) { return (n + RS_FP8_BLOCK - 1) / RS_FP8_BLOCK; }

/* Blockwise E4M3 quantization of a linear weight. w: 2-D [out][in], dtype BF16 or F32, host memory
 * (borrowed). Writes q [out][in] e4m3 and scale_inv [ceil(out/128)][ceil(in/128)] f32, the
 * checkpoint's `weight_scale_inv` layout. Returns RS_OK, RS_EFORMAT when w holds a NaN or an
 * infinity (the codes and scales are written all the same, by the rule below: such a weight is not
 * to be served, and the caller refuses it), RS_EINVAL (not 2-D, NULL data) or RS_EUNSUPPORTED
 * (another dtype). */
int rs_fp8_quantize_weight(const rs_tensor *w, uint8_t *q /* [out][in] e4m3 */,
                           float *scale_inv /* [ceil(out/128)][ceil(in/128)] f32 */);

/* The definition of rs_fp8_quantize_weight: plain scalar C, the same contract and results. The
 * fast kernels are tested against it bit for bit. */
int rs_fp8_quantize_weight_ref(const rs_tensor *w, uint8_t *q /* [out][in] e4m3 */,
                               float *scale_inv /* [ceil(out/128)][ceil(in/128)] f32 */);

/* Optional fast kernel behind rs_fp8_quantize_weight. This file's code does not depend on any
 * backend: fp8.c references this symbol weakly and calls it when the program links a definition
 * (kernels/cpu/cpu_fp8_quant.c provides one, vectorized for the CPU it runs on). A definition gets
 * a w that passed rs_fp8_quantize_weight's checks, must produce exactly rs_fp8_quantize_weight_ref's
 * codes, scales and return value (RS_OK or RS_EFORMAT), or return RS_EUNSUPPORTED without writing
 * anything when it cannot run here (fp8.c then uses the reference). Called concurrently on
 * different tensors. */
int rs_fp8_quantize_weight_fast(const rs_tensor *w /* [out][in] bf16/f32 */, uint8_t *q /* [out][in] e4m3 */,
                                float *scale_inv /* [ceil(out/128)][ceil(in/128)] f32 */);

/* w[o][i] = e4m3(q[o][i]) * scale_inv[o/128][i/128], the product rounded to fp32. */
void rs_fp8_dequantize_weight(const uint8_t *q /* [out][in] e4m3 */,
                              const float *scale_inv /* [ceil(out/128)][ceil(in/128)] f32 */,
                              int64_t out, int64_t in, float *w /* [out][in] f32 */);

/* Dynamic per-token, per-128-group activation quantization. */
void rs_fp8_quantize_act(const float *x /* [rows][k] f32 */, int64_t rows, int64_t k,
                         uint8_t *q /* [rows][k] e4m3 */,
                         float *scale /* [rows][ceil(k/128)] f32 */);

/* x[r][j] = e4m3(q[r][j]) * scale[r][j/128], the product rounded to fp32. */
void rs_fp8_dequantize_act(const uint8_t *q /* [rows][k] e4m3 */,
                           const float *scale /* [rows][ceil(k/128)] f32 */, int64_t rows, int64_t k,
                           float *x /* [rows][k] f32 */);

#endif /* RS_FP8_H */
