/*
 * cpu_attention_simd.c — the E4M3 KV kernels of attention: decoding codes to fp32, alone or fused
 * into the scores (q . K) and the output (P V) of one page, in plain C, AVX2+F16C and AVX-512F.
 *
 * The vector decode is a bit trick rather than a gather from the 256-entry table: an E4M3 code
 * S.EEEE.MMM placed in an fp16 as S.0EEEE.MMM0000000 (sign to bit 15, the 7 magnitude bits shifted
 * left by 7) is the fp16 2^(E-15) * 1.MMM, i.e. exactly value(code) / 2^8 — for subnormal codes
 * too (E = 0 gives the fp16 subnormal 0.MMM * 2^-14 = value / 2^8). vcvtph2ps widens it exactly
 * and a multiply by 256 (exact) restores the value. The only codes whose fp16 image is not their
 * value are the NaNs (S.1111.111, which would read as 480): their lanes are forced to 0xFFFF, an
 * fp16 NaN. With the code sign-extended to 16 bits the image is one shift and one mask, so decode
 * == rs_fp8_e4m3_f32[] lane for lane costs a widening load, 5 integer ops (3 of them for NaN), a
 * convert and a multiply per 8 or 16 codes, and no table lookups. Tails (head_dim not a multiple
 * of the vector width) use the table.
 *
 * scores: per row, the g heads' partial sums stay in g vector registers over the head dimension
 * and are reduced once per row. accum: per 16 (AVX2: 8) output lanes, the g heads' outputs stay in
 * registers over the page's rows, so out is loaded and stored once per page, not once per row.
 * Heads go 8 at a time (8 accumulators); the kernel bodies are written once per head count through
 * always-inline bodies with a constant G, as cpu_simd_avx512.c does for its tiles.
 *
 * Compiled for any x86-64 target: each function carries its target attribute and is only called
 * when the backend found the feature, like cpu_simd_*.c.
 */
#include "cpu_attention_simd.h"

#include "../../core/rs.h"
#include "../fp8.h"

/* ---- plain C ---- */

static void decode_scalar(float *dst, const uint8_t *src, int n) {
    for (int i = 0; i < n; i++) dst[i] = rs_fp8_e4m3_f32[src[i]];
}

static void scores_scalar(float *sc, size_t ld, const float *q, int g, const uint8_t *k, size_t stride, int n,
                          int hd) {
    for (int t = 0; t < n; t++) {
        const uint8_t *kt = k + (size_t)t * stride;
        for (int h = 0; h < g; h++) {
            const float *qh = q + (size_t)h * (size_t)hd;
            float s = 0.0f;
            for (int i = 0; i < hd; i++) s += qh[i] * rs_fp8_e4m3_f32[kt[i]];
            sc[(size_t)h * ld + (size_t)t] = s;
        }
    }
}

static void accum_scalar(float *out, const float *p, size_t ld, int g, const uint8_t *v, size_t stride, int n,
                         int hd) {
    for (int t = 0; t < n; t++) {
        const uint8_t *vt = v + (size_t)t * stride;
        for (int h = 0; h < g; h++) {
            float w = p[(size_t)h * ld + (size_t)t], *oh = out + (size_t)h * (size_t)hd;
            for (int i = 0; i < hd; i++) oh[i] += w * rs_fp8_e4m3_f32[vt[i]];
        }
    }
}

const rs_cpu_vec_e4m3 rs_cpu_vec_e4m3_scalar = {.decode = decode_scalar, .scores = scores_scalar,
                                                .accum = accum_scalar};

