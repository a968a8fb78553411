/*
 * cuda_attention.cu — writing K/V into the paged cache, and causal attention over it, on the GPU.
 * The CPU twins are in kernels/cpu/cpu_attention.c (the reference); kernels/backend.h has the
 * contracts and the page layout [n_blocks][2 (K, V)][RS_KV_BLOCK][n_kv_heads][head_dim].
 *
 * kv_store — bit-identical to the CPU for every dtype and scale mode.
 *   One block per (row, K-or-V); warp w takes KV heads w, w + 4, ..., its lanes the head's dims
 *   d = lane, lane + 32, .... F32 is a copy of the bits (NaN payloads kept). BF16 repeats the CPU's
 *   integer rounding (rs_f32_to_bf16: round to nearest even, NaN quieted with its sign and payload);
 *   __float2bfloat16_rn would agree except on NaN, which it canonicalizes. E4M3 codes are
 *   __nv_cvt_float_to_fp8(__fdiv_rn(x, s), SATFINITE, E4M3), the encoder fp8.h matches on all 2^32
 *   inputs, of the same correctly rounded quotient; PER_TOKEN's s = fmaxf(amax, 1e-10) / 448 with
 *   amax a warp max of fabsf (fmaxf skips NaN; max is exact, so the reduction order is irrelevant).
 *
 * attention — flash-decoding style: one pass over the context with an online softmax in fp32, no
 *   score buffer, compared with the CPU under a tolerance (other summation order, CUDA's expf).
 *   Block (row r, KV head kvh, chunk z) does query heads kvh * group + [z * gc, z * gc + ng) of row
 *   r, ng <= gc <= 16 of the group that shares the KV head, so each K/V element read serves ng heads.
 *   128 threads (4 warps). The positions 0..pos[r] go by tiles of 64; per tile:
 *     A  threads j < n look up position t0 + j's page in the block table: its K row index and
 *        score multiplier (scale, scale * k_scale[kvh] or scale * ks_j) and V weight (vs_j or 1);
 *     B  warp w scores positions j = w, w + 4, ...: lanes load the K row's dims d = lane + 32 k
 *        (k < 8, head_dim <= 256), decode exactly, dot with each head's q (in shared memory), warp
 *        sum; score = dot * multiplier, as the CPU folds the E4M3 scales;
 *     C  warp w updates heads w, w + 4, ...: tile max, new running max m', correction
 *        exp(m - m'), p_j = exp(s_j - m'), l = l * corr + sum p_j; the tile keeps p_j * vs_j;
 *     D  thread t owns outputs i = t + 128 a (a < 16) of the [ng][head_dim] block, i.e. head i / hd,
 *        dim i % hd: acc = acc * corr + sum_j p_j * V[j][dim], in registers.
 *   gc * head_dim <= 128 * 16, so D covers every output; shared memory holds q, one tile of p and
 *   per-position metadata (~13 KiB), independent of the context length. The end writes
 *   acc / l (times v_scale[kvh] for PER_HEAD: softmax(s V) = s softmax(V), as on the CPU).
 *   gc = min(group, 16, 2048 / head_dim) (>= 8), any value of which is correct; the grid is
 *   (n_tok, n_kv_heads, ceil(group / gc)). In exact numerics one block walks a row's whole
 *   context. In fast numerics a decode row's context splits over blocks (flash-decoding's split-K:
 *   decode_splits picks enough blocks for two waves of the GPU), each writing its softmax-normalized
 *   partial output and log-sum-exp, and attention_combine_kernel merges them; a decode step of few
 *   rows at long context then uses every SM. Fast numerics' decode rows take attention_warps_kernel
 *   (below: independent warps with many K/V loads in flight, no barrier per tile; its pipelined form
 *   by default), the same contract in another fp32 order, or attention_mma_kernel (the same on
 *   tensor cores); RS_CUDA_ATTENTION=tiles|staged|warps|pipelined|mma chooses (backend.h). With
 *   RS_CUDA_ATTENTION_SHARED=1 a decode step's rows that share pages (forked samples) read them once
 *   per unit (attention_shared_kernel) and take the chosen kernel over their own pages only.
 *   Prefill chunks go to the tensor-core kernel.
 *   The host checks what the CPU asserts as it reads (positions, the pages a row can reach,
 *   every row in a sequence), since a kernel cannot; positions, sequence starts and block tables
 *   reach the GPU through the context's mirrors (a row finds its sequence in seq_start itself, so
 *   every array a kernel reads is one the caller handed over: a recorded step graph re-reads them).
 */
#include <math.h>
#include <stdlib.h>

#include <cuda_fp8.h>

#include "cuda_internal.h"
#include "cuda_mma.h"

extern "C" {
#include "../fp8.h"
}

#define KV_THREADS 128 /* kv_store: 4 warps, one KV head at a time each */

#define ATT_THREADS 128                               /* 4 warps */
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_TILE 64                                   /* context positions per tile */
#define ATT_MAX_HD 256                                /* lanes hold K dims lane + 32 k, k < 8 */
#define ATT_KREG (ATT_MAX_HD / 32)
#define ATT_MAX_HEADS 16                              /* query heads per block (gc) */
#define ATT_ACC 16                                    /* output accumulators per thread */
#define ATT_MAX_OUT (ATT_THREADS * ATT_ACC)           /* gc * head_dim <= this */
#define ATT_STAGE_BYTES 16384                         /* a tile's K (then V) rows of one KV head */
#define ATT_STAGE_VECS (ATT_STAGE_BYTES / 16 / ATT_THREADS) /* 16-byte loads per thread per tile */

/* backend.h's contract for a layer (rs_kv_layer_check), and a cache the kernels can index. */
static void kv_layer_check(const rs_kv_layer *kv) {
    rs_kv_layer_check(kv);
    RS_ASSERT(kv->pages && kv->n_blocks > 0 && kv->n_kv_heads > 0 && kv->head_dim > 0);
}

/* ---- kv_store ---- */

/* rs_f32_to_bf16 (kernels/tensor.c), step for step. */
__device__ __forceinline__ uint16_t bf16_bits(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o >= 1; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o >= 1; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Block (r, half): row r of k (half 0) or v (half 1) into slot[r]. */
static __global__ void kv_store_kernel(void *pages /* [n_blocks][2][16][n_kv][hd] of dt */, rs_dtype dt,
                                       rs_kv_scale_mode mode, const float *k /* [n_tok][n_kv][hd] */,
                                       const float *v /* [n_tok][n_kv][hd] */, const int32_t *slot /* [n_tok] */,
                                       const float *k_scale /* [n_kv] */, const float *v_scale /* [n_kv] */,
                                       float *token_scales /* [n_blocks][2][16][n_kv] */, int n_kv, int hd) {
    const int r = blockIdx.x, half = blockIdx.y, lane = threadIdx.x % 32;
    const size_t row_elems = (size_t)n_kv * (size_t)hd;
    const float *src = (half ? v : k) + (size_t)r * row_elems;
    const int64_t s = slot[r];
    if (s < 0) return; /* a padding row of a step graph stores nothing (backend.h) */
    /* the [n_kv][hd] row of (slot, half) in the pages; token_scales is the same without hd */
    const size_t prow = ((size_t)(s / RS_KV_BLOCK) * 2 + (size_t)half) * RS_KV_BLOCK + (size_t)(s % RS_KV_BLOCK);
    /* h is the same for all lanes of a warp, so the warp reductions below see all 32 lanes */
    for (int h = threadIdx.x / 32; h < n_kv; h += KV_THREADS / 32) {
        const float *x = src + (size_t)h * (size_t)hd;
        const size_t at = prow * row_elems + (size_t)h * (size_t)hd;
        if (dt == RS_DTYPE_F32) {
            const uint32_t *xb = (const uint32_t *)x; /* the bits, NaN payloads included */
            for (int d = lane; d < hd; d += 32) ((uint32_t *)pages)[at + (size_t)d] = xb[d];
        } else if (dt == RS_DTYPE_BF16) {
            for (int d = lane; d < hd; d += 32) ((uint16_t *)pages)[at + (size_t)d] = bf16_bits(x[d]);
        } else {
            float sc;
            if (mode == RS_KV_SCALE_PER_TOKEN) {
                float amax = 0.0f;
                for (int d = lane; d < hd; d += 32) amax = fmaxf(amax, fabsf(x[d]));
                amax = warp_max(amax);
                sc = __fdiv_rn(fmaxf(amax, RS_FP8_AMAX_FLOOR), RS_FP8_E4M3_MAX);
                if (lane == 0) token_scales[prow * (size_t)n_kv + (size_t)h] = sc;
            } else {
                sc = (half ? v_scale : k_scale)[h];
            }
            for (int d = lane; d < hd; d += 32)
                ((uint8_t *)pages)[at + (size_t)d] =
                    (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(x[d], sc), __NV_SATFINITE, __NV_E4M3);
        }
    }
}

void rs_cuda_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v, const rs_batch *batch) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    kv_layer_check(kv);
    const int n = batch->n_tok;
    if (n <= 0) return;
    RS_ASSERT(k && v && batch->slot);
    for (int r = 0; r < n; r++)
        RS_ASSERT(batch->slot[r] >= -1 && batch->slot[r] < (int64_t)kv->n_blocks * RS_KV_BLOCK); /* -1: padding */
    const int32_t *dslot = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_KV_SLOT, batch->slot, (size_t)n * sizeof(int32_t));
    kv_store_kernel<<<dim3((unsigned)n, 2), KV_THREADS, 0, c->stream>>>(
        kv->pages, kv->dtype, kv->scale_mode, k, v, dslot, kv->k_scale, kv->v_scale, kv->token_scales,
        kv->n_kv_heads, kv->head_dim);
    CUDA_CHECK_LAUNCH();
}

/* ---- attention ---- */

/* Element i of the pages as fp32, exactly (every BF16 and E4M3 value is an fp32 value). */
template <int DT>
__device__ __forceinline__ float page_elem(const void *pages, size_t i) {
    if (DT == RS_DTYPE_F32) return ((const float *)pages)[i];
    if (DT == RS_DTYPE_BF16) return __uint_as_float((uint32_t)((const uint16_t *)pages)[i] << 16);
    const __half_raw h = __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)pages)[i], __NV_E4M3);
    return __half2float(__half(h));
}

/* Staging (rs_cuda_ctx.att_kernel RS_CUDA_ATTENTION_STAGED): the tile's rows [0, n) of this KV
 * head, K (off 0) or V (off RS_KV_BLOCK), copied into st[n][hd] with 16-byte loads spread over the block's threads, all of a
 * thread's loads issued before its first store: one memory latency per tile instead of a chain of
 * dependent loads per position. Needs hd * es % 16 == 0 and ATT_TILE rows within ATT_STAGE_BYTES. */
