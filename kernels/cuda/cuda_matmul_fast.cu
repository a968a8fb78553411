/*
 * cuda_matmul_fast.cu — the matmul of the fast numerics (kernels/backend.h RS_NUMERICS_FAST): the
 * tensor-core GEMMs of cuda_blas.cu for all but the smallest batches.
 *
 *   E4M3 weights  the activation's E4M3 codes and 1x128 scales (cuda_act.cu: the recipe's
 *                 quantizer, the same codes as the exact path) into cuBLASLt's block-scaled FP8
 *                 GEMM, fp32 output. The GEMM wants t_pad = roundup(rows, 4) tokens, so with a
 *                 ragged row count the codes are copied into a t_pad-row buffer with zero rows
 *                 after them and the output comes back through a t_pad-row buffer; the scales are
 *                 rearranged into its token-contiguous layout [ceil(k/128)][t_pad] (zeros for the
 *                 padding) and the weight's scale rows padded to a multiple of 4 blocks when
 *                 ceil(k/128) is not one (never for real checkpoints' K).
 *   BF16 weights  the activation's BF16 form into cuBLASLt's BF16 GEMM, fp32 output.
 *   F16 / F32     no fast path: the exact kernels.
 * Up to c->gemv_rows rows (decode) the weight-streaming GEMV kernels run instead (cuda_matmul.cu;
 * the step is bound by weight bandwidth there, where a GEMM tile would waste most of its work).
 * Where cuBLASLt refuses a problem (cuda_blas.cu logs it once), rs_cuda_matmul_fast returns false
 * and the caller runs the exact kernels, whose results the fast ones approximate.
 */
#include "cuda_act.h"

/* dst [t_pad][k]: src's rows, then zero rows. */
static void pad_codes(rs_cuda_ctx *c, uint8_t *dst, const uint8_t *src, int rows, int t_pad, int k) {
    const size_t have = (size_t)rows * (size_t)k;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, have, cudaMemcpyDeviceToDevice, c->stream));
    CUDA_CHECK(cudaMemsetAsync(dst + have, 0, (size_t)(t_pad - rows) * (size_t)k, c->stream));
}

/* xst[b][t] = xs[t][b] for t < rows, 0 for rows <= t < t_pad (their codes are zero). */
__global__ void vec128_scales_kernel(float *__restrict__ xst /* [L][t_pad] */, const float *__restrict__ xs /* [rows][L] */,
                                     int rows, int t_pad, int L) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)L * t_pad) return;
    const int b = (int)(i / t_pad), t = (int)(i % t_pad);
    xst[i] = t < rows ? xs[(int64_t)t * L + b] : 0.0f;
}

/* wsl4[p][b] = ws[p][b] for b < L, 0 up to L4: the weight scales with cuBLASLt's column stride. */
__global__ void blk128_scales_kernel(float *__restrict__ wsl4 /* [nb][L4] */, const float *__restrict__ ws /* [nb][L] */,
                                     int nb, int L, int L4) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)nb * L4) return;
    const int p = (int)(i / L4), b = (int)(i % L4);
    wsl4[i] = b < L ? ws[(int64_t)p * L + b] : 0.0f;
}

static bool fast_fp8(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows, int n, int k) {
    if (n % 4 || k % 16) return false; /* cuBLASLt's rules (cuda_blas.cu); the exact kernels take it */
    const int t_pad = (rows + 3) / 4 * 4, L = (int)rs_fp8_blocks(k), L4 = (L + 3) / 4 * 4, nb = (int)rs_fp8_blocks(n);
    const float *xs_rows;
    const uint8_t *xq = rs_cuda_act_fp8(c, x, rows, k, &xs_rows);
    if (t_pad != rows) {
        uint8_t *padded = (uint8_t *)rs_cuda_scratch(c, RS_CUDA_S_GEMM_CODES, (size_t)t_pad * (size_t)k);
        pad_codes(c, padded, xq, rows, t_pad, k);
        xq = padded;
    }
    float *xst = (float *)rs_cuda_scratch(c, RS_CUDA_S_GEMM_XSCALES, (size_t)L * (size_t)t_pad * sizeof(float));
    vec128_scales_kernel<<<rs_cuda_blocks((size_t)L * (size_t)t_pad, 256), 256, 0, c->stream>>>(xst, xs_rows, rows,
                                                                                                t_pad, L);
    CUDA_CHECK_LAUNCH();
    const float *ws = w->scale_inv;
    if (L4 != L) {
        float *wsl4 = (float *)rs_cuda_scratch(c, RS_CUDA_S_GEMM_WSCALES, (size_t)nb * (size_t)L4 * sizeof(float));
        blk128_scales_kernel<<<rs_cuda_blocks((size_t)nb * (size_t)L4, 256), 256, 0, c->stream>>>(wsl4, ws, nb, L, L4);
        CUDA_CHECK_LAUNCH();
        ws = wsl4;
    }
    float *d = t_pad == rows ? out : (float *)rs_cuda_scratch(c, RS_CUDA_S_GEMM_OUT, (size_t)t_pad * (size_t)n * sizeof(float));
    const rs_cuda_gemm g = {RS_CUDA_GEMM_FP8, d, RS_DTYPE_F32, xq, xst, w->data, ws, t_pad, n, k};
    if (rs_cuda_blas_gemm(c, &g) != RS_OK) return false;
    if (d != out)
        CUDA_CHECK(cudaMemcpyAsync(out, d, (size_t)rows * (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice, c->stream));
    return true;
}

static bool fast_bf16(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows, int n, int k) {
    const uint16_t *xb = rs_cuda_act_bf16(c, x, rows, k);
    const rs_cuda_gemm g = {RS_CUDA_GEMM_BF16, out, RS_DTYPE_F32, xb, NULL, w->data, NULL, rows, n, k};
    return rs_cuda_blas_gemm(c, &g) == RS_OK;
}

bool rs_cuda_matmul_fast(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows) {
    const int n = (int)w->shape[0], k = (int)w->shape[1];
    if (rows <= c->gemv_rows || k <= 0) return false;
    switch (w->dtype) {
    case RS_DTYPE_E4M3: return fast_fp8(c, out, x, w, rows, n, k);
    case RS_DTYPE_BF16: return fast_bf16(c, out, x, w, rows, n, k);
    default: return false;
    }
}
