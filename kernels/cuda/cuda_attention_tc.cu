/*
 * cuda_attention_tc.cu — causal attention of prefill chunks over the paged KV cache on tensor cores
 * (fast numerics), FlashAttention-2 style with mma.sync.m16n8k16 -> fp32, in F16 operands for F32
 * and E4M3 pages and BF16 operands for BF16 pages.
 *
 * Block (tile, head h): up to 64 consecutive rows of one sequence (a chunk of its prefill), four
 * warps of 16 rows each; the query rows go into BF16 A fragments once. The context 0 .. the tile's
 * last position goes by tiles of BN positions (64, or 32 for head sizes above 128): the block
 * decodes the K and V rows of the tile from their pages into shared memory in the operand type
 * (F32 pages round to F16, E4M3 codes convert to F16 exactly, BF16 pages are copied), with each
 * position's
 * score multiplier (scale, times k_scale[kvh] for PER_HEAD or its own K scale for PER_TOKEN) and V
 * weight (its V scale for PER_TOKEN, else 1). Each warp then computes S = Q K^T for its 16 rows
 * (fp32 accumulators), masks positions after each row's own (causal) and outside the tile, keeps
 * the running row max and sum of exp (fp32, expf), rescales its output accumulators, turns the
 * probabilities (times the V weights) into A fragments in registers (the C fragment layout of
 * S is the A layout of P: no shuffles) and accumulates O += P V. The end divides by the row sums
 * (the four lanes of a row hold partial sums) and applies v_scale[kvh] for PER_HEAD.
 *
 * Fragment layouts are the PTX ISA's for m16n8k16 (.row.col), with g = lane / 4, t = lane % 4:
 * A's registers hold rows g, g+8 and columns 2t, 2t+1 (+8 for registers 2 and 3); B's hold rows
 * (k) 2t, 2t+1 (+8) of column g; C's hold rows g, g+8 and columns 2t, 2t+1. K rows in shared
 * memory are [position][dim pair] words, so B = K^T takes one word per register; V is
 * [position][dim] BF16, so P V's B takes two 16-bit loads. Rows are padded by 8 BF16 to spread the
 * banks.
 *
 * Compared with the exact kernel (cuda_attention.cu) under a tolerance: Q and P round to the
 * operand type here (and F32 K/V to F16). F16's 11 significant bits rather than BF16's 8 where the
 * pages allow it (E4M3 values are F16 values; F32 K/V are far inside F16's range): BF16 Q and K
 * moved the fixture models' FP8 logprobs by 0.16 on average against the exact kernel, F16 by
 * ~0.003 (tests/unit/test_cuda_fast.c). BF16 pages keep BF16 operands (their values need BF16's
 * range). Head sizes 32, 64, 128 and 256 (rs_cuda_attention_tc_takes); the fast dispatch sends
 * others to the split kernel.
 */
#include <math.h>

#include "cuda_act.h"
#include "cuda_internal.h"
#include "cuda_mma.h"

#define TC_THREADS 128 /* 4 warps x 16 rows = RS_CUDA_ATT_TC_ROWS */

static_assert(TC_THREADS / 32 * 16 == RS_CUDA_ATT_TC_ROWS, "a warp per 16 query rows");

/* Element i of the pages as operand bits: BF16 pages as they are (BF16 operands); F32 pages
 * rounded to F16, E4M3 codes converted exactly to F16 (F16 operands). */
template <int DT>
__device__ __forceinline__ uint32_t page_bits(const void *pages, size_t i) {
    if (DT == RS_DTYPE_BF16) return ((const uint16_t *)pages)[i];
    if (DT == RS_DTYPE_F32) return op_bits<true>(((const float *)pages)[i]);
    return __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)pages)[i], __NV_E4M3).x;
}