__device__ __forceinline__ void stage_rows(uint4 *st, const void *pages, const size_t *krow, size_t off, int n,
                                           size_t row_elems, int kvh, int hd, int es) {
    const int vpr = hd * es / 16; /* 16-byte vectors per row */
    uint4 r[ATT_STAGE_VECS];
#pragma unroll
    for (int u = 0; u < ATT_STAGE_VECS; u++) {
        const int v = (int)threadIdx.x + u * ATT_THREADS, j = v / vpr;
        if (j < n) {
            const size_t at = (krow[j] + off) * row_elems + (size_t)kvh * (size_t)hd; /* element index */
            r[u] = __ldg((const uint4 *)((const unsigned char *)pages + at * (size_t)es) + v % vpr);
        }
    }
#pragma unroll
    for (int u = 0; u < ATT_STAGE_VECS; u++) {
        const int v = (int)threadIdx.x + u * ATT_THREADS;
        if (v / vpr < n) st[v] = r[u];
    }
}

/* The positions [*t_begin, *t_end) of context split sp of a row whose own pass covers [t0, n_ctx)
 * (t0 = 0, or the whole pages of its shared_units_kernel unit, which attention_shared_kernel
 * covers), and where its partial results go: split sp covers [t0 + sp * span, t0 + (sp + 1) * span)
 * with span = ceil((n_ctx - t0) / n_split) rounded up to whole tiles (later splits may be empty).
 * An empty split writes its weight-0 partial (zero output, -inf log-sum-exp) for the combine with
 * the block's threads and returns false. */
__device__ __forceinline__ bool aw_range(int t0, int n_ctx, int n_split, int sp, int ng, int hd, size_t part0,
                                         float *part_o, float *part_lse, int *t_begin, int *t_end) {
    const int n = n_ctx - t0;
    const int per = n_split == 1 ? n : (n + n_split - 1) / n_split;
    const int span = (per + ATT_TILE - 1) / ATT_TILE * ATT_TILE;
    *t_begin = n_split == 1 ? t0 : t0 + sp * span;
    *t_end = n_split == 1 ? n_ctx : min(n_ctx, *t_begin + span);
    if (*t_begin < *t_end) return true;
    for (int i = threadIdx.x; i < ng * hd; i += blockDim.x) part_o[(part0 + (size_t)(i / hd) * n_split + sp) * hd + i % hd] = 0.0f;
    if ((int)threadIdx.x < ng) part_lse[part0 + (size_t)threadIdx.x * n_split + sp] = -INFINITY;
    return false;
}

/* Block (i, kvh, z): row r = rows ? rows[i] : i, KV head kvh, query-head chunk z % n_chunks and
 * context split z / n_chunks; see the file comment for the phases. DT is the pages' dtype. With one
 * split and no partial buffers the block writes its heads' outputs (exact numerics: the whole
 * context in one pass); otherwise split sp covers aw_range's positions of the row's context and
 * writes its normalized partial output and log-sum-exp for the combine pass. */
template <int DT, bool STAGE>
static __global__ void __launch_bounds__(ATT_THREADS)
attention_kernel(float *out /* [n_tok][n_heads][hd] */, const float *q /* [n_tok][n_heads][hd] */,
                 const void *pages /* [n_blocks][2][16][n_kv][hd] of DT */, rs_kv_scale_mode mode,
                 const float *k_scale /* [n_kv] */, const float *v_scale /* [n_kv] */,
                 const float *token_scales /* [n_blocks][2][16][n_kv] */, const int32_t *pos /* [n_tok] */,
                 const int32_t *seq_start /* [n_seq + 1] */, int n_seq, const int32_t *tables /* [n_seq][max_blocks] */,
                 int max_blocks, int n_heads, int n_kv, int hd, int group, int gc, float scale,
                 const int32_t *rows /* [grid x] or NULL */, int n_chunks, int n_split,
                 float *part_o /* [grid x][n_heads][n_split][hd] or NULL */,
                 float *part_lse /* [grid x][n_heads][n_split] */, const int32_t *row_start /* [n_tok] or NULL */) {
    __shared__ uint4 stage_s[STAGE ? ATT_STAGE_BYTES / 16 : 1]; /* the tile's K rows, then its V rows */
    __shared__ float q_s[ATT_MAX_OUT];                /* [ng][hd] this block's query heads */
    __shared__ float p_s[ATT_MAX_HEADS][ATT_TILE];    /* scores, then p_j * vs_j, of one tile */
    __shared__ size_t krow_s[ATT_TILE];               /* page row of K at each tile position */
    __shared__ float kmul_s[ATT_TILE], vmul_s[ATT_TILE];
    __shared__ float m_s[ATT_MAX_HEADS], l_s[ATT_MAX_HEADS], corr_s[ATT_MAX_HEADS];

    const int r = rows ? rows[blockIdx.x] : (int)blockIdx.x, kvh = blockIdx.y;
    const int h0 = (int)(blockIdx.z % (unsigned)n_chunks) * gc, sp = (int)(blockIdx.z / (unsigned)n_chunks);
    const int ng = min(gc, group - h0);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int n_out = ng * hd; /* <= ATT_MAX_OUT (host check) */
    const size_t head0 = (size_t)r * (size_t)n_heads + (size_t)kvh * (size_t)group + (size_t)h0;
    const size_t row_elems = (size_t)n_kv * (size_t)hd;
    /* partial results of heads h0.. of this (list row, split) */
    const size_t part0 = ((size_t)blockIdx.x * (size_t)n_heads + (size_t)kvh * (size_t)group + (size_t)h0) * (size_t)n_split;
    int t_begin, t_end; /* this block's positions; an empty split has weight 0 in the combine */
    if (!aw_range(row_start ? row_start[r] : 0, pos[r] + 1, n_split, sp, ng, hd, part0, part_o, part_lse, &t_begin, &t_end))
        return;
    const int32_t *table = tables + (size_t)rs_cuda_row_seq(seq_start, n_seq, r) * (size_t)max_blocks;
    const bool per_token = DT == RS_DTYPE_E4M3 && mode == RS_KV_SCALE_PER_TOKEN;
    const float head_mul = DT == RS_DTYPE_E4M3 && !per_token ? scale * k_scale[kvh] : scale;
    const int es = DT == RS_DTYPE_F32 ? 4 : DT == RS_DTYPE_BF16 ? 2 : 1;
    const bool staged = STAGE && (hd * es) % 16 == 0 && ATT_TILE * hd * es <= ATT_STAGE_BYTES;
    const void *kv_src = staged ? (const void *)stage_s : pages; /* element (j, d): j * hd + d, else at + d */

    /* heads head0 .. head0 + ng - 1 are contiguous in q and out */
    for (int i = tid; i < n_out; i += ATT_THREADS) q_s[i] = q[head0 * (size_t)hd + (size_t)i];
    if (tid < ng) m_s[tid] = -INFINITY, l_s[tid] = 0.0f;
    float acc[ATT_ACC];
#pragma unroll
    for (int a = 0; a < ATT_ACC; a++) acc[a] = 0.0f;

    for (int t0 = t_begin; t0 < t_end; t0 += ATT_TILE) {
        const int n = min(ATT_TILE, t_end - t0);
        /* A: where each position lives, and its scale factors */
        if (tid < n) {
            const int p = t0 + tid;
            const size_t krow = ((size_t)table[p / RS_KV_BLOCK] * 2) * RS_KV_BLOCK + (size_t)(p % RS_KV_BLOCK);
            krow_s[tid] = krow;
            kmul_s[tid] = per_token ? scale * token_scales[krow * (size_t)n_kv + (size_t)kvh] : head_mul;
            vmul_s[tid] = per_token ? token_scales[(krow + RS_KV_BLOCK) * (size_t)n_kv + (size_t)kvh] : 1.0f;
        }
        __syncthreads(); /* also orders the q_s / m_s / l_s initialization before their first use */
        if (STAGE && staged) {
            stage_rows(stage_s, pages, krow_s, 0, n, row_elems, kvh, hd, es);
            __syncthreads();
        }

        /* B: scores, a warp per position */
        for (int j = warp; j < n; j += ATT_WARPS) {
            const size_t at = staged ? (size_t)j * (size_t)hd : krow_s[j] * row_elems + (size_t)kvh * (size_t)hd;
            float kr[ATT_KREG];
#pragma unroll
            for (int k = 0; k < ATT_KREG; k++) {
                const int d = lane + 32 * k;
                kr[k] = d < hd ? page_elem<DT>(kv_src, at + (size_t)d) : 0.0f;
            }
            for (int h = 0; h < ng; h++) {
                float part = 0.0f;
#pragma unroll
                for (int k = 0; k < ATT_KREG; k++) {
                    const int d = lane + 32 * k;
                    if (d < hd) part += q_s[h * hd + d] * kr[k];
                }
                part = warp_sum(part);
                if (lane == 0) p_s[h][j] = part * kmul_s[j];
            }
        }
        __syncthreads();
        /* staged: the V rows replace the K rows (B is done with them); D reads them after C's barrier */
        if (STAGE && staged) stage_rows(stage_s, pages, krow_s, RS_KV_BLOCK, n, row_elems, kvh, hd, es);

        /* C: online softmax, a warp per head */
        for (int h = warp; h < ng; h += ATT_WARPS) {
            const float m_old = m_s[h];
            float mx = -INFINITY;
            for (int j = lane; j < n; j += 32) mx = fmaxf(mx, p_s[h][j]);
            const float m_new = fmaxf(m_old, warp_max(mx));
            float sum = 0.0f;
            for (int j = lane; j < n; j += 32) {
                const float e = expf(p_s[h][j] - m_new);
                sum += e;
                p_s[h][j] = e * vmul_s[j]; /* PER_TOKEN weighs V row j by p_j * vs_j; else * 1 */
            }
            sum = warp_sum(sum);
            __syncwarp(); /* every lane has read m_s[h] before lane 0 replaces it */
            if (lane == 0) {
                /* the first tile has nothing to rescale (and -inf - -inf would be NaN) */
                const float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                corr_s[h] = corr;
                l_s[h] = l_s[h] * corr + sum;
                m_s[h] = m_new;
            }
        }
        __syncthreads();

        /* D: acc = acc * corr + sum_j p_j V[j], thread tid owning outputs tid + 128 a */
#pragma unroll
        for (int a = 0; a < ATT_ACC; a++) {
            const int i = tid + ATT_THREADS * a;
            if (i < n_out) acc[a] *= corr_s[i / hd];
        }
        for (int j = 0; j < n; j++) {
            const size_t at = staged ? (size_t)j * (size_t)hd /* V row */
                                     : (krow_s[j] + RS_KV_BLOCK) * row_elems + (size_t)kvh * (size_t)hd;
#pragma unroll
            for (int a = 0; a < ATT_ACC; a++) {
                const int i = tid + ATT_THREADS * a;
                if (i < n_out) acc[a] += p_s[i / hd][j] * page_elem<DT>(kv_src, at + (size_t)(i % hd));
            }
        }
        __syncthreads(); /* the tile's shared arrays are rewritten by the next A */
    }

    if (part_o) { /* the split's softmax-normalized output and its log-sum-exp; v_scale in the combine */
#pragma unroll
        for (int a = 0; a < ATT_ACC; a++) {
            const int i = tid + ATT_THREADS * a;
            if (i < n_out) part_o[(part0 + (size_t)(i / hd) * n_split + sp) * hd + i % hd] = acc[a] / l_s[i / hd];
        }
        if (tid < ng) part_lse[part0 + (size_t)tid * n_split + sp] = m_s[tid] + logf(l_s[tid]);
        return;
    }
    const float out_mul = DT == RS_DTYPE_E4M3 && !per_token ? v_scale[kvh] : 1.0f;
#pragma unroll
    for (int a = 0; a < ATT_ACC; a++) {
        const int i = tid + ATT_THREADS * a;
        if (i < n_out) out[head0 * (size_t)hd + (size_t)i] = acc[a] / l_s[i / hd] * out_mul;
    }
}

