/*
 * fp8_layout.h — RS_LAYOUT_FP8_PAIRS32, the order in which the CPU backend keeps E4M3 weights when
 * it runs the AVX-512 VNNI GEMM (fp8_gemm_vnni.c).
 *
 * Why. Row-major codes make a batch-1 GEMV put k in the vector lanes, so every 128-block of every
 * output ends in a horizontal sum of three integer accumulators: a quarter of the kernel's time.
 * With 32 outputs interleaved pair by pair, one 64-byte load holds codes k = 2p, 2p + 1 of 32
 * outputs, the lanes are outputs, and the block sums come out of the accumulators as they are.
 *
 * The layout, for a weight [n][k] with k even (rs_fp8_pairs32_fits):
 *   - rows are taken in groups of 32; group g (rows 32g .. 32g + 31, g < n / 32) occupies the
 *     same 32 k bytes as in row-major order, so the layout only permutes bytes within a group;
 *   - within a group, pair p (0 <= p < k / 2) is the 64 bytes at 64 p; its 16-bit slot s
 *     (bytes 2s, 2s + 1) holds codes [r][2p], [r][2p + 1] of row r = rs_fp8_pairs32_row(s):
 *     4 (s / 8) + s % 8 when s % 8 < 4, else 16 + 4 (s / 8) + s % 8 - 4. This is the order in
 *     which decode64's in-lane byte unpacks put output j in dword lane j of one vector (j < 16)
 *     and output 16 + j in lane j of the other, so the kernel needs no permutation;
 *   - the last n % 32 rows stay row-major where they are.
 * Block scales (scale_inv) are not affected.
 */
#ifndef RS_FP8_LAYOUT_H
#define RS_FP8_LAYOUT_H

#include <stdbool.h>
#include <stdint.h>

#define RS_FP8_PAIRS32_ROWS 32

/* The row in slot s (0..31) of a pair. */
static inline int rs_fp8_pairs32_row(int s) {
    return (s % 8 < 4 ? 0 : 12) + 4 * (s / 8) + s % 8;
}

/* The layout applies to [n][k] (it needs whole pairs and at least one group). */
static inline bool rs_fp8_pairs32_fits(int64_t n, int64_t k) {
    return k > 0 && k % 2 == 0 && n >= RS_FP8_PAIRS32_ROWS;
}

/* Row-major codes src [n][k] -> dst in RS_LAYOUT_FP8_PAIRS32 (both n * k bytes, no overlap).
 * AVX-512 where the CPU has it, else portable C; the same bytes either way. */
void rs_fp8_pairs32_pack(uint8_t *dst, const uint8_t *src, int64_t n, int64_t k);

/* The inverse: RS_LAYOUT_FP8_PAIRS32 src -> row-major dst (portable C; tests, fallbacks). */
void rs_fp8_pairs32_unpack(uint8_t *dst, const uint8_t *src, int64_t n, int64_t k);

/* Code [r][c] of a weight [n][k] stored in RS_LAYOUT_FP8_PAIRS32. */
static inline uint8_t rs_fp8_pairs32_at(const uint8_t *data, int64_t n, int64_t k, int64_t r, int64_t c) {
    const int64_t g = r / RS_FP8_PAIRS32_ROWS;
    if (g >= n / RS_FP8_PAIRS32_ROWS) return data[r * k + c];
    const int j = (int)(r % RS_FP8_PAIRS32_ROWS);
    const int s = j < 16 ? 8 * (j / 4) + j % 4 : 8 * ((j - 16) / 4) + 4 + (j - 16) % 4; /* inverse of _row */
    return data[g * RS_FP8_PAIRS32_ROWS * k + (c / 2) * 64 + 2 * s + c % 2];
}

#endif /* RS_FP8_LAYOUT_H */
