/*
 * cpu_internal.h — what the CPU backend's files share, and nothing else includes except its tests.
 *
 * The backend's private context (thread pool, SIMD level, scratch buffers grown on demand so the
 * hot path does not allocate), the matmul core that the MoE op reuses, the per-ISA kernels and
 * the op entry points that backend_cpu.c puts in the table.
 *
 * SIMD is chosen once at init from what the CPU supports (AVX-512F, else AVX2+FMA+F16C, else
 * scalar); RS_CPU_SIMD=scalar|avx2|avx512 in the environment caps it, and tests cap it through
 * rs_cpu_set_simd to run every path on one machine. The scalar matmul is the reference: it sums
 * each dot product sequentially in fp32, so the scalar path and rs_cpu_matmul_ref agree bit for bit.
 */
#ifndef RS_CPU_INTERNAL_H
#define RS_CPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../../core/pool.h"
#include "../backend_impl.h"
#include "../exp.h"
#include "fp8_gemm.h"

typedef enum rs_cpu_simd {
    RS_CPU_SIMD_SCALAR = 0,
    RS_CPU_SIMD_AVX2,   /* AVX2 + FMA + F16C */
    RS_CPU_SIMD_AVX512, /* AVX-512F (+ the AVX2 set, which every AVX-512 CPU has) */
} rs_cpu_simd;

/* A scratch buffer: 64-byte aligned, grown on demand, contents not kept across growth. */
typedef struct rs_cpu_buf {
    void *p;
    size_t cap;
} rs_cpu_buf;

/* A batch-1 matmul with BF16/F16/F32 weights on AVX-512 has two tile forms that give the same bits
 * (cpu_simd_avx512.c): four weight rows read together, or one after another. Which reads memory
 * faster changes with the machine's load, so cpu_matmul.c times both per weight shape and takes
 * the faster, trying the other every RS_CPU_GEMV_PROBE calls. RS_CPU_GEMV=tile|rows (or
 * rs_cpu_set_gemv) fixes one form, for tests and benchmarks. */
typedef enum rs_cpu_gemv { RS_CPU_GEMV_AUTO = 0, RS_CPU_GEMV_TILE, RS_CPU_GEMV_ROWS } rs_cpu_gemv;
#define RS_CPU_GEMV_SHAPES 16
#define RS_CPU_GEMV_PROBE  16
typedef struct rs_cpu_gemv_pick {
    int64_t n, k;            /* the weight shape (n = 0: a free entry) */
    int es;                  /* its element size */
    bool dot;                /* the fast numerics' vdpbf16ps tile */
    uint32_t calls;
    double ns_per_byte[2];   /* recent time of each form (0: not timed yet), [0] tile, [1] rows */
} rs_cpu_gemv_pick;

typedef struct rs_cpu_ctx {
    rs_pool *pool;
    int n_threads;
    rs_cpu_simd simd;        /* level the kernels use */
    rs_cpu_simd simd_max;    /* what this CPU supports */
    rs_cpu_buf *thread_buf;  /* [n_threads] per-thread scratch (attention scores, rope tables) */
    rs_cpu_buf param_buf[2]; /* 1-D parameters converted to fp32 (bias, norm weight) */
    rs_cpu_buf row_seq;      /* attention: sequence of each row */
    rs_cpu_buf moe[8];       /* cpu_moe.c's scratch, indexed by its moe_buf enum */
    rs_cpu_buf fp8_act;      /* FP8 matmul: the quantized activations, scales then codes */
    rs_cpu_buf fp8_rows;     /* FP8 matmul below AVX-512 VNNI: a packed weight unpacked to row-major */
    rs_cpu_buf bf16_act;     /* fast numerics: a BF16 matmul's activation rows rounded to BF16 */
    rs_cpu_gemv_pick gemv[RS_CPU_GEMV_SHAPES]; /* batch-1 tile form per weight shape (cpu_matmul.c) */
    rs_cpu_gemv gemv_mode;   /* RS_CPU_GEMV, or rs_cpu_set_gemv */
    bool bf16_dot;           /* this CPU has AVX512_BF16 (vdpbf16ps) */
    bool amx;                /* fast numerics' BF16 and FP8 matmuls take AMX tiles (cpu_amx.c): the CPU has them
                              * and neither RS_CPU_AMX=0 nor rs_cpu_set_amx turned them off; the OS's
                              * permission is asked when fast numerics are (cpu_set_numerics) */
    rs_cpu_buf amx_act;      /* AMX: the activation rows packed into B tiles (BF16), or decoded (FP8) */
    rs_cpu_buf *amx_pad;     /* [n_threads] AMX: a zero-padded weight chunk (BF16, ragged n or k), or
                              * a group of 32 FP8 weight rows decoded to BF16 */
    bool fast;               /* --numerics fast asked (rs_cpu_fast_bf16 says where it applies) */
} rs_cpu_ctx;