/* ---- attention by warps (fast numerics' decode rows; rs_cuda_ctx.att_kernel RS_CUDA_ATTENTION_WARPS) ----
 *
 * Block (i, kvh, z) as for attention_kernel (row, KV head, query-head chunk z % n_chunks, context
 * split z / n_chunks), but the warps work independently, with no barrier per tile: LP = hd / 8 lanes
 * hold one position's K (and V) row, 8 consecutive dims per lane (one 16-byte load for BF16, 8 bytes
 * for E4M3, 32 for F32), so a warp holds PPW = 32 / LP positions at once. Warp w takes runs of
 * U * PPW consecutive positions (aw_shape), every AW_WARPS-th run of the block's range, and issues
 * the K and V loads of a whole run before it uses the first: U loads of K and of V per lane in
 * flight, 4 KB per warp for BF16 at head size 128, which keeps the memory system busy without a
 * stage in shared memory. The ng <= G query heads of the chunk live in registers (q pre-multiplied by the score
 * multiplier and log2 e), so each K element read serves every head of the group; a score is a sum of
 * 8 products per lane and a butterfly over the LP lanes, which leaves it in all of them.
 * Each position group (the LP lanes of one position slot) keeps its own online softmax in base 2
 * (running max m, sum l, and its lanes' 8 dims of acc per head): no exchange per run. At the end the
 * groups of a warp merge by shuffles and the warps through shared memory, each scaled by
 * 2^(m - max m). The output, or with splits the normalized partial and its natural-log log-sum-exp
 * for attention_combine_kernel, follows attention_kernel's contract; only the order of the fp32 sums
 * and exp2f's rounding differ, so the tests bound it against the exact kernel. The page table of
 * the block's range goes through shared memory AW_TABLE entries at a time.
 * PF (RS_CUDA_ATTENTION_PIPELINED): a warp issues its next run's loads before the current run's
 * arithmetic, so its loads and its arithmetic overlap (twice the load registers).
 * Takes head sizes hd = 8 * 2^j up to 256 (LP a power of two); others take attention_kernel. */
#define AW_WARPS 4
#define AW_THREADS (AW_WARPS * 32)
#define AW_MAX_HEADS 8   /* query heads per block: q and acc are [G][8] registers per lane */
#define AW_MAX_OUT 1024  /* ng * hd: the warps' merge buffer in shared memory is [AW_WARPS][AW_MAX_OUT] */
#define AW_TABLE 256     /* page-table entries in shared memory at a time */
#define AW_LOG2E 1.4426950408889634f
#define AW_LN2 0.6931471805599453f

static bool aw_takes(int hd) { return hd >= 8 && hd <= 256 && (hd & (hd - 1)) == 0; }

/* runs of U positions per position group: 32 registers of K and V loads per lane in flight, the
 * pipelined form (PF) two runs of half that (the same registers, no spills at G = 8) */
template <int DT, int G, bool PF> struct aw_shape {
    static constexpr int WORDS = DT == RS_DTYPE_F32 ? 8 : DT == RS_DTYPE_BF16 ? 4 : 2; /* 32-bit words per 8 dims */
    static constexpr int U = (DT == RS_DTYPE_F32 ? 2 : DT == RS_DTYPE_BF16 ? 4 : G <= 4 ? 8 : 4) >> (PF ? 1 : 0);
};

/* 8 consecutive elements of the pages from element index at (a multiple of 8) */
template <int DT> __device__ __forceinline__ void aw_load(uint32_t *w, const void *pages, size_t at) {
    if (DT == RS_DTYPE_F32) {
        const uint4 *p = (const uint4 *)((const float *)pages + at);
        const uint4 a = __ldg(p), b = __ldg(p + 1);
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    } else if (DT == RS_DTYPE_BF16) {
        const uint4 a = __ldg((const uint4 *)((const uint16_t *)pages + at));
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    } else {
        const uint2 a = __ldg((const uint2 *)((const uint8_t *)pages + at));
        w[0] = a.x, w[1] = a.y;
    }
}

/* the 8 elements as fp32, exactly (zero words give zeros) */
template <int DT> __device__ __forceinline__ void aw_decode(const uint32_t *w, float f[8]) {
    if (DT == RS_DTYPE_F32) {
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] = __uint_as_float(w[e]);
    } else if (DT == RS_DTYPE_BF16) {
#pragma unroll
        for (int e = 0; e < 4; e++) f[2 * e] = __uint_as_float(w[e] << 16), f[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
    } else {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[e] & 0xffffu), __NV_E4M3);
            const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[e] >> 16), __NV_E4M3);
            __half_raw h;
            h.x = lo.x, f[4 * e] = __half2float(__half(h));
            h.x = lo.y, f[4 * e + 1] = __half2float(__half(h));
            h.x = hi.x, f[4 * e + 2] = __half2float(__half(h));
            h.x = hi.y, f[4 * e + 3] = __half2float(__half(h));
        }
    }
}

/* The block's warps merged (after a barrier): warp w left head h's running max m_s[w][h] (log2
 * units), sum l_s[w][h] and un-normalized output acc_s[w][h * hd + d]; each scaled by 2^(m - max m).
 * Writes the normalized output times out_mul, or with splits the normalized partial and its
 * natural-log log-sum-exp. Warp 0 saw the range's first position, so the max is finite. */
template <int G, int OUT>
__device__ __forceinline__ void aw_merge(const float (&m_s)[AW_WARPS][G], const float (&l_s)[AW_WARPS][G],
                                         const float (&acc_s)[AW_WARPS][OUT], int ng, int hd, float out_mul, float *out,
                                         size_t head0, float *part_o, float *part_lse, size_t part0, int n_split, int sp) {
    for (int i = threadIdx.x; i < ng * hd; i += blockDim.x) {
        const int h = i / hd;
        float M = m_s[0][h];
#pragma unroll
        for (int w = 1; w < AW_WARPS; w++) M = fmaxf(M, m_s[w][h]);
        float L = 0.0f, O = 0.0f;
#pragma unroll
        for (int w = 0; w < AW_WARPS; w++) {
            const float f = exp2f(m_s[w][h] - M); /* 0 for a warp without positions */
            L += l_s[w][h] * f;
            O += acc_s[w][i] * f;
        }
        if (part_o) {
            part_o[(part0 + (size_t)h * n_split + sp) * hd + i % hd] = O / L;
            if (i % hd == 0) part_lse[part0 + (size_t)h * n_split + sp] = M * AW_LN2 + logf(L);
        } else {
            out[head0 * (size_t)hd + (size_t)i] = O / L * out_mul;
        }
    }
}

/* Where a warp's runs read: the page-table slice [s0, s1) in shared memory and the layer's pages. */
struct aw_run_at {
    const void *pages;
    const float *token_scales;
    const int32_t *tbl_s;
    int s0, s1;
    size_t row_elems;
    int n_kv, kvh, hd, PPW, pgrp, lp;
    bool per_token;
};

/* One run's loads: lane (pgrp, lp)'s 8 dims of K and V at positions base + u * PPW + pgrp (zeros past
 * s1), with their per-token scales (1 otherwise). */
template <int DT, int G, bool PF> struct aw_regs {
    uint32_t kw[aw_shape<DT, G, PF>::U][aw_shape<DT, G, PF>::WORDS], vw[aw_shape<DT, G, PF>::U][aw_shape<DT, G, PF>::WORDS];
    float ks[aw_shape<DT, G, PF>::U], vs[aw_shape<DT, G, PF>::U];
};

template <int DT, int G, bool PF>
__device__ __forceinline__ void aw_load_run(const aw_run_at &at, int base, aw_regs<DT, G, PF> &r) {
    constexpr int WORDS = aw_shape<DT, G, PF>::WORDS, U = aw_shape<DT, G, PF>::U;
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int p = base + u * at.PPW + at.pgrp;
        r.ks[u] = 1.0f, r.vs[u] = 1.0f;
        if (p < at.s1) {
            const size_t krow = (size_t)at.tbl_s[(p - at.s0) / RS_KV_BLOCK] * 2 * RS_KV_BLOCK + (size_t)(p % RS_KV_BLOCK);
            const size_t e0 = krow * at.row_elems + (size_t)at.kvh * (size_t)at.hd + (size_t)(at.lp * 8);
            aw_load<DT>(r.kw[u], at.pages, e0);
            aw_load<DT>(r.vw[u], at.pages, e0 + RS_KV_BLOCK * at.row_elems);
            if (at.per_token) {
                r.ks[u] = at.token_scales[krow * (size_t)at.n_kv + (size_t)at.kvh];
                r.vs[u] = at.token_scales[(krow + RS_KV_BLOCK) * (size_t)at.n_kv + (size_t)at.kvh];
            }
        } else {
#pragma unroll
            for (int e = 0; e < WORDS; e++) r.kw[u][e] = 0, r.vw[u][e] = 0;
        }
    }
}

/* One run's arithmetic: scores (log2 units, -inf past s1), this position group's online softmax
 * update of m, l and acc for the ng heads. */
template <int DT, int G, bool PF>
__device__ __forceinline__ void aw_compute_run(const aw_run_at &at, int base, const aw_regs<DT, G, PF> &r,
                                               const float (&qr)[G][8], float (&m)[G], float (&l)[G],
                                               float (&acc)[G][8], int ng, int LP) {
    constexpr int U = aw_shape<DT, G, PF>::U;
    float s[U][G];
#pragma unroll
    for (int u = 0; u < U; u++) {
        float kf[8];
        aw_decode<DT>(r.kw[u], kf);
        const bool ok = base + u * at.PPW + at.pgrp < at.s1;
#pragma unroll
        for (int h = 0; h < G; h++) {
            if (h >= ng) break;
            float part = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) part = fmaf(qr[h][e], kf[e], part);
            for (int o = LP / 2; o > 0; o /= 2) part += __shfl_xor_sync(0xffffffffu, part, o);
            s[u][h] = ok ? part * r.ks[u] : -INFINITY;
        }
    }
    /* s becomes p * vs */
