/*
 * cpu_fp8_wquant.c — blockwise E4M3 weight quantization, 16 (AVX-512F) or 8 (AVX2) lanes at a time,
 * or 64 for BF16 with AVX-512 VBMI.
 *
 * Bit-identical to rs_fp8_quantize_weight_ref (kernels/fp8.c), which stays the definition, for
 * every input: each step is the same correctly rounded fp32 operation, only vectorized.
 *   amax      the largest |w| of the 128x128 block with NaN ignored. It is taken as an unsigned
 *             maximum of the bits without the sign (vpmaxud, as cheap as vmaxps): for finite
 *             values that orders them as their magnitudes, and a maximum is exact in any order,
 *             so its bits are the reference's amax; above every finite value come inf (0x7f800000)
 *             and then the NaNs, so the same maximum says, for free, whether the block holds a
 *             non-finite value (the kernel then returns RS_EFORMAT, as the reference does). A
 *             block with a NaN has its NaN-ignoring amax taken again, in scalar code, so that even
 *             its codes stay the reference's. Lanes past a ragged edge are loaded as +0, which
 *             cannot change a maximum >= 0.
 *   scale_inv fmaxf(amax, 1e-10f) / 448.0f, computed once per block in scalar code as fp8.c does.
 *   q         e4m3(w / scale_inv) with a true fp32 division per element (vdivps is correctly
 *             rounded, like the scalar divss) and the shared encoders of cpu_fp8_wquant.h.
 * BF16 is widened exactly (bits << 16), as rs_bf16_to_f32.
 *
 * BF16 on a CPU with AVX-512 VBMI takes the table encoder below instead (integer amax, codes by
 * table lookup, the fp32 path only for the lanes it cannot do): also bit-identical, 1.6x faster on
 * a matrix larger than the caches and 2.4x on one that fits (bench-quant ... normal).
 *
 * A block is handled whole — amax over its rows, then the codes — so its 32 KiB (BF16) are still
 * in L1 for the second pass; the input is read from memory once. Ragged edges: partial rows of a
 * block go through a zero-padded copy (AVX-512F has no masked 16-bit load, AVX2 none at all), so
 * nothing past the tensor is read.
 */
#include "cpu_fp8_wquant.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"

#if RS_CPU_FP8_X86

/* ---- AVX-512F ---- */

#define RS_T512 __attribute__((target("avx512f")))
#define RS_T256 __attribute__((target("avx2")))
#define RS_INLINE static inline __attribute__((always_inline))

/* 16 elements from row[i..i+16) as fp32. */
RS_T512 RS_INLINE __m512 ld16(const void *row, int bf16, int64_t i) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + i);
}

/* n < 16 elements from row[i..i+n), zeros above. */
RS_T512 RS_INLINE __m512 ld16_part(const void *row, int bf16, int64_t i, int64_t n) {
    if (bf16) {
        uint16_t t[16] = {0};
        memcpy(t, (const uint16_t *)row + i, (size_t)n * sizeof *t);
        return ld16(t, 1, 0);
    }
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), (const float *)row + i);
}

/* The reference's amax of a block (|w| maxima, NaN ignored), for the rare block with a NaN. */
static float block_amax_scalar(const void *w, int bf16, int64_t ld, int64_t rows, int64_t cw) {
    float amax = 0.0f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cw; j++) {
            const size_t i = (size_t)(r * ld + j);
            float v;
            if (bf16) {
                uint16_t h;
                memcpy(&h, (const uint16_t *)w + i, 2);
                v = rs_bf16_to_f32(h);
            } else {
                memcpy(&v, (const float *)w + i, 4);
            }
            const float a = fabsf(v);
            amax = a > amax ? a : amax;
        }
    return amax;
}

/* The amax from the largest |bits| of a block; *bad when the block holds a NaN or an infinity. */
static float amax_of_bits(uint32_t bits, const void *w, int bf16, int64_t ld, int64_t rows, int64_t cw, bool *bad) {
    if (bits >= 0x7f800000u) *bad = true;
    if (bits > 0x7f800000u) return block_amax_scalar(w, bf16, ld, rows, cw); /* a NaN: the maximum skips it */
    float amax;
    memcpy(&amax, &bits, sizeof amax);
    return amax;
}

#define ABS_BITS512(v) _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff))

