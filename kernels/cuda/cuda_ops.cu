/*
 * cuda_ops.cu — the element-wise and per-row ops on the GPU: embed, rmsnorm, rope, swiglu, add,
 * gather_rows. Their CPU twins are in kernels/cpu/cpu_ops.c, whose arithmetic they repeat:
 *
 *   embed, add, gather_rows   exact (a conversion, one fp32 add, a copy): bit-identical.
 *   rmsnorm   the sum of squares runs over the CPU's 16 fixed lanes (lane l takes elements l, l+16,
 *             ... in order) and the same tree, then the same correctly rounded divide, square root
 *             and products: bit-identical, so the per-head q/k norms and the layer norms agree
 *             exactly and later differences come from the matmuls and attention alone.
 *   rope      angle = inv_freq[i] * pos in fp32, cos and sin of it in double rounded once to fp32
 *             (as the CPU does with glibc's sincos; CUDA's double sincos is within 2 ulp of double,
 *             so the fp32 results agree unless the exact value lies within ~1e-16 of a rounding
 *             boundary), then x1 c - x2 s and x2 c + x1 s with separate roundings.
 *   swiglu    silu(g) * up with silu(g) = g / (1 + expf(-g)); CUDA's expf is within 2 ulp where the
 *             CPU's rs_expf is within 1.02, so the tests allow a few ulp.
 * The build passes --fmad=false, so no product is fused into an add behind our back; the intrinsics
 * below say the same thing explicitly where the rounding is the point.
 *
 * Token ids, positions and gather indices arrive in host memory (backend.h) and reach the kernels
 * through the context's mirrors, so one step's metadata is copied once for all its layers.
 */
#include <math.h>

#include "cuda_act.h"

/* ---- embed ---- */

/* out[i][d] = table[ids[i]][d] as fp32; one block per row i. */
__global__ void embed_kernel(float *out /* [n][dim] */, const void *table /* [vocab][dim] */, rs_dtype dt,
                             const int32_t *ids /* [n] */, int64_t dim) {
    const size_t i = blockIdx.x, row = (size_t)ids[i] * (size_t)dim;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x)
        out[i * (size_t)dim + (size_t)d] = rs_cuda_elem(table, dt, row + (size_t)d);
}

void rs_cuda_op_embed(rs_backend *b, float *out, const rs_tensor *table, const int32_t *ids, int n) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    const int64_t vocab = table->shape[0], dim = table->shape[1];
    RS_ASSERT(table->dtype == RS_DTYPE_BF16 || table->dtype == RS_DTYPE_F16 || table->dtype == RS_DTYPE_F32);
    if (n <= 0) return;
    for (int i = 0; i < n; i++) RS_ASSERT(ids[i] >= 0 && ids[i] < vocab);
    const int32_t *dids = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_EMBED_IDS, ids, (size_t)n * sizeof *ids);
    embed_kernel<<<(unsigned)n, 256, 0, c->stream>>>(out, table->data, table->dtype, dids, dim);
    CUDA_CHECK_LAUNCH();
}

/* ---- rmsnorm ---- */

#define NORM_LANES 16 /* the CPU's sum_squares lanes */

/* One block per row. Threads 0..15 are the CPU's 16 lanes of the sum of squares; the tree and the
 * scaling then repeat cpu_ops.c's norm_range exactly. FORMS (fast numerics): then the row's
 * activation forms (cuda_act.cu) from the values just written, a warp per 1x128 group. */
