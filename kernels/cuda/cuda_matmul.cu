/*
 * cuda_matmul.cu — out[rows][N] = x[rows][K] @ w[N][K]^T (+ bias) on the GPU: the op, and its exact
 * kernels (CUDA cores), bit-identical to the CPU twin kernels/cpu/cpu_matmul.c. In fast numerics the
 * op first offers the problem to cuda_matmul_fast.cu (cuBLASLt tensor cores); what that does not
 * take runs here.
 *
 * E4M3 weights (W8A8, docs/design.md "Numerics"): bit-identical to rs_fp8_quantize_act +
 * rs_fp8_gemm_ref + the fp32 bias add, i.e. to the CPU backend.
 *   quantize  per row and 128-group: amax = fmaxf over |x| (NaN ignored, order-free), s =
 *             max(amax, 1e-10) / 448 and q = e4m3(x / s), both correctly rounded divisions; the
 *             encoder is cuda_fp8.h's satfinite conversion, which the CPU codec matches on all
 *             2^32 floats, with NaN mapped to 0x7F explicitly (the CPU's code for every NaN).
 *   GEMM      per output and K block, the exact sum of code products in double (exact in any
 *             order and grouping: kernels/cpu/fp8_gemm.c proves it), so lanes may split a block
 *             and reduce it in a tree; then one rounding to fp32 and acc = fmaf(block, xs * ws,
 *             acc) over the blocks IN ORDER, one unsplit sequential chain per output. NaN block
 *             sums and NaN outputs are the canonical 0x7FC00000 (glibc's NAN), as on the CPU.
 * BF16 / F16 / F32 weights: fp32 products of x and the exactly widened weight, summed in fp32 in an
 *   order of our own (lane-strided, then a warp tree; the same for every row): tests use a tolerance.
 *
 * Kernels: E4M3 weights for rows <= 8 (decode) go through a GEMV with one warp per output feature
 * that reads the weight row once, coalesced, for every row of the batch (the step is bound by weight
 * bandwidth); above that a 32-row x 64-output tile per 128-thread block staged through shared
 * memory, each thread owning 4 x 4 (row, output) pairs; both give the reference's bits, so a token's
 * result never depends on its batch. Dense weights always take the GEMV, over groups of 8 rows, so
 * that their fp32 sums too are the same whatever the batch (dense_matmul says why). Everything runs
 * on the context's stream; the only memory used besides the operands is the activation scratch of
 * the FP8 path.
 */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "cuda_act.h"

#define FULL_MASK RS_CUDA_FULL_MASK
#define BLK RS_FP8_BLOCK      /* K block of the FP8 recipe, and the weight-scale row height */
#define GEMV_MAX_ROWS 8       /* up to this many rows: the GEMV kernels (template on the row count) */
#define GEMV_WARPS 8          /* output features (warps) per GEMV block */
#define GEMV_UNROLL 4         /* weight loads a lane issues before it uses the first (the dense GEMV) */
#define TILE_M 32             /* tiled kernels: rows per block */
#define TILE_N 64             /* tiled kernels: outputs per block */
#define TILE_K 32             /* tiled kernels: K elements per shared-memory stage */
#define TILE_THREADS 128      /* 16 x 8 threads, each 4 rows (ty + 8i) x 4 outputs (tx + 16j) */

static_assert(BLK % TILE_K == 0, "a shared-memory stage never straddles two FP8 K blocks");
static_assert(TILE_THREADS == (TILE_M / 4) * (TILE_N / 4), "4 x 4 pairs per thread");

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

__device__ __forceinline__ float canonical_nan(float v) { return isnan(v) ? __int_as_float(0x7fc00000) : v; }

/* ---- E4M3 codec ---- */