#pragma unroll
    for (int h = 0; h < G; h++) {
        if (h >= ng) break;
        float mx = s[0][h];
#pragma unroll
        for (int u = 1; u < U; u++) mx = fmaxf(mx, s[u][h]);
        const float mn = fmaxf(m[h], mx);
        const bool any = mn != -INFINITY; /* else no position of this group so far */
        const float corr = any ? exp2f(m[h] - mn) : 1.0f;
        float ps = 0.0f;
#pragma unroll
        for (int u = 0; u < U; u++) {
            const float p = any ? exp2f(s[u][h] - mn) : 0.0f;
            ps += p;
            s[u][h] = p * r.vs[u];
        }
        l[h] = l[h] * corr + ps;
        m[h] = mn;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[h][e] *= corr;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        float vf[8];
        aw_decode<DT>(r.vw[u], vf);
#pragma unroll
        for (int h = 0; h < G; h++) {
            if (h >= ng) break;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[h][e] = fmaf(s[u][h], vf[e], acc[h][e]);
        }
    }
}

template <int DT, int G, bool PF>
static __global__ void __launch_bounds__(AW_THREADS)
attention_warps_kernel(float *out /* [n_tok][n_heads][hd] */, const float *q /* [n_tok][n_heads][hd] */,
                       const void *pages /* [n_blocks][2][16][n_kv][hd] of DT */, rs_kv_scale_mode mode,
                       const float *k_scale /* [n_kv] */, const float *v_scale /* [n_kv] */,
                       const float *token_scales /* [n_blocks][2][16][n_kv] */, const int32_t *pos /* [n_tok] */,
                       const int32_t *seq_start /* [n_seq + 1] */, int n_seq, const int32_t *tables /* [n_seq][max_blocks] */,
                       int max_blocks, int n_heads, int n_kv, int hd, int group, int gc, float scale,
                       const int32_t *rows /* [grid x] or NULL */, int n_chunks, int n_split,
                       float *part_o /* [grid x][n_heads][n_split][hd] or NULL */,
                       float *part_lse /* [grid x][n_heads][n_split] */, const int32_t *row_start /* [n_tok] or NULL */) {
    constexpr int U = aw_shape<DT, G, PF>::U;
    __shared__ int32_t tbl_s[AW_TABLE];
    __shared__ float m_s[AW_WARPS][G], l_s[AW_WARPS][G];
    __shared__ float acc_s[AW_WARPS][AW_MAX_OUT];

    const int r = rows ? rows[blockIdx.x] : (int)blockIdx.x, kvh = blockIdx.y;
    const int h0 = (int)(blockIdx.z % (unsigned)n_chunks) * gc, sp = (int)(blockIdx.z / (unsigned)n_chunks);
    const int ng = min(gc, group - h0); /* <= G */
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int LP = hd / 8, PPW = 32 / LP, pgrp = lane / LP, lp = lane % LP;
    const size_t head0 = (size_t)r * (size_t)n_heads + (size_t)kvh * (size_t)group + (size_t)h0;
    const size_t row_elems = (size_t)n_kv * (size_t)hd;
    const size_t part0 = ((size_t)blockIdx.x * (size_t)n_heads + (size_t)kvh * (size_t)group + (size_t)h0) * (size_t)n_split;
    int t_begin, t_end; /* this block's positions */
    if (!aw_range(row_start ? row_start[r] : 0, pos[r] + 1, n_split, sp, ng, hd, part0, part_o, part_lse, &t_begin,
                  &t_end))
        return;
    const int32_t *table = tables + (size_t)rs_cuda_row_seq(seq_start, n_seq, r) * (size_t)max_blocks;
    const bool per_token = DT == RS_DTYPE_E4M3 && mode == RS_KV_SCALE_PER_TOKEN;
    const float qmul = (DT == RS_DTYPE_E4M3 && !per_token ? scale * k_scale[kvh] : scale) * AW_LOG2E;

    float qr[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; h++) {
        m[h] = -INFINITY, l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            qr[h][e] = h < ng ? q[(head0 + (size_t)h) * (size_t)hd + (size_t)(lp * 8 + e)] * qmul : 0.0f;
            acc[h][e] = 0.0f;
        }
    }

    const int run = U * PPW, stride = AW_WARPS * run; /* positions of one run of a warp, and between its runs */
    for (int s0 = t_begin; s0 < t_end; s0 += AW_TABLE * RS_KV_BLOCK) { /* t_begin is a multiple of a page */
        const int s1 = min(t_end, s0 + AW_TABLE * RS_KV_BLOCK);
        __syncthreads(); /* every warp is done with the previous table slice */
        for (int i = tid; i < (s1 - s0 + RS_KV_BLOCK - 1) / RS_KV_BLOCK; i += AW_THREADS)
            tbl_s[i] = table[s0 / RS_KV_BLOCK + i];
        __syncthreads();
        const aw_run_at at = {pages, token_scales, tbl_s, s0, s1, row_elems, n_kv, kvh, hd, PPW, pgrp, lp, per_token};
        aw_regs<DT, G, PF> cur;
        int base = s0 + warp * run;
        if (PF && base < s1) aw_load_run<DT, G, PF>(at, base, cur);
        for (; base < s1; base += stride) {
            if (PF) { /* the next run's loads go out before this run's arithmetic */
                aw_regs<DT, G, PF> next;
                if (base + stride < s1) aw_load_run<DT, G, PF>(at, base + stride, next);
                aw_compute_run<DT, G, PF>(at, base, cur, qr, m, l, acc, ng, LP);
                cur = next;
            } else {
                aw_load_run<DT, G, PF>(at, base, cur);
                aw_compute_run<DT, G, PF>(at, base, cur, qr, m, l, acc, ng, LP);
            }
        }
    }

    /* the warp's position groups merged (lanes lp of every group end with the sums) */
#pragma unroll
    for (int h = 0; h < G; h++) {
        if (h >= ng) break;
        float M = m[h];
        for (int o = LP; o < 32; o *= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        const float w = M == -INFINITY ? 0.0f : exp2f(m[h] - M);
        float L = l[h] * w;
        for (int o = LP; o < 32; o *= 2) L += __shfl_xor_sync(0xffffffffu, L, o);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float a = acc[h][e] * w;
            for (int o = LP; o < 32; o *= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
            acc[h][e] = a;
        }
        m[h] = M, l[h] = L;
        if (lane == 0) m_s[warp][h] = M, l_s[warp][h] = L;
        if (pgrp == 0) {
#pragma unroll
            for (int e = 0; e < 8; e++) acc_s[warp][h * hd + lp * 8 + e] = acc[h][e];
        }
    }
    __syncthreads();
    aw_merge<G, AW_MAX_OUT>(m_s, l_s, acc_s, ng, hd, DT == RS_DTYPE_E4M3 && !per_token ? v_scale[kvh] : 1.0f, out, head0,
                            part_o, part_lse, part0, n_split, sp);
}

/* ---- decode attention on tensor cores (RS_CUDA_ATTENTION_MMA) ----
 *
 * The block and range contract of attention_warps_kernel (row, KV head, chunk of up to 8 query heads,
 * context split; the same partial outputs for the combine), with the products on tensor cores
 * (cuda_mma.h, m16n8k16, fp32 accumulators). A warp takes runs of 16 positions, every AW_WARPS-th
 * run of the block's range; lane (g, t) loads the K and V rows of positions base + g and base + 8 + g,
 * dims 32 w + 8 t .. + 8 of each 32-dim window w (16-byte loads for BF16), as operand pairs (BF16
 * pages as they are; E4M3 codes converted exactly to F16; F32 rounded to F16: cuda_attention_tc.cu's
 * operand types). The sum over dims does not care which dim sits at which k, so each window is two
 * mmas whose k pairs (2t, 2t+1) and (2t+8, 2t+9) are this lane's dims 8t + 4h + {0,1} and
 * 8t + 4h + {2,3}, and Q's A fragments (the chunk's heads as rows g < ng; rows g + 8 zero) use the
 * same order:
 *   S = Q K^T   two 16 x 8 tiles (positions base + 0..7, base + 8..15), scaled to log2 units;
 *   softmax     row g's running max over the quad (t = 0..3), exp2f, the lane's part of the row sum;
 *   O += P V    P's A fragment straight from S's C fragments (times the per-token V scales); V's B
 *               fragments are its loaded rows transposed in registers, 8 x 8 at a time (movmatrix),
 *               so the 8 output dims of tile (w, j) are 32 w + 8 c/2 + 2 j + c%2 for column c, and
 *               lane (g, t) accumulates head g's dims 32 w + 8 t .. + 8.
 * The warps merge through shared memory as in attention_warps_kernel. Compared with the exact
 * kernel under the tensor-core tolerance: Q and P round to the operand type (F32 K/V to F16).
 * Head sizes 32, 64 and 128 (am_takes); others take attention_warps_kernel. */
#define AM_RUN 16 /* positions of one run of a warp: the P V mma's k */

static bool am_takes(int hd) { return hd == 32 || hd == 64 || hd == 128; }

/* 8 consecutive elements of the pages from element index at, as 4 operand pairs */
template <int DT> __device__ __forceinline__ void am_load(uint32_t w[4], const void *pages, size_t at) {
    if (DT == RS_DTYPE_BF16) {
        const uint4 a = __ldg((const uint4 *)((const uint16_t *)pages + at));
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    } else if (DT == RS_DTYPE_E4M3) {
        const uint2 a = __ldg((const uint2 *)((const uint8_t *)pages + at));
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t pair = ((j < 2 ? a.x : a.y) >> (16 * (j & 1))) & 0xffffu;
            const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)pair, __NV_E4M3);
            w[j] = (uint32_t)h.x | ((uint32_t)h.y << 16);
        }
    } else {
        const float4 *p = (const float4 *)((const float *)pages + at);
        const float4 a = __ldg(p), b = __ldg(p + 1);
        w[0] = pack2<true>(a.x, a.y), w[1] = pack2<true>(a.z, a.w), w[2] = pack2<true>(b.x, b.y), w[3] = pack2<true>(b.z, b.w);
    }
}

/* One run's loads for the mma kernels: lane (g, t)'s K and V operand pairs of positions
 * base + 8 nt + g (zeros past s1), and the score multipliers and V weights of its S columns
 * base + 8 nt + 2 t + i (head_mul and 1, or the per-token scales). */
