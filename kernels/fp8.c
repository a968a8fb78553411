/*
 * fp8.c — E4M3FN / E5M2 codecs and the blockwise quantizers (see fp8.h for the contracts).
 *
 * The encoder works on the fp32 bit pattern with integers only: no fp32 rounding can sneak in, and
 * the same code handles normals, subnormals (of either format), overflow and infinities. It is the
 * direct analogue of the host path in cuda_fp8.hpp (float -> exact double -> one rounding), which
 * tools/fp8_exhaustive.c compares it against for all 2^32 inputs.
 *
 * The quantizers use true fp32 division `w / scale`, not multiplication by a reciprocal, because
 * that is the formula of the DeepSeek-V3 reference (inference/kernel.py `act_quant`: `y = x / s`)
 * and of docs/design.md; `w * (1/s)` (verl's Triton kernel) differs in the last bit for some inputs
 * and would therefore not match checkpoints quantized the reference way. Division is correctly
 * rounded in IEEE fp32, on the CPU and with CUDA's default `-prec-div=true` (`__fdiv_rn`).
 *
 * rs_fp8_quantize_weight runs at model load and on every weight update, so it dispatches to a
 * vectorized kernel when the program has one (rs_fp8_quantize_weight_fast, fp8.h: the CPU backend's,
 * ~40x the scalar loop); the scalar loop stays here as rs_fp8_quantize_weight_ref, the definition
 * the kernel is tested against bit for bit.
 */
#include "fp8.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rs.h"

/* ---- decode tables, built at compile time from the format definitions ----
 * E4M3: exponent field E (4 bits), mantissa m (3 bits): E > 0 -> (8 + m) * 2^(E - 10),
 *       E = 0 -> m * 2^-9, E = 15 and m = 7 -> NaN.
 * E5M2: E (5 bits), m (2 bits): E > 0 -> (4 + m) * 2^(E - 17), E = 0 -> m * 2^-16,
 *       E = 31 -> inf (m = 0) or NaN.
 * Each product is exact (small integer times a power of two), so the table holds the exact value.
 * NaN codes decode to the positive quiet NaN whatever their sign bit, as CUDA's
 * __nv_cvt_fp8_to_halfraw does ("canonical NaN, discard sign"). */
#define E4M3_E(c) (((c) >> 3) & 15)
#define E4M3_M(c) ((c) & 7)
#define E4M3_MAG(c)                                                                         \
    (((c) & 0x7f) == 0x7f ? NAN                                                             \
     : E4M3_E(c)          ? (float)(8 + E4M3_M(c)) * (float)(1 << E4M3_E(c)) * 0x1p-10f \
                          : (float)E4M3_M(c) * 0x1p-9f)
#define E4M3_VAL(c) \
    (((c) & 0x7f) == 0x7f ? NAN : ((c) & 0x80) ? -E4M3_MAG((c) & 0x7f) : E4M3_MAG(c))

#define E5M2_E(c) (((c) >> 2) & 31)
#define E5M2_M(c) ((c) & 3)
#define E5M2_MAG(c)                                                                         \
    (E5M2_E(c) == 31 ? (E5M2_M(c) ? NAN : INFINITY)                                         \
     : E5M2_E(c)     ? (float)(4 + E5M2_M(c)) * (float)(1 << E5M2_E(c)) * 0x1p-17f      \
                     : (float)E5M2_M(c) * 0x1p-16f)
#define E5M2_VAL(c) \
    (E5M2_E(c) == 31 && E5M2_M(c) ? NAN : ((c) & 0x80) ? -E5M2_MAG((c) & 0x7f) : E5M2_MAG(c))

#define T4(F, b) F(b), F((b) + 1), F((b) + 2), F((b) + 3)
#define T16(F, b) T4(F, b), T4(F, (b) + 4), T4(F, (b) + 8), T4(F, (b) + 12)
#define T64(F, b) T16(F, b), T16(F, (b) + 16), T16(F, (b) + 32), T16(F, (b) + 48)
#define T256(F) T64(F, 0), T64(F, 64), T64(F, 128), T64(F, 192)

const float rs_fp8_e4m3_f32[256] = {T256(E4M3_VAL)};
const float rs_fp8_e5m2_f32[256] = {T256(E5M2_VAL)};

