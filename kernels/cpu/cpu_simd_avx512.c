/*
 * cpu_simd_avx512.c — AVX-512F kernels: the matmul tile (attention's page kernels are in
 * cpu_attention_simd.c).
 *
 * Compiled for any x86-64 target: every function carries target("avx512f,...") and is only called
 * when init found AVX-512F. A matmul tile keeps 4 weight rows x NT token rows of 16-lane fp32
 * accumulators in registers (NT <= 6: 24 accumulators, 4 weight vectors, 1 x vector of 32 zmm).
 * BF16 widens to fp32 with a zero-extend and a 16-bit shift, F16 with vcvtph2ps. The K tail (k % 16)
 * is summed in scalar after the horizontal reduction. The tile is written once per (NT, dtype)
 * through an always-inline body with constant arguments, so the compiler unrolls and keeps the
 * accumulator arrays in registers.
 *
 * One token row (batch-1 decode) also has a row-sequential form of each tile (rs_cpu_gemv_avx512,
 * rs_cpu_gemv_avx512_bf16_dot): the same four weight rows, each read front to back before the next,
 * so a thread reads one stream of memory instead of four interleaved ones. Each weight row's
 * accumulator goes through exactly the operations of the interleaved tile, in the same order, so
 * the outputs are the same bits. Which form is faster depends on the machine's memory at the time
 * (cpu_matmul.c picks by timing both): on a 2-vCPU Zen 4 VM, alternated call by call, the row form
 * read 1.04-1.40x the tile's GB/s when the tile read 36-52 GB/s, and 0.89-0.96x when it read
 * 63-72 GB/s (one FMA chain a row is latency-bound there).
 *
 * The fast numerics' BF16 tile (tile_bf16_dot, CPUs with AVX512_BF16) takes the token rows already
 * rounded to BF16 and multiplies 32 BF16 pairs per instruction with vdpbf16ps into the same 4 x NT
 * fp32 accumulators: each lane adds the two products of its pair (exact in fp32) with round-to-
 * nearest-even, denormals flushed, as the instruction defines; the K tail is a zero-masked load.
 * Twice the products of an FMA per instruction and no widening of the weights.
 */