template <int DT, int W>
__device__ __forceinline__ void am_load_run(const void *pages, const float *token_scales, const int32_t *tbl_s, int s0,
                                            int s1, int base, size_t row_elems, int n_kv, int kvh, int g, int t,
                                            bool per_token, float head_mul, float scale, uint32_t (&kw)[2][W][4],
                                            uint32_t (&vw)[2][W][4], float (&kmul)[2][2], float (&vmul)[2][2]) {
    constexpr int HD = 32 * W;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        const int p = base + 8 * nt + g;
        if (p < s1) {
            const size_t krow = (size_t)tbl_s[(p - s0) / RS_KV_BLOCK] * 2 * RS_KV_BLOCK + (size_t)(p % RS_KV_BLOCK);
            const size_t e0 = krow * row_elems + (size_t)kvh * HD + (size_t)(8 * t);
#pragma unroll
            for (int w = 0; w < W; w++) {
                am_load<DT>(kw[nt][w], pages, e0 + 32 * (size_t)w);
                am_load<DT>(vw[nt][w], pages, e0 + RS_KV_BLOCK * row_elems + 32 * (size_t)w);
            }
        } else {
#pragma unroll
            for (int w = 0; w < W; w++)
#pragma unroll
                for (int j = 0; j < 4; j++) kw[nt][w][j] = 0u, vw[nt][w][j] = 0u;
        }
    }
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int p = base + 8 * nt + 2 * t + i;
            kmul[nt][i] = head_mul, vmul[nt][i] = 1.0f;
            if (per_token && p < s1) {
                const size_t krow = (size_t)tbl_s[(p - s0) / RS_KV_BLOCK] * 2 * RS_KV_BLOCK + (size_t)(p % RS_KV_BLOCK);
                kmul[nt][i] = scale * AW_LOG2E * token_scales[krow * (size_t)n_kv + (size_t)kvh];
                vmul[nt][i] = token_scales[(krow + RS_KV_BLOCK) * (size_t)n_kv + (size_t)kvh];
            }
        }
}

template <int DT, int W>
static __global__ void __launch_bounds__(AW_THREADS)
attention_mma_kernel(float *out /* [n_tok][n_heads][hd] */, const float *q /* [n_tok][n_heads][hd] */,
                     const void *pages /* [n_blocks][2][16][n_kv][hd] of DT */, rs_kv_scale_mode mode,
                     const float *k_scale /* [n_kv] */, const float *v_scale /* [n_kv] */,
                     const float *token_scales /* [n_blocks][2][16][n_kv] */, const int32_t *pos /* [n_tok] */,
                     const int32_t *seq_start /* [n_seq + 1] */, int n_seq, const int32_t *tables /* [n_seq][max_blocks] */,
                     int max_blocks, int n_heads, int n_kv, int hd, int group, int gc, float scale,
                     const int32_t *rows /* [grid x] or NULL */, int n_chunks, int n_split,
                     float *part_o /* [grid x][n_heads][n_split][hd] or NULL */,
                     float *part_lse /* [grid x][n_heads][n_split] */, const int32_t *row_start /* [n_tok] or NULL */) {
    constexpr bool F16 = DT != RS_DTYPE_BF16;
    constexpr int HD = 32 * W;
    __shared__ int32_t tbl_s[AW_TABLE];
    __shared__ float m_s[AW_WARPS][8], l_s[AW_WARPS][8];
    __shared__ float acc_s[AW_WARPS][8 * HD];

    const int r = rows ? rows[blockIdx.x] : (int)blockIdx.x, kvh = blockIdx.y;
    const int h0 = (int)(blockIdx.z % (unsigned)n_chunks) * gc, sp = (int)(blockIdx.z / (unsigned)n_chunks);
    const int ng = min(gc, group - h0); /* <= 8 */
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const size_t head0 = (size_t)r * (size_t)n_heads + (size_t)kvh * (size_t)group + (size_t)h0;
    const size_t row_elems = (size_t)n_kv * (size_t)HD;
    const size_t part0 = ((size_t)blockIdx.x * (size_t)n_heads + (size_t)kvh * (size_t)group + (size_t)h0) * (size_t)n_split;
    int t_begin, t_end; /* this block's positions */
    if (!aw_range(row_start ? row_start[r] : 0, pos[r] + 1, n_split, sp, ng, HD, part0, part_o, part_lse, &t_begin,
                  &t_end))
        return;
    const int32_t *table = tables + (size_t)rs_cuda_row_seq(seq_start, n_seq, r) * (size_t)max_blocks;
    const bool per_token = DT == RS_DTYPE_E4M3 && mode == RS_KV_SCALE_PER_TOKEN;
    const float head_mul = (DT == RS_DTYPE_E4M3 && !per_token ? scale * k_scale[kvh] : scale) * AW_LOG2E;

    /* Q's A fragments: row g = head h0 + g (zero past ng), window w, half h: k (2t, 2t+1) = dims
     * 32 w + 8 t + 4 h + {0,1}, k (2t+8, 2t+9) = + {2,3}; rows g + 8 are zero */
    uint32_t qa[W][2][2];
#pragma unroll
    for (int w = 0; w < W; w++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float *qr = q + (head0 + (size_t)g) * HD + 32 * w + 8 * t + 4 * h;
            qa[w][h][0] = g < ng ? pack2<F16>(qr[0], qr[1]) : 0u;
            qa[w][h][1] = g < ng ? pack2<F16>(qr[2], qr[3]) : 0u;
        }
    float o[W][4][4]; /* tile (w, j): c0, c1 = head g, dims 32 w + 8 t + 2 j + {0,1}; c2, c3 rows g + 8 */
#pragma unroll
    for (int w = 0; w < W; w++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) o[w][j][i] = 0.0f;
    float m_run = -INFINITY, l_run = 0.0f; /* row g: the quad's running max (log2 units), this lane's sum */

    for (int s0 = t_begin; s0 < t_end; s0 += AW_TABLE * RS_KV_BLOCK) {
        const int s1 = min(t_end, s0 + AW_TABLE * RS_KV_BLOCK);
        __syncthreads();
        for (int i = tid; i < (s1 - s0 + RS_KV_BLOCK - 1) / RS_KV_BLOCK; i += AW_THREADS)
            tbl_s[i] = table[s0 / RS_KV_BLOCK + i];
        __syncthreads();
        for (int base = s0 + warp * AM_RUN; base < s1; base += AW_WARPS * AM_RUN) {
            uint32_t kw[2][W][4], vw[2][W][4]; /* positions base + 8 nt + g, operand pairs */
            float kmul[2][2], vmul[2][2];      /* of S columns base + 8 nt + 2 t + i */
            am_load_run<DT, W>(pages, token_scales, tbl_s, s0, s1, base, row_elems, n_kv, kvh, g, t, per_token,
                               head_mul, scale, kw, vw, kmul, vmul);
            /* S = Q K^T */
            float s[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
#pragma unroll
                for (int i = 0; i < 4; i++) s[nt][i] = 0.0f;
#pragma unroll
                for (int w = 0; w < W; w++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const uint32_t a[4] = {qa[w][h][0], 0u, qa[w][h][1], 0u};
                        const uint32_t b[2] = {kw[nt][w][2 * h], kw[nt][w][2 * h + 1]};
                        mma16816<F16>(s[nt], a, b);
                    }
            }
            /* row g's online softmax over the quad */
            float sc[2][2], mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    sc[nt][i] = base + 8 * nt + 2 * t + i < s1 ? s[nt][i] * kmul[nt][i] : -INFINITY;
                    mx = fmaxf(mx, sc[nt][i]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m_run, mx); /* finite: the run's first position is in range */
            const float corr = exp2f(m_run - mn);
            float p[2][2];
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    p[nt][i] = exp2f(sc[nt][i] - mn);
                    l_run = l_run * (nt == 0 && i == 0 ? corr : 1.0f) + p[nt][i];
                }
            m_run = mn;
#pragma unroll
            for (int w = 0; w < W; w++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) o[w][j][i] *= corr;
            /* O += P V */
            const uint32_t pa[4] = {pack2<F16>(p[0][0] * vmul[0][0], p[0][1] * vmul[0][1]), 0u,
                                    pack2<F16>(p[1][0] * vmul[1][0], p[1][1] * vmul[1][1]), 0u};
#pragma unroll
            for (int w = 0; w < W; w++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const uint32_t b[2] = {movmatrix_trans(vw[0][w][j]), movmatrix_trans(vw[1][w][j])};
                    mma16816<F16>(o[w][j], pa, b);
                }
        }
    }

    /* the quad's row sums; the warp's partial results into shared memory */
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    if (g < ng) {
        if (t == 0) m_s[warp][g] = m_run, l_s[warp][g] = l_run;
#pragma unroll
        for (int w = 0; w < W; w++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int i = 0; i < 2; i++) acc_s[warp][g * HD + 32 * w + 8 * t + 2 * j + i] = o[w][j][i];
    }
    __syncthreads();
    aw_merge<8, 8 * HD>(m_s, l_s, acc_s, ng, HD, DT == RS_DTYPE_E4M3 && !per_token ? v_scale[kvh] : 1.0f, out, head0,
                        part_o, part_lse, part0, n_split, sp);
}

/* ---- decode attention over pages that rows share (rs_cuda_ctx.att_shared, RS_CUDA_ATTENTION_SHARED) ----
 *
 * The n samples of a prompt are forked from it and share its KV pages, and so do prompts that hit
 * the same cached prefix. In a decode step (every sequence one row, no row list) with the option on:
 *   shared_units_kernel  (one block) groups the rows into units from the step's mirrored block
 *       tables and positions, so that a recorded step graph recomputes them at every replay: rows
 *       whose first whole pages are the same page form units of up to SH_ROWS / group rows, in row
 *       order; a unit's shared length is the number of leading pages that are the same page for
 *       every member and lie whole inside every member's context, times RS_KV_BLOCK. A unit of one
 *       row, or with no such page, is no unit. row_start[r] is the row's unit's shared length, or 0.
 *   attention_shared_kernel  block (leader row, KV head, split): the unit's members x the group's
 *       query heads are the rows of one m16 tile of attention_mma_kernel's products (member m, head h
 *       at tile row m * group + h), so each K/V element read serves every member's heads, and the
 *       tile holds 16 / group rows' heads where attention_mma_kernel's holds one row's group (its
 *       other rows zero). Its range is the shared length,
 *       split as aw_range splits a row; it writes the normalized partial and log-sum-exp of every
 *       member's heads into the shared partial buffers. The block of a row in no unit writes that
 *       row's weight-0 partials there; a member's own block returns.
 *   the row's own pass  any decode kernel over [row_start[r], pos[r] + 1), into the split partials.
 *   attention_combine_kernel  merges both sets of partials.
 * Every position of a row's context is in exactly one of the two ranges, so the result is the same
 * attention in another fp32 order, with the shared part on tensor cores (the mma kernel's tolerance).
 * Head sizes 32, 64 and 128 and groups of up to 8 query heads; other shapes, mixed steps and steps
 * of more than SH_MAX_ROWS rows run without it. Off by default until measured on a GPU. */
