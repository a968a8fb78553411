/*
 * cuda_act.h — device helpers that every kernel writing an activation form shares, so the FP8
 * quantizer (cuda_matmul.cu), the fused producers (rmsnorm and swiglu in cuda_ops.cu) and the
 * standalone conversions (cuda_act.cu) give the same bits: the E4M3 encoder, BF16 rounding, and
 * the quantization of one 1x128 group by one warp.
 */
#ifndef RS_CUDA_ACT_H
#define RS_CUDA_ACT_H

#include <cuda_fp8.h>

#include "cuda_internal.h"
extern "C" {
#include "../fp8.h"
}

#define RS_CUDA_FULL_MASK 0xffffffffu

/* The CPU's rs_fp8_e4m3_from_f32: round to nearest even, saturating to +-448, any NaN -> 0x7F. */
__device__ __forceinline__ uint32_t rs_cuda_e4m3_encode(float v) {
    if (isnan(v)) return 0x7fu;
    return (uint32_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

/* rs_f32_to_bf16 (kernels/tensor.c), step for step: round to nearest even, NaN quieted with its
 * sign and payload (__float2bfloat16_rn would canonicalize it). */
__device__ __forceinline__ uint16_t rs_cuda_bf16_bits(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One 1x128 group quantized by a whole warp, rs_fp8_quantize_act's arithmetic: lane l holds v[i],
 * element l + 32 i of the group (0 past its length len: |0| leaves the amax alone); amax = fmaxf
 * over |v| (NaN skipped; max is order-free, so the shuffle tree gives the CPU's value), s =
 * max(amax, 1e-10) / 448 and q = e4m3(v / s), both divisions correctly rounded. Writes the codes
 * q[l + 32 i] for l + 32 i < len and, from lane 0, *s_out. */
__device__ __forceinline__ void rs_cuda_group_fp8(const float v[RS_FP8_BLOCK / 32], int lane, int len,
                                                  uint8_t *q /* [len] */, float *s_out) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < RS_FP8_BLOCK / 32; i++) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(RS_CUDA_FULL_MASK, amax, off));
    const float s = __fdiv_rn(fmaxf(amax, RS_FP8_AMAX_FLOOR), RS_FP8_E4M3_MAX);
    if (lane == 0) *s_out = s;
#pragma unroll
    for (int i = 0; i < RS_FP8_BLOCK / 32; i++) {
        const int j = lane + 32 * i;
        if (j < len) q[j] = (uint8_t)rs_cuda_e4m3_encode(__fdiv_rn(v[i], s));
    }
}

#endif /* RS_CUDA_ACT_H */
