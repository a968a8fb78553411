/*
 * cuda_blas.cu — the one file that calls cuBLASLt: the handle, its preallocated workspace, and the
 * two tensor-core GEMMs of the fast numerics (kernels/backend.h rs_numerics), with their
 * descriptors, layouts and heuristic results cached.
 *
 *   out[t][n] = x[t][k] @ w[n][k]^T, every matrix row-major, out fp32 or BF16, fp32 accumulation:
 *     BF16   x and w BF16 (dense weights);
 *     FP8    x and w E4M3, block-scaled as the FP8 recipe (docs/design.md "Numerics") scales them:
 *            xs [ceil(k/128)][t] fp32, one scale per token and 128-wide K group, and ws
 *            [ceil(n/128)][L4] fp32, one per 128x128 weight block, L4 = roundup(ceil(k/128), 4).
 *
 * Mapping (as PyTorch's scaled_mm does): cuBLASLt is column-major, so a row-major [r][c] matrix is
 * its c x r matrix with ld = c. cuBLAS A = w (k x n, ld k) with TRANSA = T, cuBLAS B = x (k x t,
 * ld k) with TRANSB = N, D = out (n x t, ld n): m = n, the cuBLAS n = t. That is the TN layout FP8
 * requires on sm_90 (cuBLAS 12.9/13 docs §3.4.17 "cublasLtMatmul()", FP8 type table: "A must be
 * transposed and B non-transposed"). FP8 scale modes (§3.1.4 "Scaling Mode Support Overview",
 * Hopper only): A = w in CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, B = x in
 * CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F; scale tensor layouts (§3.1.4.5.1 "Scaling factors
 * layouts", 1D and 2D block scaling, L = ceil(K/128)): VEC128 is outer-dimension-major, B's scale
 * of column j and K block b at b*N + j (our xs); BLK128x128 is K-major with a column stride that is a
 * multiple of 4, A's scale of row block p and K block b at p*L4 + b (the checkpoint's
 * weight_scale_inv with its rows padded to L4). Block scaling needs M and N multiples of 4 and
 * 16-byte aligned scale pointers; FP8 also 16-byte aligned operands and leading dimensions (K a
 * multiple of 16). FAST_ACCUM stays 0 (the recipe accumulates in fp32; PyTorch refuses fast
 * accumulation with 1x128 / 128x128 scales). The caller pads t to a multiple of 4 (zero codes).
 *
 * Cache. One entry per (kind, out dtype, n, k, token bucket, alignment): the matmul descriptor, the
 * three layouts and the heuristic's algo, chosen for the bucket's largest t (buckets are powers of
 * two from 16); a call sets its own t on the cached layouts (cuBLASLt algos are tile
 * configurations, valid for any size of the same problem kind). The heuristic asks for the
 * alignment the pointers and leading dimensions really have (the default preference assumes 256
 * bytes) and at most the workspace allocated here (32 MiB, NVIDIA's recommendation for Hopper, so
 * split-K algos can run without allocating: CUDA-graph capturable). A problem cuBLASLt refuses
 * (no algo, or an error from the call) is remembered and logged once with the library's status:
 * rs_cuda_blas_gemm returns RS_EUNSUPPORTED and the caller runs its own kernels.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
extern "C" {
#include "../fp8.h"
}

#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
#define BLAS_MIN_BUCKET 16

struct rs_cuda_blas_entry {
    int kind;                 /* RS_CUDA_GEMM_BF16 | RS_CUDA_GEMM_FP8 */
    rs_dtype out_dt;          /* F32 | BF16 */
    int n, k, bucket;
    unsigned align;           /* bytes: pointers and leading dimensions are multiples of it */
    bool ok;                  /* false: cuBLASLt refused it (logged once) */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
    size_t algo_ws;           /* workspace the algo needs */
};

struct rs_cuda_blas {
    cublasLtHandle_t lt;
    void *ws;
    size_t ws_bytes;          /* allocated */
    size_t ws_limit;          /* offered to the heuristic (tests lower it) */
    rs_cuda_blas_entry *e;
    int n, cap;
    unsigned long long calls, refused;
};

static unsigned align_of(uintptr_t v) {
    unsigned a = 256;
    while (a > 1 && (v % a)) a /= 2;
    return a;
}

static int bucket_of(int t) {
    int b = BLAS_MIN_BUCKET;
    while (b < t) b *= 2;
    return b;
}

static cudaDataType_t cuda_type(rs_dtype dt) {
    switch (dt) {
    case RS_DTYPE_F32: return CUDA_R_32F;
    case RS_DTYPE_BF16: return CUDA_R_16BF;
    default: return CUDA_R_8F_E4M3;
    }
}

static const char *kind_name(int kind) { return kind == RS_CUDA_GEMM_FP8 ? "FP8 block-scaled" : "BF16"; }

