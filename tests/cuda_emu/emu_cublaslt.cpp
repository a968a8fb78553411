/* emu_cublaslt.cpp — the CPU emulation of cuBLASLt's matmul for exactly the descriptor combinations
 * rolloutd uses (kernels/cuda/cuda_blas.cu), with the library's documented semantics and refusals.
 *
 * Emulated (cuBLAS 13 docs: §3.4.17 cublasLtMatmul and its type table, §3.1.4 "Scaling Mode Support
 * Overview", §3.1.4.5.1 the scale-factor layouts; summarized in shared/reference/kernels.md §1):
 *   - D = alpha * op(A) op(B) + beta * C in column-major layouts (ORDER_COL, one matrix per batch),
 *     compute CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, host alpha/beta, no epilogue;
 *   - A, B BF16 with C = D in BF16 or F32; any transposes; no scale pointers (INVALID_VALUE, as the
 *     header says for scales set on an unsupported type combination);
 *   - A, B E4M3: TN only (TRANSA = T, TRANSB = N; sm_90), C = D in BF16, F16 or F32 (never FP8 with
 *     block scales), K such that lda and ldb are 16-byte multiples. Scale modes per operand:
 *     SCALAR_32F (a device scalar, or 1 without a pointer), VEC128_32F and BLK128x128_32F, in the
 *     combinations VEC128+VEC128, VEC128+BLK and BLK+VEC128 (BLK+BLK is NOT_SUPPORTED), which need
 *     M and N multiples of 4 and 16-byte aligned scale pointers. With L = ceil(K/128) and
 *     L4 = roundup(L, 4), operand A (op(A) is M x K): VEC128 sA[b*M + i], BLK sA[(i/128)*L4 + b];
 *     operand B (op(B) is K x N): VEC128 sB[b*N + j], BLK sB[(j/128)*L4 + b]; D = alpha *
 *     sum_b sA*sB*(sum over block b of A B). FAST_ACCUM with block scales is refused: the FP8
 *     recipe forbids it and PyTorch refuses it (ATen CUDABlas.cpp get_scale_mode).
 *   - alignment: an algo is chosen for the MIN_ALIGNMENT_*_BYTES preferences (default 256); a
 *     pointer or leading dimension less aligned than that (or than 16 bytes for FP8) is refused;
 *   - workspace: an algo may need some (the emulation's "split-K" algo for K >= 1024 does, within
 *     MAX_WORKSPACE_BYTES); cublasLtMatmul with less workspace than the algo needs returns
 *     INVALID_VALUE, as the header documents.
 * Everything else is NOT_SUPPORTED ("not emulated"), so a new descriptor use fails in CI until it
 * is emulated here. Device pointers and the byte ranges the problem reads and writes (scale tensors
 * included) are checked against the emulated device memory: reading past a scale tensor aborts.
 *
 * Arithmetic: products are exact in fp32 (E4M3 x E4M3 and BF16 x BF16), summed in fp32 in chunks of
 * 32 (a stand-in for the tensor cores' unspecified order; the "split-K" algo sums the two halves of
 * K separately first), then per K block times sA * sB into an fp32 accumulator. Tests compare this
 * against references with a tolerance, as they must compare the real library.
 * EMU_TRACE=1 prints why a call is refused. */
#include <cublasLt.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

void emu_require_device_range(const void *p, size_t n, const char *what);
void emu_stream_run(cudaStream_t s, const char *what, std::function<void()> fn);