template <int DT, int HD, bool F16 = DT != RS_DTYPE_BF16>
static __global__ void __launch_bounds__(TC_THREADS)
attention_tc_kernel(float *out /* [n_tok][n_heads][HD] */, const float *q /* [n_tok][n_heads][HD] */,
                    const void *pages /* [n_blocks][2][16][n_kv][HD] of DT */, rs_kv_scale_mode mode,
                    const float *k_scale, const float *v_scale, const float *token_scales,
                    const int32_t *pos /* [n_tok] */, const int32_t *tiles /* [n_tiles][4] */,
                    const int32_t *tables /* [n_seq][max_blocks] */, int max_blocks, int n_heads, int n_kv, int group,
                    float scale) {
    constexpr int BN = HD <= 128 ? 64 : 32, KP = HD + 8, NC = BN / 8, KC = HD / 16, DC = HD / 8;
    __shared__ uint32_t k_s[BN][KP / 2]; /* K rows as BF16 pairs of dims (2d, 2d + 1) */
    __shared__ uint16_t v_s[BN][KP];
    __shared__ float kmul_s[BN], vmul_s[BN];
    __shared__ int qmax_s;

    const int32_t *tl = tiles + 4 * (size_t)blockIdx.x;
    const int seq = tl[0], row0 = tl[1], nrows = tl[2];
    const int h = blockIdx.y, kvh = h / group;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wr0 = warp * 16;
    const bool per_token = DT == RS_DTYPE_E4M3 && mode == RS_KV_SCALE_PER_TOKEN;
    const float head_mul = DT == RS_DTYPE_E4M3 && !per_token ? scale * k_scale[kvh] : scale;
    const int32_t *table = tables + (size_t)seq * (size_t)max_blocks;
    const size_t row_elems = (size_t)n_kv * HD;

    int qp[2]; /* positions of this lane's rows g and g + 8; -1 past the tile */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int rr = wr0 + g + 8 * i;
        qp[i] = rr < nrows ? pos[row0 + rr] : -1;
    }
    if (tid == 0) {
        int mx = 0;
        for (int rr = 0; rr < nrows; rr++) mx = max(mx, pos[row0 + rr]);
        qmax_s = mx;
    }
    uint32_t qa[KC][4];
#pragma unroll
    for (int kc = 0; kc < KC; kc++) {
#pragma unroll
        for (int reg = 0; reg < 4; reg++) {
            const int rr = wr0 + g + ((reg & 1) ? 8 : 0), col = kc * 16 + 2 * t + ((reg & 2) ? 8 : 0);
            const float *qr = q + ((size_t)(row0 + rr) * (size_t)n_heads + (size_t)h) * HD + col;
            qa[kc][reg] = rr < nrows ? pack2<F16>(qr[0], qr[1]) : 0u;
        }
    }
    float o[DC][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int dc = 0; dc < DC; dc++)
#pragma unroll
        for (int i = 0; i < 4; i++) o[dc][i] = 0.0f;
    __syncthreads();
    const int qmax = qmax_s;

    for (int t0 = 0; t0 <= qmax; t0 += BN) {
        const int n = min(BN, qmax + 1 - t0);
        for (int e = tid; e < BN * HD / 2; e += TC_THREADS) { /* dims 2 dp, 2 dp + 1 of position j */
            const int j = e / (HD / 2), d = 2 * (e % (HD / 2));
            uint32_t kb = 0, vb = 0;
            if (j < n) {
                const int p = t0 + j;
                const size_t krow = ((size_t)table[p / RS_KV_BLOCK] * 2) * RS_KV_BLOCK + (size_t)(p % RS_KV_BLOCK);
                const size_t ka = krow * row_elems + (size_t)kvh * HD + d, va = ka + RS_KV_BLOCK * row_elems;
                kb = page_bits<DT>(pages, ka) | (page_bits<DT>(pages, ka + 1) << 16);
                vb = page_bits<DT>(pages, va) | (page_bits<DT>(pages, va + 1) << 16);
            }
            k_s[j][d / 2] = kb;
            v_s[j][d] = (uint16_t)(vb & 0xffffu), v_s[j][d + 1] = (uint16_t)(vb >> 16);
        }
        if (tid < BN) {
            float km = 0.0f, vm = 0.0f;
            if (tid < n) {
                const int p = t0 + tid;
                const size_t krow = ((size_t)table[p / RS_KV_BLOCK] * 2) * RS_KV_BLOCK + (size_t)(p % RS_KV_BLOCK);
                km = per_token ? scale * token_scales[krow * (size_t)n_kv + (size_t)kvh] : head_mul;
                vm = per_token ? token_scales[(krow + RS_KV_BLOCK) * (size_t)n_kv + (size_t)kvh] : 1.0f;
            }
            kmul_s[tid] = km, vmul_s[tid] = vm;
        }
        __syncthreads();

        /* S = Q K^T for the warp's 16 rows and the tile's BN positions */
        float s[NC][4];
#pragma unroll
        for (int c = 0; c < NC; c++) {
#pragma unroll
            for (int i = 0; i < 4; i++) s[c][i] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < KC; kc++) {
                uint32_t b[2];
                b[0] = k_s[c * 8 + g][kc * 8 + t];     /* dims kc*16 + 2t, +1 */
                b[1] = k_s[c * 8 + g][kc * 8 + 4 + t]; /* dims kc*16 + 8 + 2t, +1 */
                mma16816<F16>(s[c], qa[kc], b);
            }
        }
        /* scale, causal mask, running max */
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = i >> 1, col = c * 8 + 2 * t + (i & 1);
                const bool live = qp[row] >= 0 && col < n && t0 + col <= qp[row];
                s[c][i] = live ? s[c][i] * kmul_s[col] : -INFINITY;
                mx[row] = fmaxf(mx[row], s[c][i]);
            }
        float corr[2];
