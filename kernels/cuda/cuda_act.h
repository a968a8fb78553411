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

/* 16 codes p[0..16) as 4 little-endian words; codes at or past `avail` read as 0x00 (+0, which adds
 * an exact +0 to a block sum). vec: p is 16-byte aligned and avail >= 16. */
__device__ __forceinline__ void rs_cuda_load_codes16(uint32_t wd[4], const uint8_t *p, int64_t avail, bool vec) {
    if (vec) {
        const uint4 u = __ldg((const uint4 *)p);
        wd[0] = u.x, wd[1] = u.y, wd[2] = u.z, wd[3] = u.w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) wd[i] = 0;
#pragma unroll
    for (int i = 0; i < 16; i++)
        if (i < avail) wd[i / 4] |= (uint32_t)p[i] << (8 * (i % 4));
}

/* The 4 E4M3 codes of a little-endian word as fp32 values (exact; NaN codes give NaN), through the
 * hardware's paired E4M3 -> f16 conversion (cvt.rn.f16x2.e4m3x2 on sm_89+). */
__device__ __forceinline__ void rs_cuda_e4m3x4_f32(uint32_t w, float f[4]) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16), __NV_E4M3);
    __half_raw h;
    h.x = lo.x, f[0] = __half2float(__half(h));
    h.x = lo.y, f[1] = __half2float(__half(h));
    h.x = hi.x, f[2] = __half2float(__half(h));
    h.x = hi.y, f[3] = __half2float(__half(h));
}

#endif /* RS_CUDA_ACT_H */
