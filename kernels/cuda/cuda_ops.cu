/*
 * cuda_ops.cu — the element-wise and per-row ops on the GPU: embed, rmsnorm, rope, swiglu, add,
 * gather_rows, and two fused ops that save launches in every layer: add + rmsnorm (the residual
 * add and the norm after it) and q/k norm + rope (the per-head norms of q and k and both ropes).
 * Their CPU twins are in kernels/cpu/cpu_ops.c, whose arithmetic they repeat (the fused ops are
 * the single ops' sequence there, kernels/backend.c), and the fused kernels repeat the single
 * kernels' arithmetic, so each gives the bits of the launches it replaces:
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

/* ---- rmsnorm, add + rmsnorm ---- */

#define NORM_LANES 16 /* the CPU's sum_squares lanes */

/* The sum of squares of x[0..dim) in cpu_ops.c sum_squares' order, by a half-warp: its lane l (of
 * 16) sums elements l, l + 16, ... in order (the CPU's lanes), then the lanes' tree (8, 4, 2, 1
 * apart: acc[l] + acc[l + w]) runs over shuffles. Each half-warp sums its own x (NULL: nothing, 0).
 * Every lane of the warp calls it (the shuffles take the whole warp); every lane of a half-warp gets
 * the half-warp's total. */
__device__ __forceinline__ float half_warp_sum_squares(const float *x, int dim) {
    const int lane = threadIdx.x % 32;
    float s = 0.0f;
    if (x)
        for (int i = lane % NORM_LANES; i < dim; i += NORM_LANES) s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
    /* at width w, lanes l < w of each half add lane l + w's partial (within the same half); the
     * other lanes' sums are never read */
    for (int w = NORM_LANES / 2; w >= 1; w /= 2) s = __fadd_rn(s, __shfl_down_sync(RS_CUDA_FULL_MASK, s, w));
    return __shfl_sync(RS_CUDA_FULL_MASK, s, lane & NORM_LANES); /* lane 0 of the half-warp */
}

/* 1 / sqrt(sum_sq / dim + eps) with norm_range's correctly rounded divide and square root. */
__device__ __forceinline__ float norm_scale(float sum_sq, int dim, float eps) {
    const float variance = __fdiv_rn(sum_sq, (float)dim);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
}

/* One block per row. y set (add + rmsnorm): first sum[r] = x[r] + y[r], element by element, and the
 * norm is of that row (sum may be x: the residual stream in place; out may be y, whose reads are all
 * done before the first output is written). Warp 0 sums the squares (half_warp_sum_squares, both
 * halves over the same row); the scaling then repeats cpu_ops.c's norm_range exactly. FORMS (fast
 * numerics): then the row's activation forms (cuda_act.cu) from the values just written, a warp per
 * 1x128 group. */
