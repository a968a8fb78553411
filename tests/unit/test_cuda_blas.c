/*
 * test_cuda_blas.c — the fast numerics' GEMMs (kernels/cuda/cuda_blas.cu, cuda_matmul_fast.cu,
 * cuda_act.cu), built with `make CUDA=1` and run on a GPU or under the CPU emulation of CUDA
 * (tests/cuda_emu, whose cuBLASLt emulation implements the documented semantics and refusals).
 *
 *   - cuBLASLt itself refuses what the wrapper's rules and the emulation say it refuses (FP8 not TN,
 *     block scaling with M not a multiple of 4, 128x128 scales on both operands, FP8 output with
 *     block scaling, a wrong-sized attribute, too small a workspace): on a GPU this checks the
 *     emulation against the library.
 *   - the wrapper's FP8 and BF16 GEMMs against their definition, computed here in double from the
 *     documented scale layouts (a transposed or misplaced scale fails; so does a scale tensor read
 *     past its padding, which holds NaN); a layout probe that moves exactly one weight block and one
 *     token group.
 *   - the matmul op in fast numerics against exact numerics: FP8 within the tensor cores'
 *     accumulation error (FP8_MMA_REL) of the same codes (bit-identical where cuBLASLt refuses and
 *     the exact kernels run), BF16 within
 *     the rounding of the activations to BF16; the GEMMs really ran through cuBLASLt, and up to 8
 *     rows the tensor-core GEMVs ran exactly where their 16-byte loads fit.
 *   - the tensor-core GEMVs against double references of what they multiply (FP8 codes and block
 *     scales, BF16 activations), over row, feature and K tails, and their fallbacks.
 *   - the activation forms that fast-numerics rmsnorm and swiglu write in their own kernels are
 *     rs_fp8_quantize_act's codes and scales and rs_f32_to_bf16's values, and are dropped by the
 *     next op that could rewrite their activation.
 */
#ifdef RS_CUDA
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes" /* CUDA 13's cublasLt.h declares one function without */
#include <cublasLt.h>
#pragma GCC diagnostic pop
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../kernels/fp8.h"
#include "test.h"
#include "test_util.h"

/* Hooks in kernels/cuda/cuda_blas.cu and cuda_act.cu (device pointers). */
int rs_cuda_test_blas_gemm(rs_backend *b, int kind, void *out, rs_dtype out_dt, const void *x, const float *xs,
                           const void *w, const float *ws, int t, int n, int k);
void rs_cuda_test_blas_workspace_limit(rs_backend *b, size_t bytes);
void rs_cuda_test_blas_counts(rs_backend *b, unsigned long long *calls, unsigned long long *refused);
void rs_cuda_test_act_forms(rs_backend *b, const float *x, int rows, int k, uint16_t *bf16, uint8_t *q, float *s);
int rs_cuda_test_act_cached(rs_backend *b, const float *x, size_t n);
unsigned long long rs_cuda_test_gemv_tc_runs(rs_backend *b); /* cuda_matmul_fast.cu */
enum { GEMM_BF16 = 0, GEMM_FP8 = 1 }; /* cuda_internal.h RS_CUDA_GEMM_* */

/* Hopper's FP8 tensor cores add the products within an MMA aligned to the largest exponent among
 * them and truncated to about 14 bits, not fp32's 24 (DeepSeek-V3 technical report, section 3.3.2);
 * with fast accumulation off cuBLASLt promotes the partial sums to fp32 between MMAs. Truncation is
 * biased, and these tests draw codes across E4M3's whole range, so one large product sets the grid
 * the small ones are cut to: on an H200 the error reached 2^-10.8 of sum |products| here (2^-12.9
 * with activations of one magnitude), far past an fp32 accumulation's 1e-5. The bound is 2^-9 of
 * it; a misplaced scale or operand moves an output by about its own size, a large share of sum
 * |products| when few products dominate. */
#define FP8_MMA_REL 0x1p-9

static uint8_t rand_code(uint64_t *s) { /* any finite E4M3 code */
    uint8_t c;
    do c = (uint8_t)rs_test_rng(s);
    while ((c & 0x7f) == 0x7f);
    return c;
}

static float rand_scale(uint64_t *s) { return (float)exp2(-8.0 + 10.0 * (double)(rs_test_rng(s) >> 11) * 0x1p-53); }

/* ---- cuBLASLt's own refusals ---- */

typedef struct lt_case {
    cudaDataType_t ab, d;
    int32_t ta, tb, amode, bmode;
    uint64_t m, n, k;
} lt_case;

/* The heuristic's verdict on one problem (device-side scale pointers set): SUCCESS with at least one
 * algo, or the refusal. */
static cublasStatus_t lt_verdict(cublasLtHandle_t lt, const lt_case *cs, const void *scale, int *n_algos) {
    cublasLtMatmulDesc_t d;
    cublasLtMatrixLayout_t a, b, c;
    ASSERT_EQ(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &cs->ta, sizeof cs->ta), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &cs->tb, sizeof cs->tb), CUBLAS_STATUS_SUCCESS);
    if (cs->amode || cs->bmode) {
        ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &cs->amode, sizeof cs->amode), 0);
        ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &cs->bmode, sizeof cs->bmode), 0);
        ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale, sizeof scale), 0);
        ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale, sizeof scale), 0);
    }
    const bool at = cs->ta == CUBLAS_OP_T, bt = cs->tb == CUBLAS_OP_T;
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&a, cs->ab, at ? cs->k : cs->m, at ? cs->m : cs->k, (int64_t)(at ? cs->k : cs->m)), 0);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&b, cs->ab, bt ? cs->n : cs->k, bt ? cs->k : cs->n, (int64_t)(bt ? cs->n : cs->k)), 0);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&c, cs->d, cs->m, cs->n, (int64_t)cs->m), 0);
    cublasLtMatmulPreference_t p;
    ASSERT_EQ(cublasLtMatmulPreferenceCreate(&p), 0);
    const uint64_t ws = (uint64_t)32 << 20;
    ASSERT_EQ(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), 0);
    cublasLtMatmulHeuristicResult_t res[4];
    *n_algos = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, d, a, b, c, c, p, 4, res, n_algos);
    cublasLtMatmulPreferenceDestroy(p);
    cublasLtMatrixLayoutDestroy(a), cublasLtMatrixLayoutDestroy(b), cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(d);
    if (st == CUBLAS_STATUS_SUCCESS && *n_algos == 0) st = CUBLAS_STATUS_NOT_SUPPORTED;
    return st;
}

