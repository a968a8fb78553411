/*
 * cpu_amx.c — the fast numerics' BF16 and FP8 (W8A8) matmuls on AMX tiles (Intel Sapphire Rapids
 * and later): out[t][n] = sum_k bf16(x[t][k]) w[n][k] (+ bias[n]), fp32 sums, on TDPBF16PS; the
 * FP8 one is described at its section below.
 *
 * One TDPBF16PS multiplies a 16 x 32 BF16 tile by a 32 x 16 one into 16 x 16 fp32 sums: 8192
 * multiply-adds where vdpbf16ps does 32, at a throughput of about one every 12 cycles on one
 * core (3.7 TFLOP/s at 2.6 GHz, measured on a register-only loop), so many-row BF16 matmuls run
 * several times faster than on the vector units. The tile's first operand (A) is the weights as
 * they are stored: 16 weight rows, 32 k each, read with the row stride, so no weight is repacked
 * at load or at a push. The second (B) must hold k pairs by token row: B[p][2j + e] =
 * x[t0 + j][k0 + 2p + e]; the activations, rounded to BF16 as the vdpbf16ps path rounds them, are
 * packed so (16 x 16 dword transposes) once per call into 1 KB blocks, one per 16 token rows and
 * 32 k, zero past the last row and past k. The sums come out as [output][token] tiles and leave
 * through 16 x 16 transposes, adding the bias.
 *
 * Blocking: a thread takes chunks of 32 outputs (two A tiles); for each pair of 16-row token
 * groups (two B tiles) it runs the whole k loop on four accumulator tiles, reloading the chunk's
 * weights (64 B x 32 rows a step, kept in L1/L2 across token groups). A chunk past N, or any chunk
 * when k is not a multiple of 32, is first copied into a zero-padded block (a weight the tile
 * would read past its row could be another row's NaN, and 0 x NaN is NaN).
 *
 * Batch invariance: every sum is one output's own chain over k in the same steps whatever the
 * rows beside it in its tile (the tile computes each element from its A row and B column only),
 * and every row count takes this kernel, batch 1 included, so a row gets the same bits in any
 * batch. The instruction's rounding inside a step (DAZ/FTZ, an internal summation order that
 * neither sequential fp32 nor a fused chain reproduces bit for bit) is Intel's: the tests bound the
 * error against a double-precision sum instead of matching bits.
 *
 * Use needs the OS's permission for the tile data (Linux's arch_prctl ARCH_REQ_XCOMP_PERM), asked
 * once per process by rs_cpu_amx_available when fast numerics are first asked for: it enlarges the
 * process's signal frames, which a daemon on its exact numerics has no reason to pay.
 */
#include "cpu_internal.h"

#include <string.h>

#include "../../core/rs.h"
#include "../fp8.h"
#include "fp8_layout.h"

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512_transpose.h"

#define RS_TAMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512vbmi")))
#define INLINE  static inline __attribute__((always_inline))

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA  18

/* The CPU has AMX-TILE and AMX-BF16 and the OS saves their state (XCR0 bits 17, 18). */
bool rs_cpu_amx_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & (3u << 17)) == (3u << 17);
}

