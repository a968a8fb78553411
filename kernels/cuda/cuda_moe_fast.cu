/*
 * cuda_moe_fast.cu — the Qwen3-MoE block in fast numerics (cuda_moe.cu has the exact one and the
 * dispatch): routing on the device, and for decode-sized steps the whole block on the device with
 * no host round trip (so that a decode step with MoE layers records as a step graph).
 *
 *   route    one thread per row: softmax of the router logits (fp32, expf: the device's), the top
 *            k (ties to the lower expert), optional renormalization — moe_route.c's algorithm —
 *            and the row's k selections ordered by expert index (the order the outputs are added
 *            in, as on the CPU).
 *   group    (larger steps) the selections counted per expert and listed in row order, one thread
 *            per expert; only the expert offsets [E + 1] go to the host, which then runs one
 *            gather + gate/up/down matmul (cuBLASLt above the GEMV size) + scatter-add per hit
 *            expert (cuda_moe.cu). CUDA 13.0's cuBLASLt has no grouped block-scaled GEMM (added
 *            in 13.2 Update 1): one call per expert group is the library's way.
 *   fused    (up to RS_CUDA_MOE_FUSED_ROWS rows) every (row, selection) pair at once: the pair's
 *            gate and up GEMVs reading its expert's weights through a device table of expert
 *            pointers, silu * up, the activation's 1x128 quantization (E4M3 experts), the down
 *            GEMV, and per row the k weighted outputs added in expert order (product rounded, then
 *            added, as cpu_moe.c does). E4M3 experts take the fast FP8 GEMV's arithmetic (the
 *            activation's codes, exact fp32 products summed per lane in fp32, per-block scales);
 *            BF16 experts fp32 activations times widened weights.
 * The expert tables (per layer: each expert's gate/up/down data and scale pointers) live on the
 * device and are rebuilt when a weight commit moves an expert.
 */
#include <math.h>
#include <string.h>

#include "cuda_act.h"

#define MOE_WARPS 8

/* ---- routing ---- */

/* Row r (one thread): moe_route_row's softmax and top-k over logits [rows][E] (in place), then
 * sel_e / sel_w [rows][k] in ascending expert order. */
__global__ void moe_route_kernel(float *logits, int rows, int E, int k, bool norm, int32_t *sel_e, float *sel_w) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float *l = logits + (size_t)r * E;
    float mx = l[0], sum = 0.0f;
    for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
    for (int e = 0; e < E; e++) {
        l[e] = expf(l[e] - mx);
        sum += l[e];
    }
    for (int e = 0; e < E; e++) l[e] = l[e] / sum;
    int32_t *se = sel_e + (size_t)r * k;
    float *sw = sel_w + (size_t)r * k;
    for (int i = 0; i < k; i++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int m = 0; m < i; m++) taken |= se[m] == e;
            if (!taken && (best < 0 || l[e] > l[best])) best = e;
        }
        se[i] = best;
        sw[i] = l[best];
    }
    if (norm) {
        float s = 0.0f;
        for (int i = 0; i < k; i++) s += sw[i];
        for (int i = 0; i < k; i++) sw[i] = sw[i] / s;
    }
    for (int i = 1; i < k; i++) /* ascending expert order: the order outputs are added in */
        for (int j = i; j > 0 && se[j - 1] > se[j]; j--) {
            const int32_t te = se[j];
            se[j] = se[j - 1], se[j - 1] = te;
            const float tw = sw[j];
            sw[j] = sw[j - 1], sw[j - 1] = tw;
        }
}