/* The exact value of code c & 0xff as a double. The code's 7 magnitude bits placed at the top of a
 * double's exponent/mantissa (exponent field E, mantissa m << 49) read as 2^(E-1023) * (1 + m/8),
 * or as the double subnormal (m/8) * 2^-1022 when E = 0, which is E4M3's own subnormal rule; one
 * exact multiply by 2^1016 rebiases both to (8 + m) * 2^(E-10) and m * 2^-9. Checked against
 * rs_fp8_e4m3_f32 for all 256 codes (signed zeros included); NaN codes give a NaN. */
__device__ __forceinline__ double e4m3_f64(uint32_t c) {
    if ((c & 0x7fu) == 0x7fu) return __longlong_as_double(0x7ff8000000000000ll);
    const uint32_t hi = ((c & 0x80u) << 24) | ((c & 0x7fu) << 17);
    return __dmul_rn(__hiloint2double((int)hi, 0), 0x1p1016);
}

/* ---- activation quantization ---- */

/* One warp per (row r, group g) item, 8 per block; lane l holds elements l + 32i of the group. */
__global__ void __launch_bounds__(256)
    fp8_quantize_act_kernel(const float *__restrict__ x /* [rows][k] f32 */, int64_t k, int64_t ng,
                            int64_t items /* rows * ng */, uint8_t *__restrict__ q /* [rows][k] e4m3 */,
                            float *__restrict__ scale /* [rows][ng] f32 */) {
    rs_cuda_pdl_trigger(); /* the GEMV of these codes may start loading its weights (cuda_internal.h) */
    const int lane = threadIdx.x & 31;
    const int64_t item = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
    if (item >= items) return; /* whole warps only */
    const int64_t r = item / ng, g = item % ng, j0 = g * BLK;
    const int len = (int)min((int64_t)BLK, k - j0);
    const float *xr = x + r * k + j0;
    float v[BLK / 32];
#pragma unroll
    for (int i = 0; i < BLK / 32; i++) {
        const int j = lane + 32 * i;
        v[i] = j < len ? xr[j] : 0.0f;
    }
    rs_cuda_group_fp8(v, lane, len, q + r * k + j0, &scale[r * ng + g]);
}

void rs_cuda_fp8_quantize_act(rs_cuda_ctx *c, const float *x, int rows, int k, uint8_t *q, float *scale) {
    if (rows <= 0 || k <= 0) return;
    const int64_t ng = rs_fp8_blocks(k), items = (int64_t)rows * ng;
    fp8_quantize_act_kernel<<<rs_cuda_blocks((size_t)items * 32, 256), 256, 0, c->stream>>>(x, k, ng, items, q,
                                                                                             scale);
    CUDA_CHECK_LAUNCH();
}

/* ---- FP8 GEMM: GEMV for few rows ---- */

/* One warp per output feature o, GEMV_WARPS per block. The warp walks K in chunks of 4 blocks (512
 * codes): lane l takes the 16 codes [16 (l & 7), +16) of block 4c + (l >> 3), so a chunk of the
 * weight row is one coalesced 512-byte read. Each lane sums its 16 products exactly in double for
 * every row; xor-shuffles over the 8 lanes of a block complete the exact block sums; then every
 * lane runs the same fmaf chain over the chunk's blocks in order, from the block sums and scales
 * that the block's first lane broadcasts, and lane 0 stores. vec: k % 16 == 0, wq and xq aligned. */