template <bool FORMS>
__global__ void rmsnorm_kernel(float *out /* [rows][dim] */, const float *x /* [rows][dim] */,
                               const float *y /* [rows][dim] or NULL */, float *sum /* [rows][dim], with y */,
                               const void *w /* [dim] */, rs_dtype wdt, int dim, float eps,
                               uint16_t *bf /* [rows][dim] bf16 */, uint8_t *q /* [rows][dim] e4m3 */,
                               float *qs /* [rows][ceil(dim/128)] */) {
    __shared__ float inv;
    rs_cuda_pdl_trigger(); /* a GEMV of the output may start loading its weights (cuda_internal.h) */
    const size_t r = blockIdx.x;
    const float *xr = x + r * (size_t)dim;
    float *o = out + r * (size_t)dim;
    if (y) { /* uniform over the block */
        float *sr = sum + r * (size_t)dim;
        const float *yr = y + r * (size_t)dim;
        for (int d = threadIdx.x; d < dim; d += blockDim.x) sr[d] = __fadd_rn(xr[d], yr[d]);
        __syncthreads(); /* the row's sums are written (global writes are visible within the block) */
        xr = sr;
    }
    if (threadIdx.x < 32) {
        const float total = half_warp_sum_squares(xr, dim);
        if (threadIdx.x == 0) inv = norm_scale(total, dim, eps);
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

/* out = rmsnorm(x) * w, after sum = x + y when y is set: both ops' launch. */
static void launch_rmsnorm(rs_backend *b, float *out, const float *x, const float *y, float *sum, const rs_tensor *w,
                           int rows, int dim, float eps) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    RS_ASSERT(w->data && rs_tensor_numel(w) == dim);
    if (rows <= 0) return;
    const unsigned threads = dim >= 256 ? 256 : dim >= 64 ? 128 : 32;
    if (c->numerics == RS_NUMERICS_FAST) {
        uint16_t *bf;
        uint8_t *q;
        float *qs;
        rs_cuda_act_produce(c, out, (size_t)rows * (size_t)dim, dim, &bf, &q, &qs);
        rmsnorm_kernel<true><<<(unsigned)rows, threads, 0, c->stream>>>(out, x, y, sum, w->data, w->dtype, dim, eps, bf,
                                                                        q, qs);
    } else {
        rmsnorm_kernel<false><<<(unsigned)rows, threads, 0, c->stream>>>(out, x, y, sum, w->data, w->dtype, dim, eps,
                                                                         NULL, NULL, NULL);
    }
    CUDA_CHECK_LAUNCH();
}

void rs_cuda_op_rmsnorm(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim,
                        float eps) {
    launch_rmsnorm(b, out, x, NULL, NULL, w, rows, dim, eps);
}

void rs_cuda_op_add_rmsnorm(rs_backend *b, float *x, const float *y, float *out, const rs_tensor *w, int rows, int dim,
                            float eps) {
    launch_rmsnorm(b, out, x, y, x, w, rows, dim, eps);
}

/* ---- rope, q/k norm + rope ---- */

/* Rotates the pair (i, i + half) of one head xh at position p, frequency freq: angle in fp32, its
 * cos and sin in double rounded once, then the two products and their difference or sum. */
__device__ __forceinline__ void rope_pair(float *xh, int i, int half, float freq, float p) {
    const float angle = __fmul_rn(freq, p);
    double sd, cd;
    sincos((double)angle, &sd, &cd);
    const float cs = __double2float_rn(cd), sn = __double2float_rn(sd);
    const float x1 = xh[i], x2 = xh[i + half];
    xh[i] = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
    xh[i + half] = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
}

/* One block per row; threads over (head, i < half). */
__global__ void rope_kernel(float *x /* [rows][n_heads][head_dim] */, const int32_t *pos /* [rows] */,
                            const float *inv_freq /* [head_dim / 2] */, int n_heads, int head_dim) {
    const int half = head_dim / 2;
    const size_t r = blockIdx.x;
    const float p = (float)pos[r];
    for (int t = threadIdx.x; t < n_heads * half; t += blockDim.x) {
        const int h = t / half, i = t % half;
        rope_pair(x + (r * (size_t)n_heads + (size_t)h) * (size_t)head_dim, i, half, inv_freq[i], p);
    }
}

/* The mirrors of a rope's positions (the step's host array) and frequencies (the model's,
 * model/loader.c): host arrays reach the kernels through them (cuda_internal.h). */
static void rope_mirrors(rs_cuda_ctx *c, int rows, int head_dim, const int32_t *pos, const float *inv_freq,
                         const int32_t **dpos, const float **dfreq) {
    *dfreq = (const float *)rs_cuda_mirror_of(c, RS_CUDA_M_ROPE_FREQ, inv_freq, (size_t)(head_dim / 2) * sizeof(float));
    *dpos = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_ROPE_POS, pos, (size_t)rows * sizeof *pos);
}

void rs_cuda_op_rope(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                     const float *inv_freq) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    RS_ASSERT(head_dim % 2 == 0 && n_heads > 0);
    if (rows <= 0) return;
    const int32_t *dpos;
    const float *dfreq;
    rope_mirrors(c, rows, head_dim, pos, inv_freq, &dpos, &dfreq);
    const int work = n_heads * (head_dim / 2);
    const unsigned threads = work >= 256 ? 256 : work >= 128 ? 128 : 64;
    rope_kernel<<<(unsigned)rows, threads, 0, c->stream>>>(x, dpos, dfreq, n_heads, head_dim);
    CUDA_CHECK_LAUNCH();
}

