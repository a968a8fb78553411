/*
 * fp8_gemm.h — the block-scaled FP8 GEMM of the CPU backend, and the reference it must reproduce.
 *
 *   out[r][o] = sum over K blocks b, in order, of  block(r, o, b) * (xs[r][b] * ws[o/128][b])
 *   block(r, o, b) = sum over j in block b of e4m3(xq[r][j]) * e4m3(wq[o][j])      (exact)
 *
 * computed as `acc = 0.0f; for b: acc = fmaf((float)block, xs[r][b] * ws[o/128][b], acc)`,
 * with the block sum exact before its single rounding to fp32 and `xs * ws` one fp32 multiply.
 * Every output element is therefore a fixed sequence of correctly rounded operations on exactly
 * defined values: reproducible bit-for-bit by any implementation that follows the recipe (the
 * threaded SIMD path here, a CUDA-core kernel), while tensor-core paths are compared to it with a
 * tolerance. This is the docs/design.md "Numerics" contract; activations come from
 * rs_fp8_quantize_act, weights from rs_fp8_quantize_weight or a checkpoint (kernels/fp8.h).
 *
 * `out` must not overlap the inputs. Scales are used as given (negative, inf and NaN included).
 * A NaN block sum (only possible with NaN codes 0x7F / 0xFF in the inputs) is the canonical +NaN,
 * and so is every NaN output, whatever made it (NaN codes, NaN scales, inf * 0): which of two NaN
 * operands an fmaf or a product returns depends on the libm and on an operand order that the
 * compiler may swap (it treats the factors as commutative), so only the canonical NaN agrees
 * bit-for-bit between implementations. Whether an output is NaN does not depend on any of that.
 */
#ifndef RS_FP8_GEMM_H
#define RS_FP8_GEMM_H

#include <stdint.h>

#include "../../core/pool.h"
#include "../tensor.h"

typedef enum rs_fp8_gemm_isa {
    RS_FP8_GEMM_ISA_AUTO = 0, /* the best one this CPU supports */
    RS_FP8_GEMM_ISA_GENERIC,  /* portable C, any CPU: products decoded to double */
    RS_FP8_GEMM_ISA_AVX2,     /* AVX2 + FMA: exact integer digit products (vpmaddwd) */
    RS_FP8_GEMM_ISA_AVX512_VNNI, /* AVX-512 BW/VL/DQ + VBMI + VNNI + GFNI: exact integer digit products */
} rs_fp8_gemm_isa;

/* The scalar reference, single-threaded: the definition of the result. K blocks are
 * ceil(k/128) wide; the last one may be partial, and so may the last 128-row block of the weight.
 * rows, n, k >= 0 (k == 0 gives zeros). */
void rs_fp8_gemm_ref(float *out /* [rows][n] f32 */,
                     const uint8_t *xq /* [rows][k] e4m3 */,
                     const float *xs /* [rows][ceil(k/128)] f32 */,
                     const uint8_t *wq /* [n][k] e4m3 */,
                     const float *ws /* [ceil(n/128)][ceil(k/128)] f32 */,
                     int rows, int n, int k);

/* The fast path: bit-identical to rs_fp8_gemm_ref for every input, whatever the ISA and the number
 * of threads. Threads split the n output features (weight rows) through `pool` (borrowed; NULL
 * runs on the calling thread). Uses rs_fp8_gemm_detect_isa(). Allocates nothing. */
void rs_fp8_gemm(rs_pool *pool, float *out /* [rows][n] f32 */,
                 const uint8_t *xq /* [rows][k] e4m3 */,
                 const float *xs /* [rows][ceil(k/128)] f32 */,
                 const uint8_t *wq /* [n][k] e4m3 */,
                 const float *ws /* [ceil(n/128)][ceil(k/128)] f32 */,
                 int rows, int n, int k);

/* Same with a chosen instruction set, for tests and benchmarks. Returns RS_OK, or
 * RS_EUNSUPPORTED (out untouched) when this CPU cannot run `isa`. */
int rs_fp8_gemm_with_isa(rs_fp8_gemm_isa isa, rs_pool *pool, float *out /* [rows][n] f32 */,
                         const uint8_t *xq /* [rows][k] e4m3 */,
                         const float *xs /* [rows][ceil(k/128)] f32 */,
                         const uint8_t *wq /* [n][k] e4m3 */,
                         const float *ws /* [ceil(n/128)][ceil(k/128)] f32 */,
                         int rows, int n, int k);

/* Same for weights in `layout` (rs_tensor.layout): RS_LAYOUT_ROWS as above, or
 * RS_LAYOUT_FP8_PAIRS32 (fp8_layout.h) with the AVX-512 VNNI ISA only (RS_EUNSUPPORTED for any
 * other, or where the layout does not fit [n][k]). The result is the same bits. */
int rs_fp8_gemm_layout_with_isa(rs_fp8_gemm_isa isa, rs_pool *pool, float *out, const uint8_t *xq,
                                const float *xs, const uint8_t *wq, rs_layout layout, const float *ws, int rows,
                                int n, int k);

/* The SIMD kernels tile few rows (lanes = k or outputs) and many rows (lanes = rows, 16 a tile)
 * differently; where the rows past the whole 16-row tiles number between a few and 15, padding
 * them to one more 16-row tile can be the faster of the two, from a row count that depends on the
 * CPU (its ports and SIMD widths: 5 on a 2-vCPU Intel Xeon with AVX2 forced, 7 with VNNI there).
 * rs_fp8_gemm_tune finds that count for `isa` (AUTO: detected) by timing both on the calling
 * thread (a 512 x 1024 weight of Gaussian values, 15 rows down to where few-row tiles win, best
 * of 5 calls each; 40-60 ms), or takes it from the environment variable RS_FP8_ROW_TILE_MIN (1..17,
 * 17: never pad) when that is set; sets it for every later GEMM of that ISA in the process, and
 * returns it. Once per ISA and process: later calls return the first pick. Results are the same
 * bits whatever it picks. Returns 0, and sets nothing, for an ISA without the choice
 * (generic) or one this CPU cannot run. rs_fp8_gemm_row_tile_min: the count in use (0: none);
 * rs_fp8_gemm_set_row_tile_min sets it (1..17, else RS_EINVAL; RS_EUNSUPPORTED for an ISA
 * without the choice). */
int rs_fp8_gemm_tune(rs_fp8_gemm_isa isa);
int rs_fp8_gemm_row_tile_min(rs_fp8_gemm_isa isa);
int rs_fp8_gemm_set_row_tile_min(rs_fp8_gemm_isa isa, int rows);

rs_fp8_gemm_isa rs_fp8_gemm_detect_isa(void);          /* never AUTO */
int rs_fp8_gemm_isa_supported(rs_fp8_gemm_isa isa);    /* 1 if this CPU can run it */
const char *rs_fp8_gemm_isa_name(rs_fp8_gemm_isa isa); /* "avx2-exact", ... */

#endif /* RS_FP8_GEMM_H */