/* One block: rows x cw elements (cw <= 128) of w with row stride ld; codes with row stride ld.
 * Returns whether the block holds a NaN or an infinity. */
RS_T512 RS_INLINE bool block_avx512(const void *w, int bf16, int64_t ld, int64_t rows, int64_t cw, uint8_t *q,
                                    float *scale) {
    const size_t esz = bf16 ? 2 : 4;
    __m512i acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm512_setzero_si512();
    for (int64_t r = 0; r < rows; r++) {
        const void *row = (const char *)w + (size_t)(r * ld) * esz;
        if (cw == RS_FP8_BLOCK) {
            for (int c = 0; c < 8; c++) acc[c] = _mm512_max_epu32(ABS_BITS512(ld16(row, bf16, 16 * c)), acc[c]);
        } else {
            for (int64_t j = 0; j < cw; j += 16) {
                const __m512 v = cw - j >= 16 ? ld16(row, bf16, j) : ld16_part(row, bf16, j, cw - j);
                acc[j / 16] = _mm512_max_epu32(ABS_BITS512(v), acc[j / 16]);
            }
        }
    }
    for (int c = 1; c < 8; c++) acc[0] = _mm512_max_epu32(acc[c], acc[0]);
    bool bad = false;
    const float amax = amax_of_bits((uint32_t)_mm512_reduce_max_epu32(acc[0]), w, bf16, ld, rows, cw, &bad);
    const float s = fmaxf(amax, RS_FP8_AMAX_FLOOR) / RS_FP8_E4M3_MAX;
    *scale = s;
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t r = 0; r < rows; r++) {
        const void *row = (const char *)w + (size_t)(r * ld) * esz;
        uint8_t *qr = q + r * ld;
        if (cw == RS_FP8_BLOCK) {
            for (int c = 0; c < 8; c++)
                _mm_storeu_si128((__m128i *)(qr + 16 * c),
                                 _mm512_cvtepi32_epi8(rs_cpu_e4m3_encode16(_mm512_div_ps(ld16(row, bf16, 16 * c), sv))));
        } else {
            for (int64_t j = 0; j < cw; j += 16) {
                const int64_t n = RS_MIN(cw - j, 16);
                const __m512 v = n == 16 ? ld16(row, bf16, j) : ld16_part(row, bf16, j, n);
                _mm512_mask_cvtepi32_storeu_epi8(qr + j, (__mmask16)((1u << n) - 1u),
                                                 rs_cpu_e4m3_encode16(_mm512_div_ps(v, sv)));
            }
        }
    }
    return bad;
}

/* Row-major band: the same amax and codes as block_avx512 over every block of the band (a maximum
 * does not depend on the order it is taken in, and each code depends on its element and its
 * block's scale only), but the band is read row by row, front to back: amax over each row's
 * blocks into per-block vectors (L1), then the codes. Sequential reads let the hardware prefetch
 * and touch each 4 KiB page once per pass, so the band can be quantized where it lies (a weight
 * push reads it straight out of the trainer's shared memory) rather than copied first; the second
 * pass finds the band in L2 (128 rows x in: 256 KiB at in = 1024 in BF16). */
#define RS_WQ_ROWMAJOR_MAX_BLOCKS 128 /* in <= 16384: the per-block maxima stay on the stack (64 KiB) */