static bool amx_ok;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_permit(void) {
    amx_ok = rs_cpu_amx_supported() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

bool rs_cpu_amx_available(void) {
    pthread_once(&amx_once, amx_permit);
    return amx_ok;
}

/* Palette 1, eight tiles of 16 rows x 64 bytes: 0-3 the sums [out 16][token 16] fp32, 4-5 the
 * weights [out 16][k 32] BF16, 6-7 the activations [k pair 16][token 16 x 2] BF16. */
typedef struct __attribute__((packed, aligned(64))) tile_cfg {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_cfg;

/* Every tile 16 rows, but for m < 16 (the FP8 kernel's calls of m token rows) its A tile (4) and
 * the sums it makes (0, 1) get m rows (a tile multiply's time grows with its rows); each row's sums
 * are the same as in a 16-row tile, which the batch-invariance tests check. */
RS_TAMX static void tiles_configure(int m) {
    tile_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)m;
    _tile_loadconfig(&cfg);
}

/* ---- activations: BF16 rows -> 1 KB blocks [group][k step] of [k pair 16][token 16] dwords ---- */

typedef struct pack_job {
    uint32_t *xp;         /* [groups][steps][16][16] */
    const uint16_t *xb;   /* [rows][k] BF16 */
    int rows;
    int64_t k, steps;
} pack_job;

RS_TAMX static void pack_groups(void *arg, int64_t g0, int64_t g1, int tid) {
    (void)tid;
    const pack_job *j = arg;
    for (int64_t g = g0; g < g1; g++) {
        const int t0 = (int)g * 16, nt = RS_MIN(16, j->rows - t0);
        for (int64_t s = 0; s < j->steps; s++) {
            const int64_t k0 = s * 32, nk = RS_MIN((int64_t)32, j->k - k0);
            const __mmask32 km = nk == 32 ? (__mmask32)~0u : (__mmask32)((1u << nk) - 1u);
            __m512i r[16];
            for (int t = 0; t < 16; t++)
                r[t] = t < nt ? _mm512_maskz_loadu_epi16(km, j->xb + (size_t)(t0 + t) * (size_t)j->k + k0)
                              : _mm512_setzero_si512();
            rs_transpose16_epi32(r); /* r[p]: k pair p of the 16 rows */
            uint32_t *dst = j->xp + ((size_t)g * (size_t)j->steps + (size_t)s) * 256;
            for (int p = 0; p < 16; p++) _mm512_store_si512(dst + 16 * p, r[p]);
        }
    }
}

/* ---- the product ---- */

typedef struct amx_job {
    float *out;             /* [rows][n] */
    const uint16_t *w;      /* [n][k] BF16 */
    const float *bias;      /* [n] or NULL */
    const uint32_t *xp;     /* packed activations */
    rs_cpu_buf *pad;        /* [threads] zero-padded weight chunks, grown by the caller */
    int rows, groups;
    int64_t n, k, steps;
} amx_job;

/* Sums tile `c` ([out 16][token 16]) -> out[t0 + j][n0 + m] (+ bias) for j < nt, m < nn. */
RS_TAMX INLINE void tile_out(const amx_job *j, const float *c, int t0, int nt, int64_t n0, int nn) {
    __m512i r[16];
    for (int m = 0; m < 16; m++) r[m] = _mm512_load_si512(c + 16 * m);
    rs_transpose16_epi32(r); /* r[j]: token j's 16 outputs */
    const __mmask16 mask = nn >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nn) - 1u);
    const __m512 b = j->bias ? _mm512_maskz_loadu_ps(mask, j->bias + n0) : _mm512_setzero_ps();
    for (int t = 0; t < nt; t++)
        _mm512_mask_storeu_ps(j->out + (size_t)(t0 + t) * (size_t)j->n + n0, mask,
                              _mm512_add_ps(_mm512_castsi512_ps(r[t]), b));
}

/* One chunk of 32 (two == true) or 16 outputs against token groups g and g + 1 (pair) or g: the
 * whole k loop on 1-4 accumulators, then out. w: the chunk's rows, ldw bytes apart; cbuf: [4][16][16]. */
RS_TAMX INLINE void chunk_groups(const amx_job *j, const uint16_t *w, size_t ldw, int64_t n0, int nn, int g,
                                 bool two, bool pair, float *cbuf) {
    const uint32_t *xa = j->xp + (size_t)g * (size_t)j->steps * 256;
    const uint32_t *xb = pair ? xa + (size_t)j->steps * 256 : xa;
    const uint16_t *w1 = (const uint16_t *)((const char *)w + 16 * ldw);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < j->steps; s++) {
        _tile_loadd(4, w + s * 32, ldw);
        if (two) _tile_loadd(5, w1 + s * 32, ldw);
        _tile_loadd(6, xa + s * 256, 64);
        if (pair) _tile_loadd(7, xb + s * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) _tile_dpbf16ps(1, 5, 6);
        if (pair) _tile_dpbf16ps(2, 4, 7);
        if (two && pair) _tile_dpbf16ps(3, 5, 7);
    }
    /* every tile stored before the first is read back: a load right behind a tile store waits for it */
    _tile_stored(0, cbuf, 64);
    if (two) _tile_stored(1, cbuf + 256, 64);
    if (pair) _tile_stored(2, cbuf + 512, 64);
    if (two && pair) _tile_stored(3, cbuf + 768, 64);
    const int t0 = g * 16, nt0 = RS_MIN(16, j->rows - t0);
    tile_out(j, cbuf, t0, nt0, n0, RS_MIN(nn, 16));
    if (two) tile_out(j, cbuf + 256, t0, nt0, n0 + 16, nn - 16);
    if (pair) tile_out(j, cbuf + 512, t0 + 16, RS_MIN(16, j->rows - t0 - 16), n0, RS_MIN(nn, 16));
    if (two && pair) tile_out(j, cbuf + 768, t0 + 16, RS_MIN(16, j->rows - t0 - 16), n0 + 16, nn - 16);
}

