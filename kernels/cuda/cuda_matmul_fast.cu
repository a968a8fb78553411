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
 * Up to c->gemv_rows_fp8 / _bf16 rows (RS_CUDA_GEMV_ROWS_*: 8, one mma n-tile) weight-streaming
 * tensor-core GEMVs run instead, where a GEMM tile would waste most of its work: the weight tile of
 * 16 output features is the mma's A and up to 8 activation rows its B, so the weights stream once
 * with 16-byte loads and the tensor cores leave the kernel memory-bound. E4M3 weights take
 * mma m16n8k32 e4m3 on the same activation codes, one 128-wide K block per accumulator promoted to
 * fp32 with the block scales (cuBLASLt's recipe); BF16 weights take mma m16n8k16 bf16 on the
 * activation's BF16 form with fp32 accumulation (what cuBLASLt's BF16 GEMM computes). Where 16-byte
 * loads cannot run (FP8: k % 16 or misaligned codes; BF16: k % 8 or misaligned), FP8 takes the CUDA-core
 * FP8 GEMV below (the same codes, fp32 block sums, dequantized in registers) and BF16 cuda_matmul.cu's
 * exact dense GEMV. A group of weights over the same rows (rs_op_matmul_group: q, k and v; gate and
 * up) takes one GEMV launch whose blocks cover every weight's 16-feature tiles in turn, each tile
 * computed exactly as its single matmul computes it.
 * Where cuBLASLt refuses a problem (cuda_blas.cu logs it once), rs_cuda_matmul_fast returns false
 * and the caller runs the exact kernels, whose results the fast ones approximate.
 */
#include "cuda_act.h"
#include "cuda_mma.h"

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
    /* rows past nr hold nothing to reduce (nr is the same for the whole block) */
#pragma unroll
    for (int r = 0; r < FGEMV_ROWS; r++) {
        if (r >= nr) break;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(RS_CUDA_FULL_MASK, acc[r], off);
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < FGEMV_ROWS; r++)
            if (r < nr) out[(int64_t)(r0 + r) * n + o] = acc[r];
    }
}

/* ---- tensor-core GEMVs for few rows ---- */

#define TCG_WARPS 8  /* warps per block: they split K, each taking every TCG_WARPS-th 128-byte chunk */
#define TCG_ROWS 8   /* activation rows per launch group (grid y): one mma n-tile */
#define TCG_UNROLL 2 /* chunks whose loads a warp issues before it uses the first */
/* Blocks an SM holds at once: 3 caps the FP8 kernel at 80 registers (94 without the bound; neither
 * spills), so an H200's 132 SMs take 396 blocks in one wave, the 384 tiles of an 8B model's q|k|v
 * (6144 features) included; 2 a SM left those at 1.45 waves. */
#define TCG_BLOCKS_PER_SM 3

/* d += A B on the warp, fp32 accumulators. FP8: mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32
 * (sm_89+); BF16: m16n8k16 .bf16. Fragments (PTX ISA, g = lane / 4, t = lane % 4):
 *   FP8   a[0] = A[g][4t .. 4t+3], a[1] = A[g+8][4t ..], a[2] = A[g][16+4t ..], a[3] = A[g+8][16+4t ..]
 *         (one code per byte, lowest k in the low byte); b[0] = B[4t .. 4t+3][g], b[1] = B[16+4t ..][g]
 *   BF16  a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t ..], a[2] = A[g][2t+8 ..], a[3] = A[g+8][2t+8 ..];
 *         b[0] = B[2t, 2t+1][g], b[1] = B[2t+8 ..][g]
 *   both  d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1]. */
template <bool FP8>
__device__ __forceinline__ void tcg_mma(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    if (FP8) mma16832_e4m3(d, a, b);
    else mma16816<false>(d, a, b);
}