template <bool FORMS>
__global__ void rmsnorm_kernel(float *out /* [rows][dim] */, const float *x /* [rows][dim] */,
                               const void *w /* [dim] */, rs_dtype wdt, int dim, float eps,
                               uint16_t *bf /* [rows][dim] bf16 */, uint8_t *q /* [rows][dim] e4m3 */,
                               float *qs /* [rows][ceil(dim/128)] */) {
    __shared__ float acc[NORM_LANES];
    __shared__ float inv;
    rs_cuda_pdl_trigger(); /* a GEMV of the output may start loading its weights (cuda_internal.h) */
    const size_t r = blockIdx.x;
    const float *xr = x + r * (size_t)dim;
    float *o = out + r * (size_t)dim;
    if (threadIdx.x < NORM_LANES) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < dim; i += NORM_LANES) s = __fadd_rn(s, __fmul_rn(xr[i], xr[i]));
        acc[threadIdx.x] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int width = NORM_LANES / 2; width >= 1; width /= 2)
            for (int l = 0; l < width; l++) acc[l] = __fadd_rn(acc[l], acc[l + width]);
        const float variance = __fdiv_rn(acc[0], (float)dim);
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
    }
    __syncthreads();
    const float s = inv;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = __fmul_rn(rs_cuda_elem(w, wdt, (size_t)d), __fmul_rn(xr[d], s));
    if (!FORMS) return;
    __syncthreads(); /* the row's outputs are written (global writes are visible within the block) */
    const int lane = threadIdx.x % 32, L = (dim + RS_FP8_BLOCK - 1) / RS_FP8_BLOCK;
    for (int g = threadIdx.x / 32; g < L; g += blockDim.x / 32) {
        const int j0 = g * RS_FP8_BLOCK, len = min(RS_FP8_BLOCK, dim - j0);
        float v[RS_FP8_BLOCK / 32];
#pragma unroll
        for (int i = 0; i < RS_FP8_BLOCK / 32; i++) {
            const int j = lane + 32 * i;
            v[i] = j < len ? o[j0 + j] : 0.0f;
            if (j < len) bf[r * (size_t)dim + (size_t)(j0 + j)] = rs_cuda_bf16_bits(v[i]);
        }
        rs_cuda_group_fp8(v, lane, len, q + r * (size_t)dim + (size_t)j0, &qs[r * (size_t)L + (size_t)g]);
    }
}

void rs_cuda_op_rmsnorm(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim,
                        float eps) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    RS_ASSERT(w->data && rs_tensor_numel(w) == dim);
    if (rows <= 0) return;
    const unsigned threads = dim >= 256 ? 256 : dim >= 64 ? 128 : 32;
    if (c->numerics == RS_NUMERICS_FAST) {
        uint16_t *bf;
        uint8_t *q;
        float *qs;
        rs_cuda_act_produce(c, out, (size_t)rows * (size_t)dim, dim, &bf, &q, &qs);
        rmsnorm_kernel<true><<<(unsigned)rows, threads, 0, c->stream>>>(out, x, w->data, w->dtype, dim, eps, bf, q, qs);
    } else {
        rmsnorm_kernel<false><<<(unsigned)rows, threads, 0, c->stream>>>(out, x, w->data, w->dtype, dim, eps, NULL,
                                                                         NULL, NULL);
    }
    CUDA_CHECK_LAUNCH();
}

/* ---- rope ---- */

/* One block per row; threads over (head, i < half). */
__global__ void rope_kernel(float *x /* [rows][n_heads][head_dim] */, const int32_t *pos /* [rows] */,
                            const float *inv_freq /* [head_dim / 2] */, int n_heads, int head_dim) {
    const int half = head_dim / 2;
    const size_t r = blockIdx.x;
    const float p = (float)pos[r];
    for (int t = threadIdx.x; t < n_heads * half; t += blockDim.x) {
        const int h = t / half, i = t % half;
        const float angle = __fmul_rn(inv_freq[i], p);
        double sd, cd;
        sincos((double)angle, &sd, &cd);
        const float cs = __double2float_rn(cd), sn = __double2float_rn(sd);
        float *xh = x + (r * (size_t)n_heads + (size_t)h) * (size_t)head_dim;
        const float x1 = xh[i], x2 = xh[i + half];
        xh[i] = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
        xh[i + half] = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
    }
}

void rs_cuda_op_rope(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                     const float *inv_freq) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    RS_ASSERT(head_dim % 2 == 0 && n_heads > 0);
    if (rows <= 0) return;
    /* inv_freq is the model's host array (model/loader.c), pos the step's: both through mirrors */
    const float *dfreq =
        (const float *)rs_cuda_mirror_of(c, RS_CUDA_M_ROPE_FREQ, inv_freq, (size_t)(head_dim / 2) * sizeof(float));
    const int32_t *dpos = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_ROPE_POS, pos, (size_t)rows * sizeof *pos);
    const int work = n_heads * (head_dim / 2);
    const unsigned threads = work >= 256 ? 256 : work >= 128 ? 128 : 64;
    rope_kernel<<<(unsigned)rows, threads, 0, c->stream>>>(x, dpos, dfreq, n_heads, head_dim);
    CUDA_CHECK_LAUNCH();
}