template <int R>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    fp8_gemv_kernel(float *__restrict__ out /* [R][n] f32 */, const uint8_t *__restrict__ xq /* [R][k] e4m3 */,
                    const float *__restrict__ xs /* [R][kb] f32 */, const uint8_t *__restrict__ wq /* [n][k] e4m3 */,
                    const float *__restrict__ ws /* [ceil(n/128)][kb] f32 */, int n, int k, int kb, bool vec) {
    const int lane = threadIdx.x & 31, g = lane >> 3, p = lane & 7;
    const int o = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    if (o >= n) return; /* whole warps only */
    const uint8_t *wrow = wq + (int64_t)o * k;
    const float *wsrow = ws + (int64_t)(o / BLK) * kb;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;

    for (int b0 = 0; b0 < kb; b0 += 4) {
        const int b = b0 + g;                          /* this lane's block */
        const int64_t j0 = (int64_t)b * BLK + p * 16;  /* its first code */
        double s[R];
#pragma unroll
        for (int r = 0; r < R; r++) s[r] = 0.0;
        if (b < kb && j0 < k) {
            uint32_t w4[4];
            rs_cuda_load_codes16(w4, wrow + j0, k - j0, vec);
            double wv[16];
#pragma unroll
            for (int i = 0; i < 16; i++) wv[i] = e4m3_f64(w4[i / 4] >> (8 * (i % 4)));
#pragma unroll
            for (int r = 0; r < R; r++) {
                uint32_t x4[4];
                rs_cuda_load_codes16(x4, xq + (int64_t)r * k + j0, k - j0, vec);
#pragma unroll
                for (int i = 0; i < 16; i++) s[r] = __fma_rn(e4m3_f64(x4[i / 4] >> (8 * (i % 4))), wv[i], s[r]);
            }
        }
        float bf[R], sc[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int off = 1; off < 8; off <<= 1) s[r] = __dadd_rn(s[r], __shfl_xor_sync(FULL_MASK, s[r], off));
            bf[r] = canonical_nan(__double2float_rn(s[r]));
            sc[r] = (p == 0 && b < kb) ? __fmul_rn(xs[(int64_t)r * kb + b], wsrow[b]) : 0.0f;
        }
#pragma unroll
        for (int gg = 0; gg < 4; gg++) {
            if (b0 + gg >= kb) break; /* the same for every lane */
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[r] = __fmaf_rn(__shfl_sync(FULL_MASK, bf[r], 8 * gg), __shfl_sync(FULL_MASK, sc[r], 8 * gg),
                                   acc[r]);
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) out[(int64_t)r * n + o] = canonical_nan(acc[r]);
    }
}

/* ---- FP8 GEMM: tiled for many rows ---- */

/* A TILE_M x TILE_N tile of out per block. Each K block is staged TILE_K codes at a time, decoded
 * to double in shared memory (rows padded to TILE_K + 1 doubles: the 16 outputs a half-warp reads
 * fall in distinct banks); thread (tx, ty) keeps the exact double block sums of rows r0 + ty + 8i
 * and outputs o0 + tx + 16j, and at the end of each block folds them into its fmaf chains. Codes
 * past k, rows and n are staged as +0. */