static inline rs_cpu_ctx *rs_cpu_ctx_of(rs_backend *b) { return (rs_cpu_ctx *)b->ctx; }

/* Grows buf to at least `bytes` and returns it. Called by the thread that owns the buffer. */
void *rs_cpu_scratch(rs_cpu_buf *buf, size_t bytes);

/* A 1-D F32/BF16/F16 parameter of n elements as fp32: the data itself when F32, else converted
 * into buf. Returns NULL when t is absent. */
const float *rs_cpu_param_f32(rs_cpu_buf *buf, const rs_tensor *t /* [>= n] */, int64_t n); /* [n] */

/* Element i of a BF16/F16/F32 array, as fp32. */
static inline float rs_cpu_elem(const void *p /* [> i] dt */, rs_dtype dt, int64_t i) {
    switch (dt) {
    case RS_DTYPE_BF16: return rs_bf16_to_f32(((const uint16_t *)p)[i]);
    case RS_DTYPE_F16: return rs_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

/* Whether BF16 x BF16 matmuls run the fast numerics: --numerics fast asked, the AVX-512 level in
 * use and AVX512_BF16 on the CPU. They then round the activation rows to BF16 (rs_f32_to_bf16) and
 * sum BF16 products in fp32 with vdpbf16ps, or on AMX tiles where c->amx (the arithmetic of
 * llama.cpp's BF16 path and of a GPU's BF16 tensor-core GEMM), and attention over BF16 KV pages
 * takes q and the probabilities in BF16 on vdpbf16ps (cpu_attention.c). Where c->amx, FP8 matmuls
 * take their block sums in fp32 on AMX tiles too (rs_cpu_matmul_amx_fp8); every other op, and every
 * matmul elsewhere, stays exact. */
static inline bool rs_cpu_fast_bf16(const rs_cpu_ctx *c) {
    return c->fast && c->bf16_dot && c->simd == RS_CPU_SIMD_AVX512;
}
/* AMX (cpu_amx.c). Whether the CPU has AMX-BF16 tiles and the OS saves them; and whether this
 * process may use them (asks Linux for the tile state's permission on the first call, once). */
bool rs_cpu_amx_supported(void);
bool rs_cpu_amx_available(void);
/* The fast numerics' BF16 matmul on AMX tiles, for every row count when c->amx (batch invariance):
 * out = xb @ w^T (+ bias), fp32 sums of BF16 products, threaded over n on c's pool. */
void rs_cpu_matmul_amx_bf16(rs_cpu_ctx *c, float *out /* [rows][n] */, const uint16_t *xb /* [rows][k] */,
                            const uint16_t *w /* [n][k] */, const float *bias /* [n] or NULL */, int rows,
                            int64_t n, int64_t k);
/* The fast numerics' FP8 (W8A8) matmul on AMX tiles, for every row count when c->amx and the weight
 * fits (rs_cpu_amx_fp8_fits: RS_LAYOUT_FP8_PAIRS32, n and k multiples of 32): the exact kernels'
 * formula (fp8_gemm.h) with each 128-wide block sum taken in fp32 on TDPBF16PS over the E4M3 values
 * decoded to BF16 (exactly), instead of exactly. xq/xs: the activations as rs_cpu_fp8_quantize_act
 * gives them. Threaded over n on c's pool; no bias. */
bool rs_cpu_amx_fp8_fits(const rs_tensor *w);
void rs_cpu_matmul_amx_fp8(rs_cpu_ctx *c, float *out /* [rows][n] */, const uint8_t *xq /* [rows][k] */,
                           const float *xs /* [rows][ceil(k/128)] */, const rs_tensor *w /* [n][k] e4m3 */,
                           int rows);
/* Test hook: turns the AMX matmul on (where available) or off; returns whether it is on now. */
bool rs_cpu_set_amx(rs_backend *b, bool on);
/* Test hook: caps the SIMD level at `level` (and at what the CPU supports); returns the level now
 * in use. */
rs_cpu_simd rs_cpu_set_simd(rs_backend *b, rs_cpu_simd level);
/* Test hook: whether this build's allocations poison the bytes around them for AddressSanitizer
 * (backend_cpu.c compiled with it). */
bool rs_cpu_alloc_poisons(void);
void rs_cpu_set_gemv(rs_backend *b, rs_cpu_gemv mode);
const char *rs_cpu_simd_name(rs_cpu_simd s);

/* ---- matmul core (cpu_matmul.c) ---- */

/* out = x @ w^T (+ bias), threaded over N with the context's pool. Bitwise independent of the
 * thread count (each output is computed by one tile whatever the split). An E4M3 weight (with its
 * scale_inv) takes the W8A8 path: x quantized per token and 128-group (rs_fp8_quantize_act), then
 * rs_fp8_gemm, then + bias in fp32 — bit-identical to rs_fp8_gemm_ref on the same codes, whatever
 * the SIMD level and thread count. */
void rs_cpu_matmul(rs_cpu_ctx *c, float *out /* [rows][N] */, const float *x /* [rows][K] */,
                   const rs_tensor *w /* [N][K] bf16/f16/f32/e4m3 */,
                   const rs_tensor *bias /* [N] or absent */, int rows);
/* The reference: one thread, plain C, each output a sequential fp32 sum over k, then + bias. For an
 * E4M3 weight: rs_fp8_quantize_act, rs_fp8_gemm_ref, then + bias (allocates; tests only). */
void rs_cpu_matmul_ref(float *out /* [rows][N] */, const float *x /* [rows][K] */,
                       const rs_tensor *w /* [N][K] bf16/f16/f32/e4m3 */,
                       const rs_tensor *bias /* [N] or absent */, int rows);

/* One tile of the matmul: out[t][j] = x[t][:k] . w[j][:k] (+ bias[j]) for j < nw <= RS_CPU_NW
 * weight rows and t < nt token rows (nt <= the ISA's RS_CPU_NT_*). Meanwhile the kernel pulls
 * `prefetch` (RS_CPU_NW rows laid out like w, or NULL) into L2: the weights the caller needs next. */
typedef struct rs_cpu_tile {
    float *out;           /* [nt][ldo] */
    const float *x;       /* [nt][ldx] fp32 */
    const uint16_t *xb;   /* [nt][ldx] BF16: the fast numerics' tile reads these instead of x */
    const void *w;        /* [nw][ldw] of the kernel's dtype */
    const float *bias;    /* [nw] fp32, or NULL */
    const void *prefetch; /* [RS_CPU_NW][ldw] of the kernel's dtype, or NULL */
    int64_t ldo, ldx, ldw, k;
    int nw, nt;
} rs_cpu_tile;
/* Each ISA file returns one kernel per weight dtype (BF16, F16, F32). */
typedef void (*rs_cpu_tile_fn)(const rs_cpu_tile *t);
#define RS_CPU_NW        4 /* weight rows per tile, every ISA */
#define RS_CPU_NT_AVX512 6 /* token rows per tile: 24 zmm accumulators + 4 weights + 1 x */
#define RS_CPU_NT_AVX2   3 /* 12 ymm accumulators + 3 x + 1 weight (16 registers) */
rs_cpu_tile_fn rs_cpu_tile_avx512(rs_dtype dt);
rs_cpu_tile_fn rs_cpu_tile_avx2(rs_dtype dt);
/* The fast numerics' tile: BF16 weights times BF16 token rows (xb) on vdpbf16ps, fp32 sums
 * (AVX512_BF16 CPUs only), and the rounding of fp32 activations to BF16 that feeds it,
 * bit-identical to rs_f32_to_bf16 element by element. */
rs_cpu_tile_fn rs_cpu_tile_avx512_bf16_dot(void);
/* The row-sequential forms of the AVX-512 tiles, for one token row (t->nt == 1) only. (An AVX2 form,
 * tried in a throwaway build, took 2.0-2.35x its tile's time: one 8-lane FMA chain a row is bound
 * by the FMA's latency.) */
rs_cpu_tile_fn rs_cpu_gemv_avx512(rs_dtype dt);
rs_cpu_tile_fn rs_cpu_gemv_avx512_bf16_dot(void);
void rs_cpu_round_bf16_avx512(uint16_t *dst /* [n] */, const float *src /* [n] */, size_t n);

/* The FP8 GEMM's instruction set at SIMD level s (cpu_matmul.c; every one gives the same bits):
 * AVX-512 VNNI where the CPU has that set at the AVX-512 level, else the AVX2 kernel, scalar C at
 * the scalar level. */
rs_fp8_gemm_isa rs_cpu_fp8_isa(rs_cpu_simd s);

/* ---- FP8 activations (cpu_fp8_quant.c) ---- */

/* rs_fp8_quantize_act, bit for bit, vectorized at the AVX-512 level (the reference elsewhere). */
void rs_cpu_fp8_quantize_act(rs_cpu_simd simd, const float *x /* [rows][k] f32 */, int64_t rows, int64_t k,
                             uint8_t *q /* [rows][k] e4m3 */, float *scale /* [rows][ceil(k/128)] f32 */);
/* rs_fp8_e4m3_from_f32_n, bit for bit, with the encoder rs_cpu_fp8_quantize_act uses (tests). */
void rs_cpu_fp8_encode_n(rs_cpu_simd simd, uint8_t *dst /* [n] e4m3 */, const float *src /* [n] f32 */,
                         size_t n);

/* ---- exp and the softmax / silu loops on it (cpu_exp.c): the same bits at every level ---- */
const rs_cpu_exp_vec *rs_cpu_exp_for(rs_cpu_simd s);

/* ---- the ops of the table (each file implements its own); shapes as in backend.h ---- */
void rs_cpu_op_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias,
                      int rows);
void rs_cpu_op_embed(rs_backend *b, float *out, const rs_tensor *table, const int32_t *ids, int n);
void rs_cpu_op_rmsnorm(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim,
                       float eps);
void rs_cpu_op_rope(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                    const float *inv_freq);
void rs_cpu_op_swiglu(rs_backend *b, float *out, const float *gate, const float *up, size_t n);
void rs_cpu_op_add(rs_backend *b, float *x, const float *y, size_t n);
void rs_cpu_op_gather_rows(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim);
void rs_cpu_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v,
                        const rs_batch *batch);
void rs_cpu_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                         float scale, const rs_batch *batch);
void rs_cpu_op_moe(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w);

/* out[i] = silu(gate[i]) * up[i] for i in [0, n), silu(g) = g / (1 + rs_expf(-g)) in fp32; single
 * thread (the op threads it; MoE calls it per expert). out may alias gate. */
void rs_cpu_swiglu_span(float *out /* [n] */, const float *gate /* [n] */, const float *up /* [n] */,
                        size_t n);

#endif /* RS_CPU_INTERNAL_H */
