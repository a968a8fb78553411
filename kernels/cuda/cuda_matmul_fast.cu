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
 * Up to c->gemv_rows_fp8 / _bf16 rows (RS_CUDA_GEMV_ROWS_*: 2 and 8, measured) weight-streaming
 * GEMV kernels run instead, where a GEMM tile would waste most of its work: for E4M3 weights the fast
 * FP8 GEMV below (the same activation codes, fp32 block sums, dequantized in registers); for BF16
 * weights cuda_matmul.cu's dense GEMV (fp32 activations, fp32 sums).
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

/* ---- FP8 GEMV for few rows ---- */

#define FGEMV_WARPS 8 /* output features (warps) per block */
#define FGEMV_ROWS 8  /* rows per launch group (grid y) */
#define FGEMV_UNROLL 4 /* 512-code chunks whose loads a warp issues before it uses the first */

/* One warp per output feature o and group of up to FGEMV_ROWS rows: the weight row streams once per
 * group in 512-code chunks, lane l taking the 16 codes [16 (l & 7), +16) of K block 4 c + (l >> 3)
 * (one coalesced 512-byte read per chunk), decoded in registers. Per row, the lane sums its 16
 * exact fp32 products in fp32 and adds that times xs * ws to its fp32 accumulator; a warp tree
 * sums the lanes at the end. NaN codes decode to NaN (the hardware conversion), as in cuBLASLt.
 * vec: k % 16 == 0 and 16-byte aligned codes. */
__global__ void __launch_bounds__(FGEMV_WARPS * 32)
    fp8_gemv_fast_kernel(float *__restrict__ out /* [rows][n] */, const uint8_t *__restrict__ xq /* [rows][k] e4m3 */,
                         const float *__restrict__ xs /* [rows][L] */, const uint8_t *__restrict__ wq /* [n][k] e4m3 */,
                         const float *__restrict__ ws /* [ceil(n/128)][L] */, int rows, int n, int k, int L, bool vec) {
    const int lane = threadIdx.x & 31, g = lane >> 3, p = lane & 7;
    const int o = blockIdx.x * FGEMV_WARPS + threadIdx.x / 32;
    if (o >= n) return; /* whole warps only */
    const int r0 = blockIdx.y * FGEMV_ROWS, nr = min(FGEMV_ROWS, rows - r0);
    const uint8_t *wrow = wq + (int64_t)o * k;
    const float *wsrow = ws + (int64_t)(o / RS_FP8_BLOCK) * L;
    float acc[FGEMV_ROWS];
#pragma unroll
    for (int r = 0; r < FGEMV_ROWS; r++) acc[r] = 0.0f;
    for (int c0 = 0; c0 < L; c0 += 4 * FGEMV_UNROLL) {
        uint32_t w4[FGEMV_UNROLL][4]; /* the loads first: FGEMV_UNROLL 512-byte chunks in flight per warp */
#pragma unroll
        for (int u = 0; u < FGEMV_UNROLL; u++) {
            const int b = c0 + 4 * u + g;
            const int64_t j0 = (int64_t)b * RS_FP8_BLOCK + p * 16;
            if (b < L && j0 < k) rs_cuda_load_codes16(w4[u], wrow + j0, k - j0, vec);
        }
#pragma unroll
        for (int u = 0; u < FGEMV_UNROLL; u++) {
            const int b = c0 + 4 * u + g;
            const int64_t j0 = (int64_t)b * RS_FP8_BLOCK + p * 16;
            if (b >= L || j0 >= k) continue;
            float wf[16];
#pragma unroll
            for (int i = 0; i < 4; i++) rs_cuda_e4m3x4_f32(w4[u][i], wf + 4 * i);
            const float wsc = wsrow[b];
#pragma unroll
            for (int r = 0; r < FGEMV_ROWS; r++) {
                if (r >= nr) break;
                const int64_t row = r0 + r;
                uint32_t x4[4];
                rs_cuda_load_codes16(x4, xq + row * k + j0, k - j0, vec);
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float xf[4];
                    rs_cuda_e4m3x4_f32(x4[i], xf);
#pragma unroll
                    for (int e = 0; e < 4; e++) s = fmaf(xf[e], wf[4 * i + e], s);
                }
                acc[r] = fmaf(s, xs[row * L + b] * wsc, acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < FGEMV_ROWS; r++)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(RS_CUDA_FULL_MASK, acc[r], off);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < FGEMV_ROWS; r++)
            if (r < nr) out[(int64_t)(r0 + r) * n + o] = acc[r];
    }
}

static bool fast_fp8_gemv(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows, int n, int k) {
    const int L = (int)rs_fp8_blocks(k);
    const float *xs;
    const uint8_t *xq = rs_cuda_act_fp8(c, x, rows, k, &xs);
    const bool vec = k % 16 == 0 && ((uintptr_t)xq & 15) == 0 && ((uintptr_t)w->data & 15) == 0;
    const unsigned groups = rs_cuda_blocks((size_t)rows, FGEMV_ROWS);
    RS_ASSERT(groups <= 65535u);
    const dim3 grid(rs_cuda_blocks((size_t)n, FGEMV_WARPS), groups);
    fp8_gemv_fast_kernel<<<grid, FGEMV_WARPS * 32, 0, c->stream>>>(out, xq, xs, (const uint8_t *)w->data, w->scale_inv,
                                                                  rows, n, k, L, vec);
    CUDA_CHECK_LAUNCH();
    return true;
}

static bool fast_bf16(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows, int n, int k) {
    const uint16_t *xb = rs_cuda_act_bf16(c, x, rows, k);
    const rs_cuda_gemm g = {RS_CUDA_GEMM_BF16, out, RS_DTYPE_F32, xb, NULL, w->data, NULL, rows, n, k};
    return rs_cuda_blas_gemm(c, &g) == RS_OK;
}

bool rs_cuda_matmul_fast(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows) {
    const int n = (int)w->shape[0], k = (int)w->shape[1];
    if (k <= 0) return false;
    switch (w->dtype) {
    case RS_DTYPE_E4M3:
        return rows <= c->gemv_rows_fp8 ? fast_fp8_gemv(c, out, x, w, rows, n, k) : fast_fp8(c, out, x, w, rows, n, k);
    case RS_DTYPE_BF16: /* the dense GEMV is the exact kernel: false runs it */
        return rows > c->gemv_rows_bf16 && fast_bf16(c, out, x, w, rows, n, k);
    default: return false;
    }
}
