/*
 * cpu_attention_simd.c — the page kernels of attention: the scores (q . K) and the output (P V)
 * of one KV page, over F32, BF16 or E4M3 rows, in plain C, AVX2+F16C and AVX-512F.
 *
 * Reading a row: F32 is loaded, BF16 widened (zero-extend, shift by 16), and an E4M3 code decoded
 * with a bit trick rather than a gather from the 256-entry table: the code S.EEEE.MMM placed in an
 * fp16 as S.0EEEE.MMM0000000 (sign to bit 15, the 7 magnitude bits shifted left by 7) is the fp16
 * 2^(E-15) * 1.MMM, i.e. exactly value(code) / 2^8 — for subnormal codes too (E = 0 gives the
 * fp16 subnormal 0.MMM * 2^-14 = value / 2^8). vcvtph2ps widens it exactly and a multiply by 256
 * (exact) restores the value. The only codes whose fp16 image is not their value are the NaNs
 * (S.1111.111, which would read as 480): their lanes are forced to 0xFFFF, an fp16 NaN. With the
 * code sign-extended to 16 bits the image is one shift and one mask, so decode ==
 * rs_fp8_e4m3_f32[] lane for lane costs a widening load, 5 integer ops (3 of them for NaN), a
 * convert and a multiply per 8 or 16 codes, and no table lookups. Tails (head_dim not a multiple
 * of the vector width) are scalar.
 *
 * scores: four K rows at a time, each read once for up to 4 (AVX2: 2) heads, whose 16 partial
 * sums stay in registers over the head dimension; the four sums of a head are reduced together
 * by one tree (cpu_hsum.h), which gives every row the same summation order whatever its slot, so a
 * score depends only on q and the K row. accum: per 16 (AVX2: 8) output lanes, the heads' outputs
 * (up to 8) stay in registers over the page's rows, so out is loaded and stored once per page,
 * not once per row. The kernel bodies are written once per head count and dtype through
 * always-inline bodies with constant arguments, as cpu_simd_avx512.c does for its tiles.
 *
 * The fast numerics' kernels over BF16 pages (AVX512_BF16) take q and p already in BF16 and use
 * vdpbf16ps: scores like the fp32 kernel, 32 elements an instruction; P V pairs two V rows by
 * interleaving their 16-bit elements, multiplies them with a (p[t], p[t + 1]) pair broadcast as one
 * 32-bit lane, and restores the element order once per page.
 *
 * Compiled for any x86-64 target: each function carries its target attribute and is only called
 * when the backend found the feature, like cpu_simd_*.c.
 */
#include "cpu_attention_simd.h"

#include <string.h>

#include "cpu_hsum.h"

#include "../../core/rs.h"
#include "../fp8.h"

/* ---- plain C ---- */

/* Element i of a row of dtype dt (F32, BF16 or E4M3). */
static inline float kv_elem(const void *row, rs_dtype dt, size_t i) {
    return dt == RS_DTYPE_E4M3 ? rs_fp8_e4m3_f32[((const uint8_t *)row)[i]] : rs_cpu_elem(row, dt, (int64_t)i);
}

/* Row t of a page: `stride` elements of dt (1, 2 or 4 bytes) apart. */
static inline const void *kv_page_row(const void *page, rs_dtype dt, size_t stride, int t) {
    const size_t es = dt == RS_DTYPE_E4M3 ? 1 : dt == RS_DTYPE_BF16 ? 2 : 4;
    return (const char *)page + (size_t)t * stride * es;
}

static void decode_scalar(float *dst, const uint8_t *src, int n) {
    for (int i = 0; i < n; i++) dst[i] = rs_fp8_e4m3_f32[src[i]];
}

/* Lanes [i0, hd) of every row and head, sequential: all of the plain-C kernel, the tail of the
 * vector ones (scores adds to what the vector part stored). */
static void scores_tail(float *sc, size_t ld, const float *q, int g, const void *k, rs_dtype dt, size_t stride, int n,
                        int hd, int i0, bool add) {
    for (int t = 0; t < n; t++) {
        const void *kt = kv_page_row(k, dt, stride, t);
        for (int h = 0; h < g; h++) {
            const float *qh = q + (size_t)h * (size_t)hd;
            float s = 0.0f;
            for (int i = i0; i < hd; i++) s += qh[i] * kv_elem(kt, dt, (size_t)i);
            sc[(size_t)h * ld + (size_t)t] = add ? sc[(size_t)h * ld + (size_t)t] + s : s;
        }
    }
}