/* out[r][o] = sum_j x[r][j] w[o][j] for the 16 output features o0 + [0, 16) of block x and the rows
 * r0 + [0, TCG_ROWS) of block y: the weight tile is A (16 x K, row-major), the rows are B's columns
 * (K x 8), on tensor cores. Both operands are read as bytes (E4M3 codes, or BF16 pairs) in 128-byte
 * chunks of their rows: a 128-code K block for FP8, 64 elements for BF16. The sum over k does not
 * care which k sits where, so a chunk is permuted the same way for A and B: lane (g, t) loads 16
 * contiguous bytes at 16 t of each 64-byte half h of the chunk from weight rows o0 + g and o0 + g + 8
 * and from row r0 + g of x (the 4 lanes of a fragment row read 64 contiguous bytes); the first 8 of
 * them are the k of its registers in one mma, the last 8 in a second (words .x/.y and .z/.w: a[0] =
 * row g's, a[1] = row g+8's, a[2], a[3] and b[1] the next word). Each warp walks its chunks with
 * TCG_UNROLL chunks of 16-byte loads in flight (4 KB of weights a warp, 32 KB a block).
 *   FP8   each chunk's 4 mmas start from 0 and promote into fp32 accumulators: acc += d * (ws[o/128][b]
 *         * xs[r][b]), the recipe's 128x128 weight and 1x128 activation scales (o0 is a multiple of 16,
 *         so the warp's 16 features share ws's row).
 *   BF16  the mmas accumulate into acc directly (fp32, as cuBLASLt's BF16 GEMM), no scales.
 * The warps' accumulators are summed in warp order through shared memory. Bytes past a row's end
 * (k not a multiple of a chunk), features past n and rows past `rows` are zeros: they add exact
 * zeros, and only valid outputs are written. NaN codes decode to NaN (the hardware's conversion).
 * Needs k * element size a multiple of 16 and 16-byte aligned x and w (the dispatch checks). */
/* The weights of one launch: up to TCG_GROUP matrices that multiply the same activation rows (a
 * layer's q, k and v, or gate and up), each with its output; block x's 16 features belong to the
 * first weight whose tile count `tiles_end` (cumulative) exceeds blockIdx.x. */
#define TCG_GROUP 3
struct tcg_weights {
    float *out[TCG_GROUP];         /* [rows][n] */
    const uint8_t *w[TCG_GROUP];   /* [n][row_bytes] */
    const float *ws[TCG_GROUP];    /* FP8: [ceil(n/128)][L] */
    int n[TCG_GROUP];
    unsigned tiles_end[TCG_GROUP]; /* sum of ceil(n / 16) over this weight and the ones before */
    int count;
};

template <bool FP8>
__global__ void __launch_bounds__(TCG_WARPS * 32, TCG_BLOCKS_PER_SM)
    gemv_tc_kernel(tcg_weights ww, const uint8_t *__restrict__ x /* [rows][row_bytes] */,
                   const float *__restrict__ xs /* FP8: [rows][L] */, int rows, int64_t row_bytes, int L) {
    /* this block's weight (constant indices only: the parameters stay in the constant bank) */
    float *__restrict__ out = ww.out[0];
    const uint8_t *__restrict__ w = ww.w[0];
    const float *__restrict__ ws = ww.ws[0];
    int n = ww.n[0], o0 = blockIdx.x * 16;
#pragma unroll
    for (int i = 1; i < TCG_GROUP; i++)
        if (i < ww.count && blockIdx.x >= ww.tiles_end[i - 1])
            out = ww.out[i], w = ww.w[i], ws = ww.ws[i], n = ww.n[i], o0 = (int)(blockIdx.x - ww.tiles_end[i - 1]) * 16;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * TCG_ROWS;
    const int nchunks = (int)((row_bytes + 127) / 128);
    const bool wlo = o0 + g < n, whi = o0 + g + 8 < n, xok = r0 + g < rows;
    const uint8_t *wrow_lo = w + (int64_t)(o0 + g) * row_bytes, *wrow_hi = wrow_lo + 8 * row_bytes;
    const uint8_t *xrow = x + (int64_t)(r0 + g) * row_bytes;
    const float *wsrow = FP8 ? ws + (int64_t)(o0 / RS_FP8_BLOCK) * L : NULL;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    rs_cuda_pdl_trigger(); /* the next GEMV may start loading its weights */
    bool waited = false;
    for (int c0 = warp; c0 < nchunks; c0 += TCG_WARPS * TCG_UNROLL) {
        uint4 wa[TCG_UNROLL][2], wb[TCG_UNROLL][2], xb[TCG_UNROLL][2]; /* the loads first */
        const uint4 z = {0u, 0u, 0u, 0u};
        /* lane t's 16 bytes of half h of chunk c0 + u * TCG_WARPS of a row, zeros past it or when !ok
         * (row_bytes % 16 == 0: whole 16-byte pieces) */
        auto piece = [&](const uint8_t *row, bool ok, int u, int h) {
            const int c = c0 + u * TCG_WARPS;
            const int64_t j = (int64_t)c * 128 + 64 * h + 16 * t;
            return ok && c < nchunks && j < row_bytes ? __ldg((const uint4 *)(row + j)) : z;
        };
#pragma unroll
        for (int u = 0; u < TCG_UNROLL; u++)
#pragma unroll
            for (int h = 0; h < 2; h++) wa[u][h] = piece(wrow_lo, wlo, u, h), wb[u][h] = piece(wrow_hi, whi, u, h);
        if (!waited) { /* launched early (PDL): the weights above may load before x is written */
            rs_cuda_pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < TCG_UNROLL; u++)
#pragma unroll
            for (int h = 0; h < 2; h++) xb[u][h] = piece(xrow, xok, u, h);
#pragma unroll
        for (int u = 0; u < TCG_UNROLL; u++) {
            const int c = c0 + u * TCG_WARPS;
            if (c >= nchunks) break; /* warp-uniform */
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            float *dst = FP8 ? d : acc;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint32_t a1[4] = {wa[u][h].x, wb[u][h].x, wa[u][h].y, wb[u][h].y};
                const uint32_t a2[4] = {wa[u][h].z, wb[u][h].z, wa[u][h].w, wb[u][h].w};
                const uint32_t b1[2] = {xb[u][h].x, xb[u][h].y}, b2[2] = {xb[u][h].z, xb[u][h].w};
                tcg_mma<FP8>(dst, a1, b1);
                tcg_mma<FP8>(dst, a2, b2);
            }
            if (FP8) {
                const float sw = wsrow[c];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int r = r0 + 2 * t + (i & 1);
                    const float sx = r < rows ? xs[(int64_t)r * L + c] : 0.0f;
                    acc[i] = fmaf(d[i], sw * sx, acc[i]);
                }
            }
        }
    }
    if (!waited) rs_cuda_pdl_wait(); /* a warp without chunks: nothing before the kernel before it is done */
    __shared__ float part[TCG_WARPS][4][32];