const rs_cpu_vec_e4m3 *rs_cpu_vec_e4m3_for(rs_cpu_simd s) {
    return s == RS_CPU_SIMD_AVX512 ? &rs_cpu_vec_e4m3_avx512
           : s == RS_CPU_SIMD_AVX2 ? &rs_cpu_vec_e4m3_avx2
                                   : &rs_cpu_vec_e4m3_scalar;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T256   __attribute__((target("avx2,fma,f16c")))
#define T512   __attribute__((target("avx512f,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#define MAX_G  8 /* query heads per kernel pass: 8 accumulators */

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

/* The scalar remainder of both kernels: lanes [i0, hd) of every row and head. */
static void scores_tail(float *sc, size_t ld, const float *q, int g, const uint8_t *k, size_t stride, int n, int hd,
                        int i0) {
    for (int t = 0; t < n; t++)
        for (int h = 0; h < g; h++) {
            float s = 0.0f;
            const float *qh = q + (size_t)h * (size_t)hd;
            const uint8_t *kt = k + (size_t)t * stride;
            for (int i = i0; i < hd; i++) s += qh[i] * rs_fp8_e4m3_f32[kt[i]];
            sc[(size_t)h * ld + (size_t)t] += s;
        }
}

static void accum_tail(float *out, const float *p, size_t ld, int g, const uint8_t *v, size_t stride, int n, int hd,
                       int i0) {
    if (i0 == hd) return;
    for (int t = 0; t < n; t++)
        for (int h = 0; h < g; h++) {
            float w = p[(size_t)h * ld + (size_t)t];
            for (int i = i0; i < hd; i++)
                out[(size_t)h * (size_t)hd + (size_t)i] += w * rs_fp8_e4m3_f32[v[(size_t)t * stride + (size_t)i]];
        }
}

/* Runs body(G) over the heads 8 at a time; G is a constant in each expansion. */
#define FOR_HEAD_CHUNKS(g, BODY)                                                                             \
    for (int h0 = 0; h0 < (g); h0 += MAX_G) {                                                                \
        switch (RS_MIN(MAX_G, (g) - h0)) {                                                                   \
        case 1: BODY(1); break;                                                                              \
        case 2: BODY(2); break;                                                                              \
        case 3: BODY(3); break;                                                                              \
        case 4: BODY(4); break;                                                                              \
        case 5: BODY(5); break;                                                                              \
        case 6: BODY(6); break;                                                                              \
        case 7: BODY(7); break;                                                                              \
        default: BODY(8); break;                                                                             \
        }                                                                                                    \
    }

/* ---- AVX2 + F16C: 8 codes per vector ---- */

T256 INLINE __m256 decode8(const uint8_t *p) {
    __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_mul_ps(_mm256_cvtph_ps(f16_image8(c)), _mm256_set1_ps(256.0f));
}

T256 INLINE float hsum256(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

T256 static void decode256(float *dst, const uint8_t *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, decode8(src + i));
    for (; i < n; i++) dst[i] = rs_fp8_e4m3_f32[src[i]];
}

T256 INLINE void scores256_body(float *sc, size_t ld, const float *q, const uint8_t *k, size_t stride, int n, int hd,
                                const int G) {
    const int h8 = hd & ~7;
    for (int t = 0; t < n; t++) {
        const uint8_t *kt = k + (size_t)t * stride;
        __m256 acc[MAX_G];
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) acc[h] = _mm256_setzero_ps();
        for (int i = 0; i < h8; i += 8) {
            __m256 d = decode8(kt + i);
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
                acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * (size_t)hd + (size_t)i), d, acc[h]);
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) sc[(size_t)h * ld + (size_t)t] = hsum256(acc[h]);
    }
}

T256 static void scores256(float *sc, size_t ld, const float *q, int g, const uint8_t *k, size_t stride, int n,
                           int hd) {
#define BODY(G) scores256_body(sc + (size_t)h0 * ld, ld, q + (size_t)h0 * (size_t)hd, k, stride, n, hd, G)
    FOR_HEAD_CHUNKS(g, BODY)
#undef BODY
    if (hd & 7) scores_tail(sc, ld, q, g, k, stride, n, hd, hd & ~7);
}

T256 INLINE void accum256_body(float *out, const float *p, size_t ld, const uint8_t *v, size_t stride, int n, int hd,
                               const int G) {
    const int h8 = hd & ~7;
    for (int i = 0; i < h8; i += 8) {
        __m256 acc[MAX_G];
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) acc[h] = _mm256_loadu_ps(out + (size_t)h * (size_t)hd + (size_t)i);
        for (int t = 0; t < n; t++) {
            __m256 d = decode8(v + (size_t)t * stride + (size_t)i);
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
                acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[(size_t)h * ld + (size_t)t]), d, acc[h]);
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) _mm256_storeu_ps(out + (size_t)h * (size_t)hd + (size_t)i, acc[h]);
    }
}

