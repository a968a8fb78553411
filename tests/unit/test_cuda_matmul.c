/*
 * test_cuda_matmul.c — the CUDA backend's matmul (kernels/cuda/cuda_matmul.cu) against the CPU
 * backend and the CPU references (built with `make CUDA=1`; skipped without a GPU).
 *
 * The W8A8 pieces must be bit-identical to their definitions: activation quantization to
 * rs_fp8_quantize_act (codes and scales; rounding boundaries, fp32 subnormals, signed zeros, NaN,
 * inf, floor-sized groups), the block-scaled GEMM to rs_fp8_gemm_ref (every code, ragged K and N,
 * K = 0, both the few-rows GEMV and the tiled kernel, NaN codes and scales), and the whole op with
 * E4M3 weights to the CPU backend's. BF16 / F16 / F32 weights sum in another order than the CPU, so
 * those outputs are compared with a tolerance relative to the magnitude of their terms.
 */
#ifdef RS_CUDA
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../kernels/cpu/fp8_gemm.h"
#include "../../kernels/fp8.h"
#include "test.h"
#include "test_util.h"

/* C-callable hooks defined at the bottom of cuda_matmul.cu; all pointers are device memory. */
void rs_cuda_test_fp8_quantize_act(rs_backend *b, const float *x_dev, int rows, int k, uint8_t *q_dev,
                                   float *s_dev);
void rs_cuda_test_fp8_gemm(rs_backend *b, float *out_dev, const uint8_t *xq_dev, const float *xs_dev,
                           const uint8_t *wq_dev, const float *ws_dev, int rows, int n, int k);

/* ---- helpers ---- */

static double rng_unit(uint64_t *s) { return (double)(rs_test_rng(s) >> 11) * 0x1p-53; } /* [0, 1) */

/* +-2^u for u uniform in [lo, hi): values spread over many binades. */
static float rng_mag(uint64_t *s, double lo, double hi) {
    float v = (float)exp2(lo + (hi - lo) * rng_unit(s));
    return rs_test_rng(s) & 1 ? -v : v;
}

static uint8_t rand_code(uint64_t *s) { /* any of the 254 non-NaN codes */
    uint8_t c;
    do c = (uint8_t)rs_test_rng(s);
    while ((c & 0x7f) == 0x7f);
    return c;
}


/* A device buffer of `bytes` filled with 0xA5 (a NaN pattern as floats): outputs that a kernel
 * forgets to write do not pass as zeros. */
static void *dev_garbage(rs_backend *g, size_t bytes) {
    unsigned char *h = malloc(bytes ? bytes : 1);
    memset(h, 0xA5, bytes ? bytes : 1);
    void *p = rs_test_to_backend(g, h, bytes ? bytes : 1);
    free(h);
    return p;
}

/* The same tensor in the memory of the CPU backend c and of the CUDA backend g. */
typedef struct twin {
    rs_tensor cpu, gpu;
} twin;

static twin twin_make(rs_backend *c, rs_backend *g, rs_dtype dt, int ndim, int64_t d0, int64_t d1,
                      const void *data, const float *scale_inv /* E4M3 only */) {
    twin t;
    memset(&t, 0, sizeof t);
    t.cpu.dtype = dt;
    t.cpu.ndim = ndim;
    t.cpu.shape[0] = d0;
    t.cpu.shape[1] = ndim == 2 ? d1 : 0;
    t.gpu = t.cpu;
    size_t bytes = (size_t)rs_tensor_numel(&t.cpu) * rs_dtype_size(dt);
    t.cpu.data = rs_test_to_backend(c, data, bytes);
    t.gpu.data = rs_test_to_backend(g, data, bytes);
    if (scale_inv) {
        size_t sb = (size_t)rs_fp8_blocks(d0) * (size_t)rs_fp8_blocks(d1) * sizeof(float);
        t.cpu.scale_inv = rs_test_to_backend(c, scale_inv, sb);
        t.gpu.scale_inv = rs_test_to_backend(g, scale_inv, sb);
    }
    return t;
}