#pragma unroll
    for (int i = 0; i < 4; i++) part[warp][i][lane] = acc[i];
    __syncthreads();
    if (threadIdx.x < 4 * 32) {
        const int i = threadIdx.x / 32, l = threadIdx.x & 31;
        float sum = part[0][i][l];
#pragma unroll
        for (int v = 1; v < TCG_WARPS; v++) sum += part[v][i][l];
        const int r = r0 + 2 * (l & 3) + (i & 1), o = o0 + (l >> 2) + 8 * (i >> 1);
        if (r < rows && o < n) out[(int64_t)r * n + o] = sum;
    }
}

/* One launch over the weights of ww (their outputs, weight pointers, scales and n filled in; the
 * tiles here) for rows activation rows x (FP8: codes with scales xs; BF16: the BF16 form), k wide. */
static void gemv_tc(rs_cuda_ctx *c, bool fp8, tcg_weights ww, const void *x, const float *xs, int rows, int k) {
    unsigned tiles = 0;
    for (int i = 0; i < ww.count; i++) ww.tiles_end[i] = tiles += rs_cuda_blocks((size_t)ww.n[i], 16);
    const unsigned groups = rs_cuda_blocks((size_t)rows, TCG_ROWS);
    RS_ASSERT(groups <= 65535u);
    const dim3 grid(tiles, groups);
    const int64_t row_bytes = (int64_t)k * (fp8 ? 1 : 2);
    const int L = (int)rs_fp8_blocks(k);
    const uint8_t *xb = (const uint8_t *)x;
    const unsigned threads = TCG_WARPS * 32;
    if (c->pdl) { /* a programmatic dependent of the kernel before it (cuda_internal.h rs_cuda_pdl_wait) */
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid, cfg.blockDim = dim3(threads), cfg.dynamicSmemBytes = 0, cfg.stream = c->stream;
        cfg.attrs = attr, cfg.numAttrs = 1;
        if (fp8) CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemv_tc_kernel<true>, ww, xb, xs, rows, row_bytes, L));
        else CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemv_tc_kernel<false>, ww, xb, (const float *)NULL, rows, row_bytes, L));
    } else if (fp8) {
        gemv_tc_kernel<true><<<grid, threads, 0, c->stream>>>(ww, xb, xs, rows, row_bytes, L);
    } else {
        gemv_tc_kernel<false><<<grid, threads, 0, c->stream>>>(ww, xb, NULL, rows, row_bytes, L);
    }
    CUDA_CHECK_LAUNCH();
    c->gemv_tc_runs++;
}