static void accum_tail(float *out, const float *p, size_t ld, int g, const void *v, rs_dtype dt, size_t stride, int n,
                       int hd, int i0) {
    if (i0 == hd) return;
    for (int t = 0; t < n; t++) {
        const void *vt = kv_page_row(v, dt, stride, t);
        for (int h = 0; h < g; h++) {
            float w = p[(size_t)h * ld + (size_t)t], *oh = out + (size_t)h * (size_t)hd;
            for (int i = i0; i < hd; i++) oh[i] += w * kv_elem(vt, dt, (size_t)i);
        }
    }
}

static void scores_scalar(float *sc, size_t ld, const float *q, int g, const void *k, rs_dtype dt, size_t stride,
                          int n, int hd) {
    scores_tail(sc, ld, q, g, k, dt, stride, n, hd, 0, false);
}

static void accum_scalar(float *out, const float *p, size_t ld, int g, const void *v, rs_dtype dt, size_t stride,
                         int n, int hd) {
    accum_tail(out, p, ld, g, v, dt, stride, n, hd, 0);
}

const rs_cpu_kv_vec rs_cpu_kv_vec_scalar = {.decode = decode_scalar, .scores = scores_scalar, .accum = accum_scalar};

const rs_cpu_kv_vec *rs_cpu_kv_vec_for(rs_cpu_simd s) {
    return s == RS_CPU_SIMD_AVX512 ? &rs_cpu_kv_vec_avx512
           : s == RS_CPU_SIMD_AVX2 ? &rs_cpu_kv_vec_avx2
                                   : &rs_cpu_kv_vec_scalar;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T256   __attribute__((target("avx2,fma,f16c")))
#define T512   __attribute__((target("avx512f,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#define MAX_G  8 /* query heads per accum pass: 8 accumulators */
#define KROWS  4 /* K rows per scores step */

/* The fp16 images (see the file comment) of codes sign-extended to 16-bit lanes: shifting left by
 * 7 puts the magnitude bits at 7..13 and copies of the sign at 14 and 15; the mask keeps bit 15.
 * NaN codes (magnitude 0x7f, image 0x3f80 under the sign) become 0xffff, an fp16 NaN. */
T256 INLINE __m128i f16_image8(__m128i c /* [8] sign-extended codes */) {
    __m128i h = _mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16((short)0xbf80));
    __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3f80)), _mm_set1_epi16(0x3f80));
    return _mm_or_si128(h, nan);
}

T256 INLINE __m256i f16_image16(__m256i c /* [16] sign-extended codes */) {
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16((short)0xbf80));
    __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3f80)), _mm256_set1_epi16(0x3f80));
    return _mm256_or_si256(h, nan);
}

/* Runs BODY(G) over the heads MAXC at a time (MAXC <= 8); G is a constant in each expansion. */
#define FOR_HEAD_CHUNKS(g, MAXC, BODY)                                                                       \
    for (int h0 = 0; h0 < (g); h0 += (MAXC)) {                                                               \
        switch (RS_MIN((MAXC), (g) - h0)) {                                                                  \
        case 1: BODY(1); break;                                                                              \
        case 2: if (2 <= (MAXC)) BODY(2); break;                                                             \
        case 3: if (3 <= (MAXC)) BODY(3); break;                                                             \
        case 4: if (4 <= (MAXC)) BODY(4); break;                                                             \
        case 5: if (5 <= (MAXC)) BODY(5); break;                                                             \
        case 6: if (6 <= (MAXC)) BODY(6); break;                                                             \
        case 7: if (7 <= (MAXC)) BODY(7); break;                                                             \
        default: if (8 <= (MAXC)) BODY(8); break;                                                            \
        }                                                                                                    \
    }

/* One kernel per dtype, each calling its body with a constant dt. */
#define FOR_DTYPE(dt, CALL)                                                                                  \
    switch (dt) {                                                                                            \
    case RS_DTYPE_E4M3: CALL(RS_DTYPE_E4M3); break;                                                          \
    case RS_DTYPE_BF16: CALL(RS_DTYPE_BF16); break;                                                          \
    default: CALL(RS_DTYPE_F32); break;                                                                      \
    }