/* Expert e (one thread): its selections in row order; offsets [E + 1] from thread 0's count. */
__global__ void moe_group_kernel(const int32_t *sel_e, const float *sel_w, int n_sel, int E, int32_t *offsets,
                                 int32_t *rows_out, float *wts_out, int k) {
    __shared__ int32_t counts[1024];
    const int e = threadIdx.x;
    if (e < E) {
        int c = 0;
        for (int i = 0; i < n_sel; i++) c += sel_e[i] == e;
        counts[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        for (int i = 0; i < E; i++) offsets[i + 1] = offsets[i] + counts[i];
    }
    __syncthreads();
    if (e < E) {
        int at = offsets[e];
        for (int i = 0; i < n_sel; i++)
            if (sel_e[i] == e) rows_out[at] = i / k, wts_out[at] = sel_w[i], at++;
    }
}

/* ---- expert tables ---- */

/* Pointer table of one layer's experts: [6][E] = gate, gate scales, up, up scales, down, down scales. */
struct rs_cuda_moe_table {
    const rs_tensor *key; /* the layer's gate array */
    int E;
    const void **host;    /* [6 E] the pointers as last uploaded */
    const void **dev;     /* [6 E] on the device */
};

#define MOE_TABLES 256

/* Expert e's six pointers, in the table's order. */
static void expert_ptrs(const rs_moe_weights *w, int e, const void *p[6]) {
    p[0] = w->gate[e].data, p[1] = w->gate[e].scale_inv, p[2] = w->up[e].data, p[3] = w->up[e].scale_inv;
    p[4] = w->down[e].data, p[5] = w->down[e].scale_inv;
}

static const void *const *moe_table(rs_cuda_ctx *c, const rs_moe_weights *w) {
    const int E = w->n_experts;
    rs_cuda_moe_table *t = NULL;
    for (int i = 0; i < c->n_moe_tables && !t; i++)
        if (c->moe_tables[i].key == w->gate && c->moe_tables[i].E == E) t = &c->moe_tables[i];
    if (!t) {
        RS_ASSERT(c->n_moe_tables < MOE_TABLES);
        if (!c->moe_tables) c->moe_tables = (rs_cuda_moe_table *)rs_xcalloc(MOE_TABLES, sizeof *c->moe_tables);
        t = &c->moe_tables[c->n_moe_tables++];
        t->key = w->gate, t->E = E;
        t->host = (const void **)rs_xcalloc((size_t)6 * E, sizeof(void *));
        rs_backend_cuda_capture_lock();
        CUDA_CHECK(cudaMalloc((void **)&t->dev, (size_t)6 * E * sizeof(void *)));
        rs_backend_cuda_capture_unlock();
    }
    bool same = true;
    for (int e = 0; e < E && same; e++) {
        const void *p[6];
        expert_ptrs(w, e, p);
        for (int j = 0; j < 6; j++) same &= t->host[j * E + e] == p[j];
    }
    if (!same) {
        /* recording: the device table is not rewritten, so neither is its host copy (the op-by-op
         * rerun must see the difference and upload) */
        if (c->recording) {
            rs_cuda_recording_broken(c, "a weight commit moved an expert");
            return t->dev;
        }
        for (int e = 0; e < E; e++) {
            const void *p[6];
            expert_ptrs(w, e, p);
            for (int j = 0; j < 6; j++) t->host[j * E + e] = p[j];
        }
        CUDA_CHECK(cudaMemcpyAsync(t->dev, t->host, (size_t)6 * E * sizeof(void *), cudaMemcpyHostToDevice, c->stream));
        c->mem_gen++; /* recorded steps read this table: it holds other pointers now, they go */
    }
    return t->dev;
}

void rs_cuda_moe_tables_free(rs_cuda_ctx *c) {
    for (int i = 0; i < c->n_moe_tables; i++) {
        free(c->moe_tables[i].host);
        rs_backend_cuda_capture_lock();
        CUDA_CHECK(cudaFree(c->moe_tables[i].dev));
        rs_backend_cuda_capture_unlock();
    }
    free(c->moe_tables);
    c->moe_tables = NULL;
    c->n_moe_tables = 0;
}

/* ---- fused small-batch path ---- */

/* Block (o-block, pair p): warp w computes output o = blockIdx.x * MOE_WARPS + w of the pair's
 * expert matrix W = tab[which][e] (e = sel_e[p]) [n_out][k_in] against input row
 * xrow = p / div: E4M3 weights with the row's codes and scales (the fast FP8 GEMV's arithmetic),
 * or BF16 weights with its fp32 values. */
template <bool FP8>
__global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_pair_gemv_kernel(float *__restrict__ out /* [pairs][ld_out] */, int n_out, int ld_out, int k_in,
                         const float *__restrict__ xf /* [*][k_in] f32 (BF16 weights) */,
                         const uint8_t *__restrict__ xq /* [*][k_in] e4m3 */, const float *__restrict__ xs /* [*][L] */,
                         int div, const int32_t *__restrict__ sel_e, const void *const *__restrict__ tab, int which,
                         int E) {
    const int lane = threadIdx.x & 31, o = blockIdx.x * MOE_WARPS + threadIdx.x / 32, p = blockIdx.y;
    if (o >= n_out) return;
    const int e = sel_e[p], xr = p / div;
    const void *wd = tab[(2 * which) * E + e];
    float acc = 0.0f;
    if (FP8) {
        const int L = (k_in + RS_FP8_BLOCK - 1) / RS_FP8_BLOCK, g = lane >> 3, q = lane & 7;
        const uint8_t *wrow = (const uint8_t *)wd + (int64_t)o * k_in;
        const float *wsrow = (const float *)tab[(2 * which + 1) * E + e] + (int64_t)(o / RS_FP8_BLOCK) * L;
        const uint8_t *xrow = xq + (int64_t)xr * k_in;
        const bool vec = k_in % 16 == 0 && ((uintptr_t)wrow & 15) == 0 && ((uintptr_t)xrow & 15) == 0;
        for (int b0 = 0; b0 < L; b0 += 4) {
            const int b = b0 + g;
            const int64_t j0 = (int64_t)b * RS_FP8_BLOCK + q * 16;
            if (b >= L || j0 >= k_in) continue;
            uint32_t w4[4], x4[4];
            rs_cuda_load_codes16(w4, wrow + j0, k_in - j0, vec);
            rs_cuda_load_codes16(x4, xrow + j0, k_in - j0, vec);
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float wf[4], xv[4];
                rs_cuda_e4m3x4_f32(w4[i], wf);
                rs_cuda_e4m3x4_f32(x4[i], xv);
#pragma unroll
                for (int t = 0; t < 4; t++) s = fmaf(xv[t], wf[t], s);
            }
            acc = fmaf(s, xs[(int64_t)xr * L + b] * wsrow[b], acc);
        }
    } else {
        const uint16_t *wrow = (const uint16_t *)wd + (int64_t)o * k_in;
        const float *xrow = xf + (int64_t)xr * k_in;
        for (int j = lane; j < k_in; j += 32) acc = fmaf(xrow[j], __uint_as_float((uint32_t)wrow[j] << 16), acc);
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(RS_CUDA_FULL_MASK, acc, off);
    if (lane == 0) out[(int64_t)p * ld_out + o] = acc;
}

/* act[p][i] = silu(gate) * up over the pair's gu row [gate | up]. */
__global__ void moe_silu_kernel(float *act /* [pairs][inter] */, const float *gu /* [pairs][2 inter] */, int inter,
                                size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t p = i / (size_t)inter, j = i % (size_t)inter;
        const float g = gu[p * 2 * inter + j], u = gu[p * 2 * inter + inter + j];
        act[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
    }
}

/* out[r][d] = sum over the row's k pairs (ascending expert) of y[p][d] * w[p], rounded as cpu_moe.c. */
__global__ void moe_combine_kernel(float *out /* [rows][hidden] */, const float *y /* [rows k][hidden] */,
                                   const float *sel_w /* [rows][k] */, int k, int hidden) {
    const int r = blockIdx.x;
    for (int d = threadIdx.x; d < hidden; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++)
            acc = __fadd_rn(acc, __fmul_rn(y[((size_t)r * k + j) * hidden + d], sel_w[(size_t)r * k + j]));
        out[(size_t)r * hidden + d] = acc;
    }
}