RS_TEST(cuda_blas_lt_refuses_what_cublas_refuses) {
    rs_backend *g = rs_test_cuda_or_skip();
    cublasLtHandle_t lt;
    ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
    float *scale = rs_backend_alloc(g, 1 << 20); /* room for any scale tensor below */
    const int32_t T = CUBLAS_OP_T, N = CUBLAS_OP_N, V = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                  B = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    int n_algos;
    /* the wrapper's problems are accepted: FP8 TN with 128x128 weight / 1x128 token scales, F32 and
     * BF16 out; BF16 TN with F32 out */
    const lt_case ok[] = {{CUDA_R_8F_E4M3, CUDA_R_32F, T, N, B, V, 256, 64, 512},
                          {CUDA_R_8F_E4M3, CUDA_R_16BF, T, N, B, V, 128, 16, 256},
                          {CUDA_R_16BF, CUDA_R_32F, T, N, 0, 0, 256, 64, 512}};
    for (size_t i = 0; i < RS_ARRAY_LEN(ok); i++) {
        cublasStatus_t st = lt_verdict(lt, &ok[i], scale, &n_algos);
        if (st != CUBLAS_STATUS_SUCCESS) RS_TEST_FAIL("accepted case %zu refused: %s", i, cublasLtGetStatusName(st));
    }
    /* and what the documentation says it refuses is refused */
    const struct { lt_case c; const char *why; } bad[] = {
        {{CUDA_R_8F_E4M3, CUDA_R_32F, N, N, B, V, 256, 64, 512}, "FP8 NN (sm_90 needs TN)"},
        {{CUDA_R_8F_E4M3, CUDA_R_32F, T, T, B, V, 256, 64, 512}, "FP8 TT"},
        {{CUDA_R_8F_E4M3, CUDA_R_32F, T, N, B, V, 256, 62, 512}, "block scaling with N = 62"},
        {{CUDA_R_8F_E4M3, CUDA_R_32F, T, N, V, V, 126, 64, 512}, "block scaling with M = 126"},
        {{CUDA_R_8F_E4M3, CUDA_R_32F, T, N, B, B, 256, 256, 512}, "128x128 scales on both operands"},
        {{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, T, N, B, V, 256, 64, 512}, "FP8 output with block scaling"},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(bad); i++) {
        cublasStatus_t st = lt_verdict(lt, &bad[i].c, scale, &n_algos);
        if (st == CUBLAS_STATUS_SUCCESS) RS_TEST_FAIL("cuBLASLt accepted %s (%d algos)", bad[i].why, n_algos);
    }
    /* attribute sizes are checked: TRANSA is an int32_t */
    cublasLtMatmulDesc_t d;
    ASSERT_EQ(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    const int8_t t8 = CUBLAS_OP_T;
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &t8, sizeof t8), CUBLAS_STATUS_INVALID_VALUE);
    cublasLtMatmulDescDestroy(d);
    rs_backend_free_mem(g, scale);
    cublasLtDestroy(lt);
    rs_backend_free(g);
}

/* An algo that needs workspace, run with less: the library refuses the call (INVALID_VALUE). */
RS_TEST(cuda_blas_lt_refuses_a_small_workspace) {
    rs_backend *g = rs_test_cuda_or_skip();
    cublasLtHandle_t lt;
    ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
    enum { M = 64, NN = 64, K = 4096 };
    uint16_t *a = rs_backend_alloc(g, (size_t)M * K * 2), *bm = rs_backend_alloc(g, (size_t)NN * K * 2);
    float *dd = rs_backend_alloc(g, (size_t)M * NN * 4);
    void *ws = rs_backend_alloc(g, (size_t)32 << 20);
    cublasLtMatmulDesc_t d;
    cublasLtMatrixLayout_t la, lb, lc;
    const int32_t T = CUBLAS_OP_T, N = CUBLAS_OP_N;
    ASSERT_EQ(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F), 0);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof T), 0);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &N, sizeof N), 0);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, M, K), 0);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, NN, K), 0);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, M, NN, M), 0);
    cublasLtMatmulPreference_t p;
    ASSERT_EQ(cublasLtMatmulPreferenceCreate(&p), 0);
    const uint64_t max_ws = (uint64_t)32 << 20;
    ASSERT_EQ(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof max_ws), 0);
    cublasLtMatmulHeuristicResult_t res[16];
    int got = 0;
    ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, d, la, lb, lc, lc, p, 16, res, &got), CUBLAS_STATUS_SUCCESS);
    int with_ws = -1;
    for (int i = 0; i < got && with_ws < 0; i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize >= 512) with_ws = i;
    if (with_ws < 0) {
        printf("  (no algo of %d needs workspace for this problem here: nothing to refuse)\n", got);
    } else {
        const float alpha = 1.0f, beta = 0.0f;
        cublasStatus_t st = cublasLtMatmul(lt, d, &alpha, a, la, bm, lb, &beta, dd, lc, dd, lc, &res[with_ws].algo, ws,
                                           res[with_ws].workspaceSize - 256, NULL);
        ASSERT_EQ(st, CUBLAS_STATUS_INVALID_VALUE);
        st = cublasLtMatmul(lt, d, &alpha, a, la, bm, lb, &beta, dd, lc, dd, lc, &res[with_ws].algo, ws,
                            res[with_ws].workspaceSize, NULL);
        ASSERT_EQ(st, CUBLAS_STATUS_SUCCESS);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    cublasLtMatmulPreferenceDestroy(p);
    cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(d);
    rs_backend_free_mem(g, a), rs_backend_free_mem(g, bm), rs_backend_free_mem(g, dd), rs_backend_free_mem(g, ws);
    cublasLtDestroy(lt);
    rs_backend_free(g);
}

/* ---- the wrapper against the definition ---- */

/* The FP8 GEMM's definition in double: out[t][o] = sum_b xs[b][t] * ws[o/128][b] * sum_{j in b}
 * e4m3(x[t][j]) e4m3(w[o][j]); mag[t][o] the same with absolute values (the error scale). */
static void fp8_definition(const uint8_t *x, const float *xs, const uint8_t *w, const float *ws, int t, int n, int k,
                           double *ref, double *mag) {
    const int L = (int)rs_fp8_blocks(k), L4 = (L + 3) / 4 * 4;
    for (int r = 0; r < t; r++)
        for (int o = 0; o < n; o++) {
            double acc = 0, m = 0;
            for (int b = 0; b < L; b++) {
                double blk = 0, bm = 0;
                for (int j = b * 128; j < RS_MIN(k, b * 128 + 128); j++) {
                    const double p = (double)rs_fp8_e4m3_to_f32(x[(size_t)r * k + j]) * rs_fp8_e4m3_to_f32(w[(size_t)o * k + j]);
                    blk += p, bm += fabs(p);
                }
                const double sc = (double)xs[(size_t)b * t + r] * ws[(size_t)(o / 128) * L4 + b];
                acc += sc * blk, m += fabs(sc) * bm;
            }
            ref[(size_t)r * n + o] = acc, mag[(size_t)r * n + o] = m;
        }
}

/* Runs the wrapper's FP8 GEMM on host operands; returns malloc'd fp32 outputs [t][n], or NULL when
 * refused. */
static float *run_fp8(rs_backend *g, const uint8_t *x, const float *xs, const uint8_t *w, const float *ws, int t, int n,
                      int k, rs_dtype out_dt) {
    const int L = (int)rs_fp8_blocks(k), L4 = (L + 3) / 4 * 4, nb = (int)rs_fp8_blocks(n);
    uint8_t *dx = rs_test_to_backend(g, x, (size_t)t * k), *dw = rs_test_to_backend(g, w, (size_t)n * k);
    float *dxs = rs_test_to_backend(g, xs, (size_t)L * t * 4), *dws = rs_test_to_backend(g, ws, (size_t)nb * L4 * 4);
    const size_t es = rs_dtype_size(out_dt);
    void *dout = rs_backend_alloc(g, (size_t)t * n * es);
    int rc = rs_cuda_test_blas_gemm(g, GEMM_FP8, dout, out_dt, dx, dxs, dw, dws, t, n, k);
    float *out = NULL;
    if (rc == RS_OK) {
        void *h = rs_test_to_host(g, dout, (size_t)t * n * es);
        out = malloc((size_t)t * n * sizeof(float));
        for (size_t i = 0; i < (size_t)t * n; i++)
            out[i] = out_dt == RS_DTYPE_F32 ? ((float *)h)[i] : rs_bf16_to_f32(((uint16_t *)h)[i]);
        free(h);
    }
    rs_backend_free_mem(g, dx), rs_backend_free_mem(g, dw), rs_backend_free_mem(g, dxs), rs_backend_free_mem(g, dws);
    rs_backend_free_mem(g, dout);
    return out;
}