RS_T512 static bool band_avx512_rows(const void *w, int bf16, int64_t rows, int64_t in, uint8_t *q, float *srow) {
    const size_t esz = bf16 ? 2 : 4;
    const int64_t nfull = in / RS_FP8_BLOCK, tail = in - nfull * RS_FP8_BLOCK, nb = nfull + (tail > 0);
    /* acc[8c + k]: the largest |bits| of lanes 16k..16k+15 of block column c */
    __m512i acc[8 * RS_WQ_ROWMAJOR_MAX_BLOCKS];
    for (int64_t c = 0; c < 8 * nb; c++) acc[c] = _mm512_setzero_si512();
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)w + (size_t)(r * in) * esz;
        for (int64_t c = 0; c < nfull; c++)
            for (int k = 0; k < 8; k++)
                acc[8 * c + k] = _mm512_max_epu32(ABS_BITS512(ld16(row, bf16, c * RS_FP8_BLOCK + 16 * k)), acc[8 * c + k]);
        for (int64_t j = 0; j < tail; j += 16) {
            const int64_t i = nfull * RS_FP8_BLOCK + j;
            const __m512 v = tail - j >= 16 ? ld16(row, bf16, i) : ld16_part(row, bf16, i, tail - j);
            acc[8 * nfull + j / 16] = _mm512_max_epu32(ABS_BITS512(v), acc[8 * nfull + j / 16]);
        }
    }
    for (int64_t c = 0; c < nb; c++)
        for (int k = 1; k < 8; k++) acc[8 * c] = _mm512_max_epu32(acc[8 * c + k], acc[8 * c]);
    __m512 sv[RS_WQ_ROWMAJOR_MAX_BLOCKS];
    bool bad = false;
    for (int64_t c = 0; c < nb; c++) {
        const float amax = amax_of_bits((uint32_t)_mm512_reduce_max_epu32(acc[8 * c]), (const char *)w + (size_t)(c * RS_FP8_BLOCK) * esz,
                                        bf16, in, rows, RS_MIN((int64_t)RS_FP8_BLOCK, in - c * RS_FP8_BLOCK), &bad);
        const float s = fmaxf(amax, RS_FP8_AMAX_FLOOR) / RS_FP8_E4M3_MAX;
        srow[c] = s;
        sv[c] = _mm512_set1_ps(s);
    }
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)w + (size_t)(r * in) * esz;
        uint8_t *qr = q + r * in;
        for (int64_t c = 0; c < nfull; c++) {
            const int64_t c0 = c * RS_FP8_BLOCK;
            for (int k = 0; k < 8; k++)
                _mm_storeu_si128((__m128i *)(qr + c0 + 16 * k),
                                 _mm512_cvtepi32_epi8(rs_cpu_e4m3_encode16(_mm512_div_ps(ld16(row, bf16, c0 + 16 * k), sv[c]))));
        }
        for (int64_t j = 0; j < tail; j += 16) {
            const int64_t i = nfull * RS_FP8_BLOCK + j, n = RS_MIN(tail - j, 16);
            const __m512 v = n == 16 ? ld16(row, bf16, i) : ld16_part(row, bf16, i, n);
            _mm512_mask_cvtepi32_storeu_epi8(qr + i, (__mmask16)((1u << n) - 1u),
                                             rs_cpu_e4m3_encode16(_mm512_div_ps(v, sv[nfull])));
        }
    }
    return bad;
}

/* ---- AVX-512 VBMI, BF16: the table encoder ----
 *
 * A BF16 weight has 8 significant bits, and a block divides all of its weights by one scale s, so
 * the E4M3 code of x / s is mostly a table lookup on x's 7 mantissa bits plus an add of its
 * exponent. With x = mx 2^(ex-127), mx = 1.m (m: 7 bits, ex: the biased exponent), and
 * s = ms 2^(es-127), ms in [1, 2):
 *     fl32(x / s) = fl32(mx / ms) 2^(ex-es)               whenever the result is a normal fp32,
 * because a correctly rounded quotient only scales with powers of two. The encoder's normal branch
 * (rs_cpu_e4m3_encode16) computes code = ((a + lsb + 0x7ffff) >> 20) - 960 from a = the bits of
 * |y|, lsb = bit 20 of a; adding (ex-es) << 23 to a adds (ex-es) << 3 to that and leaves bit 20
 * alone. So for the block, d[m] = ((bits(q) + lsb + 0x7ffff) >> 20) - 1008 with q = fl32(mx / ms)
 * (0.5 < q < 2, so 0 <= d <= 16) and E0 = es - 6 give
 *     code = d[m] + 8 t,   t = ex - E0,
 * computed in byte lanes: vpermi2b looks d up (128 entries, two registers, indexed by the low byte
 * of x, whose bit 7 the instruction ignores), t comes from the high byte. The result is the
 * reference's exactly when code >= 9 and 0 <= t <= 15: code >= 9 means a >= 2^-6 (a < 0x3c800000
 * gives at most (0x3c87ffff >> 20) - 960 = 8), the normal branch, and t >= 0 means y >= 2^-7, a
 * normal fp32 (a negative t cannot pass for a small one: E0 <= 240 for any finite BF16 amax, so it
 * wraps to a byte above 15); the branch's clamp to 0x7e is applied too. x = +-0 and BF16 subnormals (ex = 0)
 * give a signed zero, as the reference does (|x / s| < 2^-84 as s > 2^-42). Any other lane
 * (E4M3 subnormals, y near 2^-6) sends its 64 elements through the fp32 encoder with a true
 * division; for trained weights that is about one chunk in a hundred. Blocks holding a NaN or an
 * infinity (integer amax >= 0x7f80) take the fp32 kernel whole.
 *
 * The amax is integer as well: for BF16 without NaN, |x| orders as its bits & 0x7fff, so vpmaxuw
 * over 32 lanes replaces widening, abs and vmaxps over 16, and widening the maximum's bits gives
 * the reference's float amax exactly. Two ops per 32 weights and about 20 per 64 for the codes,
 * against about 8 and 80 in the fp32 kernel: the band is read at memory speed. */