/* ---- AVX2 + F16C: 8 lanes ---- */

#define SG256 2 /* heads per scores pass: 2 x KROWS accumulators, KROWS rows, 1 q of 16 registers */

T256 INLINE __m256 decode8(const uint8_t *p) {
    __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_mul_ps(_mm256_cvtph_ps(f16_image8(c)), _mm256_set1_ps(256.0f));
}

/* 8 values of a row of dt from element i, as fp32. */
T256 INLINE __m256 load8(const void *row, int i, const rs_dtype dt) {
    if (dt == RS_DTYPE_E4M3) return decode8((const uint8_t *)row + i);
    if (dt == RS_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + i);
}

T256 static void decode256(float *dst, const uint8_t *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, decode8(src + i));
    for (; i < n; i++) dst[i] = rs_fp8_e4m3_f32[src[i]];
}

T256 INLINE void scores256_body(float *sc, size_t ld, const float *q, const void *k, size_t stride, int n, int hd,
                                const int G, const rs_dtype dt) {
    const int h8 = hd & ~7;
    for (int t0 = 0; t0 < n; t0 += KROWS) {
        const void *kt[KROWS]; /* missing rows repeat the last one; their sums are dropped */
#pragma GCC unroll 4
        for (int u = 0; u < KROWS; u++) kt[u] = kv_page_row(k, dt, stride, RS_MIN(t0 + u, n - 1));
        __m256 acc[SG256][KROWS];
#pragma GCC unroll 4
        for (int h = 0; h < G; h++)
#pragma GCC unroll 4
            for (int u = 0; u < KROWS; u++) acc[h][u] = _mm256_setzero_ps();
        for (int i = 0; i < h8; i += 8) {
            __m256 d[KROWS];
#pragma GCC unroll 4
            for (int u = 0; u < KROWS; u++) d[u] = load8(kt[u], i, dt);
#pragma GCC unroll 4
            for (int h = 0; h < G; h++) {
                const __m256 qv = _mm256_loadu_ps(q + (size_t)h * (size_t)hd + (size_t)i);
#pragma GCC unroll 4
                for (int u = 0; u < KROWS; u++) acc[h][u] = _mm256_fmadd_ps(qv, d[u], acc[h][u]);
            }
        }
        const int nu = RS_MIN(KROWS, n - t0);
#pragma GCC unroll 4
        for (int h = 0; h < G; h++) {
            float s[KROWS];
            _mm_storeu_ps(s, rs_hsum4_256(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
            for (int u = 0; u < nu; u++) sc[(size_t)h * ld + (size_t)(t0 + u)] = s[u];
        }
    }
}

T256 static void scores256(float *sc, size_t ld, const float *q, int g, const void *k, rs_dtype dt, size_t stride,
                           int n, int hd) {
#define BODY(G) scores256_body(sc + (size_t)h0 * ld, ld, q + (size_t)h0 * (size_t)hd, k, stride, n, hd, G, DT)
#define CALL(D)                                                                                              \
    {                                                                                                        \
        const rs_dtype DT = D;                                                                               \
        FOR_HEAD_CHUNKS(g, SG256, BODY)                                                                      \
    }
    FOR_DTYPE(dt, CALL)
#undef CALL
#undef BODY
    if (hd & 7) scores_tail(sc, ld, q, g, k, dt, stride, n, hd, hd & ~7, true);
}

T256 INLINE void accum256_body(float *out, const float *p, size_t ld, const void *v, size_t stride, int n, int hd,
                               const int G, const rs_dtype dt) {
    const int h8 = hd & ~7;
    for (int i = 0; i < h8; i += 8) {
        __m256 acc[MAX_G];
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) acc[h] = _mm256_loadu_ps(out + (size_t)h * (size_t)hd + (size_t)i);
        for (int t = 0; t < n; t++) {
            __m256 d = load8(kv_page_row(v, dt, stride, t), i, dt);
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
                acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[(size_t)h * ld + (size_t)t]), d, acc[h]);
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) _mm256_storeu_ps(out + (size_t)h * (size_t)hd + (size_t)i, acc[h]);
    }
}