RS_TEST(cuda_blas_fp8_matches_definition) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 101;
    /* (t, n, k): one block; L = 3 (weight scale rows padded to 4, the pad holding NaN); ragged N
     * blocks (n = 136); several K and N blocks */
    static const int shapes[][3] = {{4, 128, 128}, {8, 256, 384}, {36, 136, 512}, {12, 384, 1024}};
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        const int t = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
        const int L = (int)rs_fp8_blocks(k), L4 = (L + 3) / 4 * 4, nb = (int)rs_fp8_blocks(n);
        uint8_t *x = malloc((size_t)t * k), *w = malloc((size_t)n * k);
        float *xs = malloc((size_t)L * t * 4), *ws = malloc((size_t)nb * L4 * 4);
        for (size_t i = 0; i < (size_t)t * k; i++) x[i] = rand_code(&s);
        for (size_t i = 0; i < (size_t)n * k; i++) w[i] = rand_code(&s);
        for (size_t i = 0; i < (size_t)L * t; i++) xs[i] = rand_scale(&s);
        for (int p = 0; p < nb; p++)
            for (int b = 0; b < L4; b++) ws[p * L4 + b] = b < L ? rand_scale(&s) * (rs_test_rng(&s) & 1 ? 1 : -1) : NAN;
        double *ref = malloc((size_t)t * n * sizeof(double)), *mag = malloc((size_t)t * n * sizeof(double));
        fp8_definition(x, xs, w, ws, t, n, k, ref, mag);
        for (int bf = 0; bf < 2; bf++) {
            float *got = run_fp8(g, x, xs, w, ws, t, n, k, bf ? RS_DTYPE_BF16 : RS_DTYPE_F32);
            if (!got) RS_TEST_FAIL("t %d n %d k %d: the FP8 GEMM was refused", t, n, k);
            for (size_t i = 0; i < (size_t)t * n; i++) {
                const double tol = FP8_MMA_REL * mag[i] + (bf ? fabs(ref[i]) * 0x1p-8 : 0) + 1e-30;
                if (!(fabs(got[i] - ref[i]) <= tol))
                    RS_TEST_FAIL("t %d n %d k %d %s: out[%zu][%zu] %.9g, definition %.9g (tol %.3g)", t, n, k,
                                 bf ? "bf16" : "f32", i / n, i % n, got[i], ref[i], tol);
            }
            free(got);
        }
        free(x), free(w), free(xs), free(ws), free(ref), free(mag);
    }
    rs_backend_free(g);
}

/* The scale layouts by a probe: with every code 1.0 and every scale 1, then one weight block
 * (rows 128..255, K block 1) and one token group (token 2, K block 0) scaled by 2^10, exactly the
 * outputs of those rows and of that token change (shared/reference/kernels.md §7 device check 3). */
RS_TEST(cuda_blas_fp8_scale_layout_probe) {
    rs_backend *g = rs_test_cuda_or_skip();
    enum { T = 8, N = 256, K = 256, L = 2, L4 = 4, NB = 2 };
    uint8_t *x = malloc(T * K), *w = malloc(N * K);
    memset(x, 0x38, T * K), memset(w, 0x38, N * K); /* e4m3 1.0 */
    float xs[L * T], ws[NB * L4];
    for (int i = 0; i < L * T; i++) xs[i] = 1.0f;
    for (int i = 0; i < NB * L4; i++) ws[i] = 1.0f;
    float *base = run_fp8(g, x, xs, w, ws, T, N, K, RS_DTYPE_F32);
    ASSERT_TRUE(base != NULL);
    ws[1 * L4 + 1] = 1024.0f;  /* weight block (p = 1, b = 1) */
    xs[0 * T + 2] = 1024.0f;   /* token 2, K block 0 */
    float *probe = run_fp8(g, x, xs, w, ws, T, N, K, RS_DTYPE_F32);
    ASSERT_TRUE(probe != NULL);
    for (int t = 0; t < T; t++)
        for (int o = 0; o < N; o++) {
            const double blk0 = 128.0 * (t == 2 ? 1024 : 1), blk1 = 128.0 * (o >= 128 ? 1024 : 1);
            const double want = blk0 + blk1;
            ASSERT_NEAR(base[t * N + o], 256.0, 0);
            if (probe[t * N + o] != (float)want)
                RS_TEST_FAIL("token %d output %d: %.9g, want %.9g (a scale tensor is laid out wrongly)", t, o,
                             probe[t * N + o], want);
        }
    free(base), free(probe), free(x), free(w);
    rs_backend_free(g);
}

RS_TEST(cuda_blas_bf16_matches_definition) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 103;
    /* odd K (2-byte alignment), one row, a long one */
    static const int shapes[][3] = {{1, 64, 96}, {5, 100, 131}, {64, 256, 1024}, {17, 33, 8}};
    for (size_t si = 0; si < RS_ARRAY_LEN(shapes); si++) {
        const int t = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
        uint16_t *x = malloc((size_t)t * k * 2), *w = malloc((size_t)n * k * 2);
        for (size_t i = 0; i < (size_t)t * k; i++) x[i] = rs_f32_to_bf16(rs_test_uniform(&s));
        for (size_t i = 0; i < (size_t)n * k; i++) w[i] = rs_f32_to_bf16(rs_test_uniform(&s));
        uint16_t *dx = rs_test_to_backend(g, x, (size_t)t * k * 2), *dw = rs_test_to_backend(g, w, (size_t)n * k * 2);
        float *dout = rs_backend_alloc(g, (size_t)t * n * 4);
        ASSERT_EQ(rs_cuda_test_blas_gemm(g, GEMM_BF16, dout, RS_DTYPE_F32, dx, NULL, dw, NULL, t, n, k), RS_OK);
        float *got = rs_test_to_host(g, dout, (size_t)t * n * 4);
        for (int r = 0; r < t; r++)
            for (int o = 0; o < n; o++) {
                double ref = 0, mag = 0;
                for (int j = 0; j < k; j++) {
                    const double p = (double)rs_bf16_to_f32(x[(size_t)r * k + j]) * rs_bf16_to_f32(w[(size_t)o * k + j]);
                    ref += p, mag += fabs(p);
                }
                if (!(fabs(got[r * n + o] - ref) <= 1e-5 * mag + 1e-30))
                    RS_TEST_FAIL("t %d n %d k %d: out[%d][%d] %.9g, definition %.9g", t, n, k, r, o, got[r * n + o], ref);
            }
        free(got), free(x), free(w);
        rs_backend_free_mem(g, dx), rs_backend_free_mem(g, dw), rs_backend_free_mem(g, dout);
    }
    rs_backend_free(g);
}

/* Problems cuBLASLt is documented to refuse come back RS_EUNSUPPORTED (the op then falls back), and
 * an algo that fits a small workspace is found when the large one is not offered. */
