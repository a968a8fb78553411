/*
 * fp8_gemm_avx2.c — the block-scaled E4M3 GEMM of fp8_gemm.h on AVX2 integer dot products
 * (vpmaddwd), bit-identical to rs_fp8_gemm_ref. The kernel of every x86-64 CPU with AVX2 that
 * lacks the AVX-512 VNNI set of fp8_gemm_vnni.c (Haswell to Comet Lake, Zen 1 to 3, Skylake-X).
 *
 * Why integers, and why it is exact (the argument of fp8_gemm_vnni.c). Every E4M3 value is
 * V * 2^-9 with V = ±M * 2^(max(e,1)-1) an integer, M = m (e = 0) or 8 + m. Split V by the top
 * exponent bit e3 into two exclusive 16-bit digits: L = V when e3 = 0 (|L| <= 15 * 2^6 = 960),
 * H = V / 128 when e3 = 1 (exact; |H| <= 14 * 2^7 = 1792). A block sum is
 *
 *   sum_j x_j w_j = 2^-18 (S_LL + 128 S_X + 16384 S_HH),
 *   S_LL = sum Lx Lw,  S_X = sum (Lx Hw + Hx Lw),  S_HH = sum Hx Hw,
 *
 * each below 2^29 in magnitude over a 128-block in any order (at most one of the four digit
 * products of a j is nonzero), so int32 lanes hold them exactly; the combination is an exact int64,
 * and its one rounding to fp32 (times 2^-18, exact) is the reference's fp32 block sum. A NaN code
 * in the block's x or w makes the block sum the canonical NaN, as in the reference. Then the
 * reference's own sequence: the fp32 product of the two scales, fmaf over the blocks in order
 * from +0, NaN outputs canonical. Hence bit-identity, for any tiling and thread count.
 *
 * Digits without a 128-entry lookup (decode32). A digit is a power of two times a signed
 * mantissa: pow = 2^(max(e,1)-1) (L, 1..64) or 2^(e-8) (H, 1..128), an unsigned byte looked up
 * by vpshufb from the 4 exponent bits (0 for the other class), and ±M, a signed byte (m, the
 * implicit bit from another 16-entry vpshufb, vpsignb by the code). vpmaddubsw multiplies
 * unsigned by signed bytes and adds adjacent pairs into int16: with the pow of every odd byte set
 * to 0 (vpshufb zeroes a byte whose index has bit 7 set), the word is the digit of the even code,
 * exactly (one product, |.| <= 1920); likewise for odd codes. 32 codes give four word vectors:
 * L_even, L_odd, H_even, H_odd (word j = the digit of code 2j, or 2j + 1). vpmaddwd then pairs
 * words 2i, 2i + 1, i.e. codes 4i and 4i + 2 (or 4i + 1 and 4i + 3); the activations go through
 * the same decode, so both sides pair the same codes: 16 instructions per 32 codes.
 *
 * Activations in one digit where they can be: a block of codes all >= 2^-3 in E4M3 units (or
 * zero; smaller ones are rare once a block is scaled to amax 448) has every V a multiple of 8, and
 * X = V / 8 fits int16, so a weight chunk takes 4 vpmaddwd per row instead of 8.
 *
 * Arrangements:
 *   - few rows (r1: tiles of 1 or 2 rows with the weight digits in registers, 3..8 rows with them
 *     staged in L1): lanes = k. One decode per 32 weight codes serves every row of the tile; at
 *     the end of a block each row's accumulators are summed across lanes, exactly, in double.
 *     The tile's activation digits (one- and two-digit forms) are decoded once per super-block
 *     (up to 32 K blocks) into L1, and each output's weight row is read front to back. At batch
 *     1 this is ~11 instructions per 32 weight codes beyond the decode's 16. With 1 or 2 rows
 *     (r1_out_few) a one-digit block leaves only its int32 lane-pair sums in the decode loop; their
 *     widening to double runs after the output's last block (1.2-1.3x at batch 1: in the loop, its
 *     latency held up the next block's decode).
 *   - many rows (r2: tiles of 16 rows; a remainder padded to one from a row count that
 *     rs_fp8_gemm_tune times for the CPU): lanes = rows. The tile's activations,
 *     one digit X = V >> 4 (or >> 5) and a rare remainder, are transposed so that two ymm hold one
 *     code pair of 16 rows; each output's weight digits are decoded once per block for up to
 *     4 such tiles (64 rows) and broadcast. X times the weight's H digits goes through every
 *     pair, the L digits (rare: |w| < 2 in E4M3 units) and the remainders only where they are
 *     nonzero (see r2_tile).
 * Work items are (chunk of 128 outputs, or of 256 where there are many rows and items enough for
 * every thread; group of up to 4 row tiles, or one lanes = k tile), the tiles varying fastest;
 * threads take contiguous runs of items. Nothing is allocated: the scratch (under 112 KB) is on
 * the stack.
 */
#include "fp8_gemm_avx2.h"

#include <math.h>
#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define INLINE         static inline __attribute__((always_inline))

#define BLK      RS_FP8_BLOCK
#define CHUNK    128 /* output features per work item ... */
#define CHUNK_MAX 256 /* ... or this many, where every thread still gets 4 items (rs_fp8_gemm_avx2) */
#define R1_ROWS  8  /* rows of a lanes = k tile */
#define XD_ROW_BLOCKS 32 /* row-blocks of activation digits a lanes = k tile holds (24 KB) */
#define R2_ROWS  16 /* rows of a lanes = rows tile: two ymm of int32 */
#define R2_NO    4  /* outputs accumulated together in a lanes = rows tile */
#define R2_TILES 4  /* lanes = rows tiles of one work item, sharing each weight block's decode */
#define R2_XABS_MAX4 1118481 /* (2^31 - 1) / 1920: the largest row sum of |X| that takes s = 4 */

/* Batch-1 and few-row items read each output's weight row front to back, and the rows of an item
 * one after another: a plain stream, which the hardware prefetchers of some CPUs do not run far
 * enough ahead of (on a Xeon with 2 vCPUs, without this, batch-1 FP8 decode ran at half the speed).
 * Each 128-code block asks for the two cache lines R1_PF_AHEAD bytes further on, the next rows' when
 * the row ends before that. 4 KB ran best of 0.5-16 KB there (docs/benchmarks.md). */
#define R1_PF_AHEAD 4096

RS_TARGET_AVX2 INLINE void r1_prefetch(const uint8_t *w) {
    _mm_prefetch((const char *)(w + R1_PF_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + R1_PF_AHEAD + 64), _MM_HINT_T0);
}

/* ---- decode ---- */

/* The decode's constants: vpshufb tables indexed by the exponent e (both 128-bit lanes alike) and
 * byte masks, kept in registers across a loop. */
