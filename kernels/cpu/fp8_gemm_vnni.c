/*
 * fp8_gemm_vnni.c — the block-scaled E4M3 GEMM of fp8_gemm.h on AVX-512 integer dot products
 * (VNNI), bit-identical to rs_fp8_gemm_ref.
 *
 * Why integers, and why it is exact. Every E4M3 value is V * 2^-9 with V = ±M * 2^(max(e,1)-1) an
 * integer, M = m (e = 0) or 8 + m, |V| <= 448 * 512 = 14 * 2^14. Split V by the top exponent bit e3
 * into two exclusive 16-bit digits, V = L + 128 H: L = V when e3 = 0 (|L| <= 15 * 2^6 = 960), H =
 * V / 128 when e3 = 1 (exact, V is then a multiple of 2^7; |H| <= 14 * 2^7 = 1792). A block sum is
 *
 *   sum_j x_j w_j = 2^-18 (S_LL + 128 S_X + 16384 S_HH),
 *   S_LL = sum Lx Lw,  S_X = sum (Lx Hw + Hx Lw),  S_HH = sum Hx Hw.
 *
 * For each j at most one of the four digit products is nonzero, so over a 128-block |S_LL| <=
 * 128 * 960^2 < 2^27, |S_X| <= 128 * 960 * 1792 < 2^28 and |S_HH| <= 128 * 1792^2 < 2^29; so is
 * every partial sum, in any order. vpdpwssd (pairs of s16 x s16 products added into int32, no
 * saturation) therefore computes the three sums exactly, the combination is exact in double
 * (< 2^43 * 2^-18), and its one rounding to fp32 is the reference's fp32 block sum. A NaN code
 * anywhere in the block's x or w makes the block sum the canonical NaN, as in the reference (E4M3
 * has no inf, so nothing else can give NaN). What follows is the reference's own sequence: the
 * fp32 product of the two scales, then fmaf over the blocks in order from +0, and NaN outputs
 * made the canonical NaN. Hence bit-identity, for any tiling and thread count.
 *
 * Digit lookup (decode64): gf2p8affineqb moves the sign to bit 6 and e3 to bit 7 and complements
 * (so that NaN, S.1111.111, becomes a zero test); vpermi2b looks the low and high bytes of L and H
 * up in 128-entry tables indexed by the low 7 bits (sign and the 6 other exponent/mantissa bits),
 * zero-masked by e3; byte unpacks make the words. Unpacks interleave within 128-bit lanes, so the
 * words come out in a fixed permuted order of k (always adjacent pairs 2i, 2i+1 in one dword);
 * activations go through the same routine, so the pairs of both sides line up.
 *
 * Weights come in two layouts (rs_tensor.layout): row-major, as checkpoints store them, or
 * RS_LAYOUT_FP8_PAIRS32 (fp8_layout.h), in which the CPU backend keeps the weights it serves:
 * groups of 32 rows interleaved pair by pair, so that one 64-byte load is codes 2p, 2p + 1 of 32
 * outputs and decode64 puts output j in dword lane j (j < 16) of one vector, 16 + j of the other.
 * Three arrangements of the products:
 *   - few rows, packed weights (r3, tiles of <= 2 rows inside tiles of <= 4): lanes = outputs.
 *     One decode per 64 codes, the row's L and H word pairs of k-pair p broadcast, 8 vpdpwssd per
 *     row; the block sums come out of the accumulators lane by lane, no horizontal sums. One asm
 *     loop per block; an item reads each group's contiguous run front to back, 8 KB prefetched
 *     ahead. Batch 1 streams ~29 G weights/s from memory on one Zen 5 core (vs 21 with row-major
 *     weights), ~56 on two: more than the memory gives BF16 weights most of the time.
 *   - few rows, row-major weights (r1, tiles of <= 4 rows): lanes = k. One decode per 64 weight
 *     codes, then 8 vpdpwssd per row; at the end of a block the 3 accumulators of each (row,
 *     output) are summed across lanes by a transpose tree (a quarter of the time at batch 1).
 *     Weight rows are read 1 KB at a time (a super-block of 8 K blocks), four side by side, two
 *     groups prefetched ahead. Also the path of the row-major tail rows of a packed weight.
 *   - many rows (tiles of 16 rows, the last padded from r2_min rows, a count rs_fp8_gemm_tune
 *     times for the CPU; with packed weights, items of up to four tiles; fewer rows going to
 *     lanes = outputs tiles): lanes = rows.
 *     The tile's activation digits are transposed so that one zmm holds one k-pair of 16 rows; the
 *     weight digits are decoded once per block into L1 (4 outputs at a time from row-major
 *     weights, a whole 32-output group from packed ones, which then serves every tile of the item)
 *     and broadcast, no horizontal sums. The activations take one digit X = V >> 4 (or >> 5) and a rare
 *     remainder (r2_state), so each k-pair takes 1 vpdpwssd per output and tile for the weight's
 *     H digits (one asm loop per block); the L-digit products run only over the pairs where the
 *     weight has an L digit, which a block scaled to amax 448 gives to few codes (|w| < 2 in E4M3
 *     units; with packed weights, the pairs where one of 4 outputs has one), the remainder
 *     products only over the pairs where a row has a remainder.
 *     Outputs leave through 16 x 16 transposes.
 * Work items are (chunk of 128 outputs, row tile), the tile varying fastest so that a chunk's
 * weights stay in L2 across the tiles; threads take contiguous runs of items. Nothing is
 * allocated: the scratch (under 64 KB) is on the stack.
 */
#include "fp8_gemm_vnni.h"

#include <math.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"
#include "fp8_layout.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "avx512_transpose.h"

#define RS_TARGET_VNNI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni,gfni,fma")))
#define INLINE static inline __attribute__((always_inline))

#define BLK     RS_FP8_BLOCK
#define CHUNK   128 /* output features per work item */
#define R1_ROWS 4  /* rows of a lanes = k tile */
#define R2_ROWS 16 /* rows of a lanes = rows tile: one zmm of int32 */
#define SB      8  /* K blocks per lanes = k super-block */
#define R1_PREFETCH 2 /* lanes = k: prefetch the weight rows this many output groups ahead */
#define R2_NO   4  /* outputs decoded and accumulated together in a lanes = rows tile */
#define R2_TILES 4 /* lanes = rows tiles sharing a decode of RS_LAYOUT_FP8_PAIRS32 weights */
#define R2_XABS_MAX4 1118481 /* (2^31 - 1) / 1920: the largest row sum of |X| that takes s = 4 (r2_state) */

/* gf2p8affineqb matrix: output bit i = parity(code & byte[7 - i]); swaps bits 6 and 7. */
#define SWAP67 0x0102040810208040ull

/* ---- digit tables, indexed by t = ~swap67(code) & 0x7f (so u = t ^ 0x7f = sign << 6 | e2..e0 m) ---- */
#define VD_U(t)   ((t) ^ 0x7f)
#define VD_SG(t)  ((VD_U(t) & 0x40) ? -1 : 1)
#define VD_E(t)   ((VD_U(t) >> 3) & 7)
#define VD_M(t)   (VD_U(t) & 7)
#define VD_L(t)   (VD_SG(t) * (VD_E(t) ? (8 + VD_M(t)) << (VD_E(t) ? VD_E(t) - 1 : 0) : VD_M(t)))
#define VD_H(t)   (VD_E(t) == 7 && VD_M(t) == 7 ? 0 : VD_SG(t) * ((8 + VD_M(t)) << VD_E(t))) /* NaN: 0 */
#define VD_LB0(t) ((uint8_t)((uint16_t)VD_L(t) & 0xff))
#define VD_LB1(t) ((uint8_t)((uint16_t)VD_L(t) >> 8))
#define VD_HB0(t) ((uint8_t)((uint16_t)VD_H(t) & 0xff))
#define VD_HB1(t) ((uint8_t)((uint16_t)VD_H(t) >> 8))
#define V4(F, b)   F(b), F((b) + 1), F((b) + 2), F((b) + 3)
#define V16(F, b)  V4(F, b), V4(F, (b) + 4), V4(F, (b) + 8), V4(F, (b) + 12)
#define V64(F, b)  V16(F, b), V16(F, (b) + 16), V16(F, (b) + 32), V16(F, (b) + 48)
#define V128(F)    V64(F, 0), V64(F, 64)

static const _Alignas(64) uint8_t digit_tab[4][128] = {
    {V128(VD_LB0)}, /* L, low byte */
    {V128(VD_LB1)}, /* L, high byte */
    {V128(VD_HB0)}, /* H, low byte */
    {V128(VD_HB1)}, /* H, high byte */
};

typedef struct vlut {
    __m512i t[8]; /* digit_tab as 64-byte halves */
} vlut;

RS_TARGET_VNNI INLINE void lut_load(vlut *l) {
#pragma GCC unroll 16
    for (int i = 0; i < 8; i++) l->t[i] = _mm512_load_si512(&digit_tab[i / 2][64 * (i % 2)]);
}

/* 64 codes -> d[0..3] = L words (from unpacklo, unpackhi), H words (same); NaN codes set *nan bits. */
RS_TARGET_VNNI INLINE void decode64(__m512i codes, const vlut *l, __m512i d[4], __mmask64 *nan) {
    const __m512i idx = _mm512_gf2p8affine_epi64_epi8(codes, _mm512_set1_epi64((long long)SWAP67), 0xff);
    const __mmask64 lo = _mm512_movepi8_mask(idx); /* bit 7 = !e3 */
    *nan = _kor_mask64(*nan, _mm512_testn_epi8_mask(idx, _mm512_set1_epi8((char)0xbf)));
    const __m512i l0 = _mm512_maskz_permutex2var_epi8(lo, l->t[0], idx, l->t[1]);
    const __m512i l1 = _mm512_maskz_permutex2var_epi8(lo, l->t[2], idx, l->t[3]);
    const __m512i h0 = _mm512_maskz_permutex2var_epi8(_knot_mask64(lo), l->t[4], idx, l->t[5]);
    const __m512i h1 = _mm512_maskz_permutex2var_epi8(_knot_mask64(lo), l->t[6], idx, l->t[7]);
    d[0] = _mm512_unpacklo_epi8(l0, l1);
    d[1] = _mm512_unpackhi_epi8(l0, l1);
    d[2] = _mm512_unpacklo_epi8(h0, h1);
    d[3] = _mm512_unpackhi_epi8(h0, h1);
}

