#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <cuda_fp16.h>
typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
extern "C" uint8_t rs_fp8_e4m3_from_f32(float);
extern "C" const float rs_fp8_e4m3_f32[256];
/* The project's CPU encoder stands in for the hardware one (fp8.h claims they agree on all 2^32
 * floats except NaN; NaN -> 0x7F here as there). Emulation cannot check that claim. */
static inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t s, __nv_fp8_interpretation_t i) {
    if (s != __NV_SATFINITE || i != __NV_E4M3) abort();
    return rs_fp8_e4m3_from_f32(x);
}
/* e4m3 -> binary16 bits, via the exact fp32 value (every E4M3 value is a normal f16 or zero) */
static inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t c, __nv_fp8_interpretation_t i) {
    if (i != __NV_E4M3) abort();
    __half_raw r;
    const float f = rs_fp8_e4m3_f32[c];
    uint32_t u;
    memcpy(&u, &f, 4);
    const unsigned s = (u >> 16) & 0x8000u;
    if (isnan(f)) r.x = (unsigned short)(s | 0x7fffu);
    else if ((u & 0x7fffffffu) == 0) r.x = (unsigned short)s;
    else {
        const int e = (int)((u >> 23) & 0xff) - 127;
        if (e < -14 || e > 15 || (u & 0x1fffu)) abort();
        r.x = (unsigned short)(s | (unsigned)(e + 15) << 10 | ((u >> 13) & 0x3ffu));
    }
    return r;
}
typedef unsigned short __nv_fp8x2_storage_t;
/* two codes (low byte first) -> two binary16 values, as the paired hardware conversion */
static inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t c, __nv_fp8_interpretation_t i) {
    __half2_raw r;
    r.x = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(c & 0xff), i).x;
    r.y = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(c >> 8), i).x;
    return r;
}