typedef struct dlut {
    __m256i pow_l; /* L digit's power of two: e = 0, 1 -> 1, e = 2..7 -> 2^(e-1); 0 for e >= 8 */
    __m256i pow_h; /* H digit's: e = 8..15 -> 2^(e-8); 0 for e < 8 */
    __m256i imp;   /* the implicit mantissa bit: 8 for e > 0 */
    __m256i low4, low3, even;
} dlut;

static const _Alignas(16) uint8_t pow_l_tab[16] = {1, 1, 2, 4, 8, 16, 32, 64, 0, 0, 0, 0, 0, 0, 0, 0};
static const _Alignas(16) uint8_t pow_h_tab[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 8, 16, 32, 64, 128};
static const _Alignas(16) uint8_t imp_tab[16] = {0, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8};

RS_TARGET_AVX2 INLINE void dlut_load(dlut *l) {
    l->pow_l = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)pow_l_tab));
    l->pow_h = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)pow_h_tab));
    l->imp = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)imp_tab));
    l->low4 = _mm256_set1_epi8(0x0f);
    l->low3 = _mm256_set1_epi8(7);
    l->even = _mm256_set1_epi16(0x00ff);
}

/* 32 codes -> d[0..3] = L_even, L_odd, H_even, H_odd digit words (word j: code 2j or 2j + 1).
 * *nan keeps the running byte-wise max of 2 * code mod 256 (the code without its sign, shifted):
 * 0xfe there means a NaN code (S.1111.111) was seen. Neither needs a constant of its own: the
 * decode keeps 16 registers busy. */
RS_TARGET_AVX2 INLINE void decode32(__m256i c, const dlut *l, __m256i d[4], __m256i *nan) {
    const __m256i e = _mm256_and_si256(_mm256_srli_epi16(c, 3), l->low4);
    __m256i m = _mm256_or_si256(_mm256_and_si256(c, l->low3), _mm256_shuffle_epi8(l->imp, e));
    m = _mm256_sign_epi8(m, c); /* -M for sign-bit codes; code 0x00 gives 0, as M = 0 there */
    const __m256i me = _mm256_and_si256(m, l->even), mo = _mm256_xor_si256(m, me);
    const __m256i pl = _mm256_shuffle_epi8(l->pow_l, e), ph = _mm256_shuffle_epi8(l->pow_h, e);
    d[0] = _mm256_maddubs_epi16(pl, me);
    d[1] = _mm256_maddubs_epi16(pl, mo);
    d[2] = _mm256_maddubs_epi16(ph, me);
    d[3] = _mm256_maddubs_epi16(ph, mo);
    *nan = _mm256_max_epu8(*nan, _mm256_add_epi8(c, c));
}

RS_TARGET_AVX2 INLINE bool nan_seen(__m256i nan) {
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(nan, _mm256_set1_epi8((char)0xfe))) != 0;
}

/* The 32 codes at p, of which only the first n (1..32) are in the array: zeros past them. */
RS_TARGET_AVX2 INLINE __m256i load_codes(const uint8_t *p, int64_t n) {
    if (n >= 32) return _mm256_loadu_si256((const __m256i *)p);
    _Alignas(32) uint8_t t[32] = {0};
    memcpy(t, p, (size_t)n);
    return _mm256_load_si256((const __m256i *)t);
}

/* Whether codes p[0 .. n) hold a NaN code. */
static bool has_nan_code(const uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if ((p[i] & 0x7f) == 0x7f) return true;
    return false;
}

static inline float canonical_nan(float v) { return isnan(v) ? NAN : v; }

/* ---- the job ---- */

typedef struct ajob {
    float *out;        /* [rows][n] f32 */
    const uint8_t *xq; /* [rows][k] e4m3 */
    const float *xs;   /* [rows][kb] f32 */
    const uint8_t *wq; /* [n][k] e4m3 */
    const float *ws;   /* [ceil(n/128)][kb] f32 */
    int rows, n, k;
    int64_t kb, chunk, n_chunks; /* outputs per item (CHUNK or CHUNK_MAX), items per row tile */
    int n_r2g;    /* groups of up to R2_TILES lanes = rows tiles: rows [0, r1_start) */
    int r1_start; /* lanes = k tiles of R1_ROWS rows from here */
    int n_units;  /* n_r2g plus the lanes = k tiles */
} ajob;

/* A block's exact sum as the lane sum of 4 doubles (each lane exact, and so is their sum: every
 * lane is a multiple of 2^-18 below 2^25 in magnitude), from the one-digit accumulators al, ah. */
RS_TARGET_AVX2 INLINE __m256d lanes_one(__m256i al, __m256i ah) {
    const __m256i p = _mm256_hadd_epi32(al, ah); /* al01 al23 ah01 ah23 | al45 al67 ah45 ah67: < 2^31 */
    const __m256d q = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(p)),
                                    _mm256_cvtepi32_pd(_mm256_extracti128_si256(p, 1)));
    return _mm256_mul_pd(q, _mm256_setr_pd(0x1p-15, 0x1p-15, 0x1p-8, 0x1p-8)); /* 8, 1024 times 2^-18 */
}

/* The same from the two-digit accumulators (S_LL, S_X, S_HH; lane totals below 2^29). */
RS_TARGET_AVX2 INLINE __m256d lanes_two(__m256i ll, __m256i xa, __m256i hh) {
    const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(ll, xa), _mm256_hadd_epi32(hh, hh));
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    return _mm256_mul_pd(_mm256_cvtepi32_pd(s), _mm256_setr_pd(0x1p-18, 0x1p-11, 0x1p-4, 0.0));
}

/* The fp32 block sums of four blocks from their lanes: the exact lane sums, rounded once. */
RS_TARGET_AVX2 INLINE __m128 sum4(const __m256d v[4]) {
    const __m256d h01 = _mm256_hadd_pd(v[0], v[1]), h23 = _mm256_hadd_pd(v[2], v[3]);
    const __m256d s = _mm256_add_pd(_mm256_permute2f128_pd(h01, h23, 0x20), _mm256_permute2f128_pd(h01, h23, 0x31));
    return _mm256_cvtpd_ps(s);
}

/* ---------------------------------------------------------------------------------------------
 * Few rows: lanes = k
 * ------------------------------------------------------------------------------------------- */

/* An activation block in one digit, when it can be: every code of the block with e >= 4 (or
 * zero) has V a multiple of 8, and then V = 8 X with |X| <= 28672 in int16, so a weight chunk
 * needs 4 vpmaddwd per row instead of 8: A_L = sum Lw X, A_H = sum Hw X, block sum =
 * 2^-18 (8 A_L + 1024 A_H). In int32 lanes, 16 codes a lane, |A_H| <= 16 * 1792 * 28672 < 2^30,
 * and a sum of two lanes < 2^31 (lanes_one widens after that). Blocks with smaller codes
 * (|x| < 2^-3 in E4M3 units: rare once a block is scaled to amax 448) keep the two digits. */