void rs_cuda_blas_init(rs_cuda_ctx *c) {
    rs_cuda_blas *bl = (rs_cuda_blas *)rs_xcalloc(1, sizeof *bl);
    CUBLAS_CHECK(cublasLtCreate(&bl->lt));
    bl->ws_bytes = bl->ws_limit = BLAS_WORKSPACE_BYTES;
    CUDA_CHECK(cudaMalloc(&bl->ws, bl->ws_bytes));
    c->blas = bl;
}

static void entry_release(rs_cuda_blas_entry *e) {
    if (e->a) CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(e->a));
    if (e->b) CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(e->b));
    if (e->d) CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(e->d));
    if (e->desc) CUBLAS_CHECK(cublasLtMatmulDescDestroy(e->desc));
}

static void cache_clear(rs_cuda_blas *bl) {
    for (int i = 0; i < bl->n; i++) entry_release(&bl->e[i]);
    bl->n = 0;
}

void rs_cuda_blas_free(rs_cuda_ctx *c) {
    rs_cuda_blas *bl = c->blas;
    if (!bl) return;
    cache_clear(bl);
    free(bl->e);
    CUDA_CHECK(cudaFree(bl->ws));
    CUBLAS_CHECK(cublasLtDestroy(bl->lt));
    free(bl);
    c->blas = NULL;
}

size_t rs_cuda_blas_version(const rs_cuda_ctx *c) {
    (void)c;
    return cublasLtGetVersion();
}

/* Builds entry e (kind, dtypes, n, k, bucket, align set) : descriptor, layouts at t = bucket and the
 * heuristic's first algo within the workspace. Returns the cuBLAS status that refused it, or
 * SUCCESS. */