namespace {

struct Desc {
    uint32_t magic;
    int32_t compute, scale_type, pointer_mode, transa, transb, transc, epilogue;
    const void *bias;
    const void *a_scale, *b_scale, *c_scale, *d_scale, *amax_d;
    int8_t fast_accum;
    int32_t a_mode, b_mode, c_mode, d_mode;
};
struct Layout {
    uint32_t magic;
    uint32_t type;
    int32_t order;
    uint64_t rows, cols;
    int64_t ld;
    int32_t batch;
};
struct Pref {
    uint32_t magic;
    uint32_t search;
    uint64_t max_ws;
    uint32_t align[4]; /* A, B, C, D */
};
const uint32_t DESC_MAGIC = 0x4c744d44, LAYOUT_MAGIC = 0x4c744c59, PREF_MAGIC = 0x4c745052, ALGO_MAGIC = 0x4c74414c;
static_assert(sizeof(Desc) <= sizeof(cublasLtMatmulDescOpaque_t), "desc fits");
static_assert(sizeof(Layout) <= sizeof(cublasLtMatrixLayoutOpaque_t), "layout fits");
static_assert(sizeof(Pref) <= sizeof(cublasLtMatmulPreferenceOpaque_t), "pref fits");

/* algo.data: [0] magic, [1] workspace bytes, [2] problem signature, [3] split-K (0/1), [4..7] the
 * alignments (A, B, C, D) it was chosen for */

bool trace() {
    static int t = getenv("EMU_TRACE") != NULL;
    return t;
}

cublasStatus_t refuse(cublasStatus_t st, const std::string &why) {
    if (trace()) fprintf(stderr, "emu cuBLASLt: %s: %s\n", st == CUBLAS_STATUS_NOT_SUPPORTED ? "NOT_SUPPORTED" : "INVALID_VALUE",
                         why.c_str());
    return st;
}

size_t type_size(uint32_t t) {
    switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F: case CUDA_R_16BF: return 2;
    case CUDA_R_8F_E4M3: case CUDA_R_8F_E5M2: return 1;
    default: return 0;
    }
}

bool is_block(int32_t m) {
    return m == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F || m == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}

/* The problem: op(A) is m x k, op(B) k x n, C and D m x n. */
struct Problem {
    const Desc *d;
    const Layout *a, *b, *c, *dd;
    uint64_t m, n, k;
    bool fp8;
};

cublasStatus_t check_layout(const Layout *l, const char *name) {
    if (!l || l->magic != LAYOUT_MAGIC) return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(name) + ": not a layout");
    if (l->order != CUBLASLT_ORDER_COL) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, std::string(name) + ": only ORDER_COL is emulated");
    if (l->batch != 1) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, std::string(name) + ": batched layouts are not emulated");
    if (l->ld < (int64_t)l->rows || l->ld < 1)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(name) + ": ld smaller than rows");
    if (!type_size(l->type)) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, std::string(name) + ": data type not emulated");
    return CUBLAS_STATUS_SUCCESS;
}