/* A tile's activation digits for one super-block of sb blocks (nr * sb <= XD_ROW_BLOCKS), chunk
 * c (codes 32c .. 32c + 31) of block bi of row r: two digits (L_even, L_odd, H_even, H_odd) at
 * two + ((r * sb + bi) * 4 + c) * 64 words, one digit (X_even, X_odd) at one + (...) * 32. */
typedef struct r1_x {
    _Alignas(32) int16_t two[XD_ROW_BLOCKS * 4 * 64];
    _Alignas(32) int16_t one[XD_ROW_BLOCKS * 4 * 32];
    float s[R1_ROWS][XD_ROW_BLOCKS];  /* x scales [row][block] */
    bool nan[R1_ROWS][XD_ROW_BLOCKS]; /* a NaN code in the row's block */
    bool one_ok[XD_ROW_BLOCKS];       /* every row's block has the one-digit form */
    int sb;                           /* blocks per super-block */
} r1_x;

/* One digit from two: X = (L + 128 H) / 8, exact when every L is a multiple of 8 (|L| <= 960). */
RS_TARGET_AVX2 INLINE __m256i one_digit(__m256i lo, __m256i hi) {
    return _mm256_add_epi16(_mm256_srai_epi16(lo, 3), _mm256_slli_epi16(hi, 4));
}

RS_TARGET_AVX2 static void r1_prep(r1_x *px, const ajob *jb, const dlut *l, int r0, int nr, int64_t b0, int nb) {
    for (int bi = 0; bi < nb; bi++) px->one_ok[bi] = true;
    for (int r = 0; r < nr; r++) {
        const uint8_t *x = jb->xq + (int64_t)(r0 + r) * jb->k;
        for (int bi = 0; bi < nb; bi++) {
            const int64_t j0 = (b0 + bi) * BLK, kw = RS_MIN((int64_t)BLK, jb->k - j0);
            __m256i nan = _mm256_setzero_si256(), low = _mm256_setzero_si256();
            int16_t *two = px->two + ((r * px->sb + bi) * 4) * 64, *one = px->one + ((r * px->sb + bi) * 4) * 32;
            for (int c = 0; c * 32 < kw; c++) {
                __m256i d[4];
                decode32(load_codes(x + j0 + 32 * c, kw - 32 * c), l, d, &nan);
                for (int v = 0; v < 4; v++) _mm256_store_si256((__m256i *)(two + c * 64 + v * 16), d[v]);
                low = _mm256_or_si256(low, _mm256_or_si256(d[0], d[1]));
                _mm256_store_si256((__m256i *)(one + c * 32), one_digit(d[0], d[2]));
                _mm256_store_si256((__m256i *)(one + c * 32 + 16), one_digit(d[1], d[3]));
            }
            /* one digit when no L digit has one of its 3 low bits set */
            px->one_ok[bi] &= _mm256_testz_si256(low, _mm256_set1_epi16(7)) != 0;
            px->nan[r][bi] = nan_seen(nan);
            px->s[r][bi] = jb->xs[(int64_t)(r0 + r) * jb->kb + b0 + bi];
        }
    }
}

/* One weight chunk (digits d) times one row's one-digit activations x: al += L.X, ah += H.X. */
RS_TARGET_AVX2 INLINE void dot_one(const __m256i d[4], const int16_t *x, __m256i *al, __m256i *ah) {
    const __m256i xe = _mm256_load_si256((const __m256i *)x), xo = _mm256_load_si256((const __m256i *)(x + 16));
    *al = _mm256_add_epi32(*al, _mm256_add_epi32(_mm256_madd_epi16(d[0], xe), _mm256_madd_epi16(d[1], xo)));
    *ah = _mm256_add_epi32(*ah, _mm256_add_epi32(_mm256_madd_epi16(d[2], xe), _mm256_madd_epi16(d[3], xo)));
}

/* The same with two-digit activations (L_e, L_o, H_e, H_o at x): S_LL, S_X, S_HH. */
RS_TARGET_AVX2 INLINE void dot_two(const __m256i d[4], const int16_t *x, __m256i *ll, __m256i *xa, __m256i *hh) {
    const __m256i *p = (const __m256i *)x;
    const __m256i x0 = _mm256_load_si256(p), x1 = _mm256_load_si256(p + 1);
    const __m256i x2 = _mm256_load_si256(p + 2), x3 = _mm256_load_si256(p + 3);
    *ll = _mm256_add_epi32(*ll, _mm256_add_epi32(_mm256_madd_epi16(d[0], x0), _mm256_madd_epi16(d[1], x1)));
    *xa = _mm256_add_epi32(*xa, _mm256_add_epi32(_mm256_madd_epi16(d[0], x2), _mm256_madd_epi16(d[1], x3)));
    *xa = _mm256_add_epi32(*xa, _mm256_add_epi32(_mm256_madd_epi16(d[2], x0), _mm256_madd_epi16(d[3], x1)));
    *hh = _mm256_add_epi32(*hh, _mm256_add_epi32(_mm256_madd_epi16(d[2], x2), _mm256_madd_epi16(d[3], x3)));
}

/* The weight chunk c of a block of kw codes at w, decoded. */
RS_TARGET_AVX2 INLINE void decode_chunk(const dlut *l, const uint8_t *w, int64_t kw, int c, __m256i d[4], __m256i *nan) {
    decode32(kw >= 32 * (c + 1) ? _mm256_loadu_si256((const __m256i *)(w + 32 * c)) : load_codes(w + 32 * c, kw - 32 * c),
             l, d, nan);
}

/* Block bi of one output (the block's kw weight codes at w) for NR <= 2 rows, decoded weights in
 * registers: lanes[r] whose sum is row r's exact block sum. */
RS_TARGET_AVX2 INLINE void r1_block_reg(const dlut *l, const r1_x *px, const int NR, const uint8_t *w, int64_t kw,
                                        int bi, __m256d lanes[], __m256i *nan) {
    const int nch = (int)((kw + 31) / 32);
    if (px->one_ok[bi]) {
        const int16_t *x = px->one + (int64_t)bi * 4 * 32;
        const int64_t rs = (int64_t)px->sb * 4 * 32;
        __m256i al[2], ah[2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) al[r] = ah[r] = _mm256_setzero_si256();
        for (int c = 0; c < nch; c++) {
            __m256i d[4];
            decode_chunk(l, w, kw, c, d, nan);
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) dot_one(d, x + r * rs + c * 32, &al[r], &ah[r]);
        }
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) lanes[r] = lanes_one(al[r], ah[r]);
    } else {
        const int16_t *x = px->two + (int64_t)bi * 4 * 64;
        const int64_t rs = (int64_t)px->sb * 4 * 64;
        __m256i ll[2], xa[2], hh[2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) ll[r] = xa[r] = hh[r] = _mm256_setzero_si256();
        for (int c = 0; c < nch; c++) {
            __m256i d[4];
            decode_chunk(l, w, kw, c, d, nan);
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) dot_two(d, x + r * rs + c * 64, &ll[r], &xa[r], &hh[r]);
        }
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) lanes[r] = lanes_two(ll[r], xa[r], hh[r]);
    }
}

