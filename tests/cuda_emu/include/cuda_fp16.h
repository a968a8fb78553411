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