/* Every rule that does not depend on pointers: shared by the heuristic and the matmul. */
cublasStatus_t check_problem(const Desc *d, const Layout *A, const Layout *B, const Layout *C, const Layout *D,
                             Problem *p) {
    if (!d || d->magic != DESC_MAGIC) return refuse(CUBLAS_STATUS_INVALID_VALUE, "not a matmul descriptor");
    cublasStatus_t st;
    if ((st = check_layout(A, "A")) || (st = check_layout(B, "B")) || (st = check_layout(C, "C")) ||
        (st = check_layout(D, "D")))
        return st;
    if (d->compute != CUBLAS_COMPUTE_32F || d->scale_type != CUDA_R_32F)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "only COMPUTE_32F with scale type R_32F is emulated");
    if (d->pointer_mode != 0) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "only host alpha/beta are emulated");
    if (d->epilogue != 1 || d->bias) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "epilogues are not emulated");
    if (d->transc != CUBLAS_OP_N) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "TRANSC must be N");
    if ((d->transa != CUBLAS_OP_N && d->transa != CUBLAS_OP_T) || (d->transb != CUBLAS_OP_N && d->transb != CUBLAS_OP_T))
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "conjugate transposes are not emulated");
    const uint64_t m = d->transa == CUBLAS_OP_N ? A->rows : A->cols, k = d->transa == CUBLAS_OP_N ? A->cols : A->rows;
    const uint64_t kb = d->transb == CUBLAS_OP_N ? B->rows : B->cols, n = d->transb == CUBLAS_OP_N ? B->cols : B->rows;
    if (kb != k) return refuse(CUBLAS_STATUS_INVALID_VALUE, "op(A) and op(B) disagree on K");
    if (C->rows != m || C->cols != n || D->rows != m || D->cols != n)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, "C/D are not M x N");
    if (C->type != D->type || C->ld != D->ld)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "C and D of different types or layouts are not emulated");
    if (A->type != B->type) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "mixed A/B types are not emulated");
    if (d->c_scale || d->d_scale || d->amax_d || d->c_mode || d->d_mode)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "C/D scaling is not emulated");
    p->d = d, p->a = A, p->b = B, p->c = C, p->dd = D, p->m = m, p->n = n, p->k = k;
    p->fp8 = A->type == CUDA_R_8F_E4M3;
    if (A->type == CUDA_R_16BF) {
        if (D->type != CUDA_R_32F && D->type != CUDA_R_16BF)
            return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "BF16 A/B: only BF16 or F32 C/D are emulated");
        if (d->a_scale || d->b_scale || d->a_mode || d->b_mode)
            return refuse(CUBLAS_STATUS_INVALID_VALUE, "BF16 A/B take no scale factors");
        if (d->fast_accum) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FAST_ACCUM is an FP8 setting");
        return CUBLAS_STATUS_SUCCESS;
    }
    if (A->type != CUDA_R_8F_E4M3) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "A/B type not emulated (BF16 or E4M3 only)");
    if (d->transa != CUBLAS_OP_T || d->transb != CUBLAS_OP_N)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8 matmul needs TRANSA = T and TRANSB = N (TN) on sm_90");
    if (D->type != CUDA_R_16BF && D->type != CUDA_R_16F && D->type != CUDA_R_32F)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8 A/B: C/D must be BF16, F16 or F32 (FP8 D is not emulated)");
    if ((A->ld % 16) || (B->ld % 16)) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8: lda/ldb must be 16-byte multiples");
    const bool ba = is_block(d->a_mode), bb = is_block(d->b_mode);
    if ((d->a_mode && !ba) || (d->b_mode && !bb))
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8: scale mode not emulated (SCALAR_32F, VEC128_32F, BLK128x128_32F)");
    if (ba != bb) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8: a block scale mode on one operand needs one on the other");
    if (ba) {
        if (d->a_mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F && d->b_mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F)
            return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8: BLK128x128 on both A and B is not supported");
        if (m % 4 || n % 4) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8 block scaling: M and N must be multiples of 4");
        if (!d->a_scale || !d->b_scale) return refuse(CUBLAS_STATUS_INVALID_VALUE, "FP8 block scaling: scale pointers unset");
        if (((uintptr_t)d->a_scale | (uintptr_t)d->b_scale) & 15)
            return refuse(CUBLAS_STATUS_INVALID_VALUE, "FP8 block scaling: scale pointers must be 16-byte aligned");
        if (D->type == CUDA_R_8F_E4M3 || D->type == CUDA_R_8F_E5M2)
            return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8 D is not supported with block scaling");
        if (d->fast_accum) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FAST_ACCUM with block scaling is refused");
    }
    return CUBLAS_STATUS_SUCCESS;
}

uint64_t signature(const Problem &p) {
    uint64_t s = 1469598103934665603ull;
    const uint64_t parts[] = {p.a->type, p.dd->type, (uint64_t)p.d->transa, (uint64_t)p.d->transb,
                              (uint64_t)p.d->a_mode, (uint64_t)p.d->b_mode, (uint64_t)p.d->fast_accum};
    for (uint64_t v : parts) s = (s ^ v) * 1099511628211ull;
    return s;
}

uint32_t align_of(uintptr_t v) {
    uint32_t a = 256;
    while (a > 1 && (v % a)) a /= 2;
    return a;
}

/* ---- arithmetic ---- */

float e4m3_value(uint8_t c) { /* independent of the project's codec */
    const int e = (c >> 3) & 15, mnt = c & 7;
    if (e == 15 && mnt == 7) return NAN;
    const float v = e ? std::ldexp((float)(8 + mnt), e - 10) : std::ldexp((float)mnt, -9);
    return (c & 0x80) ? -v : v;
}
float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
uint16_t f16_round(float f) { /* RNE binary16, for F16 D */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t s = (u >> 16) & 0x8000u;
    const float a = std::fabs(f);
    if (std::isnan(f)) return (uint16_t)(s | 0x7e00u);
    if (a >= 65520.0f) return (uint16_t)(s | 0x7c00u);
    if (a < 0x1p-14f) return (uint16_t)(s | (uint32_t)std::nearbyint(a * 0x1p24f));
    int e;
    const float fr = std::frexp(a, &e); /* a = fr * 2^e, fr in [0.5, 1) */
    uint32_t mnt = (uint32_t)std::nearbyint(fr * 2048.0f); /* 11 bits with the implicit one */
    if (mnt == 2048) mnt = 1024, e++;
    return (uint16_t)(s | (uint32_t)(e + 14) << 10 | (mnt & 0x3ffu));
}