/* Chunks [c0, c1) of 32 outputs. */
RS_TAMX static void amx_chunks(void *arg, int64_t c0, int64_t c1, int tid) {
    const amx_job *j = arg;
    float cbuf[4 * 256] __attribute__((aligned(64)));
    tiles_configure(16);
    const bool ragged_k = j->k % 32 != 0;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t n0 = c * 32;
        const int nn = (int)RS_MIN((int64_t)32, j->n - n0);
        const uint16_t *w = j->w + (size_t)n0 * (size_t)j->k;
        size_t ldw = (size_t)j->k * 2;
        if (ragged_k || nn < 32) { /* zero-padded copy: [32][steps * 32] */
            const size_t kp = (size_t)j->steps * 32;
            uint16_t *p = j->pad[tid].p;
            memset(p, 0, 32 * kp * 2);
            for (int r = 0; r < nn; r++) memcpy(p + (size_t)r * kp, w + (size_t)r * (size_t)j->k, (size_t)j->k * 2);
            w = p;
            ldw = kp * 2;
        }
        const bool two = nn > 16;
        for (int g = 0; g < j->groups; g += 2) {
            const bool pair = g + 1 < j->groups;
            if (two && pair) chunk_groups(j, w, ldw, n0, nn, g, true, true, cbuf);
            else if (two) chunk_groups(j, w, ldw, n0, nn, g, true, false, cbuf);
            else if (pair) chunk_groups(j, w, ldw, n0, nn, g, false, true, cbuf);
            else chunk_groups(j, w, ldw, n0, nn, g, false, false, cbuf);
        }
    }
    _tile_release();
}

void rs_cpu_matmul_amx_bf16(rs_cpu_ctx *c, float *out, const uint16_t *xb, const uint16_t *w, const float *bias,
                            int rows, int64_t n, int64_t k) {
    RS_ASSERT(rows > 0 && n > 0 && k > 0 && c->amx);
    const int groups = (rows + 15) / 16;
    const int64_t steps = (k + 31) / 32;
    uint32_t *xp = rs_cpu_scratch(&c->amx_act, (size_t)groups * (size_t)steps * 1024);
    pack_job pj = {.xp = xp, .xb = xb, .rows = rows, .k = k, .steps = steps};
    if ((int64_t)rows * k >= (1 << 16)) rs_pool_run(c->pool, groups, 1, pack_groups, &pj);
    else pack_groups(&pj, 0, groups, 0);
    const int64_t chunks = (n + 31) / 32;
    if (k % 32 != 0 || n % 32 != 0)
        for (int t = 0; t < c->n_threads; t++) rs_cpu_scratch(&c->amx_pad[t], 32 * (size_t)steps * 32 * 2);
    amx_job j = {.out = out, .w = w, .bias = bias, .xp = xp, .pad = c->amx_pad, .rows = rows, .groups = groups,
                 .n = n, .k = k, .steps = steps};
    /* below 64K multiply-adds in all, the pool's handoff costs more than a thread's share */
    if (chunks > 1 && n * k * rows >= (1 << 16)) rs_pool_run(c->pool, chunks, 1, amx_chunks, &j);
    else amx_chunks(&j, 0, chunks, 0);
}