static void twin_free(rs_backend *c, rs_backend *g, twin *t) {
    rs_backend_free_mem(c, t->cpu.data);
    rs_backend_free_mem(g, t->gpu.data);
    if (t->cpu.scale_inv) rs_backend_free_mem(c, t->cpu.scale_inv);
    if (t->gpu.scale_inv) rs_backend_free_mem(g, t->gpu.scale_inv);
}

/* ---- activation quantization ---- */

/* A value of the kinds the quantizer must treat exactly like the CPU. */
static float special_value(uint64_t *s) {
    switch (rs_test_rng(s) % 14) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return NAN;
    case 3: return rs_test_f32_from_bits(0xffc00000u);  /* -NaN */
    case 4: return rs_test_f32_from_bits(0x7f800001u);  /* signaling NaN */
    case 5: return rs_test_f32_from_bits(0xff812345u);  /* negative NaN with a payload */
    case 6: return INFINITY;
    case 7: return -INFINITY;
    case 8: return 3.0e38f;
    case 9: return -FLT_MAX;
    case 10: return 1e-40f;                     /* fp32 subnormal */
    case 11: return -1e-40f;
    case 12: return -0x1p-149f;
    default: return 1e30f;
    }
}

/* Runs rs_fp8_quantize_act and the CUDA kernel on x [rows][k]; codes and scales must agree bit for bit. */
static void check_quantize(rs_backend *g, const float *x, int rows, int k, const char *what) {
    size_t ng = (size_t)rs_fp8_blocks(k), nq = (size_t)rows * (size_t)k, ns = (size_t)rows * ng;
    uint8_t *want_q = malloc(nq + 1), *got_q = malloc(nq + 1);
    float *want_s = malloc((ns + 1) * sizeof(float)), *got_s = malloc((ns + 1) * sizeof(float));
    rs_fp8_quantize_act(x, rows, k, want_q, want_s);

    float *dx = rs_test_to_backend(g, x, nq * sizeof(float));
    uint8_t *dq = dev_garbage(g, nq);
    float *ds = dev_garbage(g, ns * sizeof(float));
    rs_cuda_test_fp8_quantize_act(g, dx, rows, k, dq, ds);
    rs_backend_download(g, got_q, dq, nq);
    rs_backend_download(g, got_s, ds, ns * sizeof(float));
    for (size_t i = 0; i < ns; i++)
        if (rs_test_f32_bits(got_s[i]) != rs_test_f32_bits(want_s[i]))
            RS_TEST_FAIL("%s rows %d k %d: scale[%zu][%zu] %a (0x%08x), want %a (0x%08x)", what, rows, k, i / ng,
                         i % ng, got_s[i], rs_test_f32_bits(got_s[i]), want_s[i], rs_test_f32_bits(want_s[i]));
    for (size_t i = 0; i < nq; i++)
        if (got_q[i] != want_q[i])
            RS_TEST_FAIL("%s rows %d k %d: q[%zu][%zu] of x = %a (0x%08x), scale %a: 0x%02x, want 0x%02x", what, rows,
                         k, i / (size_t)k, i % (size_t)k, x[i], rs_test_f32_bits(x[i]),
                         want_s[(i / (size_t)k) * ng + (i % (size_t)k) / 128], got_q[i], want_q[i]);
    rs_backend_free_mem(g, dx);
    rs_backend_free_mem(g, dq);
    rs_backend_free_mem(g, ds);
    free(want_q), free(got_q), free(want_s), free(got_s);
}