RS_TEST(cuda_blas_refusals_and_workspace) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint8_t *b8 = rs_backend_alloc(g, 1 << 20);
    float *bs = rs_backend_alloc(g, 1 << 16), *bo = rs_backend_alloc(g, 1 << 22);
    ASSERT_EQ(rs_cuda_test_blas_gemm(g, GEMM_FP8, bo, RS_DTYPE_F32, b8, bs, b8, bs, 6, 128, 128), RS_EUNSUPPORTED);
    ASSERT_EQ(rs_cuda_test_blas_gemm(g, GEMM_FP8, bo, RS_DTYPE_F32, b8, bs, b8, bs, 8, 130, 128), RS_EUNSUPPORTED);
    ASSERT_EQ(rs_cuda_test_blas_gemm(g, GEMM_FP8, bo, RS_DTYPE_F32, b8, bs, b8, bs, 8, 128, 40), RS_EUNSUPPORTED);
    ASSERT_EQ(rs_cuda_test_blas_gemm(g, GEMM_FP8, bo, RS_DTYPE_F32, b8 + 8, bs, b8, bs, 8, 128, 128), RS_EUNSUPPORTED);
    ASSERT_EQ(rs_cuda_test_blas_gemm(g, GEMM_FP8, bo, RS_DTYPE_F16, b8, bs, b8, bs, 8, 128, 128), RS_EUNSUPPORTED);
    ASSERT_EQ(rs_cuda_test_blas_gemm(g, GEMM_FP8, bo, RS_DTYPE_BF16, b8, bs, b8, bs, 8, 132, 128), RS_EUNSUPPORTED);
    rs_backend_free_mem(g, b8), rs_backend_free_mem(g, bs), rs_backend_free_mem(g, bo);

    /* FP8, K = 2048: with 4 KiB of workspace offered the heuristic must pick an algo that fits */
    uint64_t s = 107;
    enum { T = 8, N = 128, K = 2048, L = 16, NB = 1 };
    uint8_t *x = malloc(T * K), *w = malloc(N * K);
    float xs[L * T], ws[NB * L];
    for (int i = 0; i < T * K; i++) x[i] = rand_code(&s);
    for (int i = 0; i < N * K; i++) w[i] = rand_code(&s);
    for (int i = 0; i < L * T; i++) xs[i] = rand_scale(&s);
    for (int i = 0; i < NB * L; i++) ws[i] = rand_scale(&s);
    double *ref = malloc(T * N * sizeof(double)), *mag = malloc(T * N * sizeof(double));
    fp8_definition(x, xs, w, ws, T, N, K, ref, mag);
    rs_cuda_test_blas_workspace_limit(g, 4096);
    float *got = run_fp8(g, x, xs, w, ws, T, N, K, RS_DTYPE_F32);
    ASSERT_TRUE(got != NULL);
    for (int i = 0; i < T * N; i++) ASSERT_NEAR(got[i], ref[i], FP8_MMA_REL * mag[i] + 1e-30);
    rs_cuda_test_blas_workspace_limit(g, 0);
    free(got), free(x), free(w), free(ref), free(mag);
    rs_backend_free(g);
}

/* ---- the matmul op: fast against exact ---- */

/* rs_op_matmul of x [rows][k] with w on g in `numerics`; malloc'd result. */
static float *op_matmul(rs_backend *g, rs_numerics numerics, const rs_tensor *w, const rs_tensor *bias, const float *x,
                        int rows) {
    const int n = (int)w->shape[0], k = (int)w->shape[1];
    ASSERT_EQ(rs_backend_set_numerics(g, numerics), numerics);
    float *dx = rs_test_to_backend(g, x, (size_t)rows * k * 4), *dout = rs_backend_alloc(g, (size_t)rows * n * 4);
    rs_op_matmul(g, dout, dx, w, bias, rows);
    float *out = rs_test_to_host(g, dout, (size_t)rows * n * 4);
    rs_backend_free_mem(g, dx), rs_backend_free_mem(g, dout);
    return out;
}

RS_TEST(cuda_matmul_fast_matches_exact) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 109;
    /* (n, k): cuBLASLt refuses n % 4 and k % 16 (the exact kernels run: bit-identical); L = 1 and
     * L = 3 (weight scale rows padded); several blocks */
    static const int nk[][2] = {{7, 129}, {130, 300}, {132, 96}, {256, 384}, {512, 1024}};
    static const int rows_list[] = {1, 8, 9, 12, 33, 130};
    /* up to 8 rows the GEMV kernels, whatever the defaults (both paths run for both dtypes) */
    const int keep8 = rs_backend_cuda_set_gemv_rows(g, RS_DTYPE_E4M3, 8);
    const int keep16 = rs_backend_cuda_set_gemv_rows(g, RS_DTYPE_BF16, 8);
    for (int wdt = 0; wdt < 2; wdt++) {
        const bool fp8 = wdt == 0;
        for (size_t si = 0; si < RS_ARRAY_LEN(nk); si++) {
            const int n = nk[si][0], k = nk[si][1];
            uint16_t *wb = malloc((size_t)n * k * 2 + 2);
            for (size_t i = 0; i < (size_t)n * k; i++) wb[i] = rs_f32_to_bf16(0.05f * rs_test_uniform(&s));
            rs_tensor host_w = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {n, k}, .data = wb};
            uint8_t *q = malloc((size_t)n * k + 1);
            const size_t nsc = (size_t)rs_fp8_blocks(n) * (size_t)rs_fp8_blocks(k);
            float *sinv = malloc(nsc * sizeof(float));
            ASSERT_EQ(rs_fp8_quantize_weight(&host_w, q, sinv), RS_OK);
            float *wdq = malloc((size_t)n * k * sizeof(float)); /* the weights the GEMM multiplies, for the error scale */
            if (fp8) rs_fp8_dequantize_weight(q, sinv, n, k, wdq);
            else
                for (size_t i = 0; i < (size_t)n * k; i++) wdq[i] = rs_bf16_to_f32(wb[i]);
            rs_tensor w = {.dtype = fp8 ? RS_DTYPE_E4M3 : RS_DTYPE_BF16, .ndim = 2, .shape = {n, k}};
            w.data = fp8 ? rs_test_to_backend(g, q, (size_t)n * k) : rs_test_to_backend(g, wb, (size_t)n * k * 2);
            if (fp8) w.scale_inv = rs_test_to_backend(g, sinv, nsc * sizeof(float));
            uint16_t *bb = malloc((size_t)n * 2);
            for (int i = 0; i < n; i++) bb[i] = rs_f32_to_bf16(rs_test_uniform(&s));
            rs_tensor bias = {.dtype = RS_DTYPE_BF16, .ndim = 1, .shape = {n}, .data = rs_test_to_backend(g, bb, (size_t)n * 2)};
            const bool refused = fp8 && (n % 4 || k % 16); /* cuBLASLt's FP8 rules */
            for (size_t ri = 0; ri < RS_ARRAY_LEN(rows_list); ri++) {
                const int rows = rows_list[ri];
                float *x = malloc((size_t)rows * k * sizeof(float));
                for (size_t i = 0; i < (size_t)rows * k; i++) x[i] = rs_test_uniform(&s) * (rs_test_rng(&s) % 50 ? 1.0f : 30.0f);
                unsigned long long calls0, calls1, refused0;
                rs_cuda_test_blas_counts(g, &calls0, &refused0);
                float *want = op_matmul(g, RS_NUMERICS_EXACT, &w, &bias, x, rows);
                const unsigned long long tc0 = rs_cuda_test_gemv_tc_runs(g);
                float *got = op_matmul(g, RS_NUMERICS_FAST, &w, &bias, x, rows);
                const bool tc = rs_cuda_test_gemv_tc_runs(g) != tc0;
                rs_cuda_test_blas_counts(g, &calls1, &refused0);
                /* up to 8 rows the GEMVs: on tensor cores where 16-byte loads fit (FP8 k % 16, BF16 k % 8);
                 * else the CUDA-core FP8 GEMV (any shape) or the exact dense GEMV for BF16 */
                const bool gemv = rows <= 8, exact_kernels = (refused && !gemv) || (gemv && !fp8 && k % 8);
                if (!refused && !gemv && calls1 == calls0)
                    RS_TEST_FAIL("%s n %d k %d rows %d: fast numerics did not reach cuBLASLt", fp8 ? "e4m3" : "bf16", n,
                                 k, rows);
                if (tc != (gemv && k % (fp8 ? 16 : 8) == 0))
                    RS_TEST_FAIL("%s n %d k %d rows %d: the tensor-core GEMV %s", fp8 ? "e4m3" : "bf16", n, k, rows,
                                 tc ? "ran" : "did not run");
                /* the activation as the GEMM sees it: its E4M3 dequantization, or the BF16 rounding */
                float *xa = malloc((size_t)rows * k * sizeof(float));
                if (fp8) {
                    uint8_t *xq = malloc((size_t)rows * k + 1);
                    float *xsc = malloc(((size_t)rows * rs_fp8_blocks(k) + 1) * sizeof(float));
                    rs_fp8_quantize_act(x, rows, k, xq, xsc);
                    rs_fp8_dequantize_act(xq, xsc, rows, k, xa);
                    free(xq), free(xsc);
                }
                for (int r = 0; r < rows; r++)
                    for (int o = 0; o < n; o++) {
                        const size_t i = (size_t)r * n + o;
                        if (exact_kernels) {
                            if (rs_test_f32_bits(got[i]) != rs_test_f32_bits(want[i]))
                                RS_TEST_FAIL("%s n %d k %d rows %d: out[%d][%d] %a differs from exact %a where the "
                                             "exact kernels run", fp8 ? "e4m3" : "bf16", n, k, rows, r, o, got[i], want[i]);
                            continue;
                        }
                        double mag = fabs(rs_bf16_to_f32(bb[o]));
                        for (int j = 0; j < k; j++)
                            mag += fabs((double)(fp8 ? xa[(size_t)r * k + j] : x[(size_t)r * k + j]) * wdq[(size_t)o * k + j]);
                        /* FP8: the same products, the tensor cores' accumulation; BF16: x rounded to 8 bits */
                        const double tol = (fp8 ? FP8_MMA_REL : 0x1p-8) * mag + 1e-30;
                        if (!(fabs((double)got[i] - want[i]) <= tol))
                            RS_TEST_FAIL("%s n %d k %d rows %d: out[%d][%d] fast %.9g, exact %.9g (tol %.3g)",
                                         fp8 ? "e4m3" : "bf16", n, k, rows, r, o, got[i], want[i], tol);
                    }
                free(x), free(xa), free(want), free(got);
            }
            rs_backend_free_mem(g, w.data);
            if (w.scale_inv) rs_backend_free_mem(g, w.scale_inv);
            rs_backend_free_mem(g, bias.data);
            free(wb), free(q), free(sinv), free(wdq), free(bb);
        }
    }
    rs_backend_cuda_set_gemv_rows(g, RS_DTYPE_E4M3, keep8);
    rs_backend_cuda_set_gemv_rows(g, RS_DTYPE_BF16, keep16);
    rs_backend_free(g);
}