#define RS_TVBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))

typedef struct vbmi_tab {
    __m512i t0, t1; /* d[0..63], d[64..127] */
    __m512i e0;     /* E0 in every byte */
} vbmi_tab;

/* The table of a block whose scale s is a positive normal float. */
RS_TVBMI static vbmi_tab vbmi_tab_build(float s) {
    uint32_t sb;
    memcpy(&sb, &s, sizeof sb);
    const __m512 ms = _mm512_castsi512_ps(_mm512_set1_epi32((int)((sb & 0x7fffffu) | 0x3f800000u)));
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    uint8_t d[128];
    for (int m = 0; m < 128; m += 16) {
        const __m512i mx = _mm512_or_si512(_mm512_set1_epi32(0x3f800000),
                                           _mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(m), iota), 16));
        const __m512i qb = _mm512_castps_si512(_mm512_div_ps(_mm512_castsi512_ps(mx), ms));
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(qb, 20), _mm512_set1_epi32(1));
        const __m512i c = _mm512_srli_epi32(_mm512_add_epi32(qb, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7ffff))), 20);
        _mm_storeu_si128((__m128i *)(d + m), _mm512_cvtepi32_epi8(_mm512_sub_epi32(c, _mm512_set1_epi32(1008))));
    }
    return (vbmi_tab){.t0 = _mm512_loadu_si512(d), .t1 = _mm512_loadu_si512(d + 64),
                      .e0 = _mm512_set1_epi8((char)(uint8_t)((sb >> 23) - 6))};
}

/* x[0..64) of a table block -> q[0..64); false (nothing stored) when a lane needs the fp32 path. */
RS_TVBMI RS_INLINE bool vbmi_enc64(const uint16_t *x, uint8_t *q, const vbmi_tab *tb, __m512i idx_lo, __m512i idx_hi) {
    const __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 32);
    const __m512i lo = _mm512_permutex2var_epi8(x0, idx_lo, x1); /* e0 m6..m0 */
    const __m512i hi = _mm512_permutex2var_epi8(x0, idx_hi, x1); /* sign e7..e1 */
    const __m512i d = _mm512_permutex2var_epi8(tb->t0, lo, tb->t1);
    const __m512i hh = _mm512_add_epi8(hi, hi);
    const __m512i ex = _mm512_mask_add_epi8(hh, _mm512_movepi8_mask(lo), hh, _mm512_set1_epi8(1));
    const __m512i t = _mm512_sub_epi8(ex, tb->e0);
    const __m512i t8 = _mm512_and_si512(_mm512_slli_epi16(t, 3), _mm512_set1_epi8((char)0xf8));
    const __m512i r = _mm512_min_epu8(_mm512_add_epi8(d, t8), _mm512_set1_epi8(0x7e));
    const __mmask64 zero = _mm512_testn_epi8_mask(ex, ex);
    const __mmask64 off = _kor_mask64(_mm512_cmpgt_epu8_mask(t, _mm512_set1_epi8(15)),
                                      _mm512_cmplt_epu8_mask(r, _mm512_set1_epi8(9)));
    if (!_ktestc_mask64_u8(zero, off)) return false; /* off & ~zero != 0 */
    /* zeros keep only their sign: r | (hi & 0x80) */
    _mm512_storeu_si512(q, _mm512_ternarylogic_epi32(_mm512_maskz_mov_epi8(_knot_mask64(zero), r), hi,
                                                     _mm512_set1_epi8((char)0x80), 0xf8));
    return true;
}