RS_TEST(cuda_fp8_quantize_act_matches_cpu) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 17; /* the reference is rs_fp8_quantize_act itself */

    /* whole rows: ragged groups, magnitudes from 2^-40 to 2^40, specials, and rows that are all
     * zeros, all NaN, inf in every group, below the amax floor, huge, tiny next to large */
    static const int ks[] = {1, 127, 128, 129, 300, 1024};
    enum { ROWS = 9 };
    for (size_t ki = 0; ki < RS_ARRAY_LEN(ks); ki++) {
        int k = ks[ki];
        float *x = malloc((size_t)ROWS * (size_t)k * sizeof(float));
        for (int r = 0; r < ROWS; r++) {
            float *xr = x + (size_t)r * (size_t)k;
            for (int j = 0; j < k; j++) {
                uint64_t u = rs_test_rng(&s);
                switch (r) {
                case 0: xr[j] = (u & 1) ? 0.0f : -0.0f; break;                       /* all zeros */
                case 1: xr[j] = (u & 1) ? NAN : rs_test_f32_from_bits(0xffc00001u); break;   /* all NaN */
                case 2: xr[j] = j % 128 == 5 % k ? INFINITY : rng_mag(&s, -10, 10); break;
                case 3: xr[j] = rng_mag(&s, -60, -40); break;                        /* amax < floor */
                case 4: xr[j] = rng_mag(&s, 100, 127); break;                        /* huge */
                case 5: xr[j] = j % 128 == 0 ? 100.0f : (u & 2 ? -1e-40f : 1e-38f); break;
                case 6: xr[j] = rs_test_uniform(&s) * (u % 97 == 0 ? 300.0f : 1.0f); break; /* outliers */
                default: xr[j] = u % 16 == 0 ? special_value(&s) : rng_mag(&s, -40, 40); break;
                }
            }
        }
        check_quantize(g, x, ROWS, k, "rows");
        free(x);
    }

    /* the encoder itself: groups whose amax is exactly 448 have s = 1, so x / s = x and the codes are
     * e4m3(x) of the neighbours of every rounding boundary (midpoints between consecutive codes, +-2
     * fp32 ulps), fp32 subnormals, signed zeros and random bit patterns of magnitude <= 448 */
    {
        enum { K = 1024 };
        int rows = 0, cap = 64;
        float *x = malloc((size_t)cap * K * sizeof(float));
        size_t n = 0;
        float vals[4096];
        size_t nv = 0;
        for (int code = 0; code < 127; code++) {
            float mid = (rs_fp8_e4m3_to_f32((uint8_t)code) + rs_fp8_e4m3_to_f32((uint8_t)(code + 1))) * 0.5f;
            if (code == 126) mid = 464.0f; /* past 448: saturates; kept out of amax below */
            for (int d = -2; d <= 2; d++) {
                float v = mid;
                for (int i = 0; i < (d < 0 ? -d : d); i++) v = nextafterf(v, d < 0 ? 0.0f : INFINITY);
                if (fabsf(v) <= 448.0f) vals[nv++] = v, vals[nv++] = -v;
            }
        }
        const float extra[] = {0.0f, -0.0f, 0x1p-149f, -0x1p-149f, 0x1p-126f, -0x1p-127f, 0x1p-10f, -0x1p-10f,
                               0x1.000002p-10f, 0x1.8p-10f, 448.0f, -448.0f, NAN, -NAN};
        for (size_t i = 0; i < RS_ARRAY_LEN(extra); i++) vals[nv++] = extra[i];
        while (nv < RS_ARRAY_LEN(vals)) {
            uint32_t u = (uint32_t)rs_test_rng(&s);
            float v = rs_test_f32_from_bits(u);
            if (fabsf(v) <= 448.0f) vals[nv++] = v; /* NaN fails the test and is skipped */
        }
        size_t vi = 0;
        while (vi < nv) {
            ASSERT_TRUE(rows < cap);
            for (int j = 0; j < K; j++) {
                float v = j % 128 == 0 ? 448.0f : vi < nv ? vals[vi++] : 1.0f;
                x[n++] = v;
            }
            rows++;
        }
        check_quantize(g, x, rows, K, "encoder");
        free(x);
    }

    /* a bigger random batch */
    {
        int rows = 33, k = 1000;
        float *x = malloc((size_t)rows * (size_t)k * sizeof(float));
        for (int64_t i = 0; i < (int64_t)rows * k; i++) x[i] = rs_test_rng(&s) % 64 == 0 ? special_value(&s) : rng_mag(&s, -20, 20);
        check_quantize(g, x, rows, k, "batch");
        free(x);
    }
    rs_backend_free(g);
}