/* The fast FP8 GEMVs alone (forced for every row count): ragged K (the CUDA-core GEMV's scalar code
 * loads: within fp32-accumulation error of the exact kernels), k % 16 == 0 (the tensor-core GEMV:
 * within FP8_MMA_REL), one and two groups of 8 rows; a NaN activation makes its row NaN (as
 * cuBLASLt's E4M3 decoding does). */
RS_TEST(cuda_fp8_gemv_fast_matches_exact) {
    rs_backend *g = rs_test_cuda_or_skip();
    const int old = rs_backend_cuda_set_gemv_rows(g, RS_DTYPE_E4M3, 1 << 20);
    uint64_t s = 127;
    static const int nk[][2] = {{130, 300}, {256, 1024}, {64, 16}};
    static const int rows_list[] = {1, 5, 8, 13};
    for (size_t si = 0; si < RS_ARRAY_LEN(nk); si++) {
        const int n = nk[si][0], k = nk[si][1];
        float *wf = malloc((size_t)n * k * sizeof(float));
        for (size_t i = 0; i < (size_t)n * k; i++) wf[i] = 0.05f * rs_test_uniform(&s);
        rs_tensor hw = {.dtype = RS_DTYPE_F32, .ndim = 2, .shape = {n, k}, .data = wf};
        uint8_t *q = malloc((size_t)n * k + 1);
        const size_t nsc = (size_t)rs_fp8_blocks(n) * (size_t)rs_fp8_blocks(k);
        float *sinv = malloc(nsc * sizeof(float)), *wdq = malloc((size_t)n * k * sizeof(float));
        ASSERT_EQ(rs_fp8_quantize_weight(&hw, q, sinv), RS_OK);
        rs_fp8_dequantize_weight(q, sinv, n, k, wdq);
        rs_tensor w = {.dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = {n, k}, .data = rs_test_to_backend(g, q, (size_t)n * k),
                       .scale_inv = rs_test_to_backend(g, sinv, nsc * sizeof(float))};
        for (size_t ri = 0; ri < RS_ARRAY_LEN(rows_list); ri++) {
            const int rows = rows_list[ri];
            float *x = malloc((size_t)rows * k * sizeof(float)), *xa = malloc((size_t)rows * k * sizeof(float));
            for (size_t i = 0; i < (size_t)rows * k; i++) x[i] = rs_test_uniform(&s);
            if (rows > 1) x[(size_t)(rows - 1) * k + k / 2] = NAN; /* the last row */
            uint8_t *xq = malloc((size_t)rows * k + 1);
            float *xsc = malloc(((size_t)rows * rs_fp8_blocks(k) + 1) * sizeof(float));
            rs_fp8_quantize_act(x, rows, k, xq, xsc);
            rs_fp8_dequantize_act(xq, xsc, rows, k, xa);
            float *want = op_matmul(g, RS_NUMERICS_EXACT, &w, NULL, x, rows);
            float *got = op_matmul(g, RS_NUMERICS_FAST, &w, NULL, x, rows);
            for (int r = 0; r < rows; r++)
                for (int o = 0; o < n; o++) {
                    const size_t i = (size_t)r * n + o;
                    if (rows > 1 && r == rows - 1) {
                        if (!isnan(got[i])) RS_TEST_FAIL("n %d k %d rows %d: a NaN activation gave %g", n, k, rows, got[i]);
                        continue;
                    }
                    double mag = 0;
                    for (int j = 0; j < k; j++) mag += fabs((double)xa[(size_t)r * k + j] * wdq[(size_t)o * k + j]);
                    if (!(fabs((double)got[i] - want[i]) <= (k % 16 ? 2e-5 : FP8_MMA_REL) * mag + 1e-30))
                        RS_TEST_FAIL("n %d k %d rows %d: out[%d][%d] gemv %.9g, exact %.9g", n, k, rows, r, o, got[i], want[i]);
                }
            free(x), free(xa), free(xq), free(xsc), free(want), free(got);
        }
        rs_backend_free_mem(g, w.data), rs_backend_free_mem(g, w.scale_inv);
        free(wf), free(q), free(sinv), free(wdq);
    }
    rs_backend_cuda_set_gemv_rows(g, RS_DTYPE_E4M3, old);
    rs_backend_free(g);
}