T256 static void accum256(float *out, const float *p, size_t ld, int g, const uint8_t *v, size_t stride, int n,
                          int hd) {
#define BODY(G) accum256_body(out + (size_t)h0 * (size_t)hd, p + (size_t)h0 * ld, ld, v, stride, n, hd, G)
    FOR_HEAD_CHUNKS(g, BODY)
#undef BODY
    accum_tail(out, p, ld, g, v, stride, n, hd, hd & ~7);
}

const rs_cpu_vec_e4m3 rs_cpu_vec_e4m3_avx2 = {.decode = decode256, .scores = scores256, .accum = accum256};

/* ---- AVX-512F: 16 codes per vector (the integer part stays on 256-bit AVX2 lanes, so no BW) ---- */

T512 INLINE __m512 decode16(const uint8_t *p) {
    __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_mul_ps(_mm512_cvtph_ps(f16_image16(c)), _mm512_set1_ps(256.0f));
}

T512 static void decode512(float *dst, const uint8_t *src, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, decode16(src + i));
    for (; i < n; i++) dst[i] = rs_fp8_e4m3_f32[src[i]];
}

T512 INLINE void scores512_body(float *sc, size_t ld, const float *q, const uint8_t *k, size_t stride, int n, int hd,
                                const int G) {
    const int h16 = hd & ~15;
    for (int t = 0; t < n; t++) {
        const uint8_t *kt = k + (size_t)t * stride;
        __m512 acc[MAX_G];
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) acc[h] = _mm512_setzero_ps();
        for (int i = 0; i < h16; i += 16) {
            __m512 d = decode16(kt + i);
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
                acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)h * (size_t)hd + (size_t)i), d, acc[h]);
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) sc[(size_t)h * ld + (size_t)t] = _mm512_reduce_add_ps(acc[h]);
    }
}

T512 static void scores512(float *sc, size_t ld, const float *q, int g, const uint8_t *k, size_t stride, int n,
                           int hd) {
#define BODY(G) scores512_body(sc + (size_t)h0 * ld, ld, q + (size_t)h0 * (size_t)hd, k, stride, n, hd, G)
    FOR_HEAD_CHUNKS(g, BODY)
#undef BODY
    if (hd & 15) scores_tail(sc, ld, q, g, k, stride, n, hd, hd & ~15);
}

T512 INLINE void accum512_body(float *out, const float *p, size_t ld, const uint8_t *v, size_t stride, int n, int hd,
                               const int G) {
    const int h16 = hd & ~15;
    for (int i = 0; i < h16; i += 16) {
        __m512 acc[MAX_G];
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) acc[h] = _mm512_loadu_ps(out + (size_t)h * (size_t)hd + (size_t)i);
        for (int t = 0; t < n; t++) {
            __m512 d = decode16(v + (size_t)t * stride + (size_t)i);
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
                acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[(size_t)h * ld + (size_t)t]), d, acc[h]);
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) _mm512_storeu_ps(out + (size_t)h * (size_t)hd + (size_t)i, acc[h]);
    }
}

T512 static void accum512(float *out, const float *p, size_t ld, int g, const uint8_t *v, size_t stride, int n,
                          int hd) {
#define BODY(G) accum512_body(out + (size_t)h0 * (size_t)hd, p + (size_t)h0 * ld, ld, v, stride, n, hd, G)
    FOR_HEAD_CHUNKS(g, BODY)
#undef BODY
    accum_tail(out, p, ld, g, v, stride, n, hd, hd & ~15);
}

const rs_cpu_vec_e4m3 rs_cpu_vec_e4m3_avx512 = {.decode = decode512, .scores = scores512, .accum = accum512};

#else /* not x86: never selected, init reports scalar */

const rs_cpu_vec_e4m3 rs_cpu_vec_e4m3_avx2 = {0};
const rs_cpu_vec_e4m3 rs_cpu_vec_e4m3_avx512 = {0};

#endif