/* ---- the exact-block GEMM ---- */

/* rs_fp8_gemm_ref and the CUDA GEMM on the given operands: bit-identical outputs (NaN outputs
 * included: both sides store the canonical NaN). Returns how many outputs are nonzero. */
static int expect_gemm_equal(rs_backend *g, const uint8_t *xq, const float *xs, const uint8_t *wq, const float *ws,
                             int rows, int n, int k, const char *what) {
    size_t kb = (size_t)rs_fp8_blocks(k), nbn = (size_t)rs_fp8_blocks(n);
    size_t nx = (size_t)rows * (size_t)k, nw = (size_t)n * (size_t)k, no = (size_t)rows * (size_t)n;
    float *want = malloc((no + 1) * sizeof(float)), *got = malloc((no + 1) * sizeof(float));
    rs_fp8_gemm_ref(want, xq, xs, wq, ws, rows, n, k);
    uint8_t *dxq = rs_test_to_backend(g, xq, nx), *dwq = rs_test_to_backend(g, wq, nw);
    float *dxs = rs_test_to_backend(g, xs, (size_t)rows * kb * sizeof(float)), *dws = rs_test_to_backend(g, ws, nbn * kb * sizeof(float));
    float *dout = dev_garbage(g, no * sizeof(float));
    rs_cuda_test_fp8_gemm(g, dout, dxq, dxs, dwq, dws, rows, n, k);
    rs_backend_download(g, got, dout, no * sizeof(float));
    int nonzero = 0;
    for (size_t i = 0; i < no; i++) {
        nonzero += want[i] != 0.0f;
        if (rs_test_f32_bits(got[i]) != rs_test_f32_bits(want[i]))
            RS_TEST_FAIL("%s rows %d n %d k %d: out[%zu][%zu] %a (0x%08x), want %a (0x%08x)", what, rows, n, k,
                         i / (size_t)n, i % (size_t)n, got[i], rs_test_f32_bits(got[i]), want[i], rs_test_f32_bits(want[i]));
    }
    rs_backend_free_mem(g, dxq), rs_backend_free_mem(g, dwq), rs_backend_free_mem(g, dxs);
    rs_backend_free_mem(g, dws), rs_backend_free_mem(g, dout);
    free(want), free(got);
    return nonzero;
}

/* One random problem: the 254 finite codes, positive x scales and signed w scales over 24 binades;
 * `specials` adds NaN codes of both signs in x and w, a NaN scale with a payload, an inf and a zero
 * scale, and a weight row of -0 codes. */