/* rs_op_matmul_group against one rs_op_matmul per weight, bit for bit: three weights of one dtype
 * and K (n of 48, 16 and a ragged 40; K of two blocks and a ragged 160), a bias on the second, in
 * both numerics, at 1, 5 and 8 rows (fast numerics: one tensor-core GEMV launch for the group, where
 * the single matmuls take three) and 12 (above the GEMV rows: the single matmuls, one by one). */
RS_TEST(cuda_matmul_group_matches_single) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 137;
    static const int ns[RS_MATMUL_GROUP] = {48, 16, 40}, ks[] = {256, 160}, rows_list[] = {1, 5, 8, 12};
    for (int wdt = 0; wdt < 2; wdt++) {
        const bool fp8 = wdt == 0;
        for (size_t ki = 0; ki < RS_ARRAY_LEN(ks); ki++) {
            const int k = ks[ki], L = (int)rs_fp8_blocks(k);
            rs_tensor w[RS_MATMUL_GROUP], bias[RS_MATMUL_GROUP] = {{0}};
            const rs_tensor *wp[RS_MATMUL_GROUP], *bp[RS_MATMUL_GROUP];
            for (int i = 0; i < RS_MATMUL_GROUP; i++) {
                const int n = ns[i], nb = (int)rs_fp8_blocks(n);
                uint8_t *q = malloc((size_t)n * k);
                uint16_t *wb = malloc((size_t)n * k * 2);
                float *ws = malloc((size_t)nb * L * sizeof(float));
                for (size_t j = 0; j < (size_t)n * k; j++) q[j] = rand_code(&s), wb[j] = rs_f32_to_bf16(rs_test_uniform(&s));
                for (int j = 0; j < nb * L; j++) ws[j] = rand_scale(&s);
                w[i] = (rs_tensor){.dtype = fp8 ? RS_DTYPE_E4M3 : RS_DTYPE_BF16, .ndim = 2, .shape = {n, k}};
                w[i].data = fp8 ? rs_test_to_backend(g, q, (size_t)n * k) : rs_test_to_backend(g, wb, (size_t)n * k * 2);
                if (fp8) w[i].scale_inv = rs_test_to_backend(g, ws, (size_t)nb * L * sizeof(float));
                free(q), free(wb), free(ws);
                if (i == 1) {
                    uint16_t hb[64];
                    for (int j = 0; j < n; j++) hb[j] = rs_f32_to_bf16(rs_test_uniform(&s));
                    bias[i] = (rs_tensor){.dtype = RS_DTYPE_BF16, .ndim = 1, .shape = {n},
                                          .data = rs_test_to_backend(g, hb, (size_t)n * 2)};
                }
                wp[i] = &w[i], bp[i] = &bias[i];
            }
            for (int numerics = 0; numerics < 2; numerics++) {
                const rs_numerics nm = numerics ? RS_NUMERICS_FAST : RS_NUMERICS_EXACT;
                for (size_t ri = 0; ri < RS_ARRAY_LEN(rows_list); ri++) {
                    const int rows = rows_list[ri];
                    float *x = malloc((size_t)rows * k * sizeof(float));
                    for (size_t j = 0; j < (size_t)rows * k; j++) x[j] = rs_test_uniform(&s);
                    float *want[RS_MATMUL_GROUP];
                    const unsigned long long tc0 = rs_cuda_test_gemv_tc_runs(g);
                    for (int i = 0; i < RS_MATMUL_GROUP; i++) want[i] = op_matmul(g, nm, &w[i], &bias[i], x, rows);
                    const unsigned long long tc1 = rs_cuda_test_gemv_tc_runs(g);
                    float *dx = rs_test_to_backend(g, x, (size_t)rows * k * 4), *dout[RS_MATMUL_GROUP];
                    for (int i = 0; i < RS_MATMUL_GROUP; i++) dout[i] = rs_backend_alloc(g, (size_t)rows * ns[i] * 4);
                    rs_op_matmul_group(g, dout, dx, wp, bp, RS_MATMUL_GROUP, rows);
                    const unsigned long long tc2 = rs_cuda_test_gemv_tc_runs(g);
                    const bool gemv = nm == RS_NUMERICS_FAST && rows <= 8;
                    if (gemv ? tc1 - tc0 != RS_MATMUL_GROUP || tc2 - tc1 != 1 : tc2 != tc0)
                        RS_TEST_FAIL("%s k %d %s rows %d: tensor-core GEMV launches %llu single, %llu grouped",
                                     fp8 ? "e4m3" : "bf16", k, rs_numerics_name(nm), rows, tc1 - tc0, tc2 - tc1);
                    for (int i = 0; i < RS_MATMUL_GROUP; i++) {
                        float *got = rs_test_to_host(g, dout[i], (size_t)rows * ns[i] * 4);
                        for (size_t j = 0; j < (size_t)rows * ns[i]; j++)
                            if (rs_test_f32_bits(got[j]) != rs_test_f32_bits(want[i][j]))
                                RS_TEST_FAIL("%s k %d %s rows %d: weight %d out %zu grouped %a, single %a",
                                             fp8 ? "e4m3" : "bf16", k, rs_numerics_name(nm), rows, i, j, got[j],
                                             want[i][j]);
                        free(got), free(want[i]);
                        rs_backend_free_mem(g, dout[i]);
                    }
                    rs_backend_free_mem(g, dx);
                    free(x);
                }
            }
            for (int i = 0; i < RS_MATMUL_GROUP; i++) {
                rs_backend_free_mem(g, w[i].data);
                if (w[i].scale_inv) rs_backend_free_mem(g, w[i].scale_inv);
                if (bias[i].data) rs_backend_free_mem(g, bias[i].data);
            }
        }
    }
    rs_backend_free(g);
}

/* The tensor-core GEMVs through the matmul op at their default row limits (8), against double
 * references built here from the operands the kernels multiply: FP8 sum over K blocks of (sum of
 * x code * w code) * xs * ws, with rs_fp8_quantize_act's codes and scales and codes drawn across
 * E4M3's range with random block scales, within FP8_MMA_REL of sum |products|; BF16 sum of
 * bf16(x) * w within 1e-5 of it (fp32 accumulation). Rows 1..8 (zero B columns), n with a 16-row
 * tail and two weight scale rows, K of one and three blocks, a ragged last block and less than one
 * 64-byte window. Then the fallbacks, which must not reach the tensor-core kernel: FP8 k % 16 and a
 * misaligned weight (the CUDA-core GEMV, fp32 accumulation), BF16 k % 8 and a misaligned weight
 * (the exact dense GEMV: bit-identical to exact numerics). */