/* The same for 3..R1_ROWS rows: the block's weight digits decoded once into L1, then one row at a
 * time (the accumulators of every row do not fit in 16 registers). */
RS_TARGET_AVX2 INLINE void r1_block_staged(const dlut *l, const r1_x *px, int nr, const uint8_t *w, int64_t kw,
                                           int bi, __m256d lanes[], __m256i *nan) {
    const int nch = (int)((kw + 31) / 32);
    __m256i d[4][4];
    for (int c = 0; c < nch; c++) decode_chunk(l, w, kw, c, d[c], nan);
    if (px->one_ok[bi]) {
        const int16_t *x = px->one + (int64_t)bi * 4 * 32;
        const int64_t rs = (int64_t)px->sb * 4 * 32;
        for (int r = 0; r < nr; r++) {
            __m256i al = _mm256_setzero_si256(), ah = al;
            for (int c = 0; c < nch; c++) dot_one(d[c], x + r * rs + c * 32, &al, &ah);
            lanes[r] = lanes_one(al, ah);
        }
    } else {
        const int16_t *x = px->two + (int64_t)bi * 4 * 64;
        const int64_t rs = (int64_t)px->sb * 4 * 64;
        for (int r = 0; r < nr; r++) {
            __m256i ll = _mm256_setzero_si256(), xa = ll, hh = ll;
            for (int c = 0; c < nch; c++) dot_two(d[c], x + r * rs + c * 64, &ll, &xa, &hh);
            lanes[r] = lanes_two(ll, xa, hh);
        }
    }
}

/* The end of one output o for nr rows over the super-block's blocks [b0, b0 + nb), from each
 * block's exact lanes (lanes[r][bi]; room for nb rounded up to 4): the fp32 block sums, NaN for
 * blocks with a NaN weight code (nan: decode32's watch over the output's codes), then the
 * reference's fmaf chain; the fmaf accumulators live in out between super-blocks. */
RS_TARGET_AVX2 INLINE void r1_finish(const ajob *jb, const r1_x *px, int nr, int r0, int64_t o, int64_t b0, int nb,
                                     __m256d (*lanes)[XD_ROW_BLOCKS], __m256i nan) {
    const int64_t k = jb->k, n = jb->n;
    const uint8_t *w = jb->wq + o * k;
    _Alignas(16) float bs[R1_ROWS][XD_ROW_BLOCKS];
    for (int r = 0; r < nr; r++) {
        for (int bi = nb; bi % 4; bi++) lanes[r][bi] = _mm256_setzero_pd();
        for (int bi = 0; bi < nb; bi += 4) _mm_store_ps(&bs[r][bi], sum4(&lanes[r][bi]));
    }
    if (__builtin_expect(nan_seen(nan), 0)) /* NaN weight codes: rare; find their blocks */
        for (int bi = 0; bi < nb; bi++) {
            const int64_t j0 = (b0 + bi) * BLK;
            if (has_nan_code(w + j0, RS_MIN((int64_t)BLK, k - j0)))
                for (int r = 0; r < nr; r++) bs[r][bi] = NAN;
        }
    const float *wsb = jb->ws + (o / BLK) * jb->kb + b0;
    for (int r = 0; r < nr; r++) {
        float *dst = jb->out + (int64_t)(r0 + r) * n + o;
        float acc = b0 == 0 ? 0.0f : *dst;
        for (int bi = 0; bi < nb; bi++)
            acc = fmaf(px->nan[r][bi] ? NAN : bs[r][bi], px->s[r][bi] * wsb[bi], acc);
        *dst = canonical_nan(acc); /* NaN stays NaN through later super-blocks */
    }
}

/* One output o for nr rows (3..R1_ROWS, weight digits staged) over the super-block's blocks
 * [b0, b0 + nb). */
RS_TARGET_AVX2 __attribute__((noinline)) static void r1_out_n(const ajob *jb, const dlut *l, const r1_x *px, int nr,
                                                              int r0, int64_t o, int64_t b0, int nb) {
    const int64_t k = jb->k;
    const uint8_t *w = jb->wq + o * k;
    _Alignas(32) __m256d lanes[R1_ROWS][XD_ROW_BLOCKS];
    __m256i nan = _mm256_setzero_si256();
    for (int bi = 0; bi < nb; bi++) {
        const int64_t j0 = (b0 + bi) * BLK;
        __m256d v[R1_ROWS];
        r1_prefetch(w + j0);
        r1_block_staged(l, px, nr, w + j0, RS_MIN((int64_t)BLK, k - j0), bi, v, &nan);
        for (int r = 0; r < nr; r++) lanes[r][bi] = v[r];
    }
    r1_finish(jb, px, nr, r0, o, b0, nb, lanes, nan);
}

/* NR = 1 or 2 rows (decode): the sums of r1_out_n in two passes. The first decodes and multiplies;
 * a whole one-digit block (128 codes, px->one_ok: the common case) keeps its accumulators as one
 * vector of lane-pair sums in int32 (hadd: each below 2^31), any other block goes through
 * r1_block_reg. The second widens the kept pairs to double and rounds every block sum. Widening
 * inside the first pass puts its latency chain (hadd, cvt, add, mul) in front of the next block's
 * decode. */