#pragma unroll
        for (int row = 0; row < 2; row++) {
            mx[row] = fmaxf(mx[row], __shfl_xor_sync(RS_CUDA_FULL_MASK, mx[row], 1));
            mx[row] = fmaxf(mx[row], __shfl_xor_sync(RS_CUDA_FULL_MASK, mx[row], 2));
            const float m_new = fmaxf(m[row], mx[row]);
            corr[row] = m_new == -INFINITY ? 1.0f : expf(m[row] - m_new); /* exp(-inf) = 0 on the first tile */
            m[row] = m_new;
            l[row] *= corr[row];
        }
#pragma unroll
        for (int dc = 0; dc < DC; dc++) {
            o[dc][0] *= corr[0], o[dc][1] *= corr[0];
            o[dc][2] *= corr[1], o[dc][3] *= corr[1];
        }
        /* P = exp(S - m): row sums, then times the V weights */
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = i >> 1, col = c * 8 + 2 * t + (i & 1);
                const float p = s[c][i] == -INFINITY ? 0.0f : expf(s[c][i] - m[row]);
                l[row] += p;
                s[c][i] = p * vmul_s[col];
            }
        /* O += P V, P's A fragments straight from S's C fragments */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t a[4];
            a[0] = pack2<F16>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<F16>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<F16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<F16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dc = 0; dc < DC; dc++) {
                const int j0 = kk * 16 + 2 * t, d = dc * 8 + g;
                uint32_t b[2];
                b[0] = (uint32_t)v_s[j0][d] | ((uint32_t)v_s[j0 + 1][d] << 16);
                b[1] = (uint32_t)v_s[j0 + 8][d] | ((uint32_t)v_s[j0 + 9][d] << 16);
                mma16816<F16>(o[dc], a, b);
            }
        }
        __syncthreads(); /* the next tile rewrites the shared arrays */
    }

#pragma unroll
    for (int row = 0; row < 2; row++) {
        l[row] += __shfl_xor_sync(RS_CUDA_FULL_MASK, l[row], 1);
        l[row] += __shfl_xor_sync(RS_CUDA_FULL_MASK, l[row], 2);
    }
    const float out_mul = DT == RS_DTYPE_E4M3 && !per_token ? v_scale[kvh] : 1.0f;
#pragma unroll
    for (int dc = 0; dc < DC; dc++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = i >> 1, rr = wr0 + g + 8 * row;
            if (rr < nrows)
                out[((size_t)(row0 + rr) * (size_t)n_heads + (size_t)h) * HD + dc * 8 + 2 * t + (i & 1)] =
                    o[dc][i] / l[row] * out_mul;
        }
}

bool rs_cuda_attention_tc_takes(int head_dim) {
    return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

template <int HD>
static void launch_hd(rs_cuda_ctx *c, float *out, const float *q, const rs_kv_layer *kv, int n_heads, float scale,
                      const int32_t *pos, const int32_t *tiles, int n_tiles, const int32_t *tables, int max_blocks) {
    const dim3 grid((unsigned)n_tiles, (unsigned)n_heads);
    const int group = n_heads / kv->n_kv_heads;
#define TC_LAUNCH(DT)                                                                                             \
    attention_tc_kernel<DT, HD><<<grid, TC_THREADS, 0, c->stream>>>(out, q, kv->pages, kv->scale_mode, kv->k_scale, \
                                                                     kv->v_scale, kv->token_scales, pos, tiles,    \
                                                                     tables, max_blocks, n_heads, kv->n_kv_heads,  \
                                                                     group, scale)
    if (kv->dtype == RS_DTYPE_F32) TC_LAUNCH(RS_DTYPE_F32);
    else if (kv->dtype == RS_DTYPE_BF16) TC_LAUNCH(RS_DTYPE_BF16);
    else TC_LAUNCH(RS_DTYPE_E4M3);
#undef TC_LAUNCH
    CUDA_CHECK_LAUNCH();
}

void rs_cuda_attention_tc(rs_cuda_ctx *c, float *out, const float *q, const rs_kv_layer *kv, int n_heads, float scale,
                          const int32_t *pos, const int32_t *tiles, int n_tiles, const int32_t *tables, int max_blocks) {
    RS_ASSERT(n_tiles > 0 && n_tiles <= INT32_MAX && n_heads <= 65535);
    switch (kv->head_dim) {
    case 32: launch_hd<32>(c, out, q, kv, n_heads, scale, pos, tiles, n_tiles, tables, max_blocks); break;
    case 64: launch_hd<64>(c, out, q, kv, n_heads, scale, pos, tiles, n_tiles, tables, max_blocks); break;
    case 128: launch_hd<128>(c, out, q, kv, n_heads, scale, pos, tiles, n_tiles, tables, max_blocks); break;
    default: RS_ASSERT(kv->head_dim == 256);
        launch_hd<256>(c, out, q, kv, n_heads, scale, pos, tiles, n_tiles, tables, max_blocks); break;
    }
}