/* One block per row; a half-warp per head, the row's q heads then its k heads, a warp's two halves
 * on heads 2j and 2j + 1. A normed head (its weights set) is what rmsnorm_kernel writes for it:
 * half_warp_sum_squares over the head, norm_scale, the same products, written back in place; then
 * the same half-warp rotates the head as rope_kernel does (rope_pair). Every element is read and
 * written by its own half-warp only, so a __syncwarp orders the norm's writes before the rope's
 * reads. The lanes of a warp run the same rounds (a half without a head sums nothing), as the
 * shuffles need. */
__global__ void qk_norm_rope_kernel(float *q /* [rows][n_heads][head_dim] */, float *k /* [rows][n_kv_heads][head_dim] */,
                                    const void *qw /* [head_dim] or NULL */, rs_dtype qdt,
                                    const void *kw /* [head_dim] or NULL */, rs_dtype kdt, int n_heads, int n_kv_heads,
                                    int head_dim, float eps, const int32_t *pos /* [rows] */,
                                    const float *inv_freq /* [head_dim / 2] */) {
    const size_t r = blockIdx.x;
    const int heads = n_heads + n_kv_heads, half = head_dim / 2, lane = threadIdx.x % NORM_LANES;
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const float p = (float)pos[r];
    for (int h0 = 2 * warp; h0 < heads; h0 += 2 * warps) {
        const int h = h0 + (int)(threadIdx.x / NORM_LANES) % 2;
        float *xh = NULL;
        const void *w = NULL;
        rs_dtype wdt = qdt;
        if (h < n_heads) xh = q + (r * (size_t)n_heads + (size_t)h) * (size_t)head_dim, w = qw;
        else if (h < heads)
            xh = k + (r * (size_t)n_kv_heads + (size_t)(h - n_heads)) * (size_t)head_dim, w = kw, wdt = kdt;
        const float total = half_warp_sum_squares(w ? xh : NULL, head_dim);
        if (w) {
            const float s = norm_scale(total, head_dim, eps);
            for (int d = lane; d < head_dim; d += NORM_LANES)
                xh[d] = __fmul_rn(rs_cuda_elem(w, wdt, (size_t)d), __fmul_rn(xh[d], s));
        }
        __syncwarp();
        if (xh)
            for (int i = lane; i < half; i += NORM_LANES) rope_pair(xh, i, half, inv_freq[i], p);
    }
}

void rs_cuda_op_qk_norm_rope(rs_backend *b, float *q, float *k, const rs_tensor *q_norm, const rs_tensor *k_norm,
                             int rows, int n_heads, int n_kv_heads, int head_dim, float eps, const int32_t *pos,
                             const float *inv_freq) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    RS_ASSERT(head_dim % 2 == 0 && n_heads > 0 && n_kv_heads > 0);
    RS_ASSERT(!q_norm || (q_norm->data && rs_tensor_numel(q_norm) == head_dim));
    RS_ASSERT(!k_norm || (k_norm->data && rs_tensor_numel(k_norm) == head_dim));
    if (rows <= 0) return;
    const int32_t *dpos;
    const float *dfreq;
    rope_mirrors(c, rows, head_dim, pos, inv_freq, &dpos, &dfreq);
    /* a warp per two heads, up to 8 warps (each then takes more pairs) */
    const int pairs = (n_heads + n_kv_heads + 1) / 2;
    const unsigned threads = 32u * (unsigned)RS_MIN(pairs, 8);
    qk_norm_rope_kernel<<<(unsigned)rows, threads, 0, c->stream>>>(
        q, k, q_norm ? q_norm->data : NULL, q_norm ? q_norm->dtype : RS_DTYPE_F32, k_norm ? k_norm->data : NULL,
        k_norm ? k_norm->dtype : RS_DTYPE_F32, n_heads, n_kv_heads, head_dim, eps, dpos, dfreq);
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