T256 static void accum256(float *out, const float *p, size_t ld, int g, const void *v, rs_dtype dt, size_t stride,
                          int n, int hd) {
#define BODY(G) accum256_body(out + (size_t)h0 * (size_t)hd, p + (size_t)h0 * ld, ld, v, stride, n, hd, G, DT)
#define CALL(D)                                                                                              \
    {                                                                                                        \
        const rs_dtype DT = D;                                                                               \
        FOR_HEAD_CHUNKS(g, MAX_G, BODY)                                                                      \
    }
    FOR_DTYPE(dt, CALL)
#undef CALL
#undef BODY
    accum_tail(out, p, ld, g, v, dt, stride, n, hd, hd & ~7);
}

const rs_cpu_kv_vec rs_cpu_kv_vec_avx2 = {.decode = decode256, .scores = scores256, .accum = accum256};

/* ---- AVX-512F: 16 lanes (the E4M3 integer part stays on 256-bit AVX2 lanes, so no BW) ---- */

#define SG512 4 /* heads per scores pass: 4 x KROWS accumulators of 32 registers */

T512 INLINE __m512 decode16(const uint8_t *p) {
    __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_mul_ps(_mm512_cvtph_ps(f16_image16(c)), _mm512_set1_ps(256.0f));
}

T512 INLINE __m512 load16(const void *row, int i, const rs_dtype dt) {
    if (dt == RS_DTYPE_E4M3) return decode16((const uint8_t *)row + i);
    if (dt == RS_DTYPE_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + i);
}

T512 static void decode512(float *dst, const uint8_t *src, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, decode16(src + i));
    for (; i < n; i++) dst[i] = rs_fp8_e4m3_f32[src[i]];
}

/* The G heads' scores of up to KROWS K rows (nu of them stored) from their 16-lane partial sums,
 * each row reduced by the same tree (rs_hsum4_512). */
T512 INLINE void store_scores512(float *sc, size_t ld, __m512 acc[SG512][KROWS], int nu, const int G) {
#pragma GCC unroll 4
    for (int h = 0; h < G; h++) {
        float s[KROWS];
        _mm_storeu_ps(s, rs_hsum4_512(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
        for (int u = 0; u < nu; u++) sc[(size_t)h * ld + (size_t)u] = s[u];
    }
}

T512 INLINE void scores512_body(float *sc, size_t ld, const float *q, const void *k, size_t stride, int n, int hd,
                                const int G, const rs_dtype dt) {
    const int h16 = hd & ~15;
    for (int t0 = 0; t0 < n; t0 += KROWS) {
        const void *kt[KROWS]; /* missing rows repeat the last one; their sums are dropped */
#pragma GCC unroll 4
        for (int u = 0; u < KROWS; u++) kt[u] = kv_page_row(k, dt, stride, RS_MIN(t0 + u, n - 1));
        __m512 acc[SG512][KROWS];
#pragma GCC unroll 4
        for (int h = 0; h < G; h++)
#pragma GCC unroll 4
            for (int u = 0; u < KROWS; u++) acc[h][u] = _mm512_setzero_ps();
        for (int i = 0; i < h16; i += 16) {
            __m512 d[KROWS];
#pragma GCC unroll 4
            for (int u = 0; u < KROWS; u++) d[u] = load16(kt[u], i, dt);
#pragma GCC unroll 4
            for (int h = 0; h < G; h++) {
                const __m512 qv = _mm512_loadu_ps(q + (size_t)h * (size_t)hd + (size_t)i);
#pragma GCC unroll 4
                for (int u = 0; u < KROWS; u++) acc[h][u] = _mm512_fmadd_ps(qv, d[u], acc[h][u]);
            }
        }
        store_scores512(sc + t0, ld, acc, RS_MIN(KROWS, n - t0), G);
    }
}

T512 static void scores512(float *sc, size_t ld, const float *q, int g, const void *k, rs_dtype dt, size_t stride,
                           int n, int hd) {
#define BODY(G) scores512_body(sc + (size_t)h0 * ld, ld, q + (size_t)h0 * (size_t)hd, k, stride, n, hd, G, DT)
#define CALL(D)                                                                                              \
    {                                                                                                        \
        const rs_dtype DT = D;                                                                               \
        FOR_HEAD_CHUNKS(g, SG512, BODY)                                                                      \
    }
    FOR_DTYPE(dt, CALL)
#undef CALL
#undef BODY
    if (hd & 15) scores_tail(sc, ld, q, g, k, dt, stride, n, hd, hd & ~15, true);
}

T512 INLINE void accum512_body(float *out, const float *p, size_t ld, const void *v, size_t stride, int n, int hd,
                               const int G, const rs_dtype dt) {
    const int h16 = hd & ~15;
    for (int i = 0; i < h16; i += 16) {
        __m512 acc[MAX_G];
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) acc[h] = _mm512_loadu_ps(out + (size_t)h * (size_t)hd + (size_t)i);
        for (int t = 0; t < n; t++) {
            __m512 d = load16(kv_page_row(v, dt, stride, t), i, dt);
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
                acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[(size_t)h * ld + (size_t)t]), d, acc[h]);
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) _mm512_storeu_ps(out + (size_t)h * (size_t)hd + (size_t)i, acc[h]);
    }
}