__global__ void __launch_bounds__(TILE_THREADS)
    fp8_gemm_tiled_kernel(float *__restrict__ out /* [rows][n] f32 */, const uint8_t *__restrict__ xq /* [rows][k] e4m3 */,
                          const float *__restrict__ xs /* [rows][kb] f32 */, const uint8_t *__restrict__ wq /* [n][k] e4m3 */,
                          const float *__restrict__ ws /* [ceil(n/128)][kb] f32 */, int rows, int n, int k, int kb) {
    __shared__ double xd[TILE_M][TILE_K + 1];
    __shared__ double wd[TILE_N][TILE_K + 1];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int o0 = blockIdx.x * TILE_N, r0 = blockIdx.y * TILE_M;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;

    for (int b = 0; b < kb; b++) {
        const int jend = min((b + 1) * BLK, k);
        double s[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) s[i][j] = 0.0;
        for (int js = b * BLK; js < jend; js += TILE_K) {
            __syncthreads(); /* the previous stage has been read */
            for (int e = tid; e < TILE_M * TILE_K; e += TILE_THREADS) {
                const int rr = e / TILE_K, kk = e % TILE_K, r = r0 + rr, j = js + kk;
                xd[rr][kk] = (r < rows && j < jend) ? e4m3_f64(xq[(int64_t)r * k + j]) : 0.0;
            }
            for (int e = tid; e < TILE_N * TILE_K; e += TILE_THREADS) {
                const int oo = e / TILE_K, kk = e % TILE_K, o = o0 + oo, j = js + kk;
                wd[oo][kk] = (o < n && j < jend) ? e4m3_f64(wq[(int64_t)o * k + j]) : 0.0;
            }
            __syncthreads();
#pragma unroll 4
            for (int kk = 0; kk < TILE_K; kk++) {
                double xv[4], wv[4];
#pragma unroll
                for (int i = 0; i < 4; i++) xv[i] = xd[ty + 8 * i][kk];
#pragma unroll
                for (int j = 0; j < 4; j++) wv[j] = wd[tx + 16 * j][kk];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) s[i][j] = __fma_rn(xv[i], wv[j], s[i][j]);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + ty + 8 * i;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int o = o0 + tx + 16 * j;
                if (r < rows && o < n) {
                    const float sc = __fmul_rn(xs[(int64_t)r * kb + b], ws[(int64_t)(o / BLK) * kb + b]);
                    acc[i][j] = __fmaf_rn(canonical_nan(__double2float_rn(s[i][j])), sc, acc[i][j]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = r0 + ty + 8 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int o = o0 + tx + 16 * j;
            if (r < rows && o < n) out[(int64_t)r * n + o] = canonical_nan(acc[i][j]);
        }
    }
}

#define ROWS_SWITCH(rows, LAUNCH)                                                                      \
    switch (rows) {                                                                                    \
    case 1: LAUNCH(1); break;                                                                          \
    case 2: LAUNCH(2); break;                                                                          \
    case 3: LAUNCH(3); break;                                                                          \
    case 4: LAUNCH(4); break;                                                                          \
    case 5: LAUNCH(5); break;                                                                          \
    case 6: LAUNCH(6); break;                                                                          \
    case 7: LAUNCH(7); break;                                                                          \
    default: LAUNCH(8); break;                                                                         \
    }

void rs_cuda_fp8_gemm(rs_cuda_ctx *c, float *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                      const float *ws, int rows, int n, int k) {
    if (rows <= 0 || n <= 0) return;
    RS_ASSERT(k >= 0);
    const int kb = (int)rs_fp8_blocks(k);
    if (rows <= GEMV_MAX_ROWS) {
        const bool vec = k % 16 == 0 && aligned16(xq) && aligned16(wq);
        const unsigned grid = rs_cuda_blocks((size_t)n, GEMV_WARPS);
#define FP8_GEMV(R) fp8_gemv_kernel<R><<<grid, GEMV_WARPS * 32, 0, c->stream>>>(out, xq, xs, wq, ws, n, k, kb, vec)
        ROWS_SWITCH(rows, FP8_GEMV)
#undef FP8_GEMV
    } else {
        RS_ASSERT(rs_cuda_blocks((size_t)rows, TILE_M) <= 65535u);
        const dim3 grid(rs_cuda_blocks((size_t)n, TILE_N), rs_cuda_blocks((size_t)rows, TILE_M));
        fp8_gemm_tiled_kernel<<<grid, TILE_THREADS, 0, c->stream>>>(out, xq, xs, wq, ws, rows, n, k, kb);
    }
    CUDA_CHECK_LAUNCH();
}

/* out[r][i] += bias[i] in fp32, after the FP8 GEMM (the CPU's add_bias); a NaN sum is stored as the
 * canonical NaN, which is what the CPU's add gives for a canonical NaN output. */
__global__ void add_bias_kernel(float *out /* [rows][n] f32 */, const void *bias /* [n] */, rs_dtype bdt,
                                int64_t n, int64_t total /* rows * n */) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = canonical_nan(__fadd_rn(out[i], rs_cuda_elem(bias, bdt, (size_t)(i % n))));
}

static void add_bias(rs_cuda_ctx *c, float *out, const void *bias, rs_dtype bdt, int rows, int n) {
    const size_t total = (size_t)rows * (size_t)n;
    add_bias_kernel<<<rs_cuda_blocks(total, 256), 256, 0, c->stream>>>(out, bias, bdt, n, (int64_t)total);
    CUDA_CHECK_LAUNCH();
}

/* ---- BF16 / F16 / F32 weights ---- */

/* Weight element i of a row as fp32 (exact), DT a compile-time dtype. */
template <int DT>
__device__ __forceinline__ float welem(const void *w, int64_t i) {
    return rs_cuda_elem(w, (rs_dtype)DT, (size_t)i);
}

/* The 16 bytes u as fp32 weights: 8 BF16 / F16 (little-endian halves) or 4 F32. */
template <int DT>
__device__ __forceinline__ void unpack16(float *f, uint4 u) {
    const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (DT == RS_DTYPE_F32) {
            f[i] = __uint_as_float(wd[i]);
        } else if (DT == RS_DTYPE_BF16) {
            f[2 * i] = __uint_as_float(wd[i] << 16);
            f[2 * i + 1] = __uint_as_float(wd[i] & 0xffff0000u);
        } else {
            f[2 * i] = __half2float(__ushort_as_half((unsigned short)(wd[i] & 0xffffu)));
            f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(wd[i] >> 16)));
        }
    }
}