#include "../../core/rs.h"
#include "cpu_hsum.h"
#include "cpu_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T512   __attribute__((target("avx512f,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* 16 weights from element i of row p, as fp32. */
T512 INLINE __m512 load16(const void *p, int64_t i, const rs_dtype dt) {
    if (dt == RS_DTYPE_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == RS_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}

/* A tile's weight rows (missing ones repeat the last; their sums are dropped), the rows to prefetch
 * (NULL without), es bytes an element, and its accumulators zeroed. */
T512 INLINE void tile_start(const rs_cpu_tile *tl, size_t es, const int NT, const char *wr[RS_CPU_NW],
                            const char *pf[RS_CPU_NW], __m512 acc[RS_CPU_NW][RS_CPU_NT_AVX512]) {
    for (int j = 0; j < RS_CPU_NW; j++) {
        wr[j] = (const char *)tl->w + (size_t)((j < tl->nw ? j : tl->nw - 1) * tl->ldw) * es;
        pf[j] = tl->prefetch ? (const char *)tl->prefetch + (size_t)(j * tl->ldw) * es : NULL;
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
        for (int j = 0; j < RS_CPU_NW; j++) acc[j][t] = _mm512_setzero_ps();
}

/* ROWS (NT = 1 only): the weight rows one after another, each with its prefetch of the next block's
 * same row; else all four together. Every accumulator sees the same operations either way. */
T512 INLINE void tile_body(const rs_cpu_tile *tl, const int NT, const rs_dtype dt, const bool ROWS) {
    const size_t es = dt == RS_DTYPE_F32 ? 4 : 2;
    const int64_t k = tl->k, ldx = tl->ldx;
    const float *x = tl->x;
    const char *wr[RS_CPU_NW], *pf[RS_CPU_NW];
    __m512 acc[RS_CPU_NW][RS_CPU_NT_AVX512];
    tile_start(tl, es, NT, wr, pf, acc);

    const int64_t k16 = k & ~(int64_t)15;
    if (ROWS) {
        for (int j = 0; j < tl->nw; j++) /* the rows past nw are copies of the last: their sums are dropped */
            for (int64_t i = 0; i < k16; i += 16) {
                if (pf[j] && (i * (int64_t)es) % 64 == 0) _mm_prefetch(pf[j] + (size_t)i * es, _MM_HINT_T1);
                acc[j][0] = _mm512_fmadd_ps(load16(wr[j], i, dt), _mm512_loadu_ps(x + i), acc[j][0]);
            }
    } else
    for (int64_t i = 0; i < k16; i += 16) {
        if (pf[0] && (i * (int64_t)es) % 64 == 0) {
#pragma GCC unroll 4
            for (int j = 0; j < RS_CPU_NW; j++) _mm_prefetch(pf[j] + (size_t)i * es, _MM_HINT_T1);
        }
        __m512 wv[RS_CPU_NW];
#pragma GCC unroll 4
        for (int j = 0; j < RS_CPU_NW; j++) wv[j] = load16(wr[j], i, dt);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            __m512 xv = _mm512_loadu_ps(x + t * ldx + i);
#pragma GCC unroll 4
            for (int j = 0; j < RS_CPU_NW; j++) acc[j][t] = _mm512_fmadd_ps(wv[j], xv, acc[j][t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        float s[4];
        _mm_storeu_ps(s, rs_hsum4_512(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
        const float *xt = x + t * ldx;
        for (int j = 0; j < tl->nw; j++) {
            for (int64_t i = k16; i < k; i++) s[j] += xt[i] * rs_cpu_elem(wr[j], dt, i);
            tl->out[t * tl->ldo + j] = tl->bias ? s[j] + tl->bias[j] : s[j];
        }
    }
}

#define DEFINE_TILE(name, DT)                                                                                \
    T512 static void name(const rs_cpu_tile *t) {                                                            \
        switch (t->nt) {                                                                                     \
        case 1: tile_body(t, 1, DT, false); break;                                                           \
        case 2: tile_body(t, 2, DT, false); break;                                                           \
        case 3: tile_body(t, 3, DT, false); break;                                                           \
        case 4: tile_body(t, 4, DT, false); break;                                                           \
        case 5: tile_body(t, 5, DT, false); break;                                                           \
        default: tile_body(t, 6, DT, false); break;                                                          \
        }                                                                                                    \
    }                                                                                                        \
    T512 static void name##_rows(const rs_cpu_tile *t) {                                                     \
        RS_ASSERT(t->nt == 1);                                                                               \
        tile_body(t, 1, DT, true);                                                                           \
    }
DEFINE_TILE(tile_bf16, RS_DTYPE_BF16)
DEFINE_TILE(tile_f16, RS_DTYPE_F16)
DEFINE_TILE(tile_f32, RS_DTYPE_F32)
_Static_assert(RS_CPU_NT_AVX512 == 6, "DEFINE_TILE instantiates nt = 1..6");

rs_cpu_tile_fn rs_cpu_tile_avx512(rs_dtype dt) {
    return dt == RS_DTYPE_BF16 ? tile_bf16 : dt == RS_DTYPE_F16 ? tile_f16 : tile_f32;
}

rs_cpu_tile_fn rs_cpu_gemv_avx512(rs_dtype dt) {
    return dt == RS_DTYPE_BF16 ? tile_bf16_rows : dt == RS_DTYPE_F16 ? tile_f16_rows : tile_f32_rows;
}

/* ---- fast numerics: BF16 x BF16 on vdpbf16ps ---- */

#define TBF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")))

/* The 32 BF16 values at p, or the n < 32 there followed by zeros. Two 32-byte loads: at 1-4 token
 * rows (memory-bound) one 64-byte load a row ran 5-15% slower on Zen 4 (bench-matmul, bf16fast). */
TBF16 INLINE __m512i load32_bf16(const uint16_t *p, int64_t n) {
    if (n >= 32)
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                                  _mm256_loadu_si256((const __m256i *)(p + 16)), 1);
    return _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p);
}

/* acc[j][t] += the dot products of elements [i, i + n) (n <= 32) of weight row j and token row t. */
TBF16 INLINE void tile_dot_step(const uint16_t *const wr[RS_CPU_NW], const uint16_t *x, int64_t ldx, int64_t i,
                                int64_t n, const int NT, __m512 acc[RS_CPU_NW][RS_CPU_NT_AVX512]) {
    __m512i wv[RS_CPU_NW];
#pragma GCC unroll 4
    for (int j = 0; j < RS_CPU_NW; j++) wv[j] = load32_bf16(wr[j] + i, n);
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        const __m512i xv = load32_bf16(x + t * ldx + i, n);
#pragma GCC unroll 4
        for (int j = 0; j < RS_CPU_NW; j++) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], (__m512bh)wv[j], (__m512bh)xv);
    }
}