/* Whether every expert is E4M3 (with scales) or every one BF16, all of one shape. */
static int fused_dtype(const rs_moe_weights *w, int hidden) {
    const rs_dtype dt = w->gate[0].dtype;
    if (dt != RS_DTYPE_E4M3 && dt != RS_DTYPE_BF16) return -1;
    const int64_t inter = w->gate[0].shape[0];
    for (int e = 0; e < w->n_experts; e++) {
        const rs_tensor *ts[3] = {&w->gate[e], &w->up[e], &w->down[e]};
        for (int i = 0; i < 3; i++)
            if (ts[i]->dtype != dt || (dt == RS_DTYPE_E4M3 && !ts[i]->scale_inv)) return -1;
        if (w->gate[e].shape[0] != inter || w->up[e].shape[0] != inter || w->gate[e].shape[1] != hidden ||
            w->up[e].shape[1] != hidden || w->down[e].shape[0] != hidden || w->down[e].shape[1] != inter)
            return -1;
    }
    return dt;
}

/* Routing on the device: the router logits (exact kernels: fp32 activations) and the route kernel. */
static void route(rs_cuda_ctx *c, const float *x, int rows, int hidden, const rs_moe_weights *w, int32_t *sel_e,
                  float *sel_w) {
    const int E = w->n_experts;
    float *logits = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_LOGITS, (size_t)rows * E * sizeof(float));
    rs_cuda_matmul(c, logits, x, w->router, NULL, rows, RS_NUMERICS_EXACT);
    moe_route_kernel<<<rs_cuda_blocks((size_t)rows, 128), 128, 0, c->stream>>>(logits, rows, E, w->top_k,
                                                                               w->norm_topk_prob, sel_e, sel_w);
    CUDA_CHECK_LAUNCH();
}