/* One warp per output feature o and group of up to R rows (blockIdx.y). vec (k * size % 16 == 0, w
 * and x 16-byte aligned): lane l reads the 16-byte pieces l, l + 32, ... of the weight row (VE
 * elements each; GEMV_UNROLL pieces loaded ahead, so a warp keeps that many 512-byte reads in
 * flight: a decode step is bound by how much of the weights is in flight) and the matching float4s
 * of every x row; otherwise elements l, l + 32, .... Per-lane
 * fp32 sums, a warp tree, + bias. Every output element is the same sequence of operations whatever
 * the number of rows in the call and the row's place among them: the result of a token does not
 * depend on its batch (the CPU backend has the same property, and the tests that teacher-force a
 * generated sequence rely on it), which is why there is no separate tiled kernel for long batches. */
template <int DT, int R>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    dense_gemv_kernel(float *__restrict__ out /* [rows][n] f32 */, const float *__restrict__ x /* [rows][k] f32 */,
                      const void *__restrict__ w /* [n][k] DT */, const void *__restrict__ bias /* [n] or NULL */,
                      rs_dtype bdt, int rows, int n, int k, bool vec) {
    constexpr int VE = DT == RS_DTYPE_F32 ? 4 : 8; /* elements per 16 bytes */
    constexpr int ES = 16 / VE;                    /* bytes per element */
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    if (o >= n) return; /* whole warps only */
    const int64_t r0 = (int64_t)blockIdx.y * R;
    const int nr = (int)min((int64_t)R, rows - r0); /* rows of this group */
    x += r0 * k;
    out += r0 * n;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; r++) s[r] = 0.0f;
    if (vec) {
        const uint4 *wrow = (const uint4 *)((const char *)w + (int64_t)o * k * ES);
        constexpr int64_t STEP = 32 * VE;
        for (int64_t j0 = (int64_t)lane * VE; j0 < k; j0 += GEMV_UNROLL * STEP) {
            uint4 wv[GEMV_UNROLL]; /* the loads first: GEMV_UNROLL of them in flight per lane */
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++)
                if (j0 + u * STEP < k) wv[u] = __ldg(wrow + (j0 + u * STEP) / VE);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                const int64_t j = j0 + u * STEP;
                if (j >= k) break;
                float wf[VE];
                unpack16<DT>(wf, wv[u]);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (r >= nr) break;
                    const float4 *xr = (const float4 *)(x + (int64_t)r * k + j);
#pragma unroll
                    for (int q = 0; q < VE / 4; q++) {
                        const float4 xv = __ldg(xr + q);
                        s[r] = __fmaf_rn(xv.x, wf[4 * q], s[r]);
                        s[r] = __fmaf_rn(xv.y, wf[4 * q + 1], s[r]);
                        s[r] = __fmaf_rn(xv.z, wf[4 * q + 2], s[r]);
                        s[r] = __fmaf_rn(xv.w, wf[4 * q + 3], s[r]);
                    }
                }
            }
        }
    } else {
        for (int64_t j = lane; j < k; j += 32) {
            const float wf = welem<DT>(w, (int64_t)o * k + j);
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= nr) break;
                s[r] = __fmaf_rn(x[(int64_t)r * k + j], wf, s[r]);
            }
        }
    }
    /* rows past nr hold nothing to reduce (nr is the same for the whole block) */
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= nr) break;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s[r] = __fadd_rn(s[r], __shfl_xor_sync(FULL_MASK, s[r], off));
    }
    if (lane == 0) {
        const float bv = bias ? rs_cuda_elem(bias, bdt, (size_t)o) : 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++)
            if (r < nr) out[(int64_t)r * n + o] = bias ? __fadd_rn(s[r], bv) : s[r];
    }
}