RS_TVBMI static bool band_bf16_vbmi(const uint16_t *w, int64_t rows, int64_t in, uint8_t *q, float *srow) {
    const int64_t nfull = in / RS_FP8_BLOCK;
    __m512i acc[4 * RS_WQ_ROWMAJOR_MAX_BLOCKS];
    for (int64_t c = 0; c < 4 * nfull; c++) acc[c] = _mm512_setzero_si512();
    const __m512i mag = _mm512_set1_epi16(0x7fff);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = w + r * in;
        for (int64_t c = 0; c < 4 * nfull; c++)
            acc[c] = _mm512_max_epu16(acc[c], _mm512_and_si512(_mm512_loadu_si512(row + 32 * c), mag));
    }
    vbmi_tab tb[RS_WQ_ROWMAJOR_MAX_BLOCKS];
    __m512 sv[RS_WQ_ROWMAJOR_MAX_BLOCKS];
    bool fast[RS_WQ_ROWMAJOR_MAX_BLOCKS];
    for (int64_t c = 0; c < nfull; c++) {
        const __m512i m4 = _mm512_max_epu16(_mm512_max_epu16(acc[4 * c], acc[4 * c + 1]),
                                            _mm512_max_epu16(acc[4 * c + 2], acc[4 * c + 3]));
        const __m512i m2 = _mm512_max_epu32(_mm512_and_si512(m4, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(m4, 16));
        const uint32_t amax_bits = (uint32_t)_mm512_reduce_max_epu32(m2);
        fast[c] = amax_bits < 0x7f80u; /* no NaN or infinity */
        if (!fast[c]) continue;
        const uint32_t ab = amax_bits << 16;
        float amax;
        memcpy(&amax, &ab, sizeof amax);
        const float s = fmaxf(amax, RS_FP8_AMAX_FLOOR) / RS_FP8_E4M3_MAX;
        srow[c] = s;
        sv[c] = _mm512_set1_ps(s);
        tb[c] = vbmi_tab_build(s);
    }
    /* bytes 2i (low) and 2i + 1 (high) of the 64 words in two registers */
    static const uint8_t lo_hi[128] = {
#define P8(b) (b), (b) + 2, (b) + 4, (b) + 6, (b) + 8, (b) + 10, (b) + 12, (b) + 14
#define P64(b) P8(b), P8((b) + 16), P8((b) + 32), P8((b) + 48), P8((b) + 64), P8((b) + 80), P8((b) + 96), P8((b) + 112)
        P64(0), P64(1),
#undef P64
#undef P8
    };
    const __m512i idx_lo = _mm512_loadu_si512(lo_hi), idx_hi = _mm512_loadu_si512(lo_hi + 64);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = w + r * in;
        uint8_t *qr = q + r * in;
        for (int64_t c = 0; c < nfull; c++) {
            if (!fast[c]) continue;
            for (int64_t j = c * RS_FP8_BLOCK; j < (c + 1) * RS_FP8_BLOCK; j += 64)
                if (!vbmi_enc64(row + j, qr + j, &tb[c], idx_lo, idx_hi))
                    for (int k = 0; k < 64; k += 16)
                        _mm_storeu_si128((__m128i *)(qr + j + k),
                                         _mm512_cvtepi32_epi8(rs_cpu_e4m3_encode16(_mm512_div_ps(ld16(row, 1, j + k), sv[c]))));
        }
    }
    /* NaN or infinity blocks, and the ragged last block column: the fp32 kernel, block by block */
    bool bad = false;
    for (int64_t c = 0; c < rs_fp8_blocks(in); c++)
        if (c >= nfull || !fast[c])
            bad |= block_avx512(w + c * RS_FP8_BLOCK, 1, in, rows, RS_MIN((int64_t)RS_FP8_BLOCK, in - c * RS_FP8_BLOCK),
                                q + c * RS_FP8_BLOCK, srow + c);
    return bad;
}

/* Rows [0, rows <= 128) of a [.][in] matrix: one row of blocks. vbmi: BF16 through the table
 * encoder (the CPU has AVX-512 BW and VBMI). */