/* ---- encode ----
 * |x| = m * 2^(e - 23) with m the 24-bit significand (implicit bit included for normals).
 * The target quantum is 2^(max(e, emin) - mbits), so we drop s = 23 - mbits + max(0, emin - e)
 * low bits of m with round-to-nearest-even. For a normal result the rounded q lies in
 * [2^mbits, 2^(mbits+1)] and `((e - emin) << mbits) + q` adds the implicit bit into the exponent
 * field (a carry out of the mantissa bumps the exponent, as it should); for a subnormal result the
 * code is q itself (q = 2^mbits is the smallest normal). Anything past maxcode — overflow, inf —
 * saturates. s is capped at 31: for s >= 25 the value is below half the smallest subnormal, and
 * with s = 31 the rounding still sees r = m < half = 2^30, i.e. rounds to 0. */
static inline uint8_t fp8_encode(float x, int mbits, int emin, uint32_t maxcode) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return RS_FP8_NAN_CODE; /* CUDA canonicalizes NaN to +NaN first */
    int e;
    uint32_t m;
    if (a >= 0x00800000u) {
        e = (int)(a >> 23) - 127;
        m = (a & 0x007fffffu) | 0x00800000u;
    } else { /* fp32 subnormal or zero: m * 2^-149 */
        e = -126;
        m = a;
    }
    int s = 23 - mbits + (e < emin ? emin - e : 0);
    if (s > 31) s = 31;
    uint32_t q = m >> s, r = m & ((1u << s) - 1u), half = 1u << (s - 1);
    if (r > half || (r == half && (q & 1u))) q++;
    uint32_t code = (e >= emin ? (uint32_t)(e - emin) << mbits : 0u) + q;
    if (code > maxcode) code = maxcode;
    return (uint8_t)(sign | code);
}

uint8_t rs_fp8_e4m3_from_f32(float x) { return fp8_encode(x, 3, -6, 0x7e); }
uint8_t rs_fp8_e5m2_from_f32(float x) { return fp8_encode(x, 2, -14, 0x7b); }

void rs_fp8_e4m3_from_f32_n(uint8_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = fp8_encode(src[i], 3, -6, 0x7e);
}

void rs_fp8_e5m2_from_f32_n(uint8_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = fp8_encode(src[i], 2, -14, 0x7b);
}

void rs_fp8_e4m3_to_f32_n(float *dst, const uint8_t *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = rs_fp8_e4m3_f32[src[i]];
}

void rs_fp8_e5m2_to_f32_n(float *dst, const uint8_t *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = rs_fp8_e5m2_f32[src[i]];
}

/* ---- quantizers ---- */

/* fmaxf(amax, |v|) as CUDA's fmaxf and x86's maxps treat NaN: a NaN element — quiet or signaling —
 * is ignored, so it does not poison its block's scale (it encodes to the NaN code on its own), and
 * the result is the exact maximum whatever the order. Written as a comparison rather than a libm
 * call because glibc's fmaxf follows IEEE 754-2008 maxNum for a signaling NaN and returns NaN,
 * which made the next element reset the running maximum (an order-dependent amax). */
static inline float amax_update(float amax, float v) {
    const float a = fabsf(v);
    return a > amax ? a : amax;
}

static inline float block_scale(float amax) { return fmaxf(amax, RS_FP8_AMAX_FLOOR) / RS_FP8_E4M3_MAX; }

/* Row o of w as fp32: F32 rows are used in place, BF16 rows are widened (exactly) into buf. */
static const float *weight_row(const rs_tensor *w, int64_t o, int64_t in, float *buf /* [in] */) {
    if (w->dtype == RS_DTYPE_F32) return (const float *)w->data + o * in;
    const uint16_t *src = (const uint16_t *)w->data + o * in;
    for (int64_t i = 0; i < in; i++) buf[i] = rs_bf16_to_f32(src[i]);
    return buf;
}

static int check_weight(const rs_tensor *w) {
    if (!w || w->ndim != 2 || !w->data || w->shape[0] < 0 || w->shape[1] < 0) return RS_EINVAL;
    if (w->dtype != RS_DTYPE_BF16 && w->dtype != RS_DTYPE_F32) return RS_EUNSUPPORTED;
    return RS_OK;
}