#define SH_ROWS 16       /* tile rows of a unit: members x group */
#define SH_MAX_ROWS 1024 /* decode rows that shared_units_kernel groups in shared memory */
#define SH_UNIT (2 + SH_ROWS) /* int32 per row in the units array: members, shared length, the members */

static bool sh_takes(int hd, int group) { return am_takes(hd) && group <= SH_ROWS / 2; }

/* Runs on one block of SH_UNIT_THREADS threads: the rows' sequences, positions and first pages into
 * shared memory; each row's leader (the first row of its run of cap rows with the same first
 * page); each row's count of leading pages that are its leader's too and lie whole inside both
 * contexts (a warp a row, lanes over pages, the first mismatch by atomicMin: loads in parallel,
 * no chain through the table); each leader's unit (the minimum of its members' counts); each row's
 * start. It runs at every layer's attention call (a step's tables are the same for all of them). */
#define SH_UNIT_THREADS 1024

static __global__ void __launch_bounds__(SH_UNIT_THREADS)
shared_units_kernel(const int32_t *pos /* [n_rows] */, const int32_t *seq_start /* [n_seq + 1] */, int n_seq,
                    const int32_t *tables /* [n_seq][max_blocks] */, int max_blocks, int n_rows, int cap,
                    int32_t *units /* [n_rows][SH_UNIT] */, int32_t *row_start /* [n_rows] */) {
    __shared__ int32_t seq_s[SH_MAX_ROWS], pos_s[SH_MAX_ROWS], first_s[SH_MAX_ROWS], lead_s[SH_MAX_ROWS];
    __shared__ int32_t same_s[SH_MAX_ROWS], len_s[SH_MAX_ROWS];
    const int tid = threadIdx.x;
    for (int r = tid; r < n_rows; r += blockDim.x) {
        const int q = rs_cuda_row_seq(seq_start, n_seq, r);
        seq_s[r] = q, pos_s[r] = pos[r];
        first_s[r] = pos[r] + 1 >= RS_KV_BLOCK ? tables[(size_t)q * max_blocks] : -1 - r; /* no whole page: alone */
    }
    __syncthreads();
    for (int r = tid; r < n_rows; r += blockDim.x) {
        const int f = first_s[r];
        int k = 0; /* rows before r with the same first page */
        for (int i = 0; i < r; i++) k += first_s[i] == f;
        int lead = r;
        for (int i = 0, j = 0; i <= r; i++)
            if (first_s[i] == f && j++ == k / cap * cap) {
                lead = i;
                break;
            }
        lead_s[r] = lead;
        same_s[r] = min(max_blocks, (min(pos_s[r], pos_s[lead]) + 1) / RS_KV_BLOCK);
    }
    __syncthreads();
    const int warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;
    for (int r = warp; r < n_rows; r += n_warps) {
        const int32_t *tr = tables + (size_t)seq_s[r] * max_blocks, *tl = tables + (size_t)seq_s[lead_s[r]] * max_blocks;
        const int n = same_s[r];
        for (int b = lane; b < n; b += 32)
            if (tr[b] != tl[b]) atomicMin(&same_s[r], b);
    }
    __syncthreads();
    for (int r = tid; r < n_rows; r += blockDim.x) {
        int32_t *u = units + (size_t)r * SH_UNIT;
        len_s[r] = 0;
        u[0] = 0, u[1] = 0;
        if (lead_s[r] != r) continue;
        int n = 0, len = max_blocks;
        for (int i = r; i < n_rows && n < cap; i++)
            if (lead_s[i] == r) u[2 + n++] = i, len = min(len, same_s[i]);
        if (n < 2 || len == 0) continue;
        u[0] = n, u[1] = len * RS_KV_BLOCK;
        len_s[r] = len * RS_KV_BLOCK;
    }
    __syncthreads();
    for (int r = tid; r < n_rows; r += blockDim.x) row_start[r] = len_s[lead_s[r]];
}

template <int DT, int W>
static __global__ void __launch_bounds__(AW_THREADS)
attention_shared_kernel(const float *q /* [n_rows][n_heads][hd] */, const void *pages /* [n_blocks][2][16][n_kv][hd] of DT */,
                        rs_kv_scale_mode mode, const float *k_scale /* [n_kv] */,
                        const float *token_scales /* [n_blocks][2][16][n_kv] */, const int32_t *seq_start /* [n_seq + 1] */,
                        int n_seq, const int32_t *tables /* [n_seq][max_blocks] */, int max_blocks, int n_heads, int n_kv,
                        int group, float scale, const int32_t *units /* [n_rows][SH_UNIT] */,
                        const int32_t *row_start /* [n_rows] */, int n_split,
                        float *part_o /* [n_rows][n_heads][n_split][hd] */, float *part_lse /* [n_rows][n_heads][n_split] */) {
    constexpr bool F16 = DT != RS_DTYPE_BF16;
    constexpr int HD = 32 * W;
    __shared__ int32_t tbl_s[AW_TABLE];
    __shared__ int32_t mem_s[SH_ROWS];
    __shared__ float m_s[AW_WARPS][SH_ROWS], l_s[AW_WARPS][SH_ROWS];
    __shared__ float acc_s[AW_WARPS][SH_ROWS * HD];

    const int r = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int32_t *unit = units + (size_t)r * SH_UNIT;
    const int nm = unit[0], len = unit[1];
    if (nm < 2 && row_start[r] > 0) return; /* a member: its leader's block writes its partials */
    const int n_mem = nm < 2 ? 1 : nm, rows_used = n_mem * group;
    if (tid < n_mem) mem_s[tid] = nm < 2 ? r : unit[2 + tid];
    __syncthreads();
    int t_begin, t_end;
    {
        const int per = (len + n_split - 1) / n_split, span = (per + ATT_TILE - 1) / ATT_TILE * ATT_TILE;
        t_begin = sp * span, t_end = min(len, t_begin + span);
    }
    if (t_begin >= t_end) { /* no unit, or an empty split: weight-0 partials of every member's heads */
        for (int i = tid; i < rows_used * HD; i += AW_THREADS) {
            const int row = i / HD;
            const size_t p0 = ((size_t)mem_s[row / group] * n_heads + (size_t)kvh * group + row % group) * n_split + sp;
            part_o[p0 * HD + i % HD] = 0.0f;
            if (i % HD == 0) part_lse[p0] = -INFINITY;
        }
        return;
    }
    const int32_t *table = tables + (size_t)rs_cuda_row_seq(seq_start, n_seq, r) * (size_t)max_blocks;
    const size_t row_elems = (size_t)n_kv * (size_t)HD;
    const bool per_token = DT == RS_DTYPE_E4M3 && mode == RS_KV_SCALE_PER_TOKEN;
    const float head_mul = (DT == RS_DTYPE_E4M3 && !per_token ? scale * k_scale[kvh] : scale) * AW_LOG2E;

    /* Q's A fragments: rows g and g + 8 of the tile (member row / group, head row % group; zero past
     * the unit), k order as in attention_mma_kernel */
    uint32_t qa[W][2][4];
#pragma unroll
    for (int w = 0; w < W; w++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int hi = 0; hi < 2; hi++) {
                const int row = g + 8 * hi;
                const float *qr = q + ((size_t)mem_s[min(row / group, n_mem - 1)] * n_heads + (size_t)kvh * group +
                                       (size_t)(row % group)) * HD + 32 * w + 8 * t + 4 * h;
                qa[w][h][hi] = row < rows_used ? pack2<F16>(qr[0], qr[1]) : 0u;
                qa[w][h][2 + hi] = row < rows_used ? pack2<F16>(qr[2], qr[3]) : 0u;
            }
    float o[W][4][4]; /* tile (w, j): c0, c1 = row g, dims 32 w + 8 t + 2 j + {0,1}; c2, c3 = row g + 8 */
#pragma unroll
    for (int w = 0; w < W; w++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) o[w][j][i] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f}; /* rows g, g + 8 */

    for (int s0 = t_begin; s0 < t_end; s0 += AW_TABLE * RS_KV_BLOCK) {
        const int s1 = min(t_end, s0 + AW_TABLE * RS_KV_BLOCK);
        __syncthreads();
        for (int i = tid; i < (s1 - s0 + RS_KV_BLOCK - 1) / RS_KV_BLOCK; i += AW_THREADS)
            tbl_s[i] = table[s0 / RS_KV_BLOCK + i];
        __syncthreads();
        for (int base = s0 + warp * AM_RUN; base < s1; base += AW_WARPS * AM_RUN) {
            uint32_t kw[2][W][4], vw[2][W][4]; /* positions base + 8 nt + g, operand pairs */
            float kmul[2][2], vmul[2][2];      /* of S columns base + 8 nt + 2 t + i */
            am_load_run<DT, W>(pages, token_scales, tbl_s, s0, s1, base, row_elems, n_kv, kvh, g, t, per_token,
                               head_mul, scale, kw, vw, kmul, vmul);
            /* S = Q K^T: s[nt][0..1] row g, s[nt][2..3] row g + 8 */
            float s[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
#pragma unroll
                for (int i = 0; i < 4; i++) s[nt][i] = 0.0f;
#pragma unroll
                for (int w = 0; w < W; w++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const uint32_t b[2] = {kw[nt][w][2 * h], kw[nt][w][2 * h + 1]};
                        mma16816<F16>(s[nt], qa[w][h], b);
                    }
            }
            /* rows g and g + 8: online softmax over the quad */
            float p[2][4], corr[2];
#pragma unroll
            for (int hi = 0; hi < 2; hi++) {
                float mx = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const float v = base + 8 * nt + 2 * t + i < s1 ? s[nt][2 * hi + i] * kmul[nt][i] : -INFINITY;
                        s[nt][2 * hi + i] = v;
                        mx = fmaxf(mx, v);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mn = fmaxf(m_run[hi], mx); /* finite: the run's first position is in range */
                corr[hi] = exp2f(m_run[hi] - mn);
                float ps = 0.0f;
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        p[nt][2 * hi + i] = exp2f(s[nt][2 * hi + i] - mn);
                        ps += p[nt][2 * hi + i];
                    }
                l_run[hi] = l_run[hi] * corr[hi] + ps;
                m_run[hi] = mn;
            }
#pragma unroll
            for (int w = 0; w < W; w++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    o[w][j][0] *= corr[0], o[w][j][1] *= corr[0];
                    o[w][j][2] *= corr[1], o[w][j][3] *= corr[1];
                }
            /* O += P V: P's A fragment from S's C fragments (rows g, g + 8; k = the run's 16 positions) */
            const uint32_t pa[4] = {pack2<F16>(p[0][0] * vmul[0][0], p[0][1] * vmul[0][1]),
                                    pack2<F16>(p[0][2] * vmul[0][0], p[0][3] * vmul[0][1]),
                                    pack2<F16>(p[1][0] * vmul[1][0], p[1][1] * vmul[1][1]),
                                    pack2<F16>(p[1][2] * vmul[1][0], p[1][3] * vmul[1][1])};
#pragma unroll
            for (int w = 0; w < W; w++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const uint32_t b[2] = {movmatrix_trans(vw[0][w][j]), movmatrix_trans(vw[1][w][j])};
                    mma16816<F16>(o[w][j], pa, b);
                }
        }
    }

    /* the quads' row sums; each warp's partial results into shared memory (a warp without positions
     * leaves m = -inf, weight 0 below) */