T512 static void accum512(float *out, const float *p, size_t ld, int g, const void *v, rs_dtype dt, size_t stride,
                          int n, int hd) {
#define BODY(G) accum512_body(out + (size_t)h0 * (size_t)hd, p + (size_t)h0 * ld, ld, v, stride, n, hd, G, DT)
#define CALL(D)                                                                                              \
    {                                                                                                        \
        const rs_dtype DT = D;                                                                               \
        FOR_HEAD_CHUNKS(g, MAX_G, BODY)                                                                      \
    }
    FOR_DTYPE(dt, CALL)
#undef CALL
#undef BODY
    accum_tail(out, p, ld, g, v, dt, stride, n, hd, hd & ~15);
}

const rs_cpu_kv_vec rs_cpu_kv_vec_avx512 = {.decode = decode512, .scores = scores512, .accum = accum512};

/* ---- fast numerics over BF16 pages: BF16 q and p on vdpbf16ps ---- */

#define TBF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")))

/* The n <= 32 BF16 values at p, zeros after. */
TBF16 INLINE __m512i load32_bf16(const uint16_t *p, int n) {
    return n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p);
}

TBF16 INLINE void scores_dot_body(float *sc, size_t ld, const uint16_t *q, const uint16_t *k, size_t stride, int n,
                                  int hd, const int G) {
    for (int t0 = 0; t0 < n; t0 += KROWS) {
        const uint16_t *kt[KROWS]; /* missing rows repeat the last one; their sums are dropped */
#pragma GCC unroll 4
        for (int u = 0; u < KROWS; u++) kt[u] = k + (size_t)RS_MIN(t0 + u, n - 1) * stride;
        __m512 acc[SG512][KROWS];
#pragma GCC unroll 4
        for (int h = 0; h < G; h++)
#pragma GCC unroll 4
            for (int u = 0; u < KROWS; u++) acc[h][u] = _mm512_setzero_ps();
        for (int i = 0; i < hd; i += 32) {
            const int m = RS_MIN(32, hd - i);
            __m512i d[KROWS];
#pragma GCC unroll 4
            for (int u = 0; u < KROWS; u++) d[u] = load32_bf16(kt[u] + i, m);
#pragma GCC unroll 4
            for (int h = 0; h < G; h++) {
                const __m512bh qv = (__m512bh)load32_bf16(q + (size_t)h * (size_t)hd + (size_t)i, m);
#pragma GCC unroll 4
                for (int u = 0; u < KROWS; u++) acc[h][u] = _mm512_dpbf16_ps(acc[h][u], qv, (__m512bh)d[u]);
            }
        }
        store_scores512(sc + t0, ld, acc, RS_MIN(KROWS, n - t0), G);
    }
}

TBF16 void rs_cpu_scores_bf16_dot(float *sc, size_t ld, const uint16_t *q, int g, const uint16_t *k, size_t stride,
                                  int n, int hd) {
#define BODY(G) scores_dot_body(sc + (size_t)h0 * ld, ld, q + (size_t)h0 * (size_t)hd, k, stride, n, hd, G)
    FOR_HEAD_CHUNKS(g, SG512, BODY)
#undef BODY
}

/* acc_lo/hi[h] += the products of V rows t and t + 1 (v1; zeros past the rows) with the pair pp[h]
 * of BF16 probabilities (p[t], p[t + 1]) in one 32-bit lane. Within each 128-bit lane the low
 * unpack of the two rows holds elements 8L..8L+3, the high one 8L+4..8L+7. */
