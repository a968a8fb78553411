/*
 * fp8_cuda_ref.cpp — CUDA's own FP8 conversions, host path, as a C-callable oracle.
 *
 * cuda_fp8.h is usable from a plain host C++ compiler: without __CUDACC__ its functions are
 * declared as plain `static` host functions (__CUDA_HOSTDEVICE_FP8_DECL__), the device-only `asm`
 * branch is guarded by __CUDA_ARCH__, and memcpy punning comes from <cstring>. So this file is
 * compiled with `g++ -I$(CUDA_HOME)/include` and no nvcc, no __CUDACC__ tricks, no CUDA runtime
 * library. Nothing here is reimplemented: every answer comes from NVIDIA's header, which is what
 * makes it an independent reference for kernels/fp8.c (tools/fp8_exhaustive.c compares the two).
 *
 * Host path semantics (cuda_fp8.hpp, __nv_cvt_float_to_fp8 -> __nv_cvt_double_to_fp8): a NaN
 * input is replaced by +NaN (0x7FFFFFFF) first, then the float is widened to double exactly and
 * rounded once to nearest-even. The sm_89+ device path uses `cvt.rn.satfinite.{e4m3,e5m2}x2.f32`
 * instead; confirming that the hardware agrees is a GPU check, not something this file can do.
 */
#include <cuda_fp8.h>

extern "C" {

unsigned char cuda_ref_e4m3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }

unsigned char cuda_ref_e5m2(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2); }

/* FP8 -> fp16 (exact, __nv_cvt_fp8_to_halfraw) -> fp32 (exact). */
float cuda_ref_e4m3_to_f32(unsigned char c) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
}

float cuda_ref_e5m2_to_f32(unsigned char c) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E5M2)));
}

} /* extern "C" */