RS_T512 static bool band_avx512(const void *w, int bf16, bool vbmi, int64_t rows, int64_t in, uint8_t *q,
                                float *srow) {
    if (bf16 && vbmi && in >= RS_FP8_BLOCK && rs_fp8_blocks(in) <= RS_WQ_ROWMAJOR_MAX_BLOCKS)
        return band_bf16_vbmi(w, rows, in, q, srow);
    if (rs_fp8_blocks(in) <= RS_WQ_ROWMAJOR_MAX_BLOCKS)
        return bf16 ? band_avx512_rows(w, 1, rows, in, q, srow) : band_avx512_rows(w, 0, rows, in, q, srow);
    const size_t esz = bf16 ? 2 : 4;
    bool bad = false;
    for (int64_t c0 = 0; c0 < in; c0 += RS_FP8_BLOCK) {
        const int64_t cw = RS_MIN((int64_t)RS_FP8_BLOCK, in - c0);
        const void *wb = (const char *)w + (size_t)c0 * esz;
        if (bf16) bad |= block_avx512(wb, 1, in, rows, cw, q + c0, srow + c0 / RS_FP8_BLOCK);
        else bad |= block_avx512(wb, 0, in, rows, cw, q + c0, srow + c0 / RS_FP8_BLOCK);
    }
    return bad;
}

/* ---- AVX2 ---- */

RS_T256 RS_INLINE __m256 ld8(const void *row, int bf16, int64_t i) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + i);
}

RS_T256 RS_INLINE __m256 ld8_part(const void *row, int bf16, int64_t i, int64_t n) {
    if (bf16) {
        uint16_t t[8] = {0};
        memcpy(t, (const uint16_t *)row + i, (size_t)n * sizeof *t);
        return ld8(t, 1, 0);
    }
    float t[8] = {0};
    memcpy(t, (const float *)row + i, (size_t)n * sizeof *t);
    return _mm256_loadu_ps(t);
}

/* Bytes of four 8-lane code vectors (each code < 256), in order. The two packs work per 128-bit
 * lane, leaving dwords [c0 lo, c1 lo, c2 lo, c3 lo | c0 hi, c1 hi, c2 hi, c3 hi]; the permute
 * restores c0 lo, c0 hi, c1 lo, ... */
RS_T256 RS_INLINE __m256i pack32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#define ABS_BITS256(v) _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff))

RS_T256 RS_INLINE bool block_avx2(const void *w, int bf16, int64_t ld, int64_t rows, int64_t cw, uint8_t *q,
                                  float *scale) {
    const size_t esz = bf16 ? 2 : 4;
    __m256i acc[4];
    for (int c = 0; c < 4; c++) acc[c] = _mm256_setzero_si256();
    for (int64_t r = 0; r < rows; r++) {
        const void *row = (const char *)w + (size_t)(r * ld) * esz;
        if (cw == RS_FP8_BLOCK) {
            for (int c = 0; c < 16; c++) acc[c & 3] = _mm256_max_epu32(ABS_BITS256(ld8(row, bf16, 8 * c)), acc[c & 3]);
        } else {
            for (int64_t j = 0; j < cw; j += 8) {
                const __m256 v = cw - j >= 8 ? ld8(row, bf16, j) : ld8_part(row, bf16, j, cw - j);
                acc[(j / 8) & 3] = _mm256_max_epu32(ABS_BITS256(v), acc[(j / 8) & 3]);
            }
        }
    }
    const __m256i m = _mm256_max_epu32(_mm256_max_epu32(acc[0], acc[1]), _mm256_max_epu32(acc[2], acc[3]));
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
    bool bad = false;
    const float amax = amax_of_bits((uint32_t)_mm_cvtsi128_si32(h), w, bf16, ld, rows, cw, &bad);
    const float s = fmaxf(amax, RS_FP8_AMAX_FLOOR) / RS_FP8_E4M3_MAX;
    *scale = s;
    const __m256 sv = _mm256_set1_ps(s);
    for (int64_t r = 0; r < rows; r++) {
        const void *row = (const char *)w + (size_t)(r * ld) * esz;
        uint8_t *qr = q + r * ld;
        int64_t j = 0;
        for (; j + 32 <= cw; j += 32) {
            __m256i c[4];
            for (int k = 0; k < 4; k++) c[k] = rs_cpu_e4m3_encode8(_mm256_div_ps(ld8(row, bf16, j + 8 * k), sv));
            _mm256_storeu_si256((__m256i *)(qr + j), pack32(c[0], c[1], c[2], c[3]));
        }
        for (; j < cw; j += 8) {
            const int64_t n = RS_MIN(cw - j, 8);
            const __m256 v = n == 8 ? ld8(row, bf16, j) : ld8_part(row, bf16, j, n);
            const __m256i c = rs_cpu_e4m3_encode8(_mm256_div_ps(v, sv));
            uint8_t t[32];
            _mm256_storeu_si256((__m256i *)t, pack32(c, c, c, c));
            memcpy(qr + j, t, (size_t)n);
        }
    }
    return bad;
}