/* The weight-H products of four outputs over pairs [0, np) of a block, as one asm loop: for each
 * pair p, with x the rows' one-digit activation word pairs (xt[t][0][p]) and w_q the output's H
 * word pair broadcast, a[q] += x.w_q. In asm because GCC 12 copies the loop-carried accumulators
 * between registers every iteration, with intrinsics or with an asm statement per pair alike.
 * x: &xt[t][0][0][0]; w: output 0's H digit of pair 0, output q's at w + Q q bytes, pair p + 1's
 * P bytes after pair p's (dp_h4_rows: wd [4][2][64], Q = 512, P = 4; dp_h4_pairs: wdp [64][2][32],
 * Q = 4, P = 256); wall: the whole digit array, WN int32, which the loop reads. */
#define RS_STR_(x) #x
#define RS_STR(x)  RS_STR_(x)
#define DP_H4(NAME, Q, P, WN)                                                                             \
    RS_TARGET_VNNI INLINE void NAME(__m512i a[4], const int32_t *x, const int32_t *wall, const int32_t *w,   \
                                    int np) {                                                             \
        __m512i xv, t0, t1;                                                                               \
        const int32_t *px = x, *pw = w;                                                                   \
        long n = np;                                                                                      \
        if (n <= 0) return;                                                                               \
        __asm__("1:\n\t"                                                                                  \
                "vmovdqa64 (%[px]), %[xv]\n\t"                                                            \
                "vpbroadcastd (%[pw]), %[t0]\n\t"                                                         \
                "vpbroadcastd " RS_STR(Q) "(%[pw]), %[t1]\n\t"                                            \
                "vpdpwssd %[t0], %[xv], %[a0]\n\t"                                                        \
                "vpbroadcastd " RS_STR(2 * Q) "(%[pw]), %[t0]\n\t"                                        \
                "vpdpwssd %[t1], %[xv], %[a1]\n\t"                                                        \
                "vpbroadcastd " RS_STR(3 * Q) "(%[pw]), %[t1]\n\t"                                        \
                "vpdpwssd %[t0], %[xv], %[a2]\n\t"                                                        \
                "vpdpwssd %[t1], %[xv], %[a3]\n\t"                                                        \
                "add $64, %[px]\n\t"                                                                      \
                "add $" RS_STR(P) ", %[pw]\n\t"                                                           \
                "dec %[n]\n\t"                                                                            \
                "jnz 1b"                                                                                  \
                : [a0] "+v"(a[0]), [a1] "+v"(a[1]), [a2] "+v"(a[2]), [a3] "+v"(a[3]), [xv] "=&v"(xv),     \
                  [t0] "=&v"(t0), [t1] "=&v"(t1), [px] "+r"(px), [pw] "+r"(pw), [n] "+r"(n)               \
                : "m"(*(const int32_t(*)[64 * R2_ROWS])x), "m"(*(const int32_t(*)[WN])wall)                \
                : "cc");                                                                                  \
    }
DP_H4(dp_h4_rows, 512, 4, R2_NO * 2 * 64)
DP_H4(dp_h4_pairs, 4, 256, 64 * 2 * 32)

/* asm text: zero zmm R; store zmm R to OFF(%[acc]) */
#define ASM_ZERO(R)       "vpxord %%zmm" R ", %%zmm" R ", %%zmm" R "\n\t"
#define ASM_STORE(R, OFF) "vmovdqu32 %%zmm" R ", " OFF "(%[acc])\n\t"
#define ASM_STORE_0_7                                                                                     \
    ASM_STORE("0", "0") ASM_STORE("1", "64") ASM_STORE("2", "128") ASM_STORE("3", "192")                  \
    ASM_STORE("4", "256") ASM_STORE("5", "320") ASM_STORE("6", "384") ASM_STORE("7", "448")

/* dp_h4_pairs for two row tiles at once, from zero (x: xt[0][0], tile 1's 8192 bytes on): one
 * broadcast of each weight digit feeds both tiles. Stores acc[0..3] = tile 0's products of the
 * four outputs, [4..7] tile 1's. Fixed registers. */
RS_TARGET_VNNI static void dp_h4_pairs2(int32_t acc[8][16], const int32_t *x, const int32_t *wall, const int32_t *w,
                                        int np) {
    const int32_t *px = x, *pw = w;
    long n = np;
#define DP2_Q(OFF, A, B)                                                                                  \
    "vpbroadcastd " OFF "(%[pw]), %%zmm20\n\t"                                                          \
    "vpdpwssd %%zmm20, %%zmm16, %%zmm" A "\n\t"                                                          \
    "vpdpwssd %%zmm20, %%zmm17, %%zmm" B "\n\t"
    __asm__ volatile(ASM_ZERO("0") ASM_ZERO("1") ASM_ZERO("2") ASM_ZERO("3") ASM_ZERO("4") ASM_ZERO("5")
                     ASM_ZERO("6") ASM_ZERO("7")
                     "test %[n], %[n]\n\t"
                     "jle 2f\n\t"
                     "1:\n\t"
                     "vmovdqa64 (%[px]), %%zmm16\n\t"
                     "vmovdqa64 8192(%[px]), %%zmm17\n\t"
                     DP2_Q("0", "0", "4")
                     DP2_Q("4", "1", "5")
                     DP2_Q("8", "2", "6")
                     DP2_Q("12", "3", "7")
                     "add $64, %[px]\n\t"
                     "add $256, %[pw]\n\t"
                     "dec %[n]\n\t"
                     "jnz 1b\n\t"
                     "2:\n\t"
                     ASM_STORE_0_7
                     : [px] "+r"(px), [pw] "+r"(pw), [n] "+r"(n), "=m"(*(int32_t(*)[8][16])acc)
                     : [acc] "r"(acc), "m"(*(const int32_t(*)[R2_TILES * 2 * 64 * R2_ROWS])x),
                       "m"(*(const int32_t(*)[64 * 2 * 32])wall)
                     : "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm16", "zmm17", "zmm20",
                       "cc");
#undef DP2_Q
}

/* dp_h4_pairs2 for four row tiles (x: xt[0][0], tile t's at 8192 t bytes on): acc[4 t + q] =
 * tile t's products of output q. Fixed registers: 16 sums, 4 tiles' activations, one weight. */
RS_TARGET_VNNI static void dp_h4_pairs4(int32_t acc[16][16], const int32_t *x, const int32_t *wall, const int32_t *w,
                                        int np) {
    const int32_t *px = x, *pw = w;
    long n = np;
#define DP4_Q(OFF, A, B, C, D)                                                                            \
    "vpbroadcastd " OFF "(%[pw]), %%zmm20\n\t"                                                          \
    "vpdpwssd %%zmm20, %%zmm16, %%zmm" A "\n\t"                                                          \
    "vpdpwssd %%zmm20, %%zmm17, %%zmm" B "\n\t"                                                          \
    "vpdpwssd %%zmm20, %%zmm18, %%zmm" C "\n\t"                                                          \
    "vpdpwssd %%zmm20, %%zmm19, %%zmm" D "\n\t"
    __asm__ volatile(ASM_ZERO("0") ASM_ZERO("1") ASM_ZERO("2") ASM_ZERO("3") ASM_ZERO("4") ASM_ZERO("5")
                     ASM_ZERO("6") ASM_ZERO("7") ASM_ZERO("8") ASM_ZERO("9") ASM_ZERO("10") ASM_ZERO("11")
                     ASM_ZERO("12") ASM_ZERO("13") ASM_ZERO("14") ASM_ZERO("15")
                     "test %[n], %[n]\n\t"
                     "jle 2f\n\t"
                     "1:\n\t"
                     "vmovdqa64 (%[px]), %%zmm16\n\t"
                     "vmovdqa64 8192(%[px]), %%zmm17\n\t"
                     "vmovdqa64 16384(%[px]), %%zmm18\n\t"
                     "vmovdqa64 24576(%[px]), %%zmm19\n\t"
                     DP4_Q("0", "0", "4", "8", "12")
                     DP4_Q("4", "1", "5", "9", "13")
                     DP4_Q("8", "2", "6", "10", "14")
                     DP4_Q("12", "3", "7", "11", "15")
                     "add $64, %[px]\n\t"
                     "add $256, %[pw]\n\t"
                     "dec %[n]\n\t"
                     "jnz 1b\n\t"
                     "2:\n\t"
                     ASM_STORE_0_7
                     ASM_STORE("8", "512") ASM_STORE("9", "576") ASM_STORE("10", "640") ASM_STORE("11", "704")
                     ASM_STORE("12", "768") ASM_STORE("13", "832") ASM_STORE("14", "896") ASM_STORE("15", "960")
                     : [px] "+r"(px), [pw] "+r"(pw), [n] "+r"(n), "=m"(*(int32_t(*)[16][16])acc)
                     : [acc] "r"(acc), "m"(*(const int32_t(*)[4 * 2 * 64 * R2_ROWS])x),
                       "m"(*(const int32_t(*)[64 * 2 * 32])wall)
                     : "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10",
                       "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20",
                       "cc");
#undef DP4_Q
}

/* acc += x . broadcast(*w) (one vpdpwssd). */
RS_TARGET_VNNI INLINE __m512i dp_one(__m512i acc, __m512i x, const int32_t *w) {
    return _mm512_dpwssd_epi32(acc, x, _mm512_set1_epi32(*w));
}

/* The first n of 64 bytes (n may be <= 0 or >= 64). */
static inline __mmask64 tail_mask(int64_t n) {
    return n >= 64 ? ~(__mmask64)0 : n <= 0 ? 0 : (((__mmask64)1 << n) - 1);
}

/* NaN lanes replaced by the canonical NaN (fp8_gemm.h). */
RS_TARGET_VNNI INLINE __m512 canonical_nan16(__m512 v) {
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_ps(NAN));
}

RS_TARGET_VNNI INLINE __m128 canonical_nan4(__m128 v) {
    return _mm_mask_mov_ps(v, _mm_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm_set1_ps(NAN));
}

/* The exact block sums 2^-18 (ll + 128 x + 16384 hh), rounded once to fp32 (int32 lanes in, all
 * values < 2^29 in magnitude, so the double arithmetic is exact). */
RS_TARGET_VNNI INLINE __m256 combine8(__m256i ll, __m256i x, __m256i hh) {
    __m512d t = _mm512_fmadd_pd(_mm512_cvtepi32_pd(x), _mm512_set1_pd(128.0), _mm512_cvtepi32_pd(ll));
    t = _mm512_fmadd_pd(_mm512_cvtepi32_pd(hh), _mm512_set1_pd(16384.0), t);
    return _mm512_cvtpd_ps(_mm512_mul_pd(t, _mm512_set1_pd(0x1p-18)));
}