#pragma unroll
    for (int hi = 0; hi < 2; hi++) {
        l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], 1);
        l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], 2);
        const int row = g + 8 * hi;
        if (t == 0) m_s[warp][row] = m_run[hi], l_s[warp][row] = l_run[hi];
#pragma unroll
        for (int w = 0; w < W; w++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int i = 0; i < 2; i++) acc_s[warp][row * HD + 32 * w + 8 * t + 2 * j + i] = o[w][j][2 * hi + i];
    }
    __syncthreads();
    for (int i = tid; i < rows_used * HD; i += AW_THREADS) { /* warp 0 saw the range's first position */
        const int row = i / HD;
        float M = m_s[0][row];
#pragma unroll
        for (int w = 1; w < AW_WARPS; w++) M = fmaxf(M, m_s[w][row]);
        float L = 0.0f, O = 0.0f;
#pragma unroll
        for (int w = 0; w < AW_WARPS; w++) {
            const float f = exp2f(m_s[w][row] - M);
            L += l_s[w][row] * f;
            O += acc_s[w][i] * f;
        }
        const size_t p0 = ((size_t)mem_s[row / group] * n_heads + (size_t)kvh * group + row % group) * n_split + sp;
        part_o[p0 * HD + i % HD] = O / L;
        if (i % HD == 0) part_lse[p0] = M * AW_LN2 + logf(L);
    }
}

/* out[r][h] = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse): the splits of list row i
 * (blockIdx.x) and head h (blockIdx.y) merged, and those of its shared pages where sh_o is not NULL
 * (n_sh of them, rows without a list), times the per-head V scale (E4M3 PER_HEAD). */
static __global__ void __launch_bounds__(ATT_THREADS)
attention_combine_kernel(float *out /* [n_tok][n_heads][hd] */, const float *part_o /* [rows][n_heads][n_split][hd] */,
                         const float *part_lse /* [rows][n_heads][n_split] */, const int32_t *rows, int n_heads,
                         int hd, int n_split, int group, const float *v_scale /* [n_kv] or NULL */,
                         const float *sh_o /* [rows][n_heads][n_sh][hd] or NULL */,
                         const float *sh_lse /* [rows][n_heads][n_sh] */, int n_sh) {
    const int i = blockIdx.x, h = blockIdx.y, r = rows ? rows[i] : i;
    const size_t p0 = ((size_t)i * n_heads + (size_t)h) * (size_t)n_split;
    const size_t q0 = ((size_t)i * n_heads + (size_t)h) * (size_t)n_sh;
    if (!sh_o) n_sh = 0;
    float mx = -INFINITY; /* finite: some split of the row's context is not empty */
    for (int sp = 0; sp < n_split; sp++) mx = fmaxf(mx, part_lse[p0 + sp]);
    for (int sp = 0; sp < n_sh; sp++) mx = fmaxf(mx, sh_lse[q0 + sp]);
    float wsum = 0.0f;
    for (int sp = 0; sp < n_split; sp++) wsum += expf(part_lse[p0 + sp] - mx);
    for (int sp = 0; sp < n_sh; sp++) wsum += expf(sh_lse[q0 + sp] - mx);
    const float mul = v_scale ? v_scale[h / group] : 1.0f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int sp = 0; sp < n_split; sp++) {
            const float w = expf(part_lse[p0 + sp] - mx);
            if (w > 0.0f) acc += w * part_o[(p0 + sp) * hd + d];
        }
        for (int sp = 0; sp < n_sh; sp++) {
            const float w = expf(sh_lse[q0 + sp] - mx);
            if (w > 0.0f) acc += w * sh_o[(q0 + sp) * hd + d];
        }
        out[((size_t)r * n_heads + (size_t)h) * hd + d] = acc / wsum * mul;
    }
}

/* What every launch of one op call shares (device pointers from the mirrors). */
struct att_launch {
    float *out;
    const float *q;
    const rs_kv_layer *kv;
    int n_heads;
    float scale;
    const int32_t *dpos, *dstart;
    int n_seq;
    const int32_t *dtab;
    int max_blocks, group;
};

/* Query heads per block (gc) and chunks of the group, for the tile kernel or the warp kernel. */
static void att_chunks(const att_launch *L, bool warps, int *gc, int *n_chunks) {
    const int hd = L->kv->head_dim;
    *gc = warps ? RS_MIN(RS_MIN(L->group, AW_MAX_HEADS), AW_MAX_OUT / hd)
                : RS_MIN(RS_MIN(L->group, ATT_MAX_HEADS), ATT_MAX_OUT / hd); /* >= 4 and >= 8: hd <= 256 */
    *n_chunks = (L->group + *gc - 1) / *gc;
    RS_ASSERT(*n_chunks <= 65535);
}

/* Context splits of a decode launch: enough blocks for two waves of the GPU, at most 32. A function
 * of the row count alone, so that a recorded step replays right at any context length. */
static int decode_splits(const rs_cuda_ctx *c, int n_rows, int n_kv, int n_chunks) {
    if (c->att_splits > 0) return c->att_splits;
    const long base = (long)n_rows * n_kv * n_chunks, want = 2L * RS_MAX(c->sm_count, 1);
    return (int)RS_MAX(1L, RS_MIN(32L, (want + base - 1) / base));
}

/* What launch_shared leaves for the rows' own passes and the combine. */
struct att_shared_parts {
    const int32_t *row_start; /* [n_rows] device: where each row's own pass starts */
    float *o, *lse;           /* the units' partials [n_rows][n_heads][n_split]([hd]) */
    int n_split;
};

/* Decode rows 0..n_rows-1 (every sequence one row): shared_units_kernel, then
 * attention_shared_kernel over the units' shared pages in splits chosen, like decode_splits, from
 * the row count alone (units of cap rows assumed full), so that a recorded step replays right. */
static att_shared_parts launch_shared(rs_cuda_ctx *c, const att_launch *L, int n_rows) {
    const rs_kv_layer *kv = L->kv;
    const int n_kv = kv->n_kv_heads, hd = kv->head_dim, cap = SH_ROWS / L->group;
    int32_t *units = (int32_t *)rs_cuda_scratch(c, RS_CUDA_S_ATT_UNITS, (size_t)n_rows * (SH_UNIT + 1) * sizeof(int32_t));
    int32_t *row_start = units + (size_t)n_rows * SH_UNIT;
    shared_units_kernel<<<1, SH_UNIT_THREADS, 0, c->stream>>>(L->dpos, L->dstart, L->n_seq, L->dtab, L->max_blocks, n_rows, cap,
                                                  units, row_start);
    CUDA_CHECK_LAUNCH();
    c->att_shared_runs++;
    att_shared_parts sh;
    sh.row_start = row_start;
    if (c->att_splits > 0) sh.n_split = c->att_splits;
    else {
        const long base = (long)((n_rows + cap - 1) / cap) * n_kv, want = 2L * RS_MAX(c->sm_count, 1);
        sh.n_split = (int)RS_MAX(1L, RS_MIN(32L, (want + base - 1) / base));
    }
    const size_t np = (size_t)n_rows * (size_t)L->n_heads * (size_t)sh.n_split;
    sh.o = (float *)rs_cuda_scratch(c, RS_CUDA_S_ATT_SH_O, np * (size_t)hd * sizeof(float));
    sh.lse = (float *)rs_cuda_scratch(c, RS_CUDA_S_ATT_SH_LSE, np * sizeof(float));
    const dim3 grid((unsigned)n_rows, (unsigned)n_kv, (unsigned)sh.n_split);
#define SH_ARGS                                                                                                     \
    L->q, kv->pages, kv->scale_mode, kv->k_scale, kv->token_scales, L->dstart, L->n_seq, L->dtab, L->max_blocks,    \
        L->n_heads, n_kv, L->group, L->scale, units, row_start, sh.n_split, sh.o, sh.lse
#define SH_LAUNCH(DT)                                                                                               \
    do {                                                                                                            \
        if (hd == 32) attention_shared_kernel<DT, 1><<<grid, AW_THREADS, 0, c->stream>>>(SH_ARGS);                  \
        else if (hd == 64) attention_shared_kernel<DT, 2><<<grid, AW_THREADS, 0, c->stream>>>(SH_ARGS);             \
        else attention_shared_kernel<DT, 4><<<grid, AW_THREADS, 0, c->stream>>>(SH_ARGS);                           \
    } while (0)
    if (kv->dtype == RS_DTYPE_F32) SH_LAUNCH(RS_DTYPE_F32);
    else if (kv->dtype == RS_DTYPE_BF16) SH_LAUNCH(RS_DTYPE_BF16);
    else SH_LAUNCH(RS_DTYPE_E4M3);
#undef SH_LAUNCH
#undef SH_ARGS
    CUDA_CHECK_LAUNCH();
    return sh;
}

/* Attention over n_rows rows (rows: device list, or NULL for rows 0..n_rows-1): the warp kernel
 * when `warps` (fast numerics' decode rows) and the head size allows it, else the tile kernel
 * (staged per c->att_kernel); in n_split context splits (0: decode_splits), more than one going
 * through the partial buffers and the combine pass. */