RS_T256 static bool band_avx2(const void *w, int bf16, int64_t rows, int64_t in, uint8_t *q, float *srow) {
    const size_t esz = bf16 ? 2 : 4;
    bool bad = false;
    for (int64_t c0 = 0; c0 < in; c0 += RS_FP8_BLOCK) {
        const int64_t cw = RS_MIN((int64_t)RS_FP8_BLOCK, in - c0);
        const void *wb = (const char *)w + (size_t)c0 * esz;
        if (bf16) bad |= block_avx2(wb, 1, in, rows, cw, q + c0, srow + c0 / RS_FP8_BLOCK);
        else bad |= block_avx2(wb, 0, in, rows, cw, q + c0, srow + c0 / RS_FP8_BLOCK);
    }
    return bad;
}

#endif /* RS_CPU_FP8_X86 */

int rs_cpu_fp8_quantize_weight(rs_cpu_simd simd, const rs_tensor *w, uint8_t *q, float *scale_inv) {
    return rs_cpu_fp8_quantize_weight_ex(simd, rs_cpu_fp8_wquant_has_table(), w, q, scale_inv);
}

int rs_cpu_fp8_quantize_weight_ex(rs_cpu_simd simd, bool table, const rs_tensor *w, uint8_t *q, float *scale_inv) {
    RS_ASSERT(w && w->ndim == 2 && w->data && (w->dtype == RS_DTYPE_BF16 || w->dtype == RS_DTYPE_F32));
    RS_ASSERT(!table || rs_cpu_fp8_wquant_has_table());
#if RS_CPU_FP8_X86
    if (simd == RS_CPU_SIMD_AVX512 || simd == RS_CPU_SIMD_AVX2) {
        const int64_t out = w->shape[0], in = w->shape[1], nbi = rs_fp8_blocks(in);
        const int bf16 = w->dtype == RS_DTYPE_BF16;
        const size_t esz = rs_dtype_size(w->dtype);
        bool bad = false;
        for (int64_t o0 = 0; o0 < out; o0 += RS_FP8_BLOCK) {
            const int64_t rows = RS_MIN((int64_t)RS_FP8_BLOCK, out - o0);
            const void *band = (const char *)w->data + (size_t)o0 * (size_t)in * esz;
            uint8_t *qb = q + (size_t)o0 * (size_t)in;
            float *srow = scale_inv + (o0 / RS_FP8_BLOCK) * nbi;
            if (simd == RS_CPU_SIMD_AVX512) bad |= band_avx512(band, bf16, table, rows, in, qb, srow);
            else bad |= band_avx2(band, bf16, rows, in, qb, srow);
        }
        return bad ? RS_EFORMAT : RS_OK;
    }
#endif
    (void)simd;
    (void)table;
    return rs_fp8_quantize_weight_ref(w, q, scale_inv);
}

/* ---- level detection (no backend context here: the loader quantizes for any backend) ---- */

static rs_cpu_simd detect(void) {
    rs_cpu_simd s = RS_CPU_SIMD_SCALAR;
#if RS_CPU_FP8_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) s = RS_CPU_SIMD_AVX512;
    else if (__builtin_cpu_supports("avx2")) s = RS_CPU_SIMD_AVX2;
#endif
    const char *e = getenv("RS_CPU_SIMD");
    if (e && strcmp(e, "scalar") == 0) s = RS_CPU_SIMD_SCALAR;
    else if (e && strcmp(e, "avx2") == 0 && s > RS_CPU_SIMD_AVX2) s = RS_CPU_SIMD_AVX2;
    return s;
}

static rs_cpu_simd detected;
static bool detected_table;
static pthread_once_t detected_once = PTHREAD_ONCE_INIT;

static void detect_once(void) {
    detected = detect();
#if RS_CPU_FP8_X86
    detected_table = detected == RS_CPU_SIMD_AVX512 && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vbmi");
#endif
}

bool rs_cpu_fp8_wquant_has_table(void) {
    pthread_once(&detected_once, detect_once);
    return detected_table;
}

rs_cpu_simd rs_cpu_fp8_wquant_simd(void) {
    pthread_once(&detected_once, detect_once);
    return detected;
}