/* ---- the fast numerics' FP8 (W8A8) matmul ----
 *
 * out[t][o] = sum over K blocks b, in order, of fma(block(t, o, b), xs[t][b] * ws[o / 128][b], acc):
 * the exact kernels' formula (fp8_gemm.h) with each 128-wide block sum taken on TDPBF16PS instead
 * of exactly. E4M3 values are BF16 values (4 significant bits, exponents 2^-9 .. 2^8), so both
 * operands decode to BF16 without rounding and every product is exact in fp32; only the sums of
 * 32 products a step and the chain of steps round (the hardware's order, as in the BF16 kernel).
 *
 * The operands swap roles against the BF16 kernel: a weight in RS_LAYOUT_FP8_PAIRS32 (fp8_layout.h)
 * already has a B tile's order, k pairs by output (64 bytes = pair p of 32 outputs), and the
 * in-lane byte unpacks of its decode put outputs 0-15 in one B tile row and 16-31 in another, in
 * order. A thread takes a group of 32 outputs and, for each pair of 16-row token groups, runs the
 * K blocks on four accumulator tiles whose A operands are the activation codes decoded to BF16
 * rows (once per call), read with the row stride. After each block the tiles are stored and
 * scaled into an fp32 [token 32][output 32] accumulator. The weights are decoded (64 k bytes of
 * BF16 a group) a K block ahead of the tiles when the rows make one pair of token groups (32 rows
 * or fewer: decode and tiles stay in L1), else all of the group's k once, for every pair to read.
 * Either way every weight byte is read from memory once per call; the decode (about 5 vector
 * instructions per 64 codes) is what batch 1 pays on top of the exact kernels' reads.
 *
 * Taken where the weight is in RS_LAYOUT_FP8_PAIRS32 with n % 32 == 0 and k % 32 == 0 (every
 * projection of the models served here; others take the exact kernels), at every row count, so a
 * row's bits never depend on its batch. */

/* E4M3 -> BF16 by bytes: a BF16 value's high byte (sign, 7 exponent bits) and low byte (exponent
 * LSB, 7 mantissa bits) are each a function of the code's 7-bit magnitude, looked up for 64 codes
 * at once (vpermt2b: a 128-entry byte table in two registers, index bits 0-6), the sign ORed in;
 * the in-lane byte unpacks then make BF16 words (fp8_layout.h: the order the pairs layout is made
 * for). The tables are built from rs_fp8_e4m3_f32 (NaN 0x7f included); E4M3 values are BF16 values
 * (at most 4 significant bits, exponents 2^-9 .. 2^8), so the decode is exact. */
typedef struct e4m3_lut {
    __m512i hi[2], lo[2];
} e4m3_lut;

static uint8_t e4m3_bytes[2][128] __attribute__((aligned(64))); /* [0] high bytes, [1] low bytes */
static pthread_once_t e4m3_once = PTHREAD_ONCE_INIT;

static void e4m3_bytes_build(void) {
    for (int i = 0; i < 128; i++) {
        uint32_t bits;
        memcpy(&bits, &rs_fp8_e4m3_f32[i], 4);
        e4m3_bytes[0][i] = (uint8_t)(bits >> 24);
        e4m3_bytes[1][i] = (uint8_t)(bits >> 16);
    }
}

RS_TAMX static void e4m3_lut_init(e4m3_lut *l) {
    pthread_once(&e4m3_once, e4m3_bytes_build);
    for (int i = 0; i < 2; i++) {
        l->hi[i] = _mm512_load_si512(e4m3_bytes[0] + 64 * i);
        l->lo[i] = _mm512_load_si512(e4m3_bytes[1] + 64 * i);
    }
}

/* 64 codes -> BF16: *a = codes 0-7, 16-23, 32-39, 48-55 and *b = 8-15, 24-31, 40-47, 56-63 (each
 * 128-bit lane's low and high eight). */
RS_TAMX INLINE void e4m3_to_bf16(const e4m3_lut *l, __m512i codes, __m512i *a, __m512i *b) {
    __m512i hi = _mm512_permutex2var_epi8(l->hi[0], codes, l->hi[1]);
    const __m512i lo = _mm512_permutex2var_epi8(l->lo[0], codes, l->lo[1]);
    hi = _mm512_ternarylogic_epi32(hi, codes, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (codes & 0x80) */
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
}

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

typedef struct amx8_job {
    float *out;          /* [rows][n] */
    const uint16_t *xb;  /* [groups * 16][k] BF16 activation values, rows past `rows` zero */
    const float *xs;     /* [rows][kb] */
    const uint8_t *wq;   /* [n][k] E4M3 in RS_LAYOUT_FP8_PAIRS32 */
    const float *ws;     /* [ceil(n / 128)][kb] */
    rs_cpu_buf *dec;     /* [threads] a group's weights decoded: [2][k / 2][16] dwords */
    int rows, groups;
    int64_t n, k, kb, steps;
} amx8_job;

typedef struct act_job {
    uint16_t *xb;
    const uint8_t *xq;   /* [rows][k] */
    int rows;
    int64_t k;
} act_job;

RS_TAMX static void decode_act_rows(void *arg, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const act_job *j = arg;
    e4m3_lut l;
    e4m3_lut_init(&l);
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *dst = j->xb + r * j->k;
        if (r >= j->rows) {
            memset(dst, 0, (size_t)j->k * 2);
            continue;
        }
        const uint8_t *src = j->xq + r * j->k;
        /* e4m3_to_bf16's lanes back in k order: codes 0-31, then 32-63 */
        const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
        for (int64_t i = 0; i < j->k; i += 64) { /* k % 32 == 0: the last step may be 32 codes */
            const __mmask64 m = j->k - i >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << 32) - 1;
            __m512i a, b;
            e4m3_to_bf16(&l, _mm512_maskz_loadu_epi8(m, src + i), &a, &b);
            _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi64(a, first, b));
            if (j->k - i >= 64) _mm512_storeu_si512(dst + i + 32, _mm512_permutex2var_epi64(a, second, b));
        }
    }
}