RS_TARGET_AVX2 INLINE void r1_out_few(const ajob *jb, const dlut *l, const r1_x *px, const int NR, int r0, int64_t o,
                                      int64_t b0, int nb) {
    const int64_t k = jb->k, rs = (int64_t)px->sb * 4 * 32;
    const uint8_t *w = jb->wq + o * k + b0 * BLK;
    _Alignas(32) __m256i pairs[2][XD_ROW_BLOCKS];
    _Alignas(32) __m256d lanes[2][XD_ROW_BLOCKS];
    uint32_t kept = 0; /* bit bi: block bi's sums are in pairs, not yet in lanes */
    __m256i nan = _mm256_setzero_si256();
    for (int bi = 0; bi < nb; bi++) {
        const uint8_t *wb = w + (int64_t)bi * BLK;
        const int64_t kw = RS_MIN((int64_t)BLK, k - (b0 + bi) * BLK);
        r1_prefetch(wb);
        if (kw < BLK || !px->one_ok[bi]) {
            __m256d v[2];
            r1_block_reg(l, px, NR, wb, kw, bi, v, &nan);
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) lanes[r][bi] = v[r];
            continue;
        }
        const int16_t *x = px->one + (int64_t)bi * 4 * 32;
        __m256i al[2], ah[2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) al[r] = ah[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m256i d[4];
            decode32(_mm256_loadu_si256((const __m256i *)(wb + 32 * c)), l, d, &nan);
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) dot_one(d, x + r * rs + c * 32, &al[r], &ah[r]);
        }
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) pairs[r][bi] = _mm256_hadd_epi32(al[r], ah[r]);
        kept |= 1u << bi;
    }
    const __m256d unit = _mm256_setr_pd(0x1p-15, 0x1p-15, 0x1p-8, 0x1p-8); /* 8, 1024 times 2^-18 */
    for (uint32_t m = kept; m; m &= m - 1) {
        const int bi = __builtin_ctz(m);
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) {
            const __m256i p = pairs[r][bi];
            const __m256d q = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(p)),
                                            _mm256_cvtepi32_pd(_mm256_extracti128_si256(p, 1)));
            lanes[r][bi] = _mm256_mul_pd(q, unit);
        }
    }
    r1_finish(jb, px, NR, r0, o, b0, nb, lanes, nan);
}

RS_TARGET_AVX2 __attribute__((noinline)) static void r1_out_1(const ajob *jb, const dlut *l, const r1_x *px, int r0,
                                                              int64_t o, int64_t b0, int nb) {
    r1_out_few(jb, l, px, 1, r0, o, b0, nb);
}

RS_TARGET_AVX2 __attribute__((noinline)) static void r1_out_2(const ajob *jb, const dlut *l, const r1_x *px, int r0,
                                                              int64_t o, int64_t b0, int nb) {
    r1_out_few(jb, l, px, 2, r0, o, b0, nb);
}

/* Rows [r0, r0 + nr) (nr <= R1_ROWS) x outputs [o0, o1). */
RS_TARGET_AVX2 static void r1_item(const ajob *jb, const dlut *l, int r0, int nr, int64_t o0, int64_t o1) {
    r1_x px;
    px.sb = XD_ROW_BLOCKS / nr;
    for (int64_t b0 = 0; b0 < jb->kb; b0 += px.sb) {
        const int nb = (int)RS_MIN((int64_t)px.sb, jb->kb - b0);
        r1_prep(&px, jb, l, r0, nr, b0, nb);
        for (int64_t o = o0; o < o1; o++) {
            if (nr == 1)
                r1_out_1(jb, l, &px, r0, o, b0, nb);
            else if (nr == 2)
                r1_out_2(jb, l, &px, r0, o, b0, nb);
            else
                r1_out_n(jb, l, &px, nr, r0, o, b0, nb);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Many rows: lanes = rows
 * ------------------------------------------------------------------------------------------- */

/* A tile of R2_ROWS rows, two 8-row halves of one dword each: pair p of a block (decode32's order:
 * p = 16 c + 8 v + i is dword i of word vector v (0 even, 1 odd) of chunk c) of 16 rows is two ymm,
 * the weight digits are decoded once per block and output, and broadcast.
 *
 * The activations take one digit plus a rare remainder: V = 2^s X + r with X = V >> s (floor) and
 * r = V & (2^s - 1), nonzero only for small codes (rare once a row's 1x128 group is scaled to
 * 448). The block sum is 2^-18 (2^s A_L + 2^(s+7) A_H + R_L + 128 R_H), A_L = sum X Lw,
 * A_H = sum X Hw, R_L = sum r Lw, R_H = sum r Hw, each over the block in an int32 lane per row.
 * A_H takes every pair (one vpmaddwd per half, output and pair); A_L only the pairs where the
 * weight has an L digit (|w| < 2 in E4M3 units: ~1.6% of Gaussian weights), R_* only those where
 * one of the tile's rows has a remainder: skipping a zero product leaves the integer sums as they
 * were. The shift is chosen per tile and block, as in fp8_gemm_vnni.c (r2_state there):
 *   s = 4: X = (L >> 4) + 8 H (|X| <= 14336), r = L & 15 (codes below 2^-2 only), when
 *          each row has sum |X| <= (2^31 - 1) / 1920, which bounds every partial sum (no weight
 *          digit exceeds 1920, NaN codes included);
 *   s = 5: X = (L >> 5) + 4 H (|X| <= 7168), r = L & 31: |A_H| <= 128 * 7680 * 1920 < 2^31 for
 *          any codes. */
typedef struct r2_tile {
    _Alignas(32) int32_t xt[2][64][R2_ROWS]; /* [X/r][pair][row]: the block's activations */
    _Alignas(32) float acc[CHUNK_MAX][R2_ROWS]; /* [output - o0][row]: the fmaf accumulators */
    _Alignas(32) float s[R2_ROWS];           /* x scales of the block */
    double xd;                               /* 2^s: the activation digit's weight */
    uint64_t rpairs;                         /* the pairs where one of the rows has a remainder */
    uint32_t xnan;                           /* bit r: row r's block has a NaN code */
    int r0, nr;                              /* rows [r0, r0 + nr) */
} r2_tile;

/* One work item's scratch: up to R2_TILES tiles side by side (each block of weight digits is
 * decoded once for all of them), the decoded digits of R2_NO outputs, and r2_prep's rows. */
typedef struct r2_state {
    r2_tile t[R2_TILES];
    _Alignas(32) int32_t rowv[R2_ROWS][2][64]; /* [row][X/r][pair]: before transposing */
    _Alignas(32) int32_t wd[R2_NO][2][64];     /* [output][L/H][pair] */
    int nt;                                    /* tiles in use */
} r2_state;
_Static_assert(sizeof(r2_state) < 112 * 1024, "the stack scratch the header promises");

/* In-place transpose of an 8 x 8 matrix of 32-bit elements (v[i] = row i). */
RS_TARGET_AVX2 INLINE void transpose8(__m256i v[8]) {
    __m256i t[8], u[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
        v[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
    }
}

/* Bit i set when dword i of v is nonzero (i < 8). */
RS_TARGET_AVX2 INLINE uint64_t nonzero_pairs8(__m256i v) {
    return ~(uint64_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(v, _mm256_setzero_si256()))) & 0xffu;
}

/* Tile t's rows of block b into t->xt (rows past t->nr are zeros), with its shift, remainder
 * pairs and NaN rows; rowv is the scratch. */
RS_TARGET_AVX2 static void r2_prep(r2_tile *t, int32_t (*rowv)[2][64], const ajob *jb, const dlut *l, int64_t b) {
    const int64_t j0 = b * BLK, kw = RS_MIN((int64_t)BLK, jb->k - j0);
    const __m256i low4 = _mm256_set1_epi16(15), ones = _mm256_set1_epi16(1);
    const int nr = t->nr;
    uint32_t xnan = 0;
    int32_t xabs_max = 0; /* the largest row sum of |X| with s = 4 */
    __m256i rany[8];
    for (int i = 0; i < 8; i++) rany[i] = _mm256_setzero_si256();
    for (int r = 0; r < R2_ROWS; r++) {
        if (r >= nr) {
            memset(rowv[r], 0, sizeof rowv[r]);
            t->s[r] = 0.0f;
            continue;
        }
        const uint8_t *x = jb->xq + (int64_t)(t->r0 + r) * jb->k + j0;
        if (j0 + BLK < jb->k) { /* the row's next block: this item's next r2_prep */
            _mm_prefetch((const char *)(x + BLK), _MM_HINT_T0);
            _mm_prefetch((const char *)(x + BLK + 64), _MM_HINT_T0);
        }
        __m256i nan = _mm256_setzero_si256(), xabs = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i d[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256()};
            if (32 * c < kw) decode_chunk(l, x, kw, c, d, &nan);
            for (int v = 0; v < 2; v++) { /* v: even, odd codes; X = (L >> 4) + 8 H, r = L & 15 */
                const __m256i X = _mm256_add_epi16(_mm256_srai_epi16(d[v], 4), _mm256_slli_epi16(d[2 + v], 3));
                const __m256i R = _mm256_and_si256(d[v], low4);
                _mm256_store_si256((__m256i *)&rowv[r][0][16 * c + 8 * v], X);
                _mm256_store_si256((__m256i *)&rowv[r][1][16 * c + 8 * v], R);
                rany[2 * c + v] = _mm256_or_si256(rany[2 * c + v], R);
                xabs = _mm256_add_epi32(xabs, _mm256_madd_epi16(_mm256_abs_epi16(X), ones));
            }
        }
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(xabs), _mm256_extracti128_si256(xabs, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
        const int32_t row_abs = _mm_cvtsi128_si32(h);
        xabs_max = RS_MAX(xabs_max, row_abs);
        if (nan_seen(nan)) xnan |= 1u << r;
        t->s[r] = jb->xs[(int64_t)(t->r0 + r) * jb->kb + b];
    }
    t->xd = 16.0;
    if (__builtin_expect(xabs_max > R2_XABS_MAX4, 0)) { /* s = 5: X >> 1, r | (X & 1) << 4 */
        for (int i = 0; i < 8; i++) rany[i] = _mm256_setzero_si256();
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < 8; i++) {
                const __m256i X = _mm256_load_si256((const __m256i *)&rowv[r][0][8 * i]);
                const __m256i R = _mm256_or_si256(_mm256_load_si256((const __m256i *)&rowv[r][1][8 * i]),
                                                  _mm256_slli_epi16(_mm256_and_si256(X, ones), 4));
                _mm256_store_si256((__m256i *)&rowv[r][0][8 * i], _mm256_srai_epi16(X, 1));
                _mm256_store_si256((__m256i *)&rowv[r][1][8 * i], R);
                rany[i] = _mm256_or_si256(rany[i], R);
            }
        t->xd = 32.0;
    }
    uint64_t rp = 0;
    for (int i = 0; i < 8; i++) rp |= nonzero_pairs8(rany[i]) << (8 * i);
    t->rpairs = rp;
    t->xnan = xnan;
    for (int dg = 0; dg < 2; dg++) {
        if (dg == 1 && rp == 0) break; /* no remainders: xt[1] is never read */
        for (int g = 0; g < 8; g++)
            for (int h = 0; h < 2; h++) {
                __m256i v[8];
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) v[r] = _mm256_load_si256((const __m256i *)&rowv[8 * h + r][dg][8 * g]);
                transpose8(v);
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) _mm256_store_si256((__m256i *)&t->xt[dg][8 * g + i][8 * h], v[i]);
            }
    }
}