/* A weak reference (see fp8.h): its address is NULL when no object of the program defines it. */
#pragma weak rs_fp8_quantize_weight_fast

int rs_fp8_quantize_weight(const rs_tensor *w, uint8_t *q, float *scale_inv) {
    int rc = check_weight(w);
    if (rc != RS_OK) return rc;
    if (rs_fp8_quantize_weight_fast) {
        rc = rs_fp8_quantize_weight_fast(w, q, scale_inv);
        if (rc != RS_EUNSUPPORTED) return rc; /* RS_OK, or RS_EFORMAT: a non-finite weight */
    }
    return rs_fp8_quantize_weight_ref(w, q, scale_inv);
}

int rs_fp8_quantize_weight_ref(const rs_tensor *w, uint8_t *q, float *scale_inv) {
    int rc = check_weight(w);
    if (rc != RS_OK) return rc;
    int64_t out = w->shape[0], in = w->shape[1];
    int64_t nbi = rs_fp8_blocks(in);
    if (out == 0 || in == 0) return RS_OK;
    float *buf = rs_xmalloc((size_t)in * sizeof *buf);
    float *amax = rs_xmalloc((size_t)nbi * sizeof *amax);
    bool bad = false;
    for (int64_t o0 = 0; o0 < out; o0 += RS_FP8_BLOCK) {
        int64_t o1 = RS_MIN(o0 + RS_FP8_BLOCK, out);
        for (int64_t bi = 0; bi < nbi; bi++) amax[bi] = 0.0f;
        for (int64_t o = o0; o < o1; o++) {
            const float *row = weight_row(w, o, in, buf);
            for (int64_t i = 0; i < in; i++) {
                amax[i / RS_FP8_BLOCK] = amax_update(amax[i / RS_FP8_BLOCK], row[i]);
                bad |= !isfinite(row[i]);
            }
        }
        float *srow = scale_inv + (o0 / RS_FP8_BLOCK) * nbi;
        for (int64_t bi = 0; bi < nbi; bi++) srow[bi] = block_scale(amax[bi]);
        for (int64_t o = o0; o < o1; o++) {
            const float *row = weight_row(w, o, in, buf);
            uint8_t *qrow = q + o * in;
            for (int64_t i = 0; i < in; i++)
                qrow[i] = rs_fp8_e4m3_from_f32(row[i] / srow[i / RS_FP8_BLOCK]);
        }
    }
    free(amax);
    free(buf);
    return bad ? RS_EFORMAT : RS_OK;
}

void rs_fp8_dequantize_weight(const uint8_t *q, const float *scale_inv, int64_t out, int64_t in, float *w) {
    int64_t nbi = rs_fp8_blocks(in);
    for (int64_t o = 0; o < out; o++) {
        const float *srow = scale_inv + (o / RS_FP8_BLOCK) * nbi;
        for (int64_t i = 0; i < in; i++)
            w[o * in + i] = rs_fp8_e4m3_f32[q[o * in + i]] * srow[i / RS_FP8_BLOCK];
    }
}

void rs_fp8_quantize_act(const float *x, int64_t rows, int64_t k, uint8_t *q, float *scale) {
    int64_t ng = rs_fp8_blocks(k);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < ng; g++) {
            int64_t j0 = g * RS_FP8_BLOCK, j1 = RS_MIN(j0 + RS_FP8_BLOCK, k);
            const float *xr = x + r * k;
            float amax = 0.0f;
            for (int64_t j = j0; j < j1; j++) amax = amax_update(amax, xr[j]);
            float s = block_scale(amax);
            scale[r * ng + g] = s;
            for (int64_t j = j0; j < j1; j++) q[r * k + j] = rs_fp8_e4m3_from_f32(xr[j] / s);
        }
    }
}

void rs_fp8_dequantize_act(const uint8_t *q, const float *scale, int64_t rows, int64_t k, float *x) {
    int64_t ng = rs_fp8_blocks(k);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++)
            x[r * k + j] = rs_fp8_e4m3_f32[q[r * k + j]] * scale[r * ng + j / RS_FP8_BLOCK];
}