typedef struct vjob {
    float *out;        /* [rows][n] f32 */
    const uint8_t *xq; /* [rows][k] e4m3 */
    const float *xs;   /* [rows][kb] f32 */
    const uint8_t *wq; /* [n][k] e4m3 */
    const float *ws;   /* [ceil(n/128)][kb] f32 */
    int rows, n, k;
    int64_t kb, n_chunks;
    int n_r2;     /* lanes = rows tiles: rows [16 t, min(16 t + 16, rows)) */
    int r1_start; /* lanes = k tiles of 4 rows from here */
    int n_tiles;
    int64_t n_packed; /* outputs [0, n_packed) are whole groups of RS_LAYOUT_FP8_PAIRS32; 0: row-major */
    int r2_rows;      /* rows of a lanes = rows item: R2_ROWS, or R2_TILES * R2_ROWS with packed weights */
    int r2_last;      /* rows of the last lanes = rows item (<= r2_rows) */
} vjob;

/* Row r's activation codes of the block at j0 as decode64 words, d[h] from codes j0 + 64h (zeros
 * past k); true when one of them is a NaN code. */
RS_TARGET_VNNI INLINE bool decode_x_block(const vjob *jb, const vlut *l, int64_t r, int64_t j0, __m512i d[2][4]) {
    const uint8_t *x = jb->xq + r * jb->k + j0;
    __mmask64 nan = 0;
#pragma GCC unroll 16
    for (int h = 0; h < 2; h++) decode64(_mm512_maskz_loadu_epi8(tail_mask(jb->k - j0 - 64 * h), x + 64 * h), l, d[h], &nan);
    return nan != 0;
}

/* ---------------------------------------------------------------------------------------------
 * Few rows: lanes = k
 * ------------------------------------------------------------------------------------------- */

/* The tile's activation digits for one super-block. */
typedef struct r1_x {
    _Alignas(64) int16_t d[R1_ROWS][SB][2][4][32]; /* [row][block][half][L_a, L_b, H_a, H_b] */
    float s[R1_ROWS][SB];                           /* x scales */
    uint8_t nan[R1_ROWS][SB];                       /* a NaN code in the row's block */
    uint8_t nan_any[SB];                            /* ... in any row's */
} r1_x;

RS_TARGET_VNNI static void r1_prep(r1_x *px, const vjob *jb, const vlut *l, int r0, int nr, int64_t b0,
                                   int nb) {
    memset(px->nan_any, 0, sizeof px->nan_any);
    for (int r = 0; r < nr; r++) {
        for (int bi = 0; bi < nb; bi++) {
            __m512i d[2][4];
            const bool nan = decode_x_block(jb, l, r0 + r, (b0 + bi) * BLK, d);
#pragma GCC unroll 16
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 16
                for (int i = 0; i < 4; i++) _mm512_store_si512(px->d[r][bi][h][i], d[h][i]);
            px->nan[r][bi] = nan;
            px->nan_any[bi] |= nan;
            px->s[r][bi] = jb->xs[(int64_t)(r0 + r) * jb->kb + b0 + bi];
        }
    }
}