static void check_gemm_random(rs_backend *g, int rows, int n, int k, int specials, uint64_t *s) {
    size_t kb = (size_t)rs_fp8_blocks(k), nbn = (size_t)rs_fp8_blocks(n);
    size_t nx = (size_t)rows * (size_t)k, nw = (size_t)n * (size_t)k;
    uint8_t *xq = malloc(nx + 1), *wq = malloc(nw + 1);
    float *xs = malloc(((size_t)rows * kb + 1) * sizeof(float)), *ws = malloc((nbn * kb + 1) * sizeof(float));
    for (size_t i = 0; i < nx; i++) xq[i] = rand_code(s);
    for (size_t i = 0; i < nw; i++) wq[i] = rand_code(s);
    for (size_t i = 0; i < (size_t)rows * kb; i++) xs[i] = fabsf(rng_mag(s, -20, 4));
    for (size_t i = 0; i < nbn * kb; i++) ws[i] = rng_mag(s, -20, 4);
    if (specials && k > 0) {
        for (int i = 0; i < 3; i++) {
            xq[rs_test_rng(s) % nx] = i & 1 ? 0xff : 0x7f;
            wq[rs_test_rng(s) % nw] = i & 1 ? 0x7f : 0xff;
        }
        xs[rs_test_rng(s) % ((size_t)rows * kb)] = rs_test_f32_from_bits(0x7fc01234u);
        ws[rs_test_rng(s) % (nbn * kb)] = INFINITY;
        xs[rs_test_rng(s) % ((size_t)rows * kb)] = 0.0f;
        if (n > 2) memset(wq + 2 * (size_t)k, 0x80, (size_t)k);
    }
    int nonzero = expect_gemm_equal(g, xq, xs, wq, ws, rows, n, k, specials ? "specials" : "random");
    if (k > 0) ASSERT_TRUE(nonzero > 0); /* not a comparison of zeros only */
    free(xq), free(wq), free(xs), free(ws);
}

RS_TEST(cuda_fp8_gemm_matches_reference) {
    rs_backend *g = rs_test_cuda_or_skip();
    /* rows: the GEMV (1..8: one warp per output, 16-byte loads when k % 16 == 0) and the tiled
     * kernel (17, 64, 200: partial and several row tiles); (n, k): ragged K and N blocks, K = 0 */
    static const int rows[] = {1, 3, 8, 17, 64, 200};
    static const int nk[][2] = {{1, 1}, {5, 129}, {128, 128}, {130, 300}, {384, 1024}, {7, 0}, {65, 16}};
    uint64_t s = 23;
    for (size_t ri = 0; ri < RS_ARRAY_LEN(rows); ri++)
        for (size_t si = 0; si < RS_ARRAY_LEN(nk); si++)
            for (int specials = 0; specials < 2; specials++)
                check_gemm_random(g, rows[ri], nk[si][0], nk[si][1], specials, &s);

    /* every code against 1.0 (0x38), k = 1: the decoder against the table, NaN codes included.
     * x side: 32 GEMV calls of 8 rows and one tiled call of 256 rows; w side: 256 outputs with 1
     * row (GEMV) and 9 rows (tiled). */
    uint8_t codes[256], ones[256];
    float unit[256];
    for (int i = 0; i < 256; i++) codes[i] = (uint8_t)i, ones[i] = 0x38, unit[i] = 1.0f;
    for (int i = 0; i < 256; i += 8) expect_gemm_equal(g, codes + i, unit, ones, unit, 8, 3, 1, "x codes");
    expect_gemm_equal(g, codes, unit, ones, unit, 256, 3, 1, "x codes");
    expect_gemm_equal(g, ones, unit, codes, unit, 1, 256, 1, "w codes");
    expect_gemm_equal(g, ones, unit, codes, unit, 9, 256, 1, "w codes");
    rs_backend_free(g);
}

/* ---- the op ---- */

/* rs_op_matmul on both backends with the same weights and x [rows][k]; returns malloc'd outputs. */
static void run_both(rs_backend *c, rs_backend *g, const twin *w, const twin *bias, const float *x, int rows,
                     float **out_cpu, float **out_gpu) {
    int64_t n = w->cpu.shape[0], k = w->cpu.shape[1];
    size_t nx = (size_t)rows * (size_t)k, no = (size_t)rows * (size_t)n;
    float *cx = rs_test_to_backend(c, x, nx * sizeof(float)), *gx = rs_test_to_backend(g, x, nx * sizeof(float));
    float *cout = rs_backend_alloc(c, no * sizeof(float)), *gout = dev_garbage(g, no * sizeof(float));
    ASSERT_TRUE(cout != NULL);
    rs_op_matmul(c, cout, cx, &w->cpu, bias ? &bias->cpu : NULL, rows);
    rs_op_matmul(g, gout, gx, &w->gpu, bias ? &bias->gpu : NULL, rows);
    *out_cpu = malloc(no * sizeof(float));
    *out_gpu = malloc(no * sizeof(float));
    rs_backend_download(c, *out_cpu, cout, no * sizeof(float));
    rs_backend_download(g, *out_gpu, gout, no * sizeof(float));
    rs_backend_free_mem(c, cx), rs_backend_free_mem(c, cout);
    rs_backend_free_mem(g, gx), rs_backend_free_mem(g, gout);
}