/* The fp32 block sums of 8 rows: 2^-18 (2^s A_L + 2^(s+7) A_H + R), R = R_L + 128 R_H, from their
 * int32 lane sums ah, al, rr (|R| < 2^30: r < 32, so |R_H| < 128 * 31 * 1920 and
 * |R_L| < 128 * 31 * 960). Each term is a power of two times an int32 and every partial sum a
 * multiple of 2^-18 below 2^25, so the double sums are exact and rounded once. al and rr are
 * left out where they are zero (has_l, has_r: constants where this is inlined). */
RS_TARGET_AVX2 INLINE __m256 r2_sums8(__m256i ah, __m256i al, __m256i rr, __m256d kh, __m256d kl, const bool has_l,
                                     const bool has_r) {
    const __m256d kr = _mm256_set1_pd(0x1p-18);
    __m256d lo = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(ah)), kh);
    __m256d hi = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(ah, 1)), kh);
    if (has_r) {
        lo = _mm256_fmadd_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(rr)), kr, lo);
        hi = _mm256_fmadd_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(rr, 1)), kr, hi);
    }
    if (has_l) {
        lo = _mm256_fmadd_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(al)), kl, lo);
        hi = _mm256_fmadd_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(al, 1)), kl, hi);
    }
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo)), _mm256_cvtpd_ps(hi), 1);
}

/* The accumulators of outputs o - o0 .. + nq - 1 of tile t: acc = fmaf(block sum, s * wsb,
 * previous) for each row, the block sum NaN in rows whose block (x or w) has a NaN code. */
RS_TARGET_AVX2 INLINE void r2_finish(r2_tile *t, int64_t oi, int nq, __m256i ah[R2_NO][2], __m256i al[R2_NO][2],
                                     __m256i rr[R2_NO][2], const bool wnan[R2_NO], float wsb, int64_t b,
                                     const bool has_l, const bool has_r) {
    const __m256d kh = _mm256_set1_pd(128.0 * t->xd * 0x1p-18), kl = _mm256_set1_pd(t->xd * 0x1p-18);
    const __m256 sx0 = _mm256_mul_ps(_mm256_load_ps(t->s), _mm256_set1_ps(wsb));
    const __m256 sx1 = _mm256_mul_ps(_mm256_load_ps(t->s + 8), _mm256_set1_ps(wsb));
    for (int q = 0; q < nq; q++) {
        float *acc = t->acc[oi + q];
        __m256 bs0 = r2_sums8(ah[q][0], al[q][0], rr[q][0], kh, kl, has_l, has_r);
        __m256 bs1 = r2_sums8(ah[q][1], al[q][1], rr[q][1], kh, kl, has_l, has_r);
        const uint32_t nanrows = wnan[q] ? 0xffffu : t->xnan;
        if (__builtin_expect(nanrows != 0, 0)) {
            const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            const __m256i m0 = _mm256_and_si256(_mm256_set1_epi32((int)(nanrows & 0xffu)), bits);
            const __m256i m1 = _mm256_and_si256(_mm256_set1_epi32((int)(nanrows >> 8)), bits);
            bs0 = _mm256_blendv_ps(bs0, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(m0, bits)));
            bs1 = _mm256_blendv_ps(bs1, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(m1, bits)));
        }
        const __m256 p0 = b == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc);
        const __m256 p1 = b == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc + 8);
        _mm256_store_ps(acc, _mm256_fmadd_ps(bs0, sx0, p0));
        _mm256_store_ps(acc + 8, _mm256_fmadd_ps(bs1, sx1, p1));
    }
}