RS_TEST(cuda_gemv_tc_matches_reference) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 131;
    static const int ns[] = {16, 40, 256}, ks[] = {128, 384, 160, 48};
    for (int wdt = 0; wdt < 2; wdt++) {
        const bool fp8 = wdt == 0;
        for (size_t ni = 0; ni < RS_ARRAY_LEN(ns); ni++)
            for (size_t ki = 0; ki < RS_ARRAY_LEN(ks); ki++) {
                const int n = ns[ni], k = ks[ki], L = (int)rs_fp8_blocks(k), nb = (int)rs_fp8_blocks(n);
                uint8_t *q = malloc((size_t)n * k);
                uint16_t *wb = malloc((size_t)n * k * 2);
                float *ws = malloc((size_t)nb * L * sizeof(float));
                for (size_t i = 0; i < (size_t)n * k; i++) {
                    q[i] = rand_code(&s);
                    wb[i] = rs_f32_to_bf16(rs_test_uniform(&s));
                }
                for (int i = 0; i < nb * L; i++) ws[i] = rand_scale(&s);
                rs_tensor w = {.dtype = fp8 ? RS_DTYPE_E4M3 : RS_DTYPE_BF16, .ndim = 2, .shape = {n, k}};
                w.data = fp8 ? rs_test_to_backend(g, q, (size_t)n * k) : rs_test_to_backend(g, wb, (size_t)n * k * 2);
                if (fp8) w.scale_inv = rs_test_to_backend(g, ws, (size_t)nb * L * sizeof(float));
                for (int rows = 1; rows <= 8; rows++) {
                    float *x = malloc((size_t)rows * k * sizeof(float)), *xs = malloc((size_t)rows * L * sizeof(float));
                    uint8_t *xq = malloc((size_t)rows * k);
                    for (size_t i = 0; i < (size_t)rows * k; i++)
                        x[i] = rs_test_uniform(&s) * (rs_test_rng(&s) % 8 ? 1.0f : 40.0f);
                    rs_fp8_quantize_act(x, rows, k, xq, xs);
                    const unsigned long long tc0 = rs_cuda_test_gemv_tc_runs(g);
                    float *got = op_matmul(g, RS_NUMERICS_FAST, &w, NULL, x, rows);
                    if (rs_cuda_test_gemv_tc_runs(g) == tc0)
                        RS_TEST_FAIL("%s n %d k %d rows %d: the tensor-core GEMV did not run", fp8 ? "e4m3" : "bf16",
                                     n, k, rows);
                    /* launched as a programmatic dependent (PDL): the same kernel, so the same bits */
                    rs_backend_cuda_set_pdl(g, true);
                    float *got_pdl = op_matmul(g, RS_NUMERICS_FAST, &w, NULL, x, rows);
                    rs_backend_cuda_set_pdl(g, false);
                    for (size_t i = 0; i < (size_t)rows * n; i++)
                        if (rs_test_f32_bits(got_pdl[i]) != rs_test_f32_bits(got[i]))
                            RS_TEST_FAIL("%s n %d k %d rows %d: with PDL %a at %zu, without %a", fp8 ? "e4m3" : "bf16", n,
                                         k, rows, got_pdl[i], i, got[i]);
                    free(got_pdl);
                    for (int r = 0; r < rows; r++)
                        for (int o = 0; o < n; o++) {
                            double ref = 0, mag = 0;
                            for (int b = 0; b < L; b++) {
                                double part = 0, pmag = 0;
                                for (int j = b * RS_FP8_BLOCK; j < k && j < (b + 1) * RS_FP8_BLOCK; j++) {
                                    const size_t xi = (size_t)r * k + j, wi = (size_t)o * k + j;
                                    const double p =
                                        fp8 ? (double)rs_fp8_e4m3_to_f32(xq[xi]) * rs_fp8_e4m3_to_f32(q[wi])
                                            : (double)rs_bf16_to_f32(rs_f32_to_bf16(x[xi])) * rs_bf16_to_f32(wb[wi]);
                                    part += p, pmag += fabs(p);
                                }
                                const double sc =
                                    fp8 ? (double)xs[(size_t)r * L + b] * ws[(size_t)(o / RS_FP8_BLOCK) * L + b] : 1.0;
                                ref += part * sc, mag += pmag * sc;
                            }
                            const double got_v = got[(size_t)r * n + o], tol = (fp8 ? FP8_MMA_REL : 1e-5) * mag + 1e-30;
                            if (!(fabs(got_v - ref) <= tol))
                                RS_TEST_FAIL("%s n %d k %d rows %d: out[%d][%d] %.9g, reference %.9g (tol %.3g)",
                                             fp8 ? "e4m3" : "bf16", n, k, rows, r, o, got_v, ref, tol);
                        }
                    free(x), free(xs), free(xq), free(got);
                }
                rs_backend_free_mem(g, w.data);
                if (w.scale_inv) rs_backend_free_mem(g, w.scale_inv);
                free(q), free(wb), free(ws);
            }
    }
    /* the fallbacks: {k, misaligned weight} */
    static const int fb[][2] = {{100, 0}, {136, 0}, {128, 1}};
    const int n = 24, rows = 3;
    for (int wdt = 0; wdt < 2; wdt++) {
        const bool fp8 = wdt == 0;
        for (size_t fi = 0; fi < RS_ARRAY_LEN(fb); fi++) {
            const int k = fb[fi][0], off = fb[fi][1] ? (fp8 ? 1 : 2) : 0, L = (int)rs_fp8_blocks(k);
            if (!fp8 && k % 8 == 0 && !off) continue; /* k = 136: k % 16 for FP8 only */
            const size_t esz = fp8 ? 1 : 2, bytes = (size_t)n * k * esz + 16;
            uint8_t *hw = malloc(bytes);
            for (size_t i = 0; i < bytes / 2; i++)
                ((uint16_t *)hw)[i] =
                    fp8 ? (uint16_t)(rand_code(&s) | rand_code(&s) << 8) : rs_f32_to_bf16(rs_test_uniform(&s));
            float *ws = malloc((size_t)L * sizeof(float));
            for (int i = 0; i < L; i++) ws[i] = rand_scale(&s);
            uint8_t *dw = rs_test_to_backend(g, hw, bytes);
            rs_tensor w = {.dtype = fp8 ? RS_DTYPE_E4M3 : RS_DTYPE_BF16, .ndim = 2, .shape = {n, k}, .data = dw + off};
            if (fp8) w.scale_inv = rs_test_to_backend(g, ws, (size_t)L * sizeof(float));
            float *x = malloc((size_t)rows * k * sizeof(float)), *xa = malloc((size_t)rows * k * sizeof(float));
            for (size_t i = 0; i < (size_t)rows * k; i++) x[i] = rs_test_uniform(&s);
            uint8_t *xq = malloc((size_t)rows * k);
            float *xs = malloc((size_t)rows * L * sizeof(float));
            rs_fp8_quantize_act(x, rows, k, xq, xs);
            rs_fp8_dequantize_act(xq, xs, rows, k, xa);
            float *want = op_matmul(g, RS_NUMERICS_EXACT, &w, NULL, x, rows);
            const unsigned long long tc0 = rs_cuda_test_gemv_tc_runs(g);
            float *got = op_matmul(g, RS_NUMERICS_FAST, &w, NULL, x, rows);
            if (rs_cuda_test_gemv_tc_runs(g) != tc0)
                RS_TEST_FAIL("%s k %d offset %d: the tensor-core GEMV ran", fp8 ? "e4m3" : "bf16", k, off);
            for (int r = 0; r < rows; r++)
                for (int o = 0; o < n; o++) {
                    const size_t i = (size_t)r * n + o;
                    if (!fp8) {
                        if (rs_test_f32_bits(got[i]) != rs_test_f32_bits(want[i]))
                            RS_TEST_FAIL("bf16 k %d offset %d: out[%d][%d] %a, exact %a", k, off, r, o, got[i],
                                         want[i]);
                        continue;
                    }
                    double mag = 0;
                    for (int j = 0; j < k; j++)
                        mag += fabs((double)xa[(size_t)r * k + j] * rs_fp8_e4m3_to_f32(hw[off + (size_t)o * k + j]) *
                                    ws[j / RS_FP8_BLOCK]);
                    if (!(fabs((double)got[i] - want[i]) <= 2e-5 * mag + 1e-30))
                        RS_TEST_FAIL("e4m3 k %d offset %d: out[%d][%d] %.9g, exact %.9g", k, off, r, o, got[i],
                                     want[i]);
                }
            free(x), free(xa), free(xq), free(xs), free(want), free(got), free(hw), free(ws);
            rs_backend_free_mem(g, dw);
            if (w.scale_inv) rs_backend_free_mem(g, w.scale_inv);
        }
    }
    rs_backend_free(g);
}