/* Sums the lanes of v[0..11] (3 groups of 4 accumulators): lane i of the result = sum of v[i]. */
RS_TARGET_VNNI INLINE __m512i reduce12(const __m512i v[12]) {
    __m512i r1[6], r2[3];
#pragma GCC unroll 16
    for (int i = 0; i < 6; i++)
        r1[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 16
    for (int i = 0; i < 3; i++) /* per 128-bit lane: the partial sums of v[4i..4i+3] */
        r2[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(r1[2 * i], r1[2 * i + 1]),
                                 _mm512_unpackhi_epi64(r1[2 * i], r1[2 * i + 1]));
    __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(r2[0], r2[1], 0x88), _mm512_shuffle_i32x4(r2[0], r2[1], 0xdd));
    __m512i b = _mm512_add_epi32(_mm512_shuffle_i32x4(r2[2], r2[2], 0x88), _mm512_shuffle_i32x4(r2[2], r2[2], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}

/* NR rows x NQ outputs (NR * NQ <= 4, outputs o.. in one 128-row weight block) over the
 * super-block's blocks [b0, b0 + nb); the fmaf accumulators live in out between super-blocks. */
RS_TARGET_VNNI INLINE void r1_group(const vjob *jb, const vlut *l, const r1_x *px, const int NR, const int NQ,
                                    int r0, int64_t o, int64_t b0, int nb) {
    const int64_t k = jb->k, kb = jb->kb, n = jb->n;
    const uint8_t *w[4];
#pragma GCC unroll 16
    for (int q = 0; q < NQ; q++) w[q] = jb->wq + (o + q) * k;
    float a4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (b0 > 0)
        for (int r = 0; r < NR; r++)
            for (int q = 0; q < NQ; q++) a4[r * NQ + q] = jb->out[(r0 + r) * n + o + q];
    __m128 acc = _mm_loadu_ps(a4);
    const float *wsb = jb->ws + (o / BLK) * kb;
    for (int bi = 0; bi < nb; bi++) {
        const int64_t b = b0 + bi, j0 = b * BLK, kw = RS_MIN((int64_t)BLK, k - j0);
        __m512i ll[4], xa[4], hh[4]; /* per (row, output): S_LL, S_X, S_HH lane-wise */
        __mmask64 wnan[4];
#pragma GCC unroll 16
        for (int i = 0; i < 4; i++) ll[i] = xa[i] = hh[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int q = 0; q < 4; q++) wnan[q] = 0;
#pragma GCC unroll 16
        for (int h = 0; h < 2; h++) {
            if (kw <= 64 * h) break;
            const __mmask64 m = tail_mask(kw - 64 * h);
#pragma GCC unroll 16
            for (int q = 0; q < NQ; q++) {
                __m512i d[4];
                const uint8_t *src = w[q] + j0 + 64 * h;
                _mm_prefetch((const char *)(src + R1_PREFETCH * NQ * k), _MM_HINT_T0);
                decode64(kw == BLK ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8(m, src), l, d, &wnan[q]);
#pragma GCC unroll 16
                for (int r = 0; r < NR; r++) {
                    const int16_t(*x)[32] = px->d[r][bi][h];
                    const int i = r * NQ + q;
                    const __m512i xla = _mm512_load_si512(x[0]), xlb = _mm512_load_si512(x[1]);
                    const __m512i xha = _mm512_load_si512(x[2]), xhb = _mm512_load_si512(x[3]);
                    ll[i] = _mm512_dpwssd_epi32(ll[i], d[0], xla);
                    xa[i] = _mm512_dpwssd_epi32(xa[i], d[0], xha);
                    xa[i] = _mm512_dpwssd_epi32(xa[i], d[2], xla);
                    hh[i] = _mm512_dpwssd_epi32(hh[i], d[2], xha);
                    ll[i] = _mm512_dpwssd_epi32(ll[i], d[1], xlb);
                    xa[i] = _mm512_dpwssd_epi32(xa[i], d[1], xhb);
                    xa[i] = _mm512_dpwssd_epi32(xa[i], d[3], xlb);
                    hh[i] = _mm512_dpwssd_epi32(hh[i], d[3], xhb);
                }
            }
        }
        __m512i v[12];
#pragma GCC unroll 16
        for (int i = 0; i < 4; i++) {
            v[i] = ll[i];
            v[4 + i] = xa[i];
            v[8 + i] = hh[i];
        }
        const __m512i s = reduce12(v); /* lanes 0-3 S_LL, 4-7 S_X, 8-11 S_HH of the 4 (row, output) */
        __m256i s8 = _mm512_castsi512_si256(s);
        __m128 bs = _mm256_castps256_ps128(combine8(_mm256_zextsi128_si256(_mm256_castsi256_si128(s8)),
                                                    _mm256_zextsi128_si256(_mm256_extracti128_si256(s8, 1)),
                                                    _mm256_zextsi128_si256(_mm512_extracti32x4_epi32(s, 2))));
        /* the scale products xs * ws, lane-wise as the reference computes them */
        const __m128 sx = NR == 1 ? _mm_set1_ps(px->s[0][bi] * wsb[b])
                                  : _mm_mul_ps(_mm_setr_ps(px->s[0][bi], px->s[RS_MIN(1 / NQ, NR - 1)][bi],
                                                           px->s[RS_MIN(2 / NQ, NR - 1)][bi],
                                                           px->s[RS_MIN(3 / NQ, NR - 1)][bi]),
                                               _mm_set1_ps(wsb[b]));
        __mmask64 wany = 0;
#pragma GCC unroll 16
        for (int q = 0; q < NQ; q++) wany = _kor_mask64(wany, wnan[q]);
        if (__builtin_expect(wany != 0 || px->nan_any[bi], 0)) { /* NaN codes: rare */
            __mmask8 nan = 0;
            for (int r = 0; r < NR; r++)
                for (int q = 0; q < NQ; q++)
                    if (px->nan[r][bi] || wnan[q]) nan |= (__mmask8)(1u << (r * NQ + q));
            bs = _mm_mask_mov_ps(bs, nan, _mm_set1_ps(NAN));
        }
        acc = _mm_fmadd_ps(bs, sx, acc);
    }
    _mm_storeu_ps(a4, canonical_nan4(acc)); /* NaN stays NaN through later super-blocks */
    for (int r = 0; r < NR; r++)
        for (int q = 0; q < NQ; q++) jb->out[(r0 + r) * n + o + q] = a4[r * NQ + q];
}

#define R1_GROUP(NR, NQ)                                                                                  \
    RS_TARGET_VNNI static void r1_group_##NR##x##NQ(const vjob *jb, const vlut *l, const r1_x *px, int r0, \
                                                   int64_t o, int64_t b0, int nb) {                        \
        r1_group(jb, l, px, NR, NQ, r0, o, b0, nb);                                                       \
    }
R1_GROUP(1, 4)
R1_GROUP(1, 1)
R1_GROUP(2, 2)
R1_GROUP(2, 1)
R1_GROUP(3, 1)
R1_GROUP(4, 1)

RS_TARGET_VNNI static void r1_item(const vjob *jb, const vlut *l, int r0, int nr, int64_t o0, int64_t o1) {
    r1_x px;
    const int nq = nr == 1 ? 4 : nr == 2 ? 2 : 1;
    for (int64_t b0 = 0; b0 < jb->kb; b0 += SB) {
        const int nb = (int)RS_MIN((int64_t)SB, jb->kb - b0);
        r1_prep(&px, jb, l, r0, nr, b0, nb);
        int64_t o = o0;
        for (; o + nq <= o1; o += nq) {
            switch (nr) {
            case 1: r1_group_1x4(jb, l, &px, r0, o, b0, nb); break;
            case 2: r1_group_2x2(jb, l, &px, r0, o, b0, nb); break;
            case 3: r1_group_3x1(jb, l, &px, r0, o, b0, nb); break;
            default: r1_group_4x1(jb, l, &px, r0, o, b0, nb); break;
            }
        }
        for (; o < o1; o++) {
            switch (nr) {
            case 1: r1_group_1x1(jb, l, &px, r0, o, b0, nb); break;
            case 2: r1_group_2x1(jb, l, &px, r0, o, b0, nb); break;
            case 3: r1_group_3x1(jb, l, &px, r0, o, b0, nb); break;
            default: r1_group_4x1(jb, l, &px, r0, o, b0, nb); break;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Few rows, RS_LAYOUT_FP8_PAIRS32 weights: lanes = outputs
 * ------------------------------------------------------------------------------------------- */

#define R3_ROWS 2 /* rows of a lanes = outputs tile (registers: 6 or 8 accumulators a row, 8 LUT) */

/* The tile's activation word pairs for one super-block, in k order (pair p = codes 2p, 2p + 1). */
typedef struct r3_x {
    _Alignas(64) int32_t w[R1_ROWS][SB][2][64]; /* [row][block][L/H][pair] */
    _Alignas(64) int32_t x1[R1_ROWS][SB][64];   /* [row][block][pair]: X = V >> 5 word pairs */
    float s[R1_ROWS][SB];
    uint8_t nan[R1_ROWS][SB];
    uint8_t one[R1_ROWS][SB]; /* every V of the row's block a multiple of 32: X alone is V / 32 */
} r3_x;

RS_TARGET_VNNI static void r3_prep(r3_x *px, const vjob *jb, const vlut *l, int r0, int nr, int64_t b0, int nb) {
    /* decode64's words: vector 0 lane 4L + i holds pair 8L + i, vector 1 lane 4L + i pair 8L + 4 + i */
    const __m512i ia = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i ib = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i low5 = _mm512_set1_epi16(31);
    for (int r = 0; r < nr; r++) {
        for (int bi = 0; bi < nb; bi++) {
            __m512i d[2][4], rem = _mm512_setzero_si512();
            px->nan[r][bi] = decode_x_block(jb, l, r0 + r, (b0 + bi) * BLK, d);
#pragma GCC unroll 16
            for (int h = 0; h < 2; h++) {
#pragma GCC unroll 16
                for (int dg = 0; dg < 2; dg++) {
                    _mm512_store_si512(&px->w[r][bi][dg][32 * h],
                                       _mm512_permutex2var_epi32(d[h][2 * dg], ia, d[h][2 * dg + 1]));
                    _mm512_store_si512(&px->w[r][bi][dg][32 * h + 16],
                                       _mm512_permutex2var_epi32(d[h][2 * dg], ib, d[h][2 * dg + 1]));
                }
                /* X = (L >> 5) + 4 H per code (r2_state's one digit); V % 32 = L & 31 */
                const __m512i xa = _mm512_add_epi16(_mm512_srai_epi16(d[h][0], 5), _mm512_slli_epi16(d[h][2], 2));
                const __m512i xb = _mm512_add_epi16(_mm512_srai_epi16(d[h][1], 5), _mm512_slli_epi16(d[h][3], 2));
                _mm512_store_si512(&px->x1[r][bi][32 * h], _mm512_permutex2var_epi32(xa, ia, xb));
                _mm512_store_si512(&px->x1[r][bi][32 * h + 16], _mm512_permutex2var_epi32(xa, ib, xb));
                rem = _mm512_or_si512(rem, _mm512_and_si512(_mm512_or_si512(d[h][0], d[h][1]), low5));
            }
            px->one[r][bi] = _mm512_test_epi16_mask(rem, rem) == 0;
            px->s[r][bi] = jb->xs[(int64_t)(r0 + r) * jb->kb + b0 + bi];
        }
    }
}

/* The outputs (bit j: output 32 g + j) that a group's NaN codes reach, from decode64's byte mask. */
static uint32_t pairs32_nan_outputs(__mmask64 bytes) {
    uint32_t m = 0;
    for (uint64_t b = bytes; b; b &= b - 1) m |= 1u << rs_fp8_pairs32_row(__builtin_ctzll(b) / 2);
    return m;
}

/* One block of a lanes = outputs tile, as one asm loop over its np pairs (np >= 1): wp, the
 * block's first pair of the group (64 bytes a pair); xp, the rows' L word pairs of the block
 * (r3_x.w[row][block][0]; H at +256 bytes, the next row at +SB * 512). Stores the accumulators to
 * acc (one row: S_LL, S_LL, S_X(a), S_X(a), S_X(b), S_X(b), S_HH, S_HH, the two vectors of each
 * being outputs 0-15 and 16-31; two rows: S_LL, S_LL, S_X, S_X, S_HH, S_HH for row 0, then row 1)
 * and returns the NaN-byte mask of the block's codes. In asm because GCC 12 copies every
 * loop-carried accumulator between registers each iteration (measured: a fifth slower); the
 * registers are fixed, the digit tables loaded once per block. */
#define R3_DECODE(C, L0, L1, H0, D0, D2)                                                                  \
    "vmovdqu8 (%[wp]), %%zmm" C "\n\t"                                                                 \
    "prefetcht0 8192(%[wp])\n\t"                                                                        \
    "vgf2p8affineqb $0xff, %[sw]%{1to8%}, %%zmm" C ", %%zmm" C "\n\t"                                  \
    "vpmovb2m %%zmm" C ", %%k1\n\t"                                                                     \
    "vptestnmb %[nm], %%zmm" C ", %%k3\n\t"                                                             \
    "knotq %%k1, %%k2\n\t"                                                                              \
    "korq %%k3, %%k4, %%k4\n\t"                                                                         \
    "vmovdqa64 %%zmm" T0 ", %%zmm" L0 "\n\t"                                                            \
    "vpermt2b %%zmm" T1 ", %%zmm" C ", %%zmm" L0 "%{%%k1%}%{z%}\n\t"                                   \
    "vmovdqa64 %%zmm" T2 ", %%zmm" L1 "\n\t"                                                            \
    "vpermt2b %%zmm" T3 ", %%zmm" C ", %%zmm" L1 "%{%%k1%}%{z%}\n\t"                                   \
    "vmovdqa64 %%zmm" T4 ", %%zmm" H0 "\n\t"                                                            \
    "vpermt2b %%zmm" T5 ", %%zmm" C ", %%zmm" H0 "%{%%k2%}%{z%}\n\t"                                   \
    "vpermi2b %%zmm" T7 ", %%zmm" T6 ", %%zmm" C "%{%%k2%}%{z%}\n\t"                                   \
    "vpunpcklbw %%zmm" L1 ", %%zmm" L0 ", %%zmm" D0 "\n\t"                                              \
    "vpunpckhbw %%zmm" L1 ", %%zmm" L0 ", %%zmm" L1 "\n\t"                                              \
    "vpunpcklbw %%zmm" C ", %%zmm" H0 ", %%zmm" D2 "\n\t"                                               \
    "vpunpckhbw %%zmm" C ", %%zmm" H0 ", %%zmm" C "\n\t"
#define R3_NEXT "add $64, %[wp]\n\t" "add $4, %[xp]\n\t" "dec %[n]\n\t" "jnz 1b\n\t"
#define R3_OPERANDS                                                                                       \
    : [wp] "+r"(wp), [xp] "+r"(xp), [n] "+r"(np), [nan] "=r"(nan)                                       \
    : [tab] "r"(digit_tab), [sw] "m"(swap67_q), [nm] "m"(nan_test_b), [acc] "r"(acc)
#define R3_LOAD_TABLES                                                                                    \
    "vmovdqa64 0(%[tab]), %%zmm" T0 "\n\t"                                                              \
    "vmovdqa64 64(%[tab]), %%zmm" T1 "\n\t"                                                             \
    "vmovdqa64 128(%[tab]), %%zmm" T2 "\n\t"                                                            \
    "vmovdqa64 192(%[tab]), %%zmm" T3 "\n\t"                                                            \
    "vmovdqa64 256(%[tab]), %%zmm" T4 "\n\t"                                                            \
    "vmovdqa64 320(%[tab]), %%zmm" T5 "\n\t"                                                            \
    "vmovdqa64 384(%[tab]), %%zmm" T6 "\n\t"                                                            \
    "vmovdqa64 448(%[tab]), %%zmm" T7 "\n\t"                                                            \
    "kxorq %%k4, %%k4, %%k4\n\t"

static const uint64_t swap67_q = SWAP67;
static const _Alignas(64) uint8_t nan_test_b[64] = {
    0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf,
    0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf,
    0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf,
    0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf, 0xbf,
};

/* the digit tables, in zmm22-29 in both variants */
#define T0 "22"
#define T1 "23"
#define T2 "24"
#define T3 "25"
#define T4 "26"
#define T5 "27"
#define T6 "28"
#define T7 "29"

/* one row: accumulators zmm0-7, decode temps zmm8-13, broadcasts zmm14-15 */
RS_TARGET_VNNI static uint64_t r3_block_1(const uint8_t *wp, const int32_t *xp, long np, int32_t acc[8][16]) {
    uint64_t nan;
    __asm__ volatile(R3_LOAD_TABLES
                     ASM_ZERO("0") ASM_ZERO("1") ASM_ZERO("2") ASM_ZERO("3") ASM_ZERO("4") ASM_ZERO("5")
                     ASM_ZERO("6") ASM_ZERO("7")
                     "1:\n\t"
                     R3_DECODE("8", "9", "10", "11", "12", "13")
                     "vpbroadcastd (%[xp]), %%zmm14\n\t"
                     "vpbroadcastd 256(%[xp]), %%zmm15\n\t"
                     "vpdpwssd %%zmm14, %%zmm12, %%zmm0\n\t"  /* S_LL: d0 . xl */
                     "vpdpwssd %%zmm14, %%zmm10, %%zmm1\n\t"  /*       d1 . xl */
                     "vpdpwssd %%zmm15, %%zmm12, %%zmm2\n\t"  /* S_X:  d0 . xh */
                     "vpdpwssd %%zmm15, %%zmm10, %%zmm3\n\t"
                     "vpdpwssd %%zmm14, %%zmm13, %%zmm4\n\t"  /*       d2 . xl */
                     "vpdpwssd %%zmm14, %%zmm8, %%zmm5\n\t"
                     "vpdpwssd %%zmm15, %%zmm13, %%zmm6\n\t"  /* S_HH: d2 . xh */
                     "vpdpwssd %%zmm15, %%zmm8, %%zmm7\n\t"
                     R3_NEXT
                     ASM_STORE_0_7
                     "kmovq %%k4, %[nan]"
                     R3_OPERANDS
                     : "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10",
                       "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26",
                       "zmm27", "zmm28", "zmm29", "k1", "k2", "k3", "k4", "cc", "memory");
    return nan;
}
/* one row whose block is one digit X (r3_x.x1): A_L = sum X Lw in zmm0-1, A_H = sum X Hw in
 * zmm2-3 (outputs 0-15, 16-31); half the products of r3_block_1. */
RS_TARGET_VNNI static uint64_t r3_block_1x(const uint8_t *wp, const int32_t *xp, long np, int32_t acc[4][16]) {
    uint64_t nan;
    __asm__ volatile(R3_LOAD_TABLES
                     ASM_ZERO("0") ASM_ZERO("1") ASM_ZERO("2") ASM_ZERO("3")
                     "1:\n\t"
                     R3_DECODE("8", "9", "10", "11", "12", "13")
                     "vpbroadcastd (%[xp]), %%zmm14\n\t"
                     "vpdpwssd %%zmm14, %%zmm12, %%zmm0\n\t"  /* A_L: d0 . X, d1 . X */
                     "vpdpwssd %%zmm14, %%zmm10, %%zmm1\n\t"
                     "vpdpwssd %%zmm14, %%zmm13, %%zmm2\n\t"  /* A_H: d2 . X, d3 . X */
                     "vpdpwssd %%zmm14, %%zmm8, %%zmm3\n\t"
                     R3_NEXT
                     ASM_STORE("0", "0") ASM_STORE("1", "64") ASM_STORE("2", "128") ASM_STORE("3", "192")
                     "kmovq %%k4, %[nan]"
                     R3_OPERANDS
                     : "zmm0", "zmm1", "zmm2", "zmm3", "zmm8", "zmm9", "zmm10", "zmm11", "zmm12", "zmm13", "zmm14",
                       "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "k1", "k2", "k3", "k4",
                       "cc", "memory");
    return nan;
}
/* two rows: accumulators zmm0-11, decode temps zmm12-17, broadcasts zmm18-21 */
RS_TARGET_VNNI static uint64_t r3_block_2(const uint8_t *wp, const int32_t *xp, long np, int32_t acc[12][16]) {
    uint64_t nan;
    __asm__ volatile(R3_LOAD_TABLES
                     ASM_ZERO("0") ASM_ZERO("1") ASM_ZERO("2") ASM_ZERO("3") ASM_ZERO("4") ASM_ZERO("5")
                     ASM_ZERO("6") ASM_ZERO("7") ASM_ZERO("8") ASM_ZERO("9") ASM_ZERO("10") ASM_ZERO("11")
                     "1:\n\t"
                     R3_DECODE("12", "13", "14", "15", "16", "17")
                     "vpbroadcastd (%[xp]), %%zmm18\n\t"
                     "vpbroadcastd 256(%[xp]), %%zmm19\n\t"
                     "vpbroadcastd 4096(%[xp]), %%zmm20\n\t"
                     "vpbroadcastd 4352(%[xp]), %%zmm21\n\t"
                     "vpdpwssd %%zmm18, %%zmm16, %%zmm0\n\t"  /* row 0 S_LL: d0 . xl, d1 . xl */
                     "vpdpwssd %%zmm18, %%zmm14, %%zmm1\n\t"
                     "vpdpwssd %%zmm19, %%zmm16, %%zmm2\n\t"  /* S_X: d0 . xh + d2 . xl */
                     "vpdpwssd %%zmm19, %%zmm14, %%zmm3\n\t"
                     "vpdpwssd %%zmm19, %%zmm17, %%zmm4\n\t"  /* S_HH: d2 . xh */
                     "vpdpwssd %%zmm19, %%zmm12, %%zmm5\n\t"
                     "vpdpwssd %%zmm20, %%zmm16, %%zmm6\n\t"  /* row 1 */
                     "vpdpwssd %%zmm20, %%zmm14, %%zmm7\n\t"
                     "vpdpwssd %%zmm21, %%zmm16, %%zmm8\n\t"
                     "vpdpwssd %%zmm21, %%zmm14, %%zmm9\n\t"
                     "vpdpwssd %%zmm21, %%zmm17, %%zmm10\n\t"
                     "vpdpwssd %%zmm21, %%zmm12, %%zmm11\n\t"
                     "vpdpwssd %%zmm18, %%zmm17, %%zmm2\n\t"
                     "vpdpwssd %%zmm18, %%zmm12, %%zmm3\n\t"
                     "vpdpwssd %%zmm20, %%zmm17, %%zmm8\n\t"
                     "vpdpwssd %%zmm20, %%zmm12, %%zmm9\n\t"
                     R3_NEXT
                     ASM_STORE_0_7
                     ASM_STORE("8", "512") ASM_STORE("9", "576") ASM_STORE("10", "640") ASM_STORE("11", "704")
                     "kmovq %%k4, %[nan]"
                     R3_OPERANDS
                     : "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10",
                       "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20",
                       "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "k1", "k2",
                       "k3", "k4", "cc", "memory");
    return nan;
}
#undef T0
#undef T1
#undef T2
#undef T3
#undef T4
#undef T5
#undef T6
#undef T7
#undef R3_DECODE
#undef R3_LOAD_TABLES
#undef R3_NEXT
#undef R3_OPERANDS

/* NR rows (of the super-block's px, from row ro) x the 32 outputs of group g, blocks [b0, b0 + nb);
 * acc [NR][32] holds the fmaf accumulators between super-blocks. Each 64-byte load is pair p of
 * all 32 outputs; decode64 makes its L and H words, output j in lane j (j < 16) of d[0] / d[2] and
 * output 16 + j in lane j of d[1] / d[3], and the row's L and H word pairs are broadcast. With
 * more than one row, S_X takes one accumulator per half (two products a pair), which keeps the
 * tile in registers. */
RS_TARGET_VNNI INLINE void r3_group(const vjob *jb, const r3_x *px, const int NR, int ro, int64_t g, int64_t b0,
                                    int nb, float acc[][32]) {
    const int64_t k = jb->k, kb = jb->kb;
    const uint8_t *wg = jb->wq + g * RS_FP8_PAIRS32_ROWS * k;
    const float *wsb = jb->ws + (g * RS_FP8_PAIRS32_ROWS / BLK) * kb;
    _Static_assert(sizeof px->w[0] == 4096 && sizeof px->w[0][0] == 512, "r3_block_*'s offsets");
    __m512 a[R3_ROWS][2];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) {
        a[r][0] = _mm512_loadu_ps(acc[r]);
        a[r][1] = _mm512_loadu_ps(acc[r] + 16);
    }
    _Alignas(64) int32_t sums[12][16];
    for (int bi = 0; bi < nb; bi++) {
        const int64_t b = b0 + bi, np = RS_MIN((int64_t)BLK, k - b * BLK) / 2;
        const uint8_t *wp = wg + b * (BLK / 2) * 64;
        if (NR == 1 && px->one[ro][bi]) {
            /* one digit: 2^-18 (32 A_L + 4096 A_H), |A_H| < 64 * 2 * 7168 * 1920 < 2^31 */
            const uint64_t wnan = r3_block_1x(wp, px->x1[ro][bi], (long)np, sums);
            const uint32_t nan = px->nan[ro][bi]                 ? 0xffffffffu
                                 : __builtin_expect(wnan != 0, 0) ? pairs32_nan_outputs(wnan)
                                                                  : 0;
            const __m512 sx = _mm512_set1_ps(px->s[ro][bi] * wsb[b]);
#pragma GCC unroll 2
            for (int v = 0; v < 2; v++) {
                __m256 f[2];
#pragma GCC unroll 2
                for (int hf = 0; hf < 2; hf++) {
                    const __m512d al = _mm512_cvtepi32_pd(_mm256_load_si256((const __m256i *)(sums[v] + 8 * hf)));
                    const __m512d ah = _mm512_cvtepi32_pd(_mm256_load_si256((const __m256i *)(sums[2 + v] + 8 * hf)));
                    const __m512d t =
                        _mm512_fmadd_pd(ah, _mm512_set1_pd(4096.0), _mm512_mul_pd(al, _mm512_set1_pd(32.0)));
                    f[hf] = _mm512_cvtpd_ps(_mm512_mul_pd(t, _mm512_set1_pd(0x1p-18)));
                }
                __m512 bs = _mm512_insertf32x8(_mm512_castps256_ps512(f[0]), f[1], 1);
                bs = _mm512_mask_mov_ps(bs, (__mmask16)(nan >> (16 * v)), _mm512_set1_ps(NAN));
                a[0][v] = _mm512_fmadd_ps(bs, sx, a[0][v]);
            }
            continue;
        }
        const uint64_t wnan = NR == 1 ? r3_block_1(wp, px->w[ro][bi][0], (long)np, sums)
                                      : r3_block_2(wp, px->w[ro][bi][0], (long)np, sums);
        const uint32_t wout = __builtin_expect(wnan != 0, 0) ? pairs32_nan_outputs(wnan) : 0;
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            const uint32_t nan = px->nan[ro + r][bi] ? 0xffffffffu : wout;
            const __m512 sx = _mm512_set1_ps(px->s[ro + r][bi] * wsb[b]);
#pragma GCC unroll 16
            for (int v = 0; v < 2; v++) {
                const int32_t *ll = sums[NR == 1 ? v : 6 * r + v], *hh = sums[NR == 1 ? 6 + v : 6 * r + 4 + v];
                const __m512i x = NR == 1 ? _mm512_add_epi32(_mm512_load_si512(sums[2 + v]), _mm512_load_si512(sums[4 + v]))
                                          : _mm512_load_si512(sums[6 * r + 2 + v]);
                const __m256 lo = combine8(_mm256_load_si256((const __m256i *)ll), _mm512_castsi512_si256(x),
                                           _mm256_load_si256((const __m256i *)hh));
                const __m256 hi = combine8(_mm256_load_si256((const __m256i *)(ll + 8)), _mm512_extracti64x4_epi64(x, 1),
                                           _mm256_load_si256((const __m256i *)(hh + 8)));
                __m512 bs = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
                bs = _mm512_mask_mov_ps(bs, (__mmask16)(nan >> (16 * v)), _mm512_set1_ps(NAN));
                a[r][v] = _mm512_fmadd_ps(bs, sx, a[r][v]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(acc[r], a[r][0]);
        _mm512_storeu_ps(acc[r] + 16, a[r][1]);
    }
}

RS_TARGET_VNNI static void r3_group_1(const vjob *jb, const r3_x *px, int ro, int64_t g, int64_t b0, int nb,
                                      float acc[][32]) {
    r3_group(jb, px, 1, ro, g, b0, nb, acc);
}

RS_TARGET_VNNI static void r3_group_2(const vjob *jb, const r3_x *px, int ro, int64_t g, int64_t b0, int nb,
                                      float acc[][32]) {
    r3_group(jb, px, 2, ro, g, b0, nb, acc);
}

/* Rows [r0, r0 + nr) (nr <= R1_ROWS) x the whole groups of outputs [o0, o1). */
RS_TARGET_VNNI static void r3_item(const vjob *jb, const vlut *l, int r0, int nr, int64_t o0, int64_t o1) {
    r3_x px;
    float acc[CHUNK / RS_FP8_PAIRS32_ROWS][R1_ROWS][32];
    memset(acc, 0, sizeof acc);
    /* a group's weights are one contiguous run: read it front to back (the activation digits of a
     * super-block are decoded again for each group, ~2% of the work) */
    for (int64_t o = o0; o < o1; o += RS_FP8_PAIRS32_ROWS) {
        float(*a)[32] = acc[(o - o0) / RS_FP8_PAIRS32_ROWS];
        for (int64_t b0 = 0; b0 < jb->kb; b0 += SB) {
            const int nb = (int)RS_MIN((int64_t)SB, jb->kb - b0);
            if (o == o0 || jb->kb > SB) r3_prep(&px, jb, l, r0, nr, b0, nb); /* one super-block: once */
            for (int ro = 0; ro < nr; ro += R3_ROWS) {
                if (nr - ro >= 2)
                    r3_group_2(jb, &px, ro, o / RS_FP8_PAIRS32_ROWS, b0, nb, a + ro);
                else
                    r3_group_1(jb, &px, ro, o / RS_FP8_PAIRS32_ROWS, b0, nb, a + ro);
            }
        }
    }
    for (int64_t o = o0; o < o1; o += RS_FP8_PAIRS32_ROWS)
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < 2; v++)
                _mm512_storeu_ps(jb->out + (int64_t)(r0 + r) * jb->n + o + 16 * v,
                                 canonical_nan16(_mm512_loadu_ps(acc[(o - o0) / RS_FP8_PAIRS32_ROWS][r] + 16 * v)));
}

/* ---------------------------------------------------------------------------------------------
 * Many rows: lanes = rows
 * ------------------------------------------------------------------------------------------- */

/* The state of an item's one to four row tiles (more than one only with RS_LAYOUT_FP8_PAIRS32
 * weights, whose decoded digits then serve up to 64 rows): the block's transposed activations, the running fmaf
 * accumulators of the chunk, and one group's decoded weight digits. Pair p of a block is dword
 * p % 16 of word vector p / 16 in the order (L_a, L_b) of codes 0-63, then of codes 64-127 — the
 * same for x (per row) and w.
 *
 * The activations take one digit plus a rare remainder: V = 2^s X + r with X = V >> s (floor) and
 * r = V & (2^s - 1), nonzero only for small codes. The block sum is 2^-18 (2^s A_L + 2^(s+7) A_H +
 * R_L + 128 R_H) with A_L = sum X Lw, A_H = sum X Hw, R_L = sum r Lw, R_H = sum r Hw, each an
 * int32 lane per row over the block. A_H takes one vpdpwssd per output and pair; A_L runs only
 * over the pairs where the weight has an L digit, R_* only over those where a row has a remainder
 * (skipping a zero product changes no integer sum). The shift is chosen per tile and block:
 *   s = 4: X = (L >> 4) + 8 H (|X| <= 14336, an int16), r = L & 15, nonzero only for codes that
 *          are not multiples of 2^-5, all below 2^-2 (|x| < amax / 1792). No weight digit exceeds
 *          1920 in magnitude (NaN codes included), so every partial sum of a row is within 1920
 *          sum |X|: s = 4 is taken
 *          when each row of the tile has sum |X| <= 1118481 = (2^31 - 1) / 1920, which typical
 *          activations meet with room to spare (a row of all-448 codes does not);
 *   s = 5: X = V >> 5 = (L >> 5) + 4 H (|X| <= 7168), r = L & 31 (codes below 2^-1): |A_H| <=
 *          128 * 7680 * 1920 < 2^31 whatever the codes, so it is always safe.
 * A smaller shift means fewer remainders: on the o and down projections of a Qwen3-0.6B-shaped
 * model in a 512-token prefill, about a third fewer pairs with one. */
typedef struct r2_state {
    _Alignas(64) int32_t xt[R2_TILES][2][64][R2_ROWS]; /* [tile][X/r][pair][row] */
    _Alignas(64) int32_t rowv[2][4][R2_ROWS][16]; /* [X/r][word vector][row][dword]: before transposing */
    _Alignas(64) int32_t wd[R2_NO][2][64];     /* [output][L/H][pair] */
    _Alignas(64) float acc[CHUNK][R2_TILES * R2_ROWS]; /* [output - o0][row of the item] */
    _Alignas(64) float s[R2_TILES][R2_ROWS];   /* x scales of the block */
    double xd[R2_TILES];                       /* per tile, 2^s: the activation digit's weight */
    _Alignas(64) int32_t wdp[64][2][32];       /* RS_LAYOUT_FP8_PAIRS32: [pair][L/H][output] of a group */
    _Alignas(64) uint32_t lmask[64];           /* ... per pair, the outputs with an L digit there */
    uint64_t rpairs[R2_TILES];                 /* per tile, the pairs where a row has a remainder */
} r2_state;

/* Tile t's rows [r0, r0 + nr) (nr <= R2_ROWS; the rest padded with zeros) for block b. */
RS_TARGET_VNNI static void r2_prep(r2_state *st, int t, __mmask16 *xnan, const vjob *jb, const vlut *l, int r0,
                                   int nr, int64_t b) {
    const int64_t j0 = b * BLK;
    const __m512i low4 = _mm512_set1_epi16(15), ones = _mm512_set1_epi16(1);
    __m512i rany = _mm512_setzero_si512();
    *xnan = 0;
    int32_t xabs_max = 0; /* the largest row sum of |X| with s = 4 */
    for (int r = 0; r < R2_ROWS; r++) {
        const uint8_t *x = jb->xq + (int64_t)(r0 + RS_MIN(r, nr - 1)) * jb->k + j0;
        __mmask64 nan = 0;
        __m512i xabs = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int h = 0; h < 2; h++) {
            __m512i d[4];
            const __mmask64 m = r < nr ? tail_mask(jb->k - j0 - 64 * h) : 0; /* padding rows: zeros */
            decode64(_mm512_maskz_loadu_epi8(m, x + 64 * h), l, d, &nan);
#pragma GCC unroll 2
            for (int v = 0; v < 2; v++) { /* v: the unpacklo, unpackhi words; X = (L >> 4) + 8 H, r = L & 15 */
                const __m512i xv = _mm512_add_epi16(_mm512_srai_epi16(d[v], 4), _mm512_slli_epi16(d[2 + v], 3));
                const __m512i rv = _mm512_and_si512(d[v], low4);
                _mm512_store_si512(st->rowv[0][2 * h + v][r], xv);
                _mm512_store_si512(st->rowv[1][2 * h + v][r], rv);
                rany = _mm512_or_si512(rany, rv);
                xabs = _mm512_add_epi32(xabs, _mm512_madd_epi16(_mm512_abs_epi16(xv), ones));
            }
        }
        const int32_t row_abs = _mm512_reduce_add_epi32(xabs);
        xabs_max = RS_MAX(xabs_max, row_abs);
        if (nan) *xnan |= (__mmask16)(1u << r);
        st->s[t][r] = r < nr ? jb->xs[(int64_t)(r0 + r) * jb->kb + b] : 0.0f;
    }
    st->xd[t] = 16.0;
    if (__builtin_expect(xabs_max > R2_XABS_MAX4, 0)) { /* s = 5 (see r2_state): X >> 1, r | (X & 1) << 4 */
        rany = _mm512_setzero_si512();
        for (int r = 0; r < R2_ROWS; r++)
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                const __m512i xv = _mm512_load_si512(st->rowv[0][g][r]);
                const __m512i rv = _mm512_or_si512(_mm512_load_si512(st->rowv[1][g][r]),
                                                   _mm512_slli_epi16(_mm512_and_si512(xv, ones), 4));
                _mm512_store_si512(st->rowv[0][g][r], _mm512_srai_epi16(xv, 1));
                _mm512_store_si512(st->rowv[1][g][r], rv);
                rany = _mm512_or_si512(rany, rv);
            }
        st->xd[t] = 32.0;
    }
    const bool rem = _mm512_test_epi32_mask(rany, rany) != 0;
    uint64_t rp = 0;
    for (int dg = 0; dg < (rem ? 2 : 1); dg++) /* no remainders: xt[t][1] is never read */
        for (int g = 0; g < 4; g++) {
            __m512i v[16];
#pragma GCC unroll 16
            for (int r = 0; r < 16; r++) v[r] = _mm512_load_si512(st->rowv[dg][g][r]);
            rs_transpose16_epi32(v);
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                _mm512_store_si512(st->xt[t][dg][16 * g + j], v[j]);
                if (dg == 1) rp |= (uint64_t)(_mm512_test_epi32_mask(v[j], v[j]) != 0) << (16 * g + j);
            }
        }
    st->rpairs[t] = rp;
}

/* 2^-18 (xd al + 128 xd ah + R) for the 16 lanes (xd = 2^s), R = rl + 128 rh in int32 (|R| <
 * 2^30: r < 32, so |rh| < 128 * 31 * 1920 and |rl| < 128 * 31 * 960). Each term is a power of two
 * times an int32 and every partial sum a multiple of 2^-18 below 2^25, so the double sums are
 * exact, rounded once to fp32. al and R are left out where they are zero (has_l, has_r:
 * constants where this is inlined). */
RS_TARGET_VNNI INLINE __m512 block_sums16(__m512i al, __m512i ah, __m512i rl, __m512i rh, double xd, const bool has_l,
                                         const bool has_r) {
    const __m512d kh = _mm512_set1_pd(128.0 * xd * 0x1p-18), kl = _mm512_set1_pd(xd * 0x1p-18);
    const __m512d kr = _mm512_set1_pd(0x1p-18);
    const __m512i rr = has_r ? _mm512_add_epi32(rl, _mm512_slli_epi32(rh, 7)) : _mm512_setzero_si512();
    __m256 f[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
#define R2_Q(v) _mm512_cvtepi32_pd(h ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v))
        __m512d t = _mm512_mul_pd(R2_Q(ah), kh);
        if (has_r) t = _mm512_fmadd_pd(R2_Q(rr), kr, t);
        if (has_l) t = _mm512_fmadd_pd(R2_Q(al), kl, t);
#undef R2_Q
        f[h] = _mm512_cvtpd_ps(t);
    }
    return _mm512_insertf32x8(_mm512_castps256_ps512(f[0]), f[1], 1);
}

/* Tile t's block sums of R2_NO outputs (the first cnt stored) into their fmaf accumulators
 * acc[q][16 t ..]: with wnan[q] the output's block is NaN, with bit r of xnan row r's. */
RS_TARGET_VNNI INLINE void r2_finish_v(const r2_state *st, int t, const __m512i al[R2_NO], const __m512i ah[R2_NO],
                                       const __m512i rl[R2_NO], const __m512i rh[R2_NO], __mmask16 xnan,
                                       const bool wnan[R2_NO], float wsb, int64_t b,
                                       float (*acc)[R2_TILES * R2_ROWS], int cnt, const bool has_l, const bool has_r) {
    const __m512 sx = _mm512_mul_ps(_mm512_load_ps(st->s[t]), _mm512_set1_ps(wsb));
#pragma GCC unroll 16
    for (int q = 0; q < R2_NO; q++) {
        if (q >= cnt) break;
        __m512 bs = block_sums16(al[q], ah[q], rl[q], rh[q], st->xd[t], has_l, has_r);
        bs = _mm512_mask_mov_ps(bs, wnan[q] ? (__mmask16)0xffff : xnan, _mm512_set1_ps(NAN));
        float *a = acc[q] + R2_ROWS * t;
        const __m512 prev = b == 0 ? _mm512_setzero_ps() : _mm512_load_ps(a);
        _mm512_store_ps(a, _mm512_fmadd_ps(bs, sx, prev));
    }
}

/* r2_finish_v with has_l (some output has an L digit in the block: al may be nonzero) and has_r
 * (tile t has remainders: rl, rh may be), one inlined copy per case. */
RS_TARGET_VNNI INLINE void r2_finish(const r2_state *st, int t, const __m512i al[R2_NO], const __m512i ah[R2_NO],
                                     const __m512i rl[R2_NO], const __m512i rh[R2_NO], __mmask16 xnan,
                                     const bool wnan[R2_NO], float wsb, int64_t b,
                                     float (*acc)[R2_TILES * R2_ROWS], int cnt, bool has_l) {
    switch (has_l + 2 * (st->rpairs[t] != 0)) {
    case 0: r2_finish_v(st, t, al, ah, rl, rh, xnan, wnan, wsb, b, acc, cnt, false, false); break;
    case 1: r2_finish_v(st, t, al, ah, rl, rh, xnan, wnan, wsb, b, acc, cnt, true, false); break;
    case 2: r2_finish_v(st, t, al, ah, rl, rh, xnan, wnan, wsb, b, acc, cnt, false, true); break;
    default: r2_finish_v(st, t, al, ah, rl, rh, xnan, wnan, wsb, b, acc, cnt, true, true); break;
    }
}

/* Tile t's remainder products of outputs q < nq over its remainder pairs: rl[q] += r . Lw,
 * rh[q] += r . Hw, with output q's L and H word pairs of pair p at wl + p * wps + q * wqs (H:
 * + hoff) int32. */
RS_TARGET_VNNI INLINE void r2_remainders(const r2_state *st, int t, const int32_t *wl, int64_t wps, int64_t wqs,
                                         int64_t hoff, __m512i rl[R2_NO], __m512i rh[R2_NO]) {
    /* local accumulators, stored once: rl and rh may live in memory (indexed by a tile number) */
    __m512i l[R2_NO], h[R2_NO];
#pragma GCC unroll 4
    for (int q = 0; q < R2_NO; q++) l[q] = rl[q], h[q] = rh[q];
    for (uint64_t m = st->rpairs[t]; m; m &= m - 1) {
        const int p = __builtin_ctzll(m);
        const __m512i r = _mm512_load_si512(st->xt[t][1][p]);
#pragma GCC unroll 4
        for (int q = 0; q < R2_NO; q++) {
            l[q] = dp_one(l[q], r, wl + p * wps + q * wqs);
            h[q] = dp_one(h[q], r, wl + p * wps + q * wqs + hoff);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < R2_NO; q++) rl[q] = l[q], rh[q] = h[q];
}

/* R2_NO outputs o.. (the last ones repeated past o1, not stored) over block b. */
RS_TARGET_VNNI static void r2_group(r2_state *st, int t, __mmask16 xnan, const vjob *jb, const vlut *l, int64_t o0,
                                    int64_t o, int64_t o1, int64_t b) {
    const int64_t k = jb->k, j0 = b * BLK, kw = RS_MIN((int64_t)BLK, k - j0);
    const int np = kw > 64 ? 64 : 32; /* pairs past the codes are zero */
    __mmask64 wnan[R2_NO];
#pragma GCC unroll 16
    for (int q = 0; q < R2_NO; q++) {
        const uint8_t *w = jb->wq + RS_MIN(o + q, o1 - 1) * k + j0;
        wnan[q] = 0;
        _mm_prefetch((const char *)(w + BLK), _MM_HINT_T0); /* the next block: needed a chunk later */
        _mm_prefetch((const char *)(w + BLK + 64), _MM_HINT_T0);
#pragma GCC unroll 16
        for (int h = 0; h < 2; h++) {
            __m512i d[4];
            decode64(_mm512_maskz_loadu_epi8(tail_mask(kw - 64 * h), w + 64 * h), l, d, &wnan[q]);
            _mm512_store_si512(&st->wd[q][0][32 * h], d[0]);
            _mm512_store_si512(&st->wd[q][0][32 * h + 16], d[1]);
            _mm512_store_si512(&st->wd[q][1][32 * h], d[2]);
            _mm512_store_si512(&st->wd[q][1][32 * h + 16], d[3]);
        }
    }
    /* Most weight codes of a block have the top exponent bit set (blocks are scaled to amax 448,
     * and only |w| < 2 in E4M3 units has it clear: ~1.6% of Gaussian weights), so their L digit is
     * zero. The H digits go through every pair; the L digits only through the pairs where either
     * of the output's two words is nonzero, found from a mask. Skipping a zero product leaves the
     * integer sums as they were, so the result stays exact. */
    uint64_t lpairs[R2_NO];
#pragma GCC unroll 16
    for (int q = 0; q < R2_NO; q++) {
        lpairs[q] = 0;
#pragma GCC unroll 16
        for (int g = 0; g < 4; g++) {
            const __m512i v = _mm512_load_si512(&st->wd[q][0][16 * g]);
            lpairs[q] |= (uint64_t)_mm512_test_epi32_mask(v, v) << (16 * g);
        }
        if (np < 64) lpairs[q] &= ((uint64_t)1 << np) - 1;
    }
    __m512i al[R2_NO], ah[R2_NO], rl[R2_NO], rh[R2_NO];
#pragma GCC unroll 16
    for (int q = 0; q < R2_NO; q++) al[q] = ah[q] = rl[q] = rh[q] = _mm512_setzero_si512();
    _Static_assert(R2_NO == 4 && R2_ROWS == 16, "dp_h4_rows' layout");
    dp_h4_rows(ah, &st->xt[t][0][0][0], &st->wd[0][0][0], &st->wd[0][1][0], np);
#pragma GCC unroll 16
    for (int q = 0; q < R2_NO; q++) {
        for (uint64_t m = lpairs[q]; m; m &= m - 1) {
            const int p = __builtin_ctzll(m);
            al[q] = dp_one(al[q], _mm512_load_si512(st->xt[t][0][p]), &st->wd[q][0][p]);
        }
    }
    r2_remainders(st, t, &st->wd[0][0][0], 1, 2 * 64, 64, rl, rh); /* wd [output][L/H][pair] */
    bool nan[R2_NO];
#pragma GCC unroll 16
    for (int q = 0; q < R2_NO; q++) nan[q] = wnan[q] != 0;
    r2_finish(st, t, al, ah, rl, rh, xnan, nan, jb->ws[(o / BLK) * jb->kb + b], b, &st->acc[o - o0],
              (int)RS_MIN((int64_t)R2_NO, o1 - o), (lpairs[0] | lpairs[1] | lpairs[2] | lpairs[3]) != 0);
}

/* r2 numbers a block's pairs in decode64's order (r2_state): pair p = 32h + 8L + i (i < 8) of the
 * block is dword 4L + i % 4 of word vector 2h + i / 4. */
#define R2_PO(p) (16 * (2 * ((p) / 32) + ((p) % 8) / 4) + 4 * (((p) % 32) / 8) + (p) % 4)
#define R2_PO4(p)  R2_PO(p), R2_PO((p) + 1), R2_PO((p) + 2), R2_PO((p) + 3)
#define R2_PO16(p) R2_PO4(p), R2_PO4((p) + 4), R2_PO4((p) + 8), R2_PO4((p) + 12)
static const uint8_t r2_pair_order[64] = {R2_PO16(0), R2_PO16(16), R2_PO16(32), R2_PO16(48)};

/* The 32 outputs of RS_LAYOUT_FP8_PAIRS32 group g over block b: the group's weight digits decoded
 * once into wdp ([pair][L/H][output], pair p's 64 bytes giving one row of each digit), then
 * R2_NO outputs at a time as in r2_group, broadcasting from wdp. */
RS_TARGET_VNNI static void r2_group_pairs(r2_state *st, int nt, const __mmask16 xnan[R2_TILES], const vjob *jb,
                                          const vlut *l, int64_t o0, int64_t g, int64_t b) {
    const int64_t k = jb->k, kw = RS_MIN((int64_t)BLK, k - b * BLK), np = kw / 2;
    const int npr = kw > 64 ? 64 : 32; /* pairs in r2's order, as in r2_group */
    const uint8_t *wp = jb->wq + g * RS_FP8_PAIRS32_ROWS * k + b * (BLK / 2) * 64;
    const int64_t gstride = RS_FP8_PAIRS32_ROWS * k;
    __mmask64 wnan = 0;
    if (np < npr) { /* a ragged last block: missing pairs are zeros */
        memset(st->wdp, 0, sizeof st->wdp);
        memset(st->lmask, 0, sizeof st->lmask);
    }
    for (int64_t p0 = 0; p0 < np; p0 += 4) {
        const int pr0 = r2_pair_order[p0]; /* pairs p0 .. p0 + 3 are consecutive in r2's order too */
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            if (p0 + i >= np) break;
            const uint8_t *c = wp + 64 * (p0 + i);
            __m512i d[4];
            _mm_prefetch((const char *)(c + 4096), _MM_HINT_T0);   /* this group's next block */
            _mm_prefetch((const char *)(c + gstride), _MM_HINT_T0); /* the next group's block */
            decode64(_mm512_loadu_si512(c), l, d, &wnan);
#pragma GCC unroll 16
            for (int v = 0; v < 4; v++) _mm512_store_si512(&st->wdp[pr0 + i][v / 2][16 * (v % 2)], d[v]);
            /* L digits are rare (see r2_group): note the outputs that have one at this pair */
            st->lmask[pr0 + i] = _cvtmask32_u32(
                _mm512_kunpackw(_mm512_test_epi32_mask(d[1], d[1]), _mm512_test_epi32_mask(d[0], d[0])));
        }
    }
    __m512i lmv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) lmv[v] = _mm512_load_si512(&st->lmask[16 * v]);
    const uint32_t wout = __builtin_expect(wnan != 0, 0) ? pairs32_nan_outputs(wnan) : 0;
    const float wsb = jb->ws[(g * RS_FP8_PAIRS32_ROWS / BLK) * jb->kb + b];
    for (int q0 = 0; q0 < RS_FP8_PAIRS32_ROWS; q0 += R2_NO) {
        __m512i al[R2_TILES][R2_NO], ah[R2_TILES][R2_NO], rl[R2_TILES][R2_NO], rh[R2_TILES][R2_NO];
#pragma GCC unroll 16
        for (int t = 0; t < R2_TILES; t++)
#pragma GCC unroll 16
            for (int q = 0; q < R2_NO; q++) al[t][q] = ah[t][q] = rl[t][q] = rh[t][q] = _mm512_setzero_si512();
        if (nt == 4) {
            _Alignas(64) int32_t h16[16][16];
            dp_h4_pairs4(h16, &st->xt[0][0][0][0], &st->wdp[0][0][0], &st->wdp[0][1][q0], npr);
#pragma GCC unroll 16
            for (int t = 0; t < 4; t++)
#pragma GCC unroll 16
                for (int q = 0; q < R2_NO; q++) ah[t][q] = _mm512_load_si512(h16[4 * t + q]);
        } else {
            int t = 0;
            if (nt >= 2) {
                _Alignas(64) int32_t h8[8][16];
                dp_h4_pairs2(h8, &st->xt[0][0][0][0], &st->wdp[0][0][0], &st->wdp[0][1][q0], npr);
#pragma GCC unroll 16
                for (int i = 0; i < 2; i++)
#pragma GCC unroll 16
                    for (int q = 0; q < R2_NO; q++) ah[i][q] = _mm512_load_si512(h8[4 * i + q]);
                t = 2;
            }
            if (t < nt) dp_h4_pairs(ah[t], &st->xt[t][0][0][0], &st->wdp[0][0][0], &st->wdp[0][1][q0], npr);
        }
        /* the pairs where one of the quad's outputs has an L digit (a zero digit adds nothing) */
        const __m512i qm = _mm512_set1_epi32((int)(0xFu << q0));
        uint64_t lp = 0;
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) lp |= (uint64_t)_mm512_test_epi32_mask(lmv[v], qm) << (16 * v);
        for (int t = 0; t < nt; t++) { /* tile by tile, so that the sums stay in registers */
            __m512i a[R2_NO];
#pragma GCC unroll 16
            for (int q = 0; q < R2_NO; q++) a[q] = _mm512_setzero_si512();
            for (uint64_t m = lp; m; m &= m - 1) {
                const int p = __builtin_ctzll(m);
                const __m512i xv = _mm512_load_si512(st->xt[t][0][p]);
#pragma GCC unroll 16
                for (int q = 0; q < R2_NO; q++) a[q] = dp_one(a[q], xv, &st->wdp[p][0][q0 + q]);
            }
#pragma GCC unroll 16
            for (int q = 0; q < R2_NO; q++) al[t][q] = a[q];
        }
        for (int t = 0; t < nt; t++) /* wdp [pair][L/H][output] */
            r2_remainders(st, t, &st->wdp[0][0][q0], 2 * 32, 1, 32, rl[t], rh[t]);
        bool nan[R2_NO];
#pragma GCC unroll 16
        for (int q = 0; q < R2_NO; q++) nan[q] = (wout >> (q0 + q)) & 1;
        for (int t = 0; t < nt; t++)
            r2_finish(st, t, al[t], ah[t], rl[t], rh[t], xnan[t], nan, wsb, b,
                      &st->acc[g * RS_FP8_PAIRS32_ROWS + q0 - o0], R2_NO, lp != 0);
    }
}