static void launch_rows(rs_cuda_ctx *c, const att_launch *L, const int32_t *rows, int n_rows, int n_split, bool warps) {
    const rs_kv_layer *kv = L->kv;
    const int n_kv = kv->n_kv_heads, hd = kv->head_dim;
    warps = warps && aw_takes(hd);
    const bool mma = warps && c->att_kernel == RS_CUDA_ATTENTION_MMA && am_takes(hd);
    int gc, n_chunks; /* the warp kernel's chunks serve the mma kernel too (hd <= 128: up to 8 heads) */
    att_chunks(L, warps, &gc, &n_chunks);
    if (n_split == 0) n_split = decode_splits(c, n_rows, n_kv, n_chunks);
    /* pages shared by rows: the units, their partials (shared.o, .lse) and each row's own start */
    const bool shared = warps && c->att_shared && !rows && n_rows >= 2 && n_rows <= SH_MAX_ROWS && sh_takes(hd, L->group);
    att_shared_parts sh = {};
    if (shared) sh = launch_shared(c, L, n_rows);
    float *part_o = NULL, *part_lse = NULL;
    if (n_split > 1 || shared) {
        const size_t np = (size_t)n_rows * (size_t)L->n_heads * (size_t)n_split;
        part_o = (float *)rs_cuda_scratch(c, RS_CUDA_S_ATT_PART_O, np * (size_t)hd * sizeof(float));
        part_lse = (float *)rs_cuda_scratch(c, RS_CUDA_S_ATT_PART_LSE, np * sizeof(float));
    }
    RS_ASSERT((size_t)n_chunks * (size_t)n_split <= 65535u);
    const dim3 grid((unsigned)n_rows, (unsigned)n_kv, (unsigned)(n_chunks * n_split));
#define ATT_ARGS                                                                                                    \
    L->out, L->q, kv->pages, kv->scale_mode, kv->k_scale, kv->v_scale, kv->token_scales, L->dpos, L->dstart,         \
        L->n_seq, L->dtab, L->max_blocks, L->n_heads, n_kv, hd, L->group, gc, L->scale, rows, n_chunks, n_split,     \
        part_o, part_lse, sh.row_start
#define AW_LAUNCH_PF(DT, G)                                                                                         \
    do {                                                                                                            \
        if (c->att_kernel == RS_CUDA_ATTENTION_PIPELINED || c->att_kernel == RS_CUDA_ATTENTION_MMA)                 \
            attention_warps_kernel<DT, G, true><<<grid, AW_THREADS, 0, c->stream>>>(ATT_ARGS);                      \
        else attention_warps_kernel<DT, G, false><<<grid, AW_THREADS, 0, c->stream>>>(ATT_ARGS);                    \
    } while (0)
#define AW_LAUNCH_G(DT)                                                                                             \
    do {                                                                                                            \
        if (gc <= 1) AW_LAUNCH_PF(DT, 1);                                                                           \
        else if (gc <= 2) AW_LAUNCH_PF(DT, 2);                                                                      \
        else if (gc <= 4) AW_LAUNCH_PF(DT, 4);                                                                      \
        else AW_LAUNCH_PF(DT, 8);                                                                                   \
    } while (0)
#define AM_LAUNCH(DT)                                                                                               \
    do {                                                                                                            \
        if (hd == 32) attention_mma_kernel<DT, 1><<<grid, AW_THREADS, 0, c->stream>>>(ATT_ARGS);                    \
        else if (hd == 64) attention_mma_kernel<DT, 2><<<grid, AW_THREADS, 0, c->stream>>>(ATT_ARGS);               \
        else attention_mma_kernel<DT, 4><<<grid, AW_THREADS, 0, c->stream>>>(ATT_ARGS);                             \
    } while (0)
#define ATT_LAUNCH(DT)                                                                                              \
    do {                                                                                                            \
        if (mma) AM_LAUNCH(DT);                                                                                     \
        else if (warps) AW_LAUNCH_G(DT);                                                                            \
        else if (c->att_kernel == RS_CUDA_ATTENTION_STAGED)                                                         \
            attention_kernel<DT, true><<<grid, ATT_THREADS, 0, c->stream>>>(ATT_ARGS);                              \
        else attention_kernel<DT, false><<<grid, ATT_THREADS, 0, c->stream>>>(ATT_ARGS);                            \
    } while (0)
    if (kv->dtype == RS_DTYPE_F32) ATT_LAUNCH(RS_DTYPE_F32);
    else if (kv->dtype == RS_DTYPE_BF16) ATT_LAUNCH(RS_DTYPE_BF16);
    else ATT_LAUNCH(RS_DTYPE_E4M3);
#undef ATT_LAUNCH
#undef AW_LAUNCH_G
#undef AW_LAUNCH_PF
#undef AM_LAUNCH
#undef ATT_ARGS
    CUDA_CHECK_LAUNCH();
    if (!part_o) return;
    const float *vs = kv->dtype == RS_DTYPE_E4M3 && kv->scale_mode == RS_KV_SCALE_PER_HEAD ? kv->v_scale : NULL;
    attention_combine_kernel<<<dim3((unsigned)n_rows, (unsigned)L->n_heads), ATT_THREADS, 0, c->stream>>>(
        L->out, part_o, part_lse, rows, L->n_heads, hd, n_split, L->group, vs, sh.o, sh.lse, sh.n_split);
    CUDA_CHECK_LAUNCH();
}

/* Fast numerics: decode rows (sequences with one row in the step) through the split-context
 * kernel, prefill chunks through the tensor-core kernel (cuda_attention_tc.cu) where the head size
 * allows it, else through the split kernel too. */
static void attention_fast(rs_cuda_ctx *c, const att_launch *L, const rs_batch *batch) {
    const int n_seq = batch->n_seq, n_tok = batch->n_tok;
    bool all_single = true;
    for (int s = 0; s < n_seq && all_single; s++) all_single = batch->seq_start[s + 1] - batch->seq_start[s] <= 1;
    const bool warps = c->att_kernel == RS_CUDA_ATTENTION_WARPS || c->att_kernel == RS_CUDA_ATTENTION_PIPELINED ||
                       c->att_kernel == RS_CUDA_ATTENTION_MMA;
    if (all_single) { /* a decode step: every row, no list (what a step graph records) */
        launch_rows(c, L, NULL, n_tok, 0, warps);
        return;
    }
    const bool tc = rs_cuda_attention_tc_takes(L->kv->head_dim);
    int32_t *rows = (int32_t *)rs_xmalloc((size_t)n_tok * sizeof(int32_t)), *tiles = (int32_t *)rs_xmalloc(
        ((size_t)n_tok + (size_t)n_seq) * 4 * sizeof(int32_t));
    int n_rows = 0, n_tiles = 0;
    for (int s = 0; s < n_seq; s++) {
        const int r0 = batch->seq_start[s], r1 = batch->seq_start[s + 1];
        if (r1 - r0 == 1 || (!tc && r1 > r0)) {
            for (int r = r0; r < r1; r++) rows[n_rows++] = r;
            continue;
        }
        for (int t = r0; t < r1; t += RS_CUDA_ATT_TC_ROWS) { /* tiles of the chunk's rows */
            int32_t *tl = tiles + 4 * (size_t)n_tiles++;
            tl[0] = s, tl[1] = t, tl[2] = RS_MIN(RS_CUDA_ATT_TC_ROWS, r1 - t), tl[3] = 0;
        }
    }
    if (n_rows) {
        const int32_t *drows = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_ATTN_ROWS, rows, (size_t)n_rows * sizeof(int32_t));
        launch_rows(c, L, drows, n_rows, 0, warps);
    }
    if (n_tiles) {
        const int32_t *dtiles =
            (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_ATTN_TILES, tiles, (size_t)n_tiles * 4 * sizeof(int32_t));
        rs_cuda_attention_tc(c, L->out, L->q, L->kv, L->n_heads, L->scale, L->dpos, dtiles, n_tiles, L->dtab,
                             L->max_blocks);
    }
    free(rows), free(tiles);
}

void rs_cuda_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                          float scale, const rs_batch *batch) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    kv_layer_check(kv);
    const int n_tok = batch->n_tok, n_seq = batch->n_seq, n_kv = kv->n_kv_heads, hd = kv->head_dim;
    if (n_tok <= 0) return;
    RS_ASSERT(n_heads > 0 && n_heads % n_kv == 0);
    RS_ASSERT(hd <= ATT_MAX_HD);
    RS_ASSERT(n_seq > 0 && batch->max_blocks > 0);

    /* the CPU's checks, plus: every row belongs to a sequence, and every page a row reads is one of
     * the layer's (the CPU asserts that as it reads; the kernel cannot) */
    int32_t *row_seq = (int32_t *)rs_xmalloc((size_t)n_tok * sizeof(int32_t));
    for (int r = 0; r < n_tok; r++) row_seq[r] = -1;
    for (int s = 0; s < n_seq; s++) {
        const int r0 = batch->seq_start[s], r1 = batch->seq_start[s + 1];
        RS_ASSERT(r0 >= 0 && r0 <= r1 && r1 <= n_tok);
        int max_pos = -1;
        for (int r = r0; r < r1; r++) {
            const int p = batch->pos[r];
            RS_ASSERT(p >= 0 && p < batch->seq_ctx[s] && p < batch->max_blocks * RS_KV_BLOCK);
            row_seq[r] = s;
            max_pos = RS_MAX(max_pos, p);
        }
        const int32_t *table = batch->block_tables + (size_t)s * (size_t)batch->max_blocks;
        if (max_pos >= 0)
            for (int blk = 0; blk <= max_pos / RS_KV_BLOCK; blk++)
                RS_ASSERT(table[blk] >= 0 && table[blk] < kv->n_blocks);
    }
    for (int r = 0; r < n_tok; r++) RS_ASSERT(row_seq[r] >= 0);

    const int group = n_heads / n_kv;
    RS_ASSERT(n_kv <= 65535);

    const int32_t *dpos = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_ATTN_POS, batch->pos, (size_t)n_tok * sizeof(int32_t));
    const int32_t *dstart = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_ATTN_SEQ_START, batch->seq_start,
                                                               ((size_t)n_seq + 1) * sizeof(int32_t));
    const int32_t *dtab = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_ATTN_TABLES, batch->block_tables,
                                                             (size_t)n_seq * (size_t)batch->max_blocks * sizeof(int32_t));
    free(row_seq);

    const att_launch L = {out, q, kv, n_heads, scale, dpos, dstart, n_seq, dtab, batch->max_blocks, group};
    if (c->numerics == RS_NUMERICS_FAST) attention_fast(c, &L, batch);
    else launch_rows(c, &L, NULL, n_tok, 1, false);
}

/* ---- C-callable hook for tests/unit/test_cuda_attention_fast.c ---- */

/* backend.h: the attention kernel of the launches from now on (a step graph recorded earlier
 * replays the kernel it recorded). */
extern "C" void rs_backend_cuda_set_attention_kernel(rs_backend *b, rs_cuda_attention_kernel k) {
    RS_ASSERT(k == RS_CUDA_ATTENTION_TILES || k == RS_CUDA_ATTENTION_STAGED || k == RS_CUDA_ATTENTION_WARPS ||
              k == RS_CUDA_ATTENTION_PIPELINED || k == RS_CUDA_ATTENTION_MMA);
    rs_cuda_ctx_of(b)->att_kernel = k;
}

/* backend.h: fast numerics' decode steps read pages that rows share once per unit, from now on. */
extern "C" void rs_backend_cuda_set_attention_shared(rs_backend *b, bool on) { rs_cuda_ctx_of(b)->att_shared = on; }

extern "C" unsigned long long rs_cuda_test_attention_shared_runs(rs_backend *b) {
    return rs_cuda_ctx_of(b)->att_shared_runs;
}

/* Fast numerics' decode attention in n context splits from now on (0: chosen by size). */
extern "C" void rs_cuda_test_attention_splits(rs_backend *b, int n) {
    RS_ASSERT(n >= 0 && n <= 64);
    rs_cuda_ctx_of(b)->att_splits = n;
}