/* ---- the activation forms ---- */

/* Device buffers for the forms of a [rows][k] activation, allocated before the op runs (an
 * allocation is a backend entry: it would drop the forms). */
typedef struct forms_bufs {
    uint16_t *bf;
    uint8_t *q;
    float *s;
} forms_bufs;

static forms_bufs forms_alloc(rs_backend *g, int rows, int k) {
    const size_t n = (size_t)rows * k;
    return (forms_bufs){rs_backend_alloc(g, n * 2), rs_backend_alloc(g, n), rs_backend_alloc(g, (size_t)rows * rs_fp8_blocks(k) * 4)};
}

/* The forms the last op left for dx are rs_f32_to_bf16's and rs_fp8_quantize_act's of host_x. */
static void expect_forms(rs_backend *g, forms_bufs fb, const float *dx, const float *host_x, int rows, int k,
                         const char *what) {
    const size_t n = (size_t)rows * k, ns = (size_t)rows * rs_fp8_blocks(k);
    if (!rs_cuda_test_act_cached(g, dx, n)) RS_TEST_FAIL("%s: the op left no forms of its output", what);
    uint16_t *dbf = fb.bf;
    uint8_t *dq = fb.q;
    float *ds = fb.s;
    rs_cuda_test_act_forms(g, dx, rows, k, dbf, dq, ds); /* a hit: copies what the op wrote */
    uint16_t *bf = rs_test_to_host(g, dbf, n * 2);
    uint8_t *q = rs_test_to_host(g, dq, n), *wq = malloc(n + 1);
    float *sc = rs_test_to_host(g, ds, ns * 4), *ws = malloc(ns * 4 + 4);
    rs_fp8_quantize_act(host_x, rows, k, wq, ws);
    for (size_t i = 0; i < n; i++) {
        if (bf[i] != rs_f32_to_bf16(host_x[i])) RS_TEST_FAIL("%s: bf16[%zu] 0x%04x, want 0x%04x", what, i, bf[i], rs_f32_to_bf16(host_x[i]));
        if (q[i] != wq[i]) RS_TEST_FAIL("%s: code[%zu] 0x%02x, want 0x%02x", what, i, q[i], wq[i]);
    }
    for (size_t i = 0; i < ns; i++)
        if (rs_test_f32_bits(sc[i]) != rs_test_f32_bits(ws[i])) RS_TEST_FAIL("%s: scale[%zu] %a, want %a", what, i, sc[i], ws[i]);
    free(bf), free(q), free(wq), free(sc), free(ws);
    rs_backend_free_mem(g, dbf), rs_backend_free_mem(g, dq), rs_backend_free_mem(g, ds);
}

RS_TEST(cuda_act_forms_of_rmsnorm_and_swiglu) {
    rs_backend *g = rs_test_cuda_or_skip();
    ASSERT_EQ(rs_backend_set_numerics(g, RS_NUMERICS_FAST), RS_NUMERICS_FAST);
    uint64_t s = 113;
    /* rmsnorm over rows of 300 (ragged last group) and 96 (one short group) */
    static const int dims[] = {300, 96, 1024};
    for (size_t di = 0; di < RS_ARRAY_LEN(dims); di++) {
        const int rows = 5, dim = dims[di];
        float *x = malloc((size_t)rows * dim * 4);
        uint16_t *wn = malloc((size_t)dim * 2);
        for (int i = 0; i < rows * dim; i++) x[i] = rs_test_uniform(&s) * (i % 77 == 0 ? 50.0f : 1.0f);
        for (int i = 0; i < dim; i++) wn[i] = rs_f32_to_bf16(1.0f + 0.1f * rs_test_uniform(&s));
        rs_tensor w = {.dtype = RS_DTYPE_BF16, .ndim = 1, .shape = {dim}, .data = rs_test_to_backend(g, wn, (size_t)dim * 2)};
        float *dx = rs_test_to_backend(g, x, (size_t)rows * dim * 4), *dout = rs_backend_alloc(g, (size_t)rows * dim * 4);
        rs_op_rmsnorm(g, dout, dx, &w, rows, dim, 1e-6f);
        float *out = rs_test_to_host(g, dout, (size_t)rows * dim * 4); /* a download keeps nothing cached */
        ASSERT_TRUE(!rs_cuda_test_act_cached(g, dout, (size_t)rows * dim));
        forms_bufs fb = forms_alloc(g, rows, dim);
        rs_op_rmsnorm(g, dout, dx, &w, rows, dim, 1e-6f);
        expect_forms(g, fb, dout, out, rows, dim, "rmsnorm");
        /* the fp32 output is exact numerics' */
        ASSERT_EQ(rs_backend_set_numerics(g, RS_NUMERICS_EXACT), RS_NUMERICS_EXACT);
        rs_op_rmsnorm(g, dout, dx, &w, rows, dim, 1e-6f);
        ASSERT_TRUE(!rs_cuda_test_act_cached(g, dout, (size_t)rows * dim)); /* exact numerics write no forms */
        float *exact = rs_test_to_host(g, dout, (size_t)rows * dim * 4);
        ASSERT_TRUE(memcmp(exact, out, (size_t)rows * dim * 4) == 0);
        ASSERT_EQ(rs_backend_set_numerics(g, RS_NUMERICS_FAST), RS_NUMERICS_FAST);
        free(x), free(wn), free(out), free(exact);
        rs_backend_free_mem(g, w.data), rs_backend_free_mem(g, dx), rs_backend_free_mem(g, dout);
    }
    /* swiglu over rows of 256 (groups of 128 consecutive elements are the rows' groups) */
    const int rows = 3, inter = 256;
    const size_t n = (size_t)rows * inter;
    float *gt = malloc(n * 4), *up = malloc(n * 4);
    for (size_t i = 0; i < n; i++) gt[i] = 4 * rs_test_uniform(&s), up[i] = rs_test_uniform(&s);
    float *dg = rs_test_to_backend(g, gt, n * 4), *du = rs_test_to_backend(g, up, n * 4);
    rs_op_swiglu(g, dg, dg, du, n);
    float *out = rs_test_to_host(g, dg, n * 4);
    rs_op_add(g, du, du, 0); /* any other op drops the forms */
    ASSERT_TRUE(!rs_cuda_test_act_cached(g, dg, n));
    rs_backend_upload(g, dg, gt, n * 4);
    forms_bufs fb = forms_alloc(g, rows, inter);
    rs_op_swiglu(g, dg, dg, du, n);
    expect_forms(g, fb, dg, out, rows, inter, "swiglu");
    free(gt), free(up), free(out);
    rs_backend_free_mem(g, dg), rs_backend_free_mem(g, du);
    rs_backend_free(g);
}
#endif
