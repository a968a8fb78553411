/*
 * cpu_scan.c — the first non-finite element of a tensor, 64 or 32 bytes at a time (see cpu_scan.h).
 *
 * Every dtype is the same loop over its element width w (1, 2 or 4 bytes): acc = max(acc, x & mag)
 * per lane, mag clearing the sign bit, then one horizontal test per 4 KiB block against thr, the
 * bits of the smallest non-finite magnitude (E4M3 0x7f, F16 0x7c00, BF16 0x7f80, F32 0x7f800000).
 * The tail of a block that does not fill a vector goes through the scalar test.
 */
#include "cpu_scan.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"

#define BLOCK 4096 /* bytes per horizontal test */

typedef struct scan_kind {
    int w;              /* element bytes */
    uint32_t mag, thr;  /* |bits| mask, smallest non-finite |bits| */
} scan_kind;

static bool kind_of(rs_dtype dt, scan_kind *k) {
    switch (dt) {
    case RS_DTYPE_E4M3: *k = (scan_kind){1, 0x7f, 0x7f}; return true;
    case RS_DTYPE_F16: *k = (scan_kind){2, 0x7fff, 0x7c00}; return true;
    case RS_DTYPE_BF16: *k = (scan_kind){2, 0x7fff, 0x7f80}; return true;
    case RS_DTYPE_F32: *k = (scan_kind){4, 0x7fffffffu, 0x7f800000u}; return true;
    default: return false;
    }
}

static uint32_t elem_bits(const scan_kind *k, const uint8_t *p, size_t i) {
    if (k->w == 1) return p[i];
    if (k->w == 2) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return h;
    }
    uint32_t u;
    memcpy(&u, p + 4 * i, 4);
    return u;
}

/* The first offender among elements [i0, i1), or -1. */
static int64_t find_scalar(const scan_kind *k, const uint8_t *p, size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; i++)
        if ((elem_bits(k, p, i) & k->mag) >= k->thr) return (int64_t)i;
    return -1;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RS_SCAN_X86 1

/* Elements [i0, i0 + m) with m * w a multiple of 32 bytes: whether any reaches thr. The masked
 * bits are non-negative as signed integers of their width, so AVX2's signed compares order them. */
__attribute__((target("avx2"))) static bool any_avx2(const scan_kind *k, const uint8_t *p, size_t i0, size_t m) {
    const uint8_t *b = p + i0 * (size_t)k->w, *end = b + m * (size_t)k->w;
    __m256i acc = _mm256_setzero_si256(), hit;
    if (k->w == 1) {
        const __m256i mag = _mm256_set1_epi8(0x7f);
        for (; b < end; b += 32) acc = _mm256_max_epu8(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)b), mag));
        hit = _mm256_cmpgt_epi8(acc, _mm256_set1_epi8((char)(k->thr - 1)));
    } else if (k->w == 2) {
        const __m256i mag = _mm256_set1_epi16(0x7fff);
        for (; b < end; b += 32) acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)b), mag));
        hit = _mm256_cmpgt_epi16(acc, _mm256_set1_epi16((short)(k->thr - 1)));
    } else {
        const __m256i mag = _mm256_set1_epi32(0x7fffffff);
        for (; b < end; b += 32) acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)b), mag));
        hit = _mm256_cmpgt_epi32(acc, _mm256_set1_epi32((int)(k->thr - 1)));
    }
    return !_mm256_testz_si256(hit, hit);
}

__attribute__((target("avx512f,avx512bw"))) static bool any_avx512(const scan_kind *k, const uint8_t *p, size_t i0,
                                                                   size_t m) {
    const uint8_t *b = p + i0 * (size_t)k->w, *end = b + m * (size_t)k->w;
    __m512i acc = _mm512_setzero_si512();
    if (k->w == 1) {
        const __m512i mag = _mm512_set1_epi8(0x7f);
        for (; b < end; b += 64) acc = _mm512_max_epu8(acc, _mm512_and_si512(_mm512_loadu_si512(b), mag));
        return _mm512_cmpge_epu8_mask(acc, mag) != 0;
    }
    if (k->w == 2) {
        const __m512i mag = _mm512_set1_epi16(0x7fff);
        for (; b < end; b += 64) acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512(b), mag));
        return _mm512_cmpge_epu16_mask(acc, _mm512_set1_epi16((short)k->thr)) != 0;
    }
    const __m512i mag = _mm512_set1_epi32(0x7fffffff);
    for (; b < end; b += 64) acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_loadu_si512(b), mag));
    return _mm512_cmpge_epu32_mask(acc, _mm512_set1_epi32((int)k->thr)) != 0;
}
#else
#define RS_SCAN_X86 0
#endif

int64_t rs_cpu_first_nonfinite_ex(rs_cpu_simd simd, rs_dtype dt, const void *data, size_t n) {
    scan_kind k;
    RS_ASSERT(kind_of(dt, &k));
    const uint8_t *p = data;
    const size_t per_block = BLOCK / (size_t)k.w;
    for (size_t i0 = 0; i0 < n; i0 += per_block) {
        const size_t i1 = RS_MIN(n, i0 + per_block);
#if RS_SCAN_X86
        const size_t vec = simd == RS_CPU_SIMD_AVX512 ? 64 / (size_t)k.w : 32 / (size_t)k.w;
        const size_t m = simd == RS_CPU_SIMD_SCALAR ? 0 : (i1 - i0) / vec * vec;
        if (m > 0) {
            const bool hit = simd == RS_CPU_SIMD_AVX512 ? any_avx512(&k, p, i0, m) : any_avx2(&k, p, i0, m);
            if (hit) return find_scalar(&k, p, i0, i0 + m);
        }
        const int64_t t = find_scalar(&k, p, i0 + m, i1);
#else
        (void)simd;
        const int64_t t = find_scalar(&k, p, i0, i1);
#endif
        if (t >= 0) return t;
    }
    return -1;
}

static rs_cpu_simd level;
static pthread_once_t level_once = PTHREAD_ONCE_INIT;

static void level_init(void) {
    level = RS_CPU_SIMD_SCALAR;
#if RS_SCAN_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) level = RS_CPU_SIMD_AVX512;
    else if (__builtin_cpu_supports("avx2")) level = RS_CPU_SIMD_AVX2;
#endif
    const char *e = getenv("RS_CPU_SIMD");
    if (e && strcmp(e, "scalar") == 0) level = RS_CPU_SIMD_SCALAR;
    else if (e && strcmp(e, "avx2") == 0 && level > RS_CPU_SIMD_AVX2) level = RS_CPU_SIMD_AVX2;
}

rs_cpu_simd rs_cpu_scan_simd(void) {
    pthread_once(&level_once, level_init);
    return level;
}

int64_t rs_cpu_first_nonfinite(rs_dtype dt, const void *p, size_t n) {
    return rs_cpu_first_nonfinite_ex(rs_cpu_scan_simd(), dt, p, n);
}