struct Operand {
    const void *p;
    uint32_t type;
    bool trans;
    int64_t ld;
    /* element (row r, col c) of op(X) */
    float at(uint64_t r, uint64_t c) const {
        const uint64_t i = trans ? c + r * (uint64_t)ld : r + c * (uint64_t)ld;
        if (type == CUDA_R_8F_E4M3) return e4m3_value(((const uint8_t *)p)[i]);
        return bf16_value(((const uint16_t *)p)[i]);
    }
};

/* The scale of op(X) row/col `o` (of `outer`) in K block b. */
float block_scale(const float *s, int32_t mode, uint64_t o, uint64_t outer, uint64_t b, uint64_t L4) {
    if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) return s[b * outer + o];
    if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F) return s[(o / 128) * L4 + b];
    return 1.0f;
}

void run(const Problem &p, float alpha, float beta, const void *A, const void *B, const void *C, void *D, bool split) {
    const Desc &d = *p.d;
    const Operand a{A, p.a->type, d.transa == CUBLAS_OP_T, p.a->ld}, b{B, p.b->type, d.transb == CUBLAS_OP_T, p.b->ld};
    const uint64_t L = (p.k + 127) / 128, L4 = (L + 3) / 4 * 4;
    const bool blocks = p.fp8 && is_block(d.a_mode);
    const uint64_t kblk = blocks ? 128 : (p.k ? p.k : 1);
    float sa = 1.0f, sb = 1.0f; /* scalar scales */
    if (p.fp8 && !blocks) {
        if (d.a_scale) sa = *(const float *)d.a_scale;
        if (d.b_scale) sb = *(const float *)d.b_scale;
    }
    const uint64_t half = split ? (p.k / 2) : p.k;
    for (uint64_t j = 0; j < p.n; j++) {
        for (uint64_t i = 0; i < p.m; i++) {
            float acc = 0.0f;
            for (uint64_t k0 = 0; k0 < p.k; k0 += kblk) {
                const uint64_t k1 = std::min(p.k, k0 + kblk);
                float part[2] = {0.0f, 0.0f}; /* "split-K": the halves of K summed apart */
                for (uint64_t c0 = k0; c0 < k1; c0 += 32) {
                    float chunk = 0.0f;
                    const uint64_t c1 = std::min(k1, c0 + 32);
                    for (uint64_t kk = c0; kk < c1; kk++) chunk += a.at(i, kk) * b.at(kk, j);
                    part[c0 >= half] += chunk;
                }
                float blk = part[0] + part[1];
                if (blocks) {
                    const uint64_t bi = k0 / 128;
                    blk *= block_scale((const float *)d.a_scale, d.a_mode, i, p.m, bi, L4) *
                           block_scale((const float *)d.b_scale, d.b_mode, j, p.n, bi, L4);
                }
                acc += blk;
            }
            float v = alpha * (acc * sa * sb);
            const uint64_t o = i + j * (uint64_t)p.dd->ld;
            if (beta != 0.0f) {
                const float cv = p.c->type == CUDA_R_32F ? ((const float *)C)[o] : bf16_value(((const uint16_t *)C)[o]);
                v += beta * cv;
            }
            if (p.dd->type == CUDA_R_32F) ((float *)D)[o] = v;
            else if (p.dd->type == CUDA_R_16BF) ((uint16_t *)D)[o] = bf16_round(v);
            else ((uint16_t *)D)[o] = f16_round(v);
        }
    }
}

/* Bytes a column-major matrix of `l` spans. */
size_t span(const Layout *l) {
    if (!l->rows || !l->cols) return 0;
    return ((l->cols - 1) * (uint64_t)l->ld + l->rows) * type_size(l->type);
}

} /* namespace */

