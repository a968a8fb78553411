#pragma once
#include <stdint.h>
#include <string.h>
struct __half_raw { unsigned short x; };
struct __half2_raw { unsigned short x, y; };
struct __half {
    unsigned short __x;
    __half() {}
    __half(__half_raw r) : __x(r.x) {}
};
/* IEEE binary16 -> binary32, exact (independent of the project's codec) */
static inline float __half2float(__half h) {
    const uint32_t s = (uint32_t)(h.__x >> 15) << 31, e = (h.__x >> 10) & 0x1f, m = h.__x & 0x3ff;
    uint32_t u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else { /* subnormal: m * 2^-24 */
        float f = (float)m * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= s;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline __half __ushort_as_half(unsigned short v) { __half h; h.__x = v; return h; }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
/* float -> binary16, round to nearest even (overflow to inf, NaN kept quiet) */
static inline __half __float2half_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sg = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    __half h;
    if (a > 0x7f800000u) { h.__x = (unsigned short)(sg | 0x7e00u); return h; }
    if (a >= 0x477ff000u) { h.__x = (unsigned short)(sg | 0x7c00u); return h; } /* >= 65520: inf */
    if (a < 0x38800000u) { /* below 2^-14: the subnormal grid 2^-24, RNE */
        float v;
        memcpy(&v, &a, 4);
        const float q = v * 0x1p24f; /* exact: a power-of-two scaling of a small value */
        float r = q - (float)(int)q;
        int n = (int)q;
        if (r > 0.5f || (r == 0.5f && (n & 1))) n++;
        h.__x = (unsigned short)(sg | (unsigned)n);
        return h;
    }
    uint32_t m = a + 0xfffu + ((a >> 13) & 1u); /* RNE at bit 13, carry into the exponent */
    h.__x = (unsigned short)(sg | (((m >> 23) - 112) << 10 | ((m >> 13) & 0x3ffu)));
    return h;
}