/* Rows go in groups of GEMV_MAX_ROWS (grid y): each weight row is read once per group. Long
 * prefills therefore re-read the weights rows / 8 times; a batch-invariant tensor-core path is the
 * way to make them fast, not a differently ordered tile. */
template <int DT>
static void dense_matmul(rs_cuda_ctx *c, float *out, const float *x, const void *w, const void *bias, rs_dtype bdt,
                         int rows, int n, int k) {
    const int es = DT == RS_DTYPE_F32 ? 4 : 2;
    const bool vec = ((int64_t)k * es) % 16 == 0 && aligned16(w) && aligned16(x);
    const unsigned groups = rs_cuda_blocks((size_t)rows, GEMV_MAX_ROWS);
    RS_ASSERT(groups <= 65535u);
    const dim3 grid(rs_cuda_blocks((size_t)n, GEMV_WARPS), groups);
    dense_gemv_kernel<DT, GEMV_MAX_ROWS><<<grid, GEMV_WARPS * 32, 0, c->stream>>>(out, x, w, bias, bdt, rows, n, k, vec);
    CUDA_CHECK_LAUNCH();
}

/* ---- the op ---- */

static void check_weight(const rs_tensor *w) {
    RS_ASSERT(w->ndim == 2 && w->data);
    if (w->dtype == RS_DTYPE_E4M3) {
        if (!w->scale_inv) RS_ERROR("cuda backend | matmul: e4m3 weight without scale_inv");
        RS_ASSERT(w->scale_inv);
    } else if (w->dtype != RS_DTYPE_BF16 && w->dtype != RS_DTYPE_F16 && w->dtype != RS_DTYPE_F32) {
        RS_ERROR("cuda backend | matmul: weight dtype %s not supported", rs_dtype_name(w->dtype));
        RS_ASSERT(!"supported matmul weight dtype");
    }
    RS_ASSERT(w->shape[0] >= 0 && w->shape[0] <= INT32_MAX && w->shape[1] >= 0 && w->shape[1] <= INT32_MAX);
}

/* The bias's data and dtype (checked for n outputs), or NULL without one. */
static const void *bias_of(const rs_tensor *bias, int n, rs_dtype *dt) {
    *dt = RS_DTYPE_F32;
    if (!rs_tensor_present(bias)) return NULL;
    RS_ASSERT(bias->data && rs_tensor_numel(bias) >= n);
    RS_ASSERT(bias->dtype == RS_DTYPE_BF16 || bias->dtype == RS_DTYPE_F16 || bias->dtype == RS_DTYPE_F32);
    *dt = bias->dtype;
    return bias->data;
}

void rs_cuda_op_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias,
                       int rows) {
    rs_cuda_ctx *c = rs_cuda_ctx_keep(b); /* a matmul reads the cached forms of x (cuda_act.cu) */
    rs_cuda_matmul(c, out, x, w, bias, rows, c->numerics);
}