struct emu_lt_ctx { uint32_t magic; };

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    *h = new emu_lt_ctx{0x4c744854};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    if (!h || h->magic != 0x4c744854) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->magic = 0;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
size_t cublasLtGetVersion(void) { return 130100; } /* the API emulated: CUDA 13.0's cuBLAS 13.1 */
const char *cublasLtGetStatusName(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_(other)";
    }
}
const char *cublasLtGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid value was used as an argument";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    default: return "cuBLAS error";
    }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *out, cublasComputeType_t compute, cudaDataType_t scale) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    cublasLtMatmulDescOpaque_t *o = new cublasLtMatmulDescOpaque_t;
    memset(o, 0, sizeof *o);
    Desc *d = (Desc *)o;
    d->magic = DESC_MAGIC;
    d->compute = compute, d->scale_type = scale, d->transa = d->transb = d->transc = CUBLAS_OP_N;
    d->epilogue = 1; /* CUBLASLT_EPILOGUE_DEFAULT */
    *out = o;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t o) {
    if (!o || ((Desc *)o)->magic != DESC_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
    ((Desc *)o)->magic = 0;
    delete o;
    return CUBLAS_STATUS_SUCCESS;
}

/* Copies an attribute of exactly `want` bytes, as the library checks sizeInBytes. */
static cublasStatus_t put(void *field, size_t want, const void *buf, size_t size, const char *name) {
    if (!buf || size != want)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(name) + ": sizeInBytes does not match the attribute's type");
    memcpy(field, buf, size);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t o, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
    Desc *d = (Desc *)o;
    if (!d || d->magic != DESC_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return put(&d->compute, 4, buf, size, "COMPUTE_TYPE");
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return put(&d->scale_type, 4, buf, size, "SCALE_TYPE");
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return put(&d->pointer_mode, 4, buf, size, "POINTER_MODE");
    case CUBLASLT_MATMUL_DESC_TRANSA: return put(&d->transa, 4, buf, size, "TRANSA");
    case CUBLASLT_MATMUL_DESC_TRANSB: return put(&d->transb, 4, buf, size, "TRANSB");
    case CUBLASLT_MATMUL_DESC_TRANSC: return put(&d->transc, 4, buf, size, "TRANSC");
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return put(&d->epilogue, 4, buf, size, "EPILOGUE");
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return put(&d->bias, sizeof(void *), buf, size, "BIAS_POINTER");
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER: return put(&d->a_scale, sizeof(void *), buf, size, "A_SCALE_POINTER");
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER: return put(&d->b_scale, sizeof(void *), buf, size, "B_SCALE_POINTER");
    case CUBLASLT_MATMUL_DESC_C_SCALE_POINTER: return put(&d->c_scale, sizeof(void *), buf, size, "C_SCALE_POINTER");
    case CUBLASLT_MATMUL_DESC_D_SCALE_POINTER: return put(&d->d_scale, sizeof(void *), buf, size, "D_SCALE_POINTER");
    case CUBLASLT_MATMUL_DESC_AMAX_D_POINTER: return put(&d->amax_d, sizeof(void *), buf, size, "AMAX_D_POINTER");
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM: return put(&d->fast_accum, 1, buf, size, "FAST_ACCUM");
    case CUBLASLT_MATMUL_DESC_A_SCALE_MODE: return put(&d->a_mode, 4, buf, size, "A_SCALE_MODE");
    case CUBLASLT_MATMUL_DESC_B_SCALE_MODE: return put(&d->b_mode, 4, buf, size, "B_SCALE_MODE");
    case CUBLASLT_MATMUL_DESC_C_SCALE_MODE: return put(&d->c_mode, 4, buf, size, "C_SCALE_MODE");
    case CUBLASLT_MATMUL_DESC_D_SCALE_MODE: return put(&d->d_mode, 4, buf, size, "D_SCALE_MODE");
    default: return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "descriptor attribute not emulated");
    }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *out, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    cublasLtMatrixLayoutOpaque_t *o = new cublasLtMatrixLayoutOpaque_t;
    memset(o, 0, sizeof *o);
    Layout *l = (Layout *)o;
    l->magic = LAYOUT_MAGIC, l->type = (uint32_t)type, l->order = CUBLASLT_ORDER_COL;
    l->rows = rows, l->cols = cols, l->ld = ld, l->batch = 1;
    *out = o;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t o) {
    if (!o || ((Layout *)o)->magic != LAYOUT_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
    ((Layout *)o)->magic = 0;
    delete o;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t o, cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
    Layout *l = (Layout *)o;
    if (!l || l->magic != LAYOUT_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: return put(&l->type, 4, buf, size, "LAYOUT_TYPE");
    case CUBLASLT_MATRIX_LAYOUT_ORDER: return put(&l->order, 4, buf, size, "LAYOUT_ORDER");
    case CUBLASLT_MATRIX_LAYOUT_ROWS: return put(&l->rows, 8, buf, size, "LAYOUT_ROWS");
    case CUBLASLT_MATRIX_LAYOUT_COLS: return put(&l->cols, 8, buf, size, "LAYOUT_COLS");
    case CUBLASLT_MATRIX_LAYOUT_LD: return put(&l->ld, 8, buf, size, "LAYOUT_LD");
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return put(&l->batch, 4, buf, size, "LAYOUT_BATCH_COUNT");
    default: return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "layout attribute not emulated");
    }
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *out) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    cublasLtMatmulPreferenceOpaque_t *o = new cublasLtMatmulPreferenceOpaque_t;
    memset(o, 0, sizeof *o);
    Pref *p = (Pref *)o;
    p->magic = PREF_MAGIC;
    for (int i = 0; i < 4; i++) p->align[i] = 256; /* the documented defaults */
    *out = o;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t o) {
    if (!o || ((Pref *)o)->magic != PREF_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
    ((Pref *)o)->magic = 0;
    delete o;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t o,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size) {
    Pref *p = (Pref *)o;
    if (!p || p->magic != PREF_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: return put(&p->search, 4, buf, size, "PREF_SEARCH_MODE");
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return put(&p->max_ws, 8, buf, size, "PREF_MAX_WORKSPACE_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return put(&p->align[0], 4, buf, size, "PREF_MIN_ALIGNMENT_A");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return put(&p->align[1], 4, buf, size, "PREF_MIN_ALIGNMENT_B");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return put(&p->align[2], 4, buf, size, "PREF_MIN_ALIGNMENT_C");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return put(&p->align[3], 4, buf, size, "PREF_MIN_ALIGNMENT_D");
    default: return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "preference attribute not emulated");
    }
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t A,
                                              cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                                              cublasLtMatrixLayout_t D, cublasLtMatmulPreference_t pref,
                                              int requested, cublasLtMatmulHeuristicResult_t results[], int *returned) {
    if (!h || !returned || !results) return CUBLAS_STATUS_INVALID_VALUE;
    *returned = 0;
    if (requested <= 0) return CUBLAS_STATUS_INVALID_VALUE;
    const Pref *pr = (const Pref *)pref;
    if (!pr || pr->magic != PREF_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
    Problem p;
    cublasStatus_t st = check_problem((const Desc *)desc, (const Layout *)A, (const Layout *)B, (const Layout *)C,
                                      (const Layout *)D, &p);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (p.fp8) {
        for (int i = 0; i < 4; i++)
            if (pr->align[i] < 16) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8: no algo for less than 16-byte alignment");
    }
    /* candidates: a "split-K" algo with workspace for long K, then one without */
    const uint64_t ws_split = std::min<uint64_t>(((p.m * p.n * 4 + 255) / 256) * 256, (uint64_t)8 << 20);
    int n = 0;
    for (int cand = 0; cand < 2 && n < requested; cand++) {
        const bool split = cand == 0;
        if (split && (p.k < 1024 || ws_split > pr->max_ws)) continue;
        cublasLtMatmulHeuristicResult_t &r = results[n++];
        memset(&r, 0, sizeof r);
        r.algo.data[0] = ALGO_MAGIC;
        r.algo.data[1] = split ? ws_split : 0;
        r.algo.data[2] = signature(p);
        r.algo.data[3] = split;
        for (int i = 0; i < 4; i++) r.algo.data[4 + i] = pr->align[i];
        r.workspaceSize = (size_t)r.algo.data[1];
        r.state = CUBLAS_STATUS_SUCCESS;
        r.wavesCount = 1.0f;
    }
    *returned = n;
    return n ? CUBLAS_STATUS_SUCCESS : refuse(CUBLAS_STATUS_NOT_SUPPORTED, "no algo fits the preferences");
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t Adesc, const void *B, cublasLtMatrixLayout_t Bdesc,
                              const void *beta, const void *C, cublasLtMatrixLayout_t Cdesc, void *D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
    if (!h || h->magic != 0x4c744854) return CUBLAS_STATUS_NOT_INITIALIZED;
    Problem p;
    cublasStatus_t st = check_problem((const Desc *)desc, (const Layout *)Adesc, (const Layout *)Bdesc,
                                      (const Layout *)Cdesc, (const Layout *)Ddesc, &p);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (!alpha || !beta) return refuse(CUBLAS_STATUS_INVALID_VALUE, "alpha/beta unset");
    if (!algo || algo->data[0] != ALGO_MAGIC || algo->data[2] != signature(p))
        return refuse(CUBLAS_STATUS_INVALID_VALUE, "the algo was not chosen for this kind of problem");
    if (workspace_bytes < algo->data[1])
        return refuse(CUBLAS_STATUS_INVALID_VALUE, "workspace smaller than the algo needs");
    if (workspace_bytes && (!workspace || ((uintptr_t)workspace & 255)))
        return refuse(CUBLAS_STATUS_INVALID_VALUE, "workspace unset or not 256-byte aligned");
    const void *ptrs[4] = {A, B, C, D};
    const Layout *lay[4] = {p.a, p.b, p.c, p.dd};
    for (int i = 0; i < 4; i++) {
        const uint32_t need = std::max<uint32_t>((uint32_t)algo->data[4 + i], p.fp8 && i < 2 ? 16u : 1u);
        const uint32_t have = std::min(align_of((uintptr_t)ptrs[i]), align_of((uintptr_t)(lay[i]->ld * type_size(lay[i]->type))));
        if (have < need)
            return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string("ABCD").substr(i, 1) +
                                                           ": pointer or ld less aligned than the algo was chosen for");
    }
    const float a = *(const float *)alpha, b = *(const float *)beta;
    /* what the problem reads and writes must be device memory */
    emu_require_device_range(A, span(p.a), "cublasLtMatmul A");
    emu_require_device_range(B, span(p.b), "cublasLtMatmul B");
    if (b != 0.0f) emu_require_device_range(C, span(p.c), "cublasLtMatmul C");
    emu_require_device_range(D, span(p.dd), "cublasLtMatmul D");
    if (workspace_bytes) emu_require_device_range(workspace, workspace_bytes, "cublasLtMatmul workspace");
    const Desc &d = *p.d;
    const uint64_t L = (p.k + 127) / 128, L4 = (L + 3) / 4 * 4;
    if (p.fp8 && is_block(d.a_mode)) {
        const size_t sa = d.a_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ? L * p.m : L4 * ((p.m + 127) / 128);
        const size_t sb = d.b_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ? L * p.n : L4 * ((p.n + 127) / 128);
        emu_require_device_range(d.a_scale, sa * 4, "cublasLtMatmul A scales");
        emu_require_device_range(d.b_scale, sb * 4, "cublasLtMatmul B scales");
    } else if (p.fp8) {
        if (d.a_scale) emu_require_device_range(d.a_scale, 4, "cublasLtMatmul A scale");
        if (d.b_scale) emu_require_device_range(d.b_scale, 4, "cublasLtMatmul B scale");
    }
    /* the descriptors as they are now: the library reads them at the call, so a later change (or a
     * destroy) must not reach a queued or graph-captured matmul */
    const Problem q = p;
    const Desc dcopy = d;
    const Layout lc[4] = {*p.a, *p.b, *p.c, *p.dd};
    const bool split = algo->data[3] != 0;
    emu_stream_run(stream, "cublasLtMatmul", [q, dcopy, lc, a, b, A, B, C, D, split]() {
        Problem r = q;
        r.d = &dcopy, r.a = &lc[0], r.b = &lc[1], r.c = &lc[2], r.dd = &lc[3];
        run(r, a, b, A, B, C, D, split);
    });
    return CUBLAS_STATUS_SUCCESS;
}

} /* extern "C" */