/* ---- swiglu, add, gather_rows ---- */

__device__ __forceinline__ float swiglu_one(float g, float u) {
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    return __fmul_rn(silu, u);
}

__global__ void swiglu_kernel(float *out, const float *gate, const float *up, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = swiglu_one(gate[i], up[i]);
}

/* Fast numerics, n a multiple of 128: the same values, and their activation forms over groups of
 * 128 consecutive elements (a row's groups when its length is a multiple of 128: cuda_act.cu), a
 * warp per group. */
__global__ void swiglu_forms_kernel(float *out, const float *gate, const float *up, size_t groups,
                                    uint16_t *bf /* [n] */, uint8_t *q /* [n] */, float *qs /* [groups] */) {
    rs_cuda_pdl_trigger(); /* the down GEMV may start loading its weights (cuda_internal.h) */
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (size_t g = blockIdx.x * (size_t)warps + threadIdx.x / 32; g < groups; g += (size_t)gridDim.x * warps) {
        const size_t i0 = g * RS_FP8_BLOCK;
        float v[RS_FP8_BLOCK / 32];
#pragma unroll
        for (int i = 0; i < RS_FP8_BLOCK / 32; i++) {
            const size_t at = i0 + (size_t)(lane + 32 * i);
            v[i] = swiglu_one(gate[at], up[at]);
            out[at] = v[i];
            bf[at] = rs_cuda_bf16_bits(v[i]);
        }
        rs_cuda_group_fp8(v, lane, RS_FP8_BLOCK, q + i0, &qs[g]);
    }
}

__global__ void add_kernel(float *x, const float *y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __fadd_rn(x[i], y[i]);
}

/* A grid for a flat op over n elements: enough blocks to fill the GPU a few times over, then the
 * kernels stride. */
static unsigned flat_blocks(const rs_cuda_ctx *c, size_t n) {
    const size_t most = (size_t)RS_MAX(c->sm_count, 1) * 8;
    return (unsigned)RS_MIN((size_t)rs_cuda_blocks(n, 256), most);
}

void rs_cuda_op_swiglu(rs_backend *b, float *out, const float *gate, const float *up, size_t n) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    if (n == 0) return;
    if (c->numerics == RS_NUMERICS_FAST && n % RS_FP8_BLOCK == 0) {
        uint16_t *bf;
        uint8_t *q;
        float *qs;
        rs_cuda_act_produce(c, out, n, 0, &bf, &q, &qs);
        const size_t groups = n / RS_FP8_BLOCK;
        swiglu_forms_kernel<<<flat_blocks(c, groups * 32), 256, 0, c->stream>>>(out, gate, up, groups, bf, q, qs);
    } else {
        swiglu_kernel<<<flat_blocks(c, n), 256, 0, c->stream>>>(out, gate, up, n);
    }
    CUDA_CHECK_LAUNCH();
}

void rs_cuda_op_add(rs_backend *b, float *x, const float *y, size_t n) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    if (n == 0) return;
    add_kernel<<<flat_blocks(c, n), 256, 0, c->stream>>>(x, y, n);
    CUDA_CHECK_LAUNCH();
}

/* out[i] = x[idx[i]]; one block per row i. */
__global__ void gather_kernel(float *out /* [n][dim] */, const float *x /* [*][dim] */, const int32_t *idx /* [n] */,
                              int dim) {
    const size_t i = blockIdx.x;
    const float *src = x + (size_t)idx[i] * (size_t)dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) out[i * (size_t)dim + (size_t)d] = src[d];
}

void rs_cuda_op_gather_rows(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    if (n <= 0) return;
    for (int i = 0; i < n; i++) RS_ASSERT(idx[i] >= 0);
    const int32_t *didx = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_GATHER_IDX, idx, (size_t)n * sizeof *idx);
    gather_kernel<<<(unsigned)n, 256, 0, c->stream>>>(out, x, didx, dim);
    CUDA_CHECK_LAUNCH();
}