static cublasStatus_t entry_build(rs_cuda_blas *bl, rs_cuda_blas_entry *e) {
    const cudaDataType_t in = e->kind == RS_CUDA_GEMM_FP8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, out = cuda_type(e->out_dt);
    cublasStatus_t st;
#define TRY(call)                                                     \
    do {                                                              \
        if ((st = (call)) != CUBLAS_STATUS_SUCCESS) return st;        \
    } while (0)
    TRY(cublasLtMatmulDescCreate(&e->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    TRY(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    TRY(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (e->kind == RS_CUDA_GEMM_FP8) {
        const int32_t am = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, bm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        const int8_t fast = 0;
        TRY(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
        TRY(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
        TRY(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
        /* the heuristic checks the scale pointers' alignment: any 16-byte aligned value will do
         * until each call sets the real ones */
        const void *probe = bl->ws;
        TRY(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &probe, sizeof probe));
        TRY(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &probe, sizeof probe));
    }
    TRY(cublasLtMatrixLayoutCreate(&e->a, in, (uint64_t)e->k, (uint64_t)e->n, e->k));
    TRY(cublasLtMatrixLayoutCreate(&e->b, in, (uint64_t)e->k, (uint64_t)e->bucket, e->k));
    TRY(cublasLtMatrixLayoutCreate(&e->d, out, (uint64_t)e->n, (uint64_t)e->bucket, e->n));
    cublasLtMatmulPreference_t pref = NULL;
    TRY(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = bl->ws_limit;
    const uint32_t al = e->align;
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; i++)
        st = cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &al, sizeof al);
    cublasLtMatmulHeuristicResult_t res[4];
    int got = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic(bl->lt, e->desc, e->a, e->b, e->d, e->d, pref, 4, res, &got);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    for (int i = 0; i < got; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > bl->ws_limit) continue;
        e->algo = res[i].algo;
        e->algo_ws = res[i].workspaceSize;
        return CUBLAS_STATUS_SUCCESS;
    }
    return CUBLAS_STATUS_NOT_SUPPORTED;
#undef TRY
}

static rs_cuda_blas_entry *entry_get(rs_cuda_blas *bl, int kind, rs_dtype out_dt, int n, int k, int bucket,
                                     unsigned align) {
    for (int i = 0; i < bl->n; i++) {
        rs_cuda_blas_entry *e = &bl->e[i];
        if (e->kind == kind && e->out_dt == out_dt && e->n == n && e->k == k && e->bucket == bucket && e->align == align)
            return e;
    }
    if (bl->n == bl->cap) {
        bl->cap = bl->cap ? 2 * bl->cap : 32;
        bl->e = (rs_cuda_blas_entry *)rs_xrealloc(bl->e, (size_t)bl->cap * sizeof *bl->e);
    }
    rs_cuda_blas_entry *e = &bl->e[bl->n++];
    memset(e, 0, sizeof *e);
    e->kind = kind, e->out_dt = out_dt, e->n = n, e->k = k, e->bucket = bucket, e->align = align;
    const cublasStatus_t st = entry_build(bl, e);
    e->ok = st == CUBLAS_STATUS_SUCCESS;
    if (!e->ok) {
        bl->refused++;
        RS_WARN("cuBLASLt: no %s GEMM for n %d, k %d, up to %d tokens, %u-byte alignment (%s): the CUDA "
                "backend's own kernels run it",
                kind_name(kind), n, k, bucket, align, cublasLtGetStatusName(st));
    }
    return e;
}

/* Shapes and pointers cuBLASLt is documented to refuse, checked before asking it. */
static const char *precheck(const rs_cuda_gemm *g) {
    if (g->out_dt != RS_DTYPE_F32 && g->out_dt != RS_DTYPE_BF16) return "output must be F32 or BF16";
    if (g->t <= 0 || g->n <= 0 || g->k <= 0) return "empty problem";
    if (g->kind == RS_CUDA_GEMM_FP8) {
        if (g->t % 4 || g->n % 4) return "FP8 block scaling needs the token and output counts to be multiples of 4";
        if (g->k % 16) return "FP8 needs K to be a multiple of 16 (16-byte leading dimensions)";
        if (((uintptr_t)g->x | (uintptr_t)g->w | (uintptr_t)g->xs | (uintptr_t)g->ws | (uintptr_t)g->out) & 15 ||
            ((size_t)g->n * rs_dtype_size(g->out_dt)) % 16)
            return "FP8 operands, scales and output rows must be 16-byte aligned";
    }
    return NULL;
}

int rs_cuda_blas_gemm(rs_cuda_ctx *c, const rs_cuda_gemm *g) {
    rs_cuda_blas *bl = c->blas;
    const char *why = precheck(g);
    if (why) {
        RS_DEBUG("cuBLASLt: %s GEMM t %d n %d k %d not offered: %s", kind_name(g->kind), g->t, g->n, g->k, why);
        return RS_EUNSUPPORTED;
    }
    const size_t in_es = g->kind == RS_CUDA_GEMM_FP8 ? 1 : 2, out_es = rs_dtype_size(g->out_dt);
    unsigned align = RS_MIN(align_of((uintptr_t)g->x), align_of((uintptr_t)g->w));
    align = RS_MIN(align, align_of((uintptr_t)g->out));
    align = RS_MIN(align, align_of((uintptr_t)g->k * in_es));
    align = RS_MIN(align, align_of((uintptr_t)g->n * out_es));
    rs_cuda_blas_entry *e = entry_get(bl, g->kind, g->out_dt, g->n, g->k, bucket_of(g->t), align);
    if (!e->ok) return RS_EUNSUPPORTED;
    const uint64_t t = (uint64_t)g->t;
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(e->b, CUBLASLT_MATRIX_LAYOUT_COLS, &t, sizeof t));
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(e->d, CUBLASLT_MATRIX_LAYOUT_COLS, &t, sizeof t));
    if (g->kind == RS_CUDA_GEMM_FP8) {
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g->ws, sizeof g->ws));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g->xs, sizeof g->xs));
    }
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t st = cublasLtMatmul(bl->lt, e->desc, &alpha, g->w, e->a, g->x, e->b, &beta, g->out, e->d,
                                             g->out, e->d, &e->algo, bl->ws, bl->ws_bytes, c->stream);
    if (st != CUBLAS_STATUS_SUCCESS) {
        e->ok = false;
        bl->refused++;
        RS_WARN("cuBLASLt: %s GEMM t %d n %d k %d failed (%s): the CUDA backend's own kernels run it from now on",
                kind_name(g->kind), g->t, g->n, g->k, cublasLtGetStatusName(st));
        return RS_EUNSUPPORTED;
    }
    bl->calls++;
    return RS_OK;
}

/* ---- C-callable hooks for tests/unit/test_cuda_blas.c ---- */

extern "C" int rs_cuda_test_blas_gemm(rs_backend *b, int kind, void *out, rs_dtype out_dt, const void *x,
                                      const float *xs, const void *w, const float *ws, int t, int n, int k) {
    rs_cuda_gemm g = {kind, out, out_dt, x, xs, w, ws, t, n, k};
    return rs_cuda_blas_gemm(rs_cuda_ctx_of(b), &g);
}

/* Offers the heuristic at most `bytes` of workspace from now on (the allocation stays); 0 restores
 * the whole workspace. Clears the cache. */
extern "C" void rs_cuda_test_blas_workspace_limit(rs_backend *b, size_t bytes) {
    rs_cuda_blas *bl = rs_cuda_ctx_of(b)->blas;
    cache_clear(bl);
    bl->ws_limit = bytes ? RS_MIN(bytes, bl->ws_bytes) : bl->ws_bytes;
}

/* GEMMs run and problems refused so far. */
extern "C" void rs_cuda_test_blas_counts(rs_backend *b, unsigned long long *calls, unsigned long long *refused) {
    const rs_cuda_blas *bl = rs_cuda_ctx_of(b)->blas;
    *calls = bl->calls;
    *refused = bl->refused;
}