/* Pairs [p0, p1) of a group's weights (w: the group's 32 k bytes) -> BF16 B-tile rows: outputs
 * 0-15 of pair p to d0 row p, 16-31 to d1 row p. */
RS_TAMX INLINE void decode_pairs(const e4m3_lut *l, const uint8_t *w, uint32_t *d0, uint32_t *d1, int64_t p0,
                                 int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
        __m512i a, b;
        _mm_prefetch((const char *)w + 64 * p + PREFETCH_BYTES, _MM_HINT_T0);
        e4m3_to_bf16(l, _mm512_loadu_si512(w + 64 * p), &a, &b);
        _mm512_store_si512(d0 + 16 * p, a);
        _mm512_store_si512(d1 + 16 * p, b);
    }
}

/* Token groups g and g + 1 (pair) of the output group at n0, whose weights are decoded in d0/d1;
 * with w (the group's codes, lut), the pairs are decoded here, a K block ahead of the tiles, so
 * that a call with few rows keeps them in L1 between the decode and the tiles. */
RS_TAMX INLINE void amx8_tokens(const amx8_job *j, uint32_t *d0, uint32_t *d1, int64_t n0, int g, bool pair,
                                float *cbuf, float (*acc)[32], const uint8_t *w, const e4m3_lut *l) {
    const int t0 = 16 * g, nt = RS_MIN(pair ? 32 : 16, j->rows - t0);
    const size_t ldx = (size_t)j->k * 2;
    const uint16_t *xa = j->xb + (size_t)t0 * (size_t)j->k, *xc = xa + 16 * (size_t)j->k;
    const float *sw = j->ws + (n0 / RS_FP8_BLOCK) * j->kb;
    for (int t = 0; t < nt; t++) memset(acc[t], 0, 32 * sizeof(float));
    if (w) decode_pairs(l, w, d0, d1, 0, 16 * RS_MIN(j->steps, 4));
    for (int64_t b = 0; b < j->kb; b++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int64_t s1 = RS_MIN(j->steps, 4 * b + 4);
        if (w && b + 1 < j->kb) /* one block ahead: tile loads right behind the stores would wait for them */
            decode_pairs(l, w, d0, d1, 16 * s1, 16 * RS_MIN(j->steps, s1 + 4));
        for (int64_t s = 4 * b; s < s1; s++) {
            _tile_loadd(4, xa + 32 * s, ldx);
            _tile_loadd(6, d0 + 256 * s, 64);
            _tile_loadd(7, d1 + 256 * s, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (pair) {
                _tile_loadd(5, xc + 32 * s, ldx);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, cbuf, 64);
        _tile_stored(1, cbuf + 256, 64);
        if (pair) {
            _tile_stored(2, cbuf + 512, 64);
            _tile_stored(3, cbuf + 768, 64);
        }
        for (int t = 0; t < nt; t++) {
            const float *c = cbuf + (t < 16 ? 16 * t : 512 + 16 * (t - 16));
            const __m512 sc = _mm512_set1_ps(j->xs[(size_t)(t0 + t) * (size_t)j->kb + (size_t)b] * sw[b]);
            _mm512_store_ps(acc[t], _mm512_fmadd_ps(_mm512_load_ps(c), sc, _mm512_load_ps(acc[t])));
            _mm512_store_ps(acc[t] + 16, _mm512_fmadd_ps(_mm512_load_ps(c + 256), sc, _mm512_load_ps(acc[t] + 16)));
        }
    }
    for (int t = 0; t < nt; t++) {
        float *o = j->out + (size_t)(t0 + t) * (size_t)j->n + n0;
        _mm512_storeu_ps(o, _mm512_load_ps(acc[t]));
        _mm512_storeu_ps(o + 16, _mm512_load_ps(acc[t] + 16));
    }
}

/* Output groups [g0, g1) of 32. */
RS_TAMX static void amx8_groups(void *arg, int64_t g0, int64_t g1, int tid) {
    const amx8_job *j = arg;
    float cbuf[4 * 256] __attribute__((aligned(64)));
    float acc[32][32] __attribute__((aligned(64)));
    e4m3_lut l;
    e4m3_lut_init(&l);
    const int64_t np = j->k / 2;
    uint32_t *d0 = j->dec[tid].p, *d1 = d0 + 16 * np;
    const bool interleave = j->groups <= 2; /* one pass over the token groups: decode as it goes */
    tiles_configure(RS_MIN(j->rows, 16));
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n0 = 32 * g;
        const uint8_t *w = j->wq + n0 * j->k;
        if (!interleave) decode_pairs(&l, w, d0, d1, 0, np);
        for (int tg = 0; tg < j->groups; tg += 2) {
            const uint8_t *wi = interleave ? w : NULL;
            if (tg + 1 < j->groups) amx8_tokens(j, d0, d1, n0, tg, true, cbuf, acc, wi, &l);
            else amx8_tokens(j, d0, d1, n0, tg, false, cbuf, acc, wi, &l);
        }
    }
    _tile_release();
}

bool rs_cpu_amx_fp8_fits(const rs_tensor *w) {
    return w->dtype == RS_DTYPE_E4M3 && w->layout == RS_LAYOUT_FP8_PAIRS32 && w->shape[0] % 32 == 0 &&
           w->shape[1] % 32 == 0 && rs_fp8_pairs32_fits(w->shape[0], w->shape[1]);
}

void rs_cpu_matmul_amx_fp8(rs_cpu_ctx *c, float *out, const uint8_t *xq, const float *xs, const rs_tensor *w,
                           int rows) {
    RS_ASSERT(rows > 0 && c->amx && rs_cpu_amx_fp8_fits(w));
    const int64_t n = w->shape[0], k = w->shape[1];
    const int groups = (rows + 15) / 16;
    uint16_t *xb = rs_cpu_scratch(&c->amx_act, (size_t)groups * 16 * (size_t)k * 2);
    act_job aj = {.xb = xb, .xq = xq, .rows = rows, .k = k};
    if ((int64_t)rows * k >= (1 << 16)) rs_pool_run(c->pool, (int64_t)groups * 16, 1, decode_act_rows, &aj);
    else decode_act_rows(&aj, 0, (int64_t)groups * 16, 0);
    for (int t = 0; t < c->n_threads; t++) rs_cpu_scratch(&c->amx_pad[t], 64 * (size_t)k);
    amx8_job j = {.out = out, .xb = xb, .xs = xs, .wq = w->data, .ws = w->scale_inv, .dec = c->amx_pad,
                  .rows = rows, .groups = groups, .n = n, .k = k, .kb = rs_fp8_blocks(k), .steps = k / 32};
    if (n > 32 && n * k * rows >= (1 << 16)) rs_pool_run(c->pool, n / 32, 1, amx8_groups, &j);
    else amx8_groups(&j, 0, n / 32, 0);
}

#else /* no AMX here: never selected (rs_cpu_amx_available is false) */

bool rs_cpu_amx_supported(void) { return false; }
bool rs_cpu_amx_available(void) { return false; }

void rs_cpu_matmul_amx_bf16(rs_cpu_ctx *c, float *out, const uint16_t *xb, const uint16_t *w, const float *bias,
                            int rows, int64_t n, int64_t k) {
    (void)c, (void)out, (void)xb, (void)w, (void)bias, (void)rows, (void)n, (void)k;
    RS_ASSERT(!"AMX matmul on a build or CPU without AMX");
}

bool rs_cpu_amx_fp8_fits(const rs_tensor *w) {
    (void)w;
    return false;
}

void rs_cpu_matmul_amx_fp8(rs_cpu_ctx *c, float *out, const uint8_t *xq, const float *xs, const rs_tensor *w,
                           int rows) {
    (void)c, (void)out, (void)xq, (void)xs, (void)w, (void)rows;
    RS_ASSERT(!"AMX matmul on a build or CPU without AMX");
}

#endif
