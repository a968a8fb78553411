/*
 * cuda_mma.h — the warp-level tensor-core pieces the attention kernels (cuda_attention_tc.cu's
 * prefill, cuda_attention.cu's decode) and the GEMVs (cuda_matmul_fast.cu) share: mma.sync m16n8k16
 * and m16n8k32 (E4M3) with fp32 accumulators, operand packing, and movmatrix's 8x8 transpose.
 * Fragment layouts are the PTX ISA's, with g = lane / 4 and t = lane % 4: A's registers hold rows g,
 * g+8 and columns 2t, 2t+1 (+8 for registers 2 and 3), B's rows (k) 2t, 2t+1 (+8) of column g, C's
 * rows g, g+8 and columns 2t, 2t+1; a movmatrix operand holds row g, columns 2t, 2t+1 of an 8x8
 * matrix of 16-bit elements. The CPU emulation implements the same layouts
 * (tests/cuda_emu/include/cuda_runtime.h).
 */
#ifndef RS_CUDA_MMA_H
#define RS_CUDA_MMA_H

#include <cuda_fp16.h>

#include "cuda_act.h"

/* d += A B on the warp: mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32. */
template <bool F16>
__device__ __forceinline__ void mma16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__)
    if (F16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(RS_CUDA_EMU)
    emu_mma_16816(d, a, b, F16);
#endif
}

/* d += A B on the warp: mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 (sm_89+), one E4M3 code
 * per byte, lowest k in the low byte: a[0] = A[g][4t .. 4t+3], a[1] = A[g+8][4t ..], a[2] =
 * A[g][16+4t ..], a[3] = A[g+8][16+4t ..]; b[0] = B[4t .. 4t+3][g], b[1] = B[16+4t ..][g]; d as for
 * m16n8k16. */
__device__ __forceinline__ void mma16832_e4m3(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__)
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(RS_CUDA_EMU)
    emu_mma_16832_e4m3(d, a, b);
#endif
}

/* One fp32 value as the operand type's bits: F16 (round to nearest even), or BF16. */
template <bool F16>
__device__ __forceinline__ uint32_t op_bits(float f) {
    if (F16) return (uint32_t)__half_as_ushort(__float2half_rn(f));
    return (uint32_t)rs_cuda_bf16_bits(f);
}

/* Two fp32 values as an operand pair, lo in the low half. */
template <bool F16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    return op_bits<F16>(lo) | (op_bits<F16>(hi) << 16);
}

/* The 8x8 matrix of 16-bit elements that the warp holds (row g, columns 2t, 2t+1 in this lane's
 * word, low half first), transposed: this lane gets row g of the transpose, i.e. elements (2t, g)
 * and (2t + 1, g) of the original. */
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
#if defined(__CUDA_ARCH__)
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
#elif defined(RS_CUDA_EMU)
    return emu_movmatrix_trans(x);
#else
    return x;
#endif
}

#endif /* RS_CUDA_MMA_H */