/* A_H of R2_NO outputs over one tile's np pairs: X . Hw, every pair, the weight digit broadcast. */
RS_TARGET_AVX2 INLINE void r2_dot_h(const r2_tile *t, const int32_t (*wd)[2][64], int np, __m256i ah[R2_NO][2]) {
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int p = 0; p < np; p++) {
        const __m256i x0 = _mm256_load_si256((const __m256i *)&t->xt[0][p][0]);
        const __m256i x1 = _mm256_load_si256((const __m256i *)&t->xt[0][p][8]);
        const __m256i w0 = _mm256_set1_epi32(wd[0][1][p]), w1 = _mm256_set1_epi32(wd[1][1][p]);
        const __m256i w2 = _mm256_set1_epi32(wd[2][1][p]), w3 = _mm256_set1_epi32(wd[3][1][p]);
        a00 = _mm256_add_epi32(a00, _mm256_madd_epi16(x0, w0));
        a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(x1, w0));
        a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(x0, w1));
        a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(x1, w1));
        a20 = _mm256_add_epi32(a20, _mm256_madd_epi16(x0, w2));
        a21 = _mm256_add_epi32(a21, _mm256_madd_epi16(x1, w2));
        a30 = _mm256_add_epi32(a30, _mm256_madd_epi16(x0, w3));
        a31 = _mm256_add_epi32(a31, _mm256_madd_epi16(x1, w3));
    }
    ah[0][0] = a00, ah[0][1] = a01, ah[1][0] = a10, ah[1][1] = a11;
    ah[2][0] = a20, ah[2][1] = a21, ah[3][0] = a30, ah[3][1] = a31;
}

/* The sparse sums of R2_NO outputs over the pairs of mask, from one tile's digits xt ([pair][row])
 * (two passes over few pairs each, rather than one per output: a loop's exit is a mispredicted
 * branch). rem = false: A_L = X . Lw (mask: the pairs where one of the outputs has an L digit; the
 * others have Lw = 0 there). rem = true: R = R_L + 128 R_H = r . Lw + 128 (r . Hw) (mask: the pairs
 * where a row has a remainder; every partial sum is below 2^30, see r2_finish). Zero for an
 * empty mask. */
RS_TARGET_AVX2 INLINE void r2_dot_sparse(const int32_t (*xt)[R2_ROWS], const int32_t (*wd)[2][64], uint64_t mask,
                                         const bool rem, __m256i acc[R2_NO][2]) {
    for (int q = 0; q < R2_NO; q++) acc[q][0] = acc[q][1] = _mm256_setzero_si256();
    for (uint64_t m = mask; m; m &= m - 1) {
        const int p = __builtin_ctzll(m);
        const __m256i x0 = _mm256_load_si256((const __m256i *)&xt[p][0]);
        const __m256i x1 = _mm256_load_si256((const __m256i *)&xt[p][8]);
#pragma GCC unroll 4
        for (int q = 0; q < R2_NO; q++) {
            const __m256i bl = _mm256_set1_epi32(wd[q][0][p]);
            __m256i s0 = _mm256_madd_epi16(x0, bl), s1 = _mm256_madd_epi16(x1, bl);
            if (rem) {
                const __m256i bh = _mm256_set1_epi32(wd[q][1][p]);
                s0 = _mm256_add_epi32(s0, _mm256_slli_epi32(_mm256_madd_epi16(x0, bh), 7));
                s1 = _mm256_add_epi32(s1, _mm256_slli_epi32(_mm256_madd_epi16(x1, bh), 7));
            }
            acc[q][0] = _mm256_add_epi32(acc[q][0], s0);
            acc[q][1] = _mm256_add_epi32(acc[q][1], s1);
        }
    }
}

/* Block b of outputs o .. o + R2_NO - 1 (those below o1), decoded once, into the accumulators of
 * every tile of the item. */
RS_TARGET_AVX2 static void r2_group(r2_state *st, const ajob *jb, const dlut *l, int64_t o0, int64_t o, int64_t o1,
                                    int64_t b) {
    const int64_t k = jb->k, j0 = b * BLK, kw = RS_MIN((int64_t)BLK, k - j0);
    const int nq = (int)RS_MIN((int64_t)R2_NO, o1 - o), np = (int)((kw + 31) / 32) * 16;
    uint64_t lpairs[R2_NO];
    bool wnan[R2_NO];
    for (int q = 0; q < R2_NO; q++) {
        lpairs[q] = 0, wnan[q] = false;
        if (q >= nq) { /* past o1: zero digits, never stored */
            memset(st->wd[q], 0, sizeof st->wd[q]);
            continue;
        }
        const uint8_t *w = jb->wq + (o + q) * k + j0;
        int32_t *wl = st->wd[q][0], *wh = st->wd[q][1];
        __m256i nan = _mm256_setzero_si256();
        uint64_t lp = 0;
        if (kw == BLK) {
            if (j0 + BLK < k) { /* the next block: needed by this item's next pass */
                _mm_prefetch((const char *)(w + BLK), _MM_HINT_T0);
                _mm_prefetch((const char *)(w + BLK + 64), _MM_HINT_T0);
            }
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                __m256i d[4];
                decode32(_mm256_loadu_si256((const __m256i *)(w + 32 * c)), l, d, &nan);
                _mm256_store_si256((__m256i *)(wl + 16 * c), d[0]);
                _mm256_store_si256((__m256i *)(wl + 16 * c + 8), d[1]);
                _mm256_store_si256((__m256i *)(wh + 16 * c), d[2]);
                _mm256_store_si256((__m256i *)(wh + 16 * c + 8), d[3]);
                lp |= (nonzero_pairs8(d[0]) | nonzero_pairs8(d[1]) << 8) << (16 * c);
            }
        } else {
            for (int c = 0; c * 32 < kw; c++) {
                __m256i d[4];
                decode_chunk(l, w, kw, c, d, &nan);
                _mm256_store_si256((__m256i *)(wl + 16 * c), d[0]);
                _mm256_store_si256((__m256i *)(wl + 16 * c + 8), d[1]);
                _mm256_store_si256((__m256i *)(wh + 16 * c), d[2]);
                _mm256_store_si256((__m256i *)(wh + 16 * c + 8), d[3]);
                lp |= (nonzero_pairs8(d[0]) | nonzero_pairs8(d[1]) << 8) << (16 * c);
            }
        }
        lpairs[q] = lp;
        wnan[q] = nan_seen(nan);
    }
    const float wsb = jb->ws[(o / BLK) * jb->kb + b];
    const uint64_t lp_any = lpairs[0] | lpairs[1] | lpairs[2] | lpairs[3];
    for (int ti = 0; ti < st->nt; ti++) {
        r2_tile *t = &st->t[ti];
        __m256i ah[R2_NO][2], al[R2_NO][2], rr[R2_NO][2];
        r2_dot_h(t, (const int32_t(*)[2][64])st->wd, np, ah);
        r2_dot_sparse(t->xt[0], (const int32_t(*)[2][64])st->wd, lp_any, false, al);
        r2_dot_sparse(t->xt[1], (const int32_t(*)[2][64])st->wd, t->rpairs, true, rr);
        const int64_t oi = o - o0;
        switch ((lp_any != 0) + 2 * (t->rpairs != 0)) { /* one copy per case, the checks made once */
        case 0: r2_finish(t, oi, nq, ah, al, rr, wnan, wsb, b, false, false); break;
        case 1: r2_finish(t, oi, nq, ah, al, rr, wnan, wsb, b, true, false); break;
        case 2: r2_finish(t, oi, nq, ah, al, rr, wnan, wsb, b, false, true); break;
        default: r2_finish(t, oi, nq, ah, al, rr, wnan, wsb, b, true, true); break;
        }
    }
}