/* Rows [r0, r0 + nr) x outputs [o0, o1): one tile of up to R2_ROWS rows, or, when the chunk's
 * weights are RS_LAYOUT_FP8_PAIRS32, up to R2_TILES of them sharing each decoded weight block. */
RS_TARGET_VNNI static void r2_item(const vjob *jb, const vlut *l, int r0, int nr, int64_t o0, int64_t o1) {
    r2_state st;
    const int nt = (nr + R2_ROWS - 1) / R2_ROWS;
    RS_ASSERT(nt <= R2_TILES && (nt == 1 || o1 <= jb->n_packed));
    for (int64_t b = 0; b < jb->kb; b++) {
        __mmask16 xnan[R2_TILES];
        for (int t = 0; t < nt; t++)
            r2_prep(&st, t, &xnan[t], jb, l, r0 + R2_ROWS * t, RS_MIN(R2_ROWS, nr - R2_ROWS * t), b);
        int64_t o = o0;
        for (; o < RS_MIN(o1, jb->n_packed); o += RS_FP8_PAIRS32_ROWS)
            r2_group_pairs(&st, nt, xnan, jb, l, o0, o / RS_FP8_PAIRS32_ROWS, b);
        for (; o < o1; o += R2_NO) r2_group(&st, 0, xnan[0], jb, l, o0, o, o1, b);
    }
    /* acc is [output][row]: transpose 16 x 16 tiles so that each row's outputs are one store */
    for (int t = 0; t < nt; t++)
        for (int64_t o = o0; o < o1; o += 16) {
            const int cnt = (int)RS_MIN((int64_t)16, o1 - o);
            __m512i v[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                v[j] = j < cnt ? _mm512_castps_si512(canonical_nan16(_mm512_load_ps(st.acc[o + j - o0] + R2_ROWS * t)))
                               : _mm512_setzero_si512();
            rs_transpose16_epi32(v);
            for (int r = 0; r < RS_MIN(R2_ROWS, nr - R2_ROWS * t); r++)
                _mm512_mask_storeu_ps(jb->out + (int64_t)(r0 + R2_ROWS * t + r) * jb->n + o,
                                      (__mmask16)((1u << cnt) - 1u), _mm512_castsi512_ps(v[r]));
        }
}

/* ---------------------------------------------------------------------------------------------
 * Driver
 * ------------------------------------------------------------------------------------------- */

/* Items [it0, it1); item = chunk * n_tiles + tile. */
RS_TARGET_VNNI static void vnni_items(void *ctx, int64_t it0, int64_t it1, int tid) {
    (void)tid;
    const vjob *jb = ctx;
    vlut l;
    lut_load(&l);
    for (int64_t it = it0; it < it1; it++) {
        const int64_t o0 = (it / jb->n_tiles) * CHUNK, o1 = RS_MIN(o0 + CHUNK, (int64_t)jb->n);
        const int t = (int)(it % jb->n_tiles);
        if (t < jb->n_r2) {
            const int r0 = t * jb->r2_rows, nr = t == jb->n_r2 - 1 ? jb->r2_last : jb->r2_rows;
            /* a chunk whose outputs are not all packed takes its tiles one at a time */
            if (nr > R2_ROWS && o1 > jb->n_packed) {
                for (int r = 0; r < nr; r += R2_ROWS) r2_item(jb, &l, r0 + r, RS_MIN(R2_ROWS, nr - r), o0, o1);
            } else {
                r2_item(jb, &l, r0, nr, o0, o1);
            }
        } else {
            const int r0 = jb->r1_start + (t - jb->n_r2) * R1_ROWS, nr = RS_MIN(R1_ROWS, jb->rows - r0);
            const int64_t op = RS_MAX(o0, RS_MIN(o1, jb->n_packed)); /* packed groups end */
            if (op > o0) r3_item(jb, &l, r0, nr, o0, op);
            if (o1 > op) r1_item(jb, &l, r0, nr, op, o1);
        }
    }
}

int rs_fp8_gemm_vnni_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("gfni") && __builtin_cpu_supports("fma");
}