TBF16 INLINE void accum_dot_pair(__m512 lo[MAX_G], __m512 hi[MAX_G], const __m512i v0, const __m512i v1,
                                 const __m512bh pp[MAX_G], const int G) {
    const __m512bh a = (__m512bh)_mm512_unpacklo_epi16(v0, v1), b = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 8
    for (int h = 0; h < G; h++) {
        lo[h] = _mm512_dpbf16_ps(lo[h], a, pp[h]);
        hi[h] = _mm512_dpbf16_ps(hi[h], b, pp[h]);
    }
}

/* Output lanes [i, i + 32) of G heads, rows taken two at a time (a lone last row pairs with zeros),
 * put back in element order and added to out at the end. */
TBF16 INLINE void accum_dot_body(float *out, const uint16_t *p, size_t ld, const uint16_t *v, size_t stride, int n,
                                 int hd, int i, const int G) {
    __m512 lo[MAX_G], hi[MAX_G];
    __m512bh pp[MAX_G];
#pragma GCC unroll 8
    for (int h = 0; h < G; h++) lo[h] = hi[h] = _mm512_setzero_ps();
    int t = 0;
    for (; t + 2 <= n; t += 2) {
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) {
            uint32_t pair;
            memcpy(&pair, p + (size_t)h * ld + (size_t)t, sizeof pair);
            pp[h] = (__m512bh)_mm512_set1_epi32((int)pair);
        }
        accum_dot_pair(lo, hi, _mm512_loadu_si512(v + (size_t)t * stride + (size_t)i),
                       _mm512_loadu_si512(v + (size_t)(t + 1) * stride + (size_t)i), pp, G);
    }
    if (t < n) {
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) pp[h] = (__m512bh)_mm512_set1_epi32((int)p[(size_t)h * ld + (size_t)t]);
        accum_dot_pair(lo, hi, _mm512_loadu_si512(v + (size_t)t * stride + (size_t)i), _mm512_setzero_si512(), pp, G);
    }
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 8
    for (int h = 0; h < G; h++) {
        float *o = out + (size_t)h * (size_t)hd + (size_t)i;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_permutex2var_ps(lo[h], i0, hi[h])));
        _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_loadu_ps(o + 16), _mm512_permutex2var_ps(lo[h], i1, hi[h])));
    }
}

TBF16 void rs_cpu_accum_bf16_dot(float *out, const uint16_t *p, size_t ld, int g, const uint16_t *v, size_t stride,
                                 int n, int hd) {
    const int h32 = hd & ~31;
    for (int i = 0; i < h32; i += 32) {
#define BODY(G) accum_dot_body(out + (size_t)h0 * (size_t)hd, p + (size_t)h0 * ld, ld, v, stride, n, hd, i, G)
        FOR_HEAD_CHUNKS(g, MAX_G, BODY)
#undef BODY
    }
    /* lanes past the last 32: the same page's sum of BF16 products in fp32, added to out */
    for (int h = 0; h < g; h++) {
        for (int i = h32; i < hd; i++) {
            float s = 0.0f;
            for (int t = 0; t < n; t++)
                s += rs_bf16_to_f32(p[(size_t)h * ld + (size_t)t]) * rs_bf16_to_f32(v[(size_t)t * stride + (size_t)i]);
            out[(size_t)h * (size_t)hd + (size_t)i] += s;
        }
    }
}

#else /* not x86: never selected, init reports scalar */

const rs_cpu_kv_vec rs_cpu_kv_vec_avx2 = {0};
const rs_cpu_kv_vec rs_cpu_kv_vec_avx512 = {0};

void rs_cpu_scores_bf16_dot(float *sc, size_t ld, const uint16_t *q, int g, const uint16_t *k, size_t stride, int n,
                            int hd) {
    (void)sc, (void)ld, (void)q, (void)g, (void)k, (void)stride, (void)n, (void)hd;
    RS_ASSERT(!"fast attention on a non-x86 CPU");
}

void rs_cpu_accum_bf16_dot(float *out, const uint16_t *p, size_t ld, int g, const uint16_t *v, size_t stride, int n,
                           int hd) {
    (void)out, (void)p, (void)ld, (void)g, (void)v, (void)stride, (void)n, (void)hd;
    RS_ASSERT(!"fast attention on a non-x86 CPU");
}

#endif