/* n x k of BF16 values as uint16, uniform in [-amp, amp). */
static uint16_t *rand_bf16(size_t n, float amp, uint64_t *s) {
    uint16_t *h = malloc(n * sizeof(uint16_t) + 2);
    for (size_t i = 0; i < n; i++) h[i] = rs_f32_to_bf16(amp * rs_test_uniform(s));
    return h;
}

RS_TEST(cuda_matmul_fp8_matches_cpu) {
    rs_backend *g = rs_test_cuda_or_skip();
    rs_backend *c = rs_backend_cpu_init(2);
    static const int nk[][2] = {{7, 129}, {130, 300}, {256, 1024}};
    static const int rows[] = {1, 5, 33};
    uint64_t s = 31;
    for (size_t si = 0; si < RS_ARRAY_LEN(nk); si++) {
        int n = nk[si][0], k = nk[si][1];
        uint16_t *wb = rand_bf16((size_t)n * (size_t)k, 0.05f, &s);
        rs_tensor wt = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {n, k}, .data = wb};
        uint8_t *q = malloc((size_t)n * (size_t)k);
        float *sinv = malloc((size_t)rs_fp8_blocks(n) * (size_t)rs_fp8_blocks(k) * sizeof(float));
        ASSERT_EQ(rs_fp8_quantize_weight(&wt, q, sinv), RS_OK);
        twin w = twin_make(c, g, RS_DTYPE_E4M3, 2, n, k, q, sinv);
        uint16_t *bb = rand_bf16((size_t)n, 1.0f, &s);
        twin bias = twin_make(c, g, RS_DTYPE_BF16, 1, n, 0, bb, NULL);
        for (size_t ri = 0; ri < RS_ARRAY_LEN(rows); ri++) {
            int nr = rows[ri];
            float *x = malloc((size_t)nr * (size_t)k * sizeof(float));
            for (int64_t i = 0; i < (int64_t)nr * k; i++) x[i] = rs_test_uniform(&s) * (rs_test_rng(&s) % 50 == 0 ? 40.0f : 1.0f);
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                float *want, *got;
                run_both(c, g, &w, with_bias ? &bias : NULL, x, nr, &want, &got);
                int nonzero = 0;
                for (size_t i = 0; i < (size_t)nr * (size_t)n; i++) {
                    nonzero += want[i] != 0.0f;
                    if (rs_test_f32_bits(got[i]) != rs_test_f32_bits(want[i]))
                        RS_TEST_FAIL("e4m3 n %d k %d rows %d bias %d: out[%zu][%zu] %a (0x%08x), cpu %a (0x%08x)", n,
                                     k, nr, with_bias, i / (size_t)n, i % (size_t)n, got[i], rs_test_f32_bits(got[i]), want[i],
                                     rs_test_f32_bits(want[i]));
                }
                ASSERT_TRUE(nonzero > 0);
                free(want), free(got);
            }
            free(x);
        }
        twin_free(c, g, &w);
        twin_free(c, g, &bias);
        free(wb), free(q), free(sinv), free(bb);
    }
    rs_backend_free(c);
    rs_backend_free(g);
}

