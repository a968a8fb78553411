/*
 * cpu_amx.c — the fast numerics' BF16 matmul on AMX tiles (Intel Sapphire Rapids and later):
 * out[t][n] = sum_k bf16(x[t][k]) w[n][k] (+ bias[n]), fp32 sums, on TDPBF16PS.
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

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512_transpose.h"

#define RS_TAMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
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

RS_TAMX static void tiles_configure(void) {
    tile_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
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
    tiles_configure();
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

#else /* no AMX here: never selected (rs_cpu_amx_available is false) */

bool rs_cpu_amx_supported(void) { return false; }
bool rs_cpu_amx_available(void) { return false; }

void rs_cpu_matmul_amx_bf16(rs_cpu_ctx *c, float *out, const uint16_t *xb, const uint16_t *w, const float *bias,
                            int rows, int64_t n, int64_t k) {
    (void)c, (void)out, (void)xb, (void)w, (void)bias, (void)rows, (void)n, (void)k;
    RS_ASSERT(!"AMX matmul on a build or CPU without AMX");
}

#endif