/* ww for one weight */
static tcg_weights tcg_one(float *out, const rs_tensor *w) {
    tcg_weights ww = {};
    ww.out[0] = out, ww.w[0] = (const uint8_t *)w->data, ww.ws[0] = (const float *)w->scale_inv;
    ww.n[0] = (int)w->shape[0], ww.count = 1;
    return ww;
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

static bool fast_fp8_gemv(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows, int n, int k) {
    const int L = (int)rs_fp8_blocks(k);
    const float *xs;
    const uint8_t *xq = rs_cuda_act_fp8(c, x, rows, k, &xs);
    const bool vec = k % 16 == 0 && aligned16(xq) && aligned16(w->data);
    if (vec) {
        gemv_tc(c, true, tcg_one(out, w), xq, xs, rows, k);
        return true;
    }
    const unsigned groups = rs_cuda_blocks((size_t)rows, FGEMV_ROWS);
    RS_ASSERT(groups <= 65535u);
    const dim3 grid(rs_cuda_blocks((size_t)n, FGEMV_WARPS), groups);
    fp8_gemv_fast_kernel<<<grid, FGEMV_WARPS * 32, 0, c->stream>>>(out, xq, xs, (const uint8_t *)w->data, w->scale_inv,
                                                                  rows, n, k, L, vec);
    CUDA_CHECK_LAUNCH();
    return true;
}

/* The tensor-core BF16 GEMV, or false (the exact dense GEMV runs) when its loads cannot be 16 bytes. */
static bool fast_bf16_gemv(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows, int n, int k) {
    if (k % 8 || !aligned16(w->data)) return false;
    const uint16_t *xb = rs_cuda_act_bf16(c, x, rows, k);
    if (!aligned16(xb)) return false;
    gemv_tc(c, false, tcg_one(out, w), xb, NULL, rows, k);
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
    case RS_DTYPE_BF16:
        return rows <= c->gemv_rows_bf16 ? fast_bf16_gemv(c, out, x, w, rows, n, k)
                                         : fast_bf16(c, out, x, w, rows, n, k);
    default: return false;
    }
}

bool rs_cuda_matmul_group_fast(rs_cuda_ctx *c, float *const *outs, const float *x, const rs_tensor *const *ws, int count,
                               int rows) {
    RS_ASSERT(count >= 1 && count <= TCG_GROUP);
    const rs_dtype dt = ws[0]->dtype;
    const int k = (int)ws[0]->shape[1];
    const bool fp8 = dt == RS_DTYPE_E4M3;
    /* where each single matmul would take the tensor-core GEMV (fast_fp8_gemv, fast_bf16_gemv) */
    if (k <= 0 || !(fp8 || dt == RS_DTYPE_BF16) || rows > (fp8 ? c->gemv_rows_fp8 : c->gemv_rows_bf16) ||
        k % (fp8 ? 16 : 8))
        return false;
    tcg_weights ww = {};
    for (int i = 0; i < count; i++) {
        if (ws[i]->dtype != dt || ws[i]->shape[1] != k || !aligned16(ws[i]->data) || ws[i]->shape[0] <= 0) return false;
        ww.out[i] = outs[i], ww.w[i] = (const uint8_t *)ws[i]->data, ww.ws[i] = (const float *)ws[i]->scale_inv;
        ww.n[i] = (int)ws[i]->shape[0];
    }
    ww.count = count;
    if (fp8) {
        const float *xs;
        const uint8_t *xq = rs_cuda_act_fp8(c, x, rows, k, &xs);
        if (!aligned16(xq)) return false;
        gemv_tc(c, true, ww, xq, xs, rows, k);
    } else {
        const uint16_t *xb = rs_cuda_act_bf16(c, x, rows, k);
        if (!aligned16(xb)) return false;
        gemv_tc(c, false, ww, xb, NULL, rows, k);
    }
    return true;
}

/* Tensor-core GEMVs launched so far (tests: the dispatch chose them, or fell back). */
extern "C" unsigned long long rs_cuda_test_gemv_tc_runs(rs_backend *b) { return rs_cuda_ctx_of(b)->gemv_tc_runs; }