/* Tiles of R2_ROWS rows from row r0, nr rows in all (nr <= R2_TILES * R2_ROWS; only the last
 * tile may be short), x outputs [o0, o1). */
RS_TARGET_AVX2 static void r2_item(const ajob *jb, const dlut *l, int r0, int nr, int64_t o0, int64_t o1) {
    r2_state st;
    st.nt = (nr + R2_ROWS - 1) / R2_ROWS;
    for (int ti = 0; ti < st.nt; ti++) {
        st.t[ti].r0 = r0 + ti * R2_ROWS;
        st.t[ti].nr = RS_MIN(R2_ROWS, nr - ti * R2_ROWS);
    }
    for (int64_t b = 0; b < jb->kb; b++) {
        for (int ti = 0; ti < st.nt; ti++) r2_prep(&st.t[ti], st.rowv, jb, l, b);
        for (int64_t o = o0; o < o1; o += R2_NO) r2_group(&st, jb, l, o0, o, o1, b);
    }
    for (int ti = 0; ti < st.nt; ti++) {
        const r2_tile *t = &st.t[ti];
        for (int r = 0; r < t->nr; r++)
            for (int64_t o = o0; o < o1; o++) jb->out[(int64_t)(t->r0 + r) * jb->n + o] = canonical_nan(t->acc[o - o0][r]);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Driver
 * ------------------------------------------------------------------------------------------- */

/* Items [it0, it1); item = chunk * n_units + unit, a unit being a group of up to R2_TILES lanes =
 * rows tiles (units [0, n_r2g)) or one lanes = k tile. */
RS_TARGET_AVX2 static void avx2_items(void *ctx, int64_t it0, int64_t it1, int tid) {
    (void)tid;
    const ajob *jb = ctx;
    dlut l;
    dlut_load(&l);
    for (int64_t it = it0; it < it1; it++) {
        const int64_t o0 = (it / jb->n_units) * jb->chunk, o1 = RS_MIN(o0 + jb->chunk, (int64_t)jb->n);
        const int u = (int)(it % jb->n_units);
        if (u < jb->n_r2g) {
            const int r0 = u * R2_TILES * R2_ROWS;
            r2_item(jb, &l, r0, RS_MIN(R2_TILES * R2_ROWS, jb->r1_start - r0), o0, o1);
        } else {
            const int r0 = jb->r1_start + (u - jb->n_r2g) * R1_ROWS;
            r1_item(jb, &l, r0, RS_MIN(R1_ROWS, jb->rows - r0), o0, o1);
        }
    }
}

int rs_fp8_gemm_avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void rs_fp8_gemm_avx2(rs_pool *pool, float *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                      const float *ws, int rows, int n, int k, int r2_min) {
    RS_ASSERT(rows > 0 && n > 0 && k > 0);
    ajob jb = {
        .out = out, .xq = xq, .xs = xs, .wq = wq, .ws = ws, .rows = rows, .n = n, .k = k,
        .kb = rs_fp8_blocks(k),
    };
    /* whole lanes = rows tiles, and a padded one for a remainder of at least r2_min rows */
    const int rem = rows % R2_ROWS, last = rem >= r2_min ? rem : 0;
    const int n_r2 = rows / R2_ROWS + (last > 0);
    jb.r1_start = rows / R2_ROWS * R2_ROWS + last;
    jb.n_r2g = (n_r2 + R2_TILES - 1) / R2_TILES;
    jb.n_units = jb.n_r2g + (rows - jb.r1_start + R1_ROWS - 1) / R1_ROWS;
    /* Wider items where there are enough: each row tile's activation digits (decoded and
     * transposed once per item and block) then serve twice the outputs. */
    const int64_t wide = ((int64_t)n + CHUNK_MAX - 1) / CHUNK_MAX * jb.n_units;
    jb.chunk = jb.n_r2g > 0 && wide >= 4 * (pool ? rs_pool_threads(pool) : 1) ? CHUNK_MAX : CHUNK;
    jb.n_chunks = ((int64_t)n + jb.chunk - 1) / jb.chunk;
    const int64_t items = jb.n_chunks * jb.n_units;
    if (pool)
        rs_pool_run(pool, items, jb.n_units, avx2_items, &jb);
    else
        avx2_items(&jb, 0, items, 0);
}

#else /* not x86-64 */

int rs_fp8_gemm_avx2_supported(void) { return 0; }

void rs_fp8_gemm_avx2(rs_pool *pool, float *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                      const float *ws, int rows, int n, int k, int r2_min) {
    (void)pool, (void)out, (void)xq, (void)xs, (void)wq, (void)ws, (void)rows, (void)n, (void)k, (void)r2_min;
    RS_ASSERT(!"rs_fp8_gemm_avx2 on a CPU without AVX2");
}

#endif