void rs_cuda_matmul(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias, int rows,
                    rs_numerics numerics) {
    check_weight(w);
    RS_ASSERT((const float *)out != x);
    const int n = (int)w->shape[0], k = (int)w->shape[1];
    if (c->act.x != x) c->act.x = NULL;  /* another activation's forms: out may overwrite it */
    if (rows <= 0 || n <= 0) return;
    rs_dtype bdt;
    const void *bp = bias_of(bias, n, &bdt);
    if (numerics == RS_NUMERICS_FAST && rs_cuda_matmul_fast(c, out, x, w, rows)) {
        if (bp) add_bias(c, out, bp, bdt, rows, n);
        return;
    }
    switch (w->dtype) {
    case RS_DTYPE_E4M3: {
        const size_t kb = (size_t)rs_fp8_blocks(k);
        uint8_t *xq = (uint8_t *)rs_cuda_scratch(c, RS_CUDA_S_ACT_CODES, (size_t)rows * (size_t)k + 16);
        float *xs = (float *)rs_cuda_scratch(c, RS_CUDA_S_ACT_SCALES, ((size_t)rows * kb + 1) * sizeof(float));
        rs_cuda_fp8_quantize_act(c, x, rows, k, xq, xs);
        rs_cuda_fp8_gemm(c, out, xq, xs, (const uint8_t *)w->data, w->scale_inv, rows, n, k);
        if (bp) add_bias(c, out, bp, bdt, rows, n);
        break;
    }
    case RS_DTYPE_BF16: dense_matmul<RS_DTYPE_BF16>(c, out, x, w->data, bp, bdt, rows, n, k); break;
    case RS_DTYPE_F16: dense_matmul<RS_DTYPE_F16>(c, out, x, w->data, bp, bdt, rows, n, k); break;
    default: dense_matmul<RS_DTYPE_F32>(c, out, x, w->data, bp, bdt, rows, n, k); break;
    }
}

void rs_cuda_op_matmul_group(rs_backend *b, float *const *outs, const float *x, const rs_tensor *const *ws,
                             const rs_tensor *const *biases, int count, int rows) {
    rs_cuda_ctx *c = rs_cuda_ctx_keep(b);
    for (int i = 0; i < count; i++) {
        check_weight(ws[i]);
        RS_ASSERT((const float *)outs[i] != x);
    }
    if (c->act.x != x) c->act.x = NULL; /* as rs_cuda_matmul */
    if (rows > 0 && c->numerics == RS_NUMERICS_FAST && rs_cuda_matmul_group_fast(c, outs, x, ws, count, rows)) {
        for (int i = 0; i < count; i++) {
            rs_dtype bdt;
            const void *bp = bias_of(biases ? biases[i] : NULL, (int)ws[i]->shape[0], &bdt);
            if (bp) add_bias(c, outs[i], bp, bdt, rows, (int)ws[i]->shape[0]);
        }
        return;
    }
    for (int i = 0; i < count; i++) rs_cuda_matmul(c, outs[i], x, ws[i], biases ? biases[i] : NULL, rows, c->numerics);
}

/* ---- C-callable hooks for tests/unit/test_cuda_matmul.c (device pointers, the backend's stream) ---- */

extern "C" void rs_cuda_test_fp8_quantize_act(rs_backend *b, const float *x_dev, int rows, int k, uint8_t *q_dev,
                                              float *s_dev) {
    rs_cuda_fp8_quantize_act(rs_cuda_ctx_of(b), x_dev, rows, k, q_dev, s_dev);
}

extern "C" void rs_cuda_test_fp8_gemm(rs_backend *b, float *out_dev, const uint8_t *xq_dev, const float *xs_dev,
                                      const uint8_t *wq_dev, const float *ws_dev, int rows, int n, int k) {
    rs_cuda_fp8_gemm(rs_cuda_ctx_of(b), out_dev, xq_dev, xs_dev, wq_dev, ws_dev, rows, n, k);
}
