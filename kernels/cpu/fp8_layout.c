/*
 * fp8_layout.c — packing row-major E4M3 codes into RS_LAYOUT_FP8_PAIRS32 (fp8_layout.h), and back.
 *
 * The AVX-512 pack takes a group 32 pairs (64 bytes of each row) at a time: the rows of even slots
 * and of odd slots word-interleaved (vpunpck[lh]wd: dword lane 4L + j of the result holds pair
 * 8L + j, or 8L + 4 + j for the high unpack), then two 16 x 16 dword transposes turn "one register
 * per slot pair" into "one register per code pair". About 7 instructions per 64 bytes, so packing
 * costs a push little next to its copies.
 */
#include "fp8_layout.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

static void pack_group_c(uint8_t *dst, const uint8_t *src, int64_t k) {
    for (int64_t p = 0; p < k / 2; p++)
        for (int s = 0; s < RS_FP8_PAIRS32_ROWS; s++) {
            const uint8_t *r = src + rs_fp8_pairs32_row(s) * k + 2 * p;
            dst[64 * p + 2 * s] = r[0];
            dst[64 * p + 2 * s + 1] = r[1];
        }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "avx512_transpose.h"

#define RS_TARGET_PACK __attribute__((target("avx512f,avx512bw")))

static int have_avx512bw(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

/* nt: dst is 64-byte aligned and written with streaming stores (the packed weights are not read
 * again soon, and a push writes hundreds of MB of them: no read for ownership, no cache pollution). */
RS_TARGET_PACK static void pack_group_avx512(uint8_t *dst, const uint8_t *src, int64_t k, bool nt) {
    const int64_t np = k / 2;
    for (int64_t p0 = 0; p0 < np; p0 += 32) {
        const int64_t cnt = np - p0 < 32 ? np - p0 : 32; /* pairs in this step */
        const __mmask64 m = cnt == 32 ? ~(__mmask64)0 : (((__mmask64)1 << (2 * cnt)) - 1);
        __m512i lo[16], hi[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const __m512i a = _mm512_maskz_loadu_epi8(m, src + rs_fp8_pairs32_row(2 * i) * k + 2 * p0);
            const __m512i b = _mm512_maskz_loadu_epi8(m, src + rs_fp8_pairs32_row(2 * i + 1) * k + 2 * p0);
            lo[i] = _mm512_unpacklo_epi16(a, b);
            hi[i] = _mm512_unpackhi_epi16(a, b);
        }
        rs_transpose16_epi32(lo);
        rs_transpose16_epi32(hi);
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) {
            const int64_t pl = p0 + 8 * (c / 4) + c % 4, ph = pl + 4;
            if (nt) {
                if (pl < np) _mm512_stream_si512((void *)(dst + 64 * pl), lo[c]);
                if (ph < np) _mm512_stream_si512((void *)(dst + 64 * ph), hi[c]);
            } else {
                if (pl < np) _mm512_storeu_si512(dst + 64 * pl, lo[c]);
                if (ph < np) _mm512_storeu_si512(dst + 64 * ph, hi[c]);
            }
        }
    }
}
#endif

void rs_fp8_pairs32_pack(uint8_t *dst, const uint8_t *src, int64_t n, int64_t k) {
    const int64_t groups = n / RS_FP8_PAIRS32_ROWS, gbytes = RS_FP8_PAIRS32_ROWS * k;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (have_avx512bw()) {
        const bool nt = (uintptr_t)dst % 64 == 0; /* then every group is: gbytes = 32 k, k even */
        for (int64_t g = 0; g < groups; g++) pack_group_avx512(dst + g * gbytes, src + g * gbytes, k, nt);
        if (nt) _mm_sfence(); /* streaming stores are weakly ordered: visible before whoever runs next */
    } else
#endif
        for (int64_t g = 0; g < groups; g++) pack_group_c(dst + g * gbytes, src + g * gbytes, k);
    memcpy(dst + groups * gbytes, src + groups * gbytes, (size_t)((n - groups * RS_FP8_PAIRS32_ROWS) * k));
}

void rs_fp8_pairs32_unpack(uint8_t *dst, const uint8_t *src, int64_t n, int64_t k) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < k; c++) dst[r * k + c] = rs_fp8_pairs32_at(src, n, k, r, c);
}