/* Weight element i of a BF16 / F16 / F32 host array as a double (exact). */
static double host_elem(const void *p, rs_dtype dt, size_t i) {
    if (dt == RS_DTYPE_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dt == RS_DTYPE_BF16 ? rs_bf16_to_f32(h) : rs_f16_to_f32(h);
}

/* n x k random values of dtype dt in [-amp, amp). */
static void *rand_weights(rs_dtype dt, size_t n, float amp, uint64_t *s) {
    void *p = malloc(n * rs_dtype_size(dt) + 4);
    for (size_t i = 0; i < n; i++) {
        float v = amp * rs_test_uniform(s);
        if (dt == RS_DTYPE_F32) ((float *)p)[i] = v;
        else ((uint16_t *)p)[i] = dt == RS_DTYPE_BF16 ? rs_f32_to_bf16(v) : rs_f32_to_f16(v);
    }
    return p;
}

RS_TEST(cuda_matmul_bf16_matches_cpu) {
    rs_backend *g = rs_test_cuda_or_skip();
    rs_backend *c = rs_backend_cpu_init(2);
    static const rs_dtype dts[] = {RS_DTYPE_BF16, RS_DTYPE_F16, RS_DTYPE_F32};
    /* odd K (scalar loads), K whose rows are 16-byte multiples in one dtype only (260), vector K */
    static const int nk[][2] = {{1000, 1027}, {33, 7}, {130, 260}, {96, 1024}, {1, 1}};
    static const int rows[] = {1, 4, 16, 77};
    uint64_t s = 37;
    for (size_t di = 0; di < RS_ARRAY_LEN(dts); di++) {
        rs_dtype dt = dts[di];
        for (size_t si = 0; si < RS_ARRAY_LEN(nk); si++) {
            int n = nk[si][0], k = nk[si][1];
            void *wh = rand_weights(dt, (size_t)n * (size_t)k, 1.0f, &s);
            twin w = twin_make(c, g, dt, 2, n, k, wh, NULL);
            rs_dtype bdt = si % 2 ? RS_DTYPE_F32 : RS_DTYPE_BF16;
            void *bh = rand_weights(bdt, (size_t)n, 2.0f, &s);
            twin bias = twin_make(c, g, bdt, 1, n, 0, bh, NULL);
            for (size_t ri = 0; ri < RS_ARRAY_LEN(rows); ri++) {
                int nr = rows[ri];
                float *x = malloc((size_t)nr * (size_t)k * sizeof(float));
                for (int64_t i = 0; i < (int64_t)nr * k; i++) x[i] = rs_test_uniform(&s);
                double *mag = malloc((size_t)nr * (size_t)n * sizeof(double)); /* sum_k |x_k w_k| */
                for (int r = 0; r < nr; r++)
                    for (int o = 0; o < n; o++) {
                        double m = 0.0;
                        for (int j = 0; j < k; j++)
                            m += fabs((double)x[(size_t)r * k + j] * host_elem(wh, dt, (size_t)o * k + j));
                        mag[(size_t)r * n + o] = m;
                    }
                for (int with_bias = 0; with_bias < 2; with_bias++) {
                    float *want, *got;
                    run_both(c, g, &w, with_bias ? &bias : NULL, x, nr, &want, &got);
                    for (int r = 0; r < nr; r++) {
                        for (int o = 0; o < n; o++) {
                            size_t i = (size_t)r * (size_t)n + (size_t)o;
                            double tol = 1e-4 * (1.0 + mag[i] + (with_bias ? fabs(host_elem(bh, bdt, (size_t)o)) : 0.0));
                            if (!(fabs((double)got[i] - (double)want[i]) <= tol))
                                RS_TEST_FAIL("%s n %d k %d rows %d bias %d: out[%d][%d] %.9g, cpu %.9g (tol %.3g)",
                                             rs_dtype_name(dt), n, k, nr, with_bias, r, o, got[i], want[i], tol);
                        }
                    }
                    free(want), free(got);
                }
                free(x), free(mag);
            }
            twin_free(c, g, &w);
            twin_free(c, g, &bias);
            free(wh), free(bh);
        }
    }
    rs_backend_free(c);
    rs_backend_free(g);
}
#endif