bool rs_cuda_moe_fused(rs_cuda_ctx *c, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w) {
    const int dt = fused_dtype(w, hidden);
    if (rows > RS_CUDA_MOE_FUSED_ROWS || dt < 0) return false;
    const int E = w->n_experts, k = w->top_k, pairs = rows * k, inter = (int)w->gate[0].shape[0];
    const bool fp8 = dt == RS_DTYPE_E4M3;
    const void *const *tab = moe_table(c, w);
    const float *xs = NULL;
    const uint8_t *xq = fp8 ? rs_cuda_act_fp8(c, x, rows, hidden, &xs) : NULL;
    int32_t *sel_e = (int32_t *)rs_cuda_scratch(c, RS_CUDA_S_MOE_SEL, (size_t)pairs * 8);
    float *sel_w = (float *)(sel_e + pairs);
    route(c, x, rows, hidden, w, sel_e, sel_w);
    float *gu = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_GATE, (size_t)pairs * 2 * inter * sizeof(float));
    float *act = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_UP, (size_t)pairs * inter * sizeof(float));
    float *y = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_Y, (size_t)pairs * hidden * sizeof(float));
    const dim3 g_up(rs_cuda_blocks((size_t)inter, MOE_WARPS), (unsigned)pairs);
    for (int which = 0; which < 2; which++) { /* gate into gu[p][0, inter), up into [inter, 2 inter) */
#define MOE_GU(F8)                                                                                                 \
    moe_pair_gemv_kernel<F8><<<g_up, MOE_WARPS * 32, 0, c->stream>>>(gu + (size_t)which * inter, inter, 2 * inter,  \
                                                                     hidden, x, xq, xs, k, sel_e, tab, which, E)
        if (fp8) MOE_GU(true);
        else MOE_GU(false);
#undef MOE_GU
        CUDA_CHECK_LAUNCH();
    }
    const size_t n_act = (size_t)pairs * inter;
    moe_silu_kernel<<<rs_cuda_blocks(n_act, 256), 256, 0, c->stream>>>(act, gu, inter, n_act);
    CUDA_CHECK_LAUNCH();
    const float *as = NULL;
    uint8_t *aq = NULL;
    if (fp8) {
        aq = (uint8_t *)rs_cuda_scratch(c, RS_CUDA_S_MOE_X, n_act + 16);
        float *asw = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_XCOPY, ((size_t)pairs * rs_fp8_blocks(inter) + 1) * 4);
        rs_cuda_fp8_quantize_act(c, act, pairs, inter, aq, asw);
        as = asw;
    }
    const dim3 g_down(rs_cuda_blocks((size_t)hidden, MOE_WARPS), (unsigned)pairs);
    if (fp8)
        moe_pair_gemv_kernel<true><<<g_down, MOE_WARPS * 32, 0, c->stream>>>(y, hidden, hidden, inter, act, aq, as, 1,
                                                                             sel_e, tab, 2, E);
    else
        moe_pair_gemv_kernel<false><<<g_down, MOE_WARPS * 32, 0, c->stream>>>(y, hidden, hidden, inter, act, aq, as, 1,
                                                                              sel_e, tab, 2, E);
    CUDA_CHECK_LAUNCH();
    moe_combine_kernel<<<(unsigned)rows, hidden >= 256 ? 256 : 128, 0, c->stream>>>(out, y, sel_w, k, hidden);
    CUDA_CHECK_LAUNCH();
    c->act.x = NULL; /* out (may be x) was rewritten */
    return true;
}

int rs_cuda_moe_route_groups(rs_cuda_ctx *c, const float *x, int rows, int hidden, const rs_moe_weights *w,
                             int32_t *offsets_host, const int32_t **rows_dev, const float **wts_dev) {
    const int E = w->n_experts, k = w->top_k, n_sel = rows * k;
    RS_ASSERT(E <= 1024);
    int32_t *sel_e = (int32_t *)rs_cuda_scratch(c, RS_CUDA_S_MOE_SEL, (size_t)n_sel * 8);
    float *sel_w = (float *)(sel_e + n_sel);
    route(c, x, rows, hidden, w, sel_e, sel_w);
    int32_t *lists = (int32_t *)rs_cuda_scratch(c, RS_CUDA_S_MOE_LISTS, ((size_t)E + 1 + 2 * (size_t)n_sel) * 4);
    int32_t *offsets = lists, *lrows = lists + E + 1;
    float *lwts = (float *)(lrows + n_sel);
    moe_group_kernel<<<1, (unsigned)((E + 31) / 32 * 32), 0, c->stream>>>(sel_e, sel_w, n_sel, E, offsets, lrows, lwts,
                                                                         k);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaMemcpyAsync(offsets_host, offsets, ((size_t)E + 1) * 4, cudaMemcpyDeviceToHost, c->stream));
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    *rows_dev = lrows;
    *wts_dev = lwts;
    return RS_OK;
}