void rs_fp8_gemm_vnni(rs_pool *pool, float *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                      int packed, const float *ws, int rows, int n, int k, int r2_min) {
    RS_ASSERT(rows > 0 && n > 0 && k > 0);
    RS_ASSERT(!packed || rs_fp8_pairs32_fits(n, k));
    vjob jb = {
        .out = out, .xq = xq, .xs = xs, .wq = wq, .ws = ws, .rows = rows, .n = n, .k = k,
        .kb = rs_fp8_blocks(k), .n_chunks = ((int64_t)n + CHUNK - 1) / CHUNK,
        .n_packed = packed ? (int64_t)n / RS_FP8_PAIRS32_ROWS * RS_FP8_PAIRS32_ROWS : 0,
    };
    /* packed weights: lanes = rows items of up to four tiles (64 rows), which share each weight
     * decode */
    jb.r2_rows = packed ? R2_TILES * R2_ROWS : R2_ROWS;
    /* The rows past whole items: an item of their own with their whole tiles, and a last padded
     * tile for a part of at least r2_min rows; fewer go to lanes = outputs tiles (cheaper than
     * padding a tile, up to a number of rows that depends on the CPU). */
    const int rem = rows % jb.r2_rows, part = rem % R2_ROWS;
    const int last = rem - part + (part >= r2_min ? part : 0);
    jb.n_r2 = rows / jb.r2_rows + (last > 0);
    jb.r2_last = last > 0 ? last : jb.r2_rows;
    jb.r1_start = rows / jb.r2_rows * jb.r2_rows + last;
    jb.n_tiles = jb.n_r2 + (rows - jb.r1_start + R1_ROWS - 1) / R1_ROWS;
    const int64_t items = jb.n_chunks * jb.n_tiles;
    if (pool)
        rs_pool_run(pool, items, jb.n_tiles, vnni_items, &jb);
    else
        vnni_items(&jb, 0, items, 0);
}

#else /* not x86-64 */

int rs_fp8_gemm_vnni_supported(void) { return 0; }

void rs_fp8_gemm_vnni(rs_pool *pool, float *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                      int packed, const float *ws, int rows, int n, int k, int r2_min) {
    (void)pool, (void)out, (void)xq, (void)xs, (void)wq, (void)packed, (void)ws, (void)rows, (void)n, (void)k, (void)r2_min;
    RS_ASSERT(!"rs_fp8_gemm_vnni on a CPU without AVX-512 VNNI");
}

#endif