/* ROWS (NT = 1 only): the weight rows one after another, as in tile_body. */
TBF16 INLINE void tile_dot_body(const rs_cpu_tile *tl, const int NT, const bool ROWS) {
    const int64_t k = tl->k, ldx = tl->ldx;
    const uint16_t *x = tl->xb;
    const char *wc[RS_CPU_NW], *pf[RS_CPU_NW];
    __m512 acc[RS_CPU_NW][RS_CPU_NT_AVX512];
    tile_start(tl, 2, NT, wc, pf, acc);
    const uint16_t *wr[RS_CPU_NW];
    for (int j = 0; j < RS_CPU_NW; j++) wr[j] = (const uint16_t *)(const void *)wc[j];

    const int64_t k32 = k & ~(int64_t)31;
    if (ROWS) {
        for (int j = 0; j < tl->nw; j++) {
            for (int64_t i = 0; i < k32; i += 32) {
                if (pf[j]) _mm_prefetch(pf[j] + (size_t)i * 2, _MM_HINT_T0);
                acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)load32_bf16(wr[j] + i, 32),
                                             (__m512bh)load32_bf16(x + i, 32));
            }
            if (k32 < k)
                acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)load32_bf16(wr[j] + k32, k - k32),
                                             (__m512bh)load32_bf16(x + k32, k - k32));
        }
    } else {
        for (int64_t i = 0; i < k32; i += 32) { /* 64 bytes of every row a step */
        /* the next weight block into L1, not L2 as the fp32 tile does: this loop has too little work
         * per byte to hide L2 latency (bench-matmul 3072 1024 bf16,bf16fast 1 1: 0.82 -> 1.0 of the
         * fp32 tile's time on Zen 4) */
        if (pf[0]) {
#pragma GCC unroll 4
            for (int j = 0; j < RS_CPU_NW; j++) _mm_prefetch(pf[j] + (size_t)i * 2, _MM_HINT_T0);
        }
            tile_dot_step(wr, x, ldx, i, 32, NT, acc);
        }
        if (k32 < k) tile_dot_step(wr, x, ldx, k32, k - k32, NT, acc);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        float s[4];
        _mm_storeu_ps(s, rs_hsum4_512(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
        for (int j = 0; j < tl->nw; j++) tl->out[t * tl->ldo + j] = tl->bias ? s[j] + tl->bias[j] : s[j];
    }
}

TBF16 static void tile_bf16_dot(const rs_cpu_tile *t) {
    switch (t->nt) {
    case 1: tile_dot_body(t, 1, false); break;
    case 2: tile_dot_body(t, 2, false); break;
    case 3: tile_dot_body(t, 3, false); break;
    case 4: tile_dot_body(t, 4, false); break;
    case 5: tile_dot_body(t, 5, false); break;
    default: tile_dot_body(t, 6, false); break;
    }
}

TBF16 static void tile_bf16_dot_rows(const rs_cpu_tile *t) {
    RS_ASSERT(t->nt == 1);
    tile_dot_body(t, 1, true);
}

rs_cpu_tile_fn rs_cpu_tile_avx512_bf16_dot(void) { return tile_bf16_dot; }
rs_cpu_tile_fn rs_cpu_gemv_avx512_bf16_dot(void) { return tile_bf16_dot_rows; }

/* rs_f32_to_bf16 (round to nearest even, NaN kept quiet) over 16 lanes. */
TBF16 INLINE __m256i round16_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q));
}

TBF16 void rs_cpu_round_bf16_avx512(uint16_t *dst, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(dst + i), round16_bf16(_mm512_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = rs_f32_to_bf16(src[i]);
}

#else /* not x86: never selected, init reports scalar */

rs_cpu_tile_fn rs_cpu_tile_avx512(rs_dtype dt) {
    (void)dt;
    return NULL;
}

rs_cpu_tile_fn rs_cpu_tile_avx512_bf16_dot(void) { return NULL; }

rs_cpu_tile_fn rs_cpu_gemv_avx512(rs_dtype dt) {
    (void)dt;
    return NULL;
}

rs_cpu_tile_fn rs_cpu_gemv_avx512_bf16_dot(void) { return NULL; }

void rs_cpu_round_bf16_avx512(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = rs_f32_to_bf16(src[i]);
}

#endif
