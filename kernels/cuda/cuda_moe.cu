/*
 * cuda_moe.cu — the Qwen3-MoE sparse MLP on the GPU, step for step the CPU's (kernels/cpu/cpu_moe.c):
 *
 *   router logits = x @ router^T on the device (the exact matmul kernels in either numerics),
 *   copied to the host;
 *   routing on the host (kernels/moe_route.c, shared with the CPU backend): softmax, top-k, optional
 *   renormalization, then the (row, weight) pairs grouped by expert in row order;
 *   out = 0, then for each hit expert in ascending index: gather its rows, gate and up matmuls,
 *   swiglu, down matmul, and out[row] += y * w (the product rounded before the add, torch's
 *   index_add_ order). Experts run one after another on the stream, so the adds happen in the same
 *   order as on the CPU, and a row appears at most once per expert, so no two threads add to one
 *   output element at a time.
 *
 * That is exact numerics (the same experts as the CPU for the same logits: the routing is the same
 * host code). The router logits come back to the host once per layer (a synchronization point), so
 * such steps are never recorded as step graphs. Fast numerics route on the device
 * (cuda_moe_fast.cu): up to RS_CUDA_MOE_FUSED_ROWS rows the whole block runs there with no host
 * round trip (recordable); above, only the expert offsets come back and the same per-expert loop
 * runs from device lists.
 */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

extern "C" {
#include "../moe_route.h"
}

/* xg[i] = x[rows[i]] */
__global__ void moe_gather_kernel(float *xg /* [n][hidden] */, const float *x /* [*][hidden] */,
                                  const int32_t *rows /* [n] */, int hidden) {
    const size_t i = blockIdx.x;
    const float *src = x + (size_t)rows[i] * (size_t)hidden;
    for (int d = threadIdx.x; d < hidden; d += blockDim.x) xg[i * (size_t)hidden + (size_t)d] = src[d];
}

/* out[rows[i]] += y[i] * wts[i], the product rounded first (cpu_moe.c run_expert). */
__global__ void moe_scatter_add_kernel(float *out /* [*][hidden] */, const float *y /* [n][hidden] */,
                                       const int32_t *rows /* [n] */, const float *wts /* [n] */, int hidden) {
    const size_t i = blockIdx.x;
    float *o = out + (size_t)rows[i] * (size_t)hidden;
    const float *yi = y + i * (size_t)hidden;
    const float w = wts[i];
    for (int d = threadIdx.x; d < hidden; d += blockDim.x) o[d] = __fadd_rn(o[d], __fmul_rn(yi[d], w));
}

static void check_expert(const rs_moe_weights *w, int e, int hidden, int64_t inter) {
    RS_ASSERT(w->gate[e].ndim == 2 && w->gate[e].shape[0] == inter && w->gate[e].shape[1] == hidden);
    RS_ASSERT(w->up[e].ndim == 2 && w->up[e].shape[0] == inter && w->up[e].shape[1] == hidden);
    RS_ASSERT(w->down[e].ndim == 2 && w->down[e].shape[0] == hidden && w->down[e].shape[1] == inter);
}

/* Every hit expert e (offsets host [E + 1]; drows / dwts its selections on the device, row order):
 * gather its rows, gate and up matmuls, swiglu, down matmul, out[row] += y * w. */
static void run_experts(rs_backend *b, rs_cuda_ctx *c, float *out, const float *x, int rows, int hidden,
                        const rs_moe_weights *w, const int32_t *offsets, const int32_t *drows, const float *dwts) {
    const size_t xbytes = (size_t)rows * (size_t)hidden * sizeof(float);
    /* out may alias x (backend.h allows it): the experts read a copy then */
    if (out == x) {
        float *xc = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_XCOPY, xbytes);
        CUDA_CHECK(cudaMemcpyAsync(xc, x, xbytes, cudaMemcpyDeviceToDevice, c->stream));
        x = xc;
    }
    CUDA_CHECK(cudaMemsetAsync(out, 0, xbytes, c->stream));
    const unsigned threads = hidden >= 256 ? 256 : 128;
    for (int e = 0; e < w->n_experts; e++) {
        const int n = offsets[e + 1] - offsets[e];
        if (n == 0) continue;
        const int64_t inter = w->gate[e].shape[0];
        check_expert(w, e, hidden, inter);
        const size_t act = (size_t)n * (size_t)inter;
        float *xg = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_X, (size_t)n * (size_t)hidden * sizeof(float));
        float *g = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_GATE, act * sizeof(float));
        float *u = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_UP, act * sizeof(float));
        float *y = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_Y, (size_t)n * (size_t)hidden * sizeof(float));
        moe_gather_kernel<<<(unsigned)n, threads, 0, c->stream>>>(xg, x, drows + offsets[e], hidden);
        CUDA_CHECK_LAUNCH();
        c->act.x = NULL; /* xg was rewritten: no cached forms of it survive (cuda_act.cu) */
        rs_cuda_op_matmul(b, g, xg, &w->gate[e], NULL, n);
        rs_cuda_op_matmul(b, u, xg, &w->up[e], NULL, n);
        rs_cuda_op_swiglu(b, g, g, u, act);
        rs_cuda_op_matmul(b, y, g, &w->down[e], NULL, n);
        moe_scatter_add_kernel<<<(unsigned)n, threads, 0, c->stream>>>(out, y, drows + offsets[e], dwts + offsets[e],
                                                                       hidden);
        CUDA_CHECK_LAUNCH();
    }
}

void rs_cuda_op_moe(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    const int n_exp = w->n_experts, k = w->top_k;
    RS_ASSERT(w->router->ndim == 2 && w->router->shape[0] == n_exp && w->router->shape[1] == hidden);
    RS_ASSERT(k >= 1 && k <= n_exp);
    if (rows <= 0) return;
    if (c->numerics == RS_NUMERICS_FAST) {
        if (rs_cuda_moe_fused(c, out, x, rows, hidden, w)) return; /* decode sizes: all on the device */
        if (c->recording) {
            rs_cuda_recording_broken(c, "the MoE op sends expert offsets to the host");
            return;
        }
        int32_t *offsets = (int32_t *)rs_xmalloc(((size_t)n_exp + 1) * sizeof(int32_t));
        const int32_t *drows;
        const float *dwts;
        rs_cuda_moe_route_groups(c, x, rows, hidden, w, offsets, &drows, &dwts);
        run_experts(b, c, out, x, rows, hidden, w, offsets, drows, dwts);
        free(offsets);
        return;
    }
    if (c->recording) { /* the routing below waits for the router logits on the host */
        rs_cuda_recording_broken(c, "the MoE op routes on the host");
        return;
    }

    /* routing: logits to the host, the shared top-k and grouping */
    float *dlogits = (float *)rs_cuda_scratch(c, RS_CUDA_S_MOE_LOGITS, (size_t)rows * (size_t)n_exp * sizeof(float));
    /* the router in fp32 activations whatever the numerics: top-k is discontinuous, and a router
     * logit rounded to BF16 would send some tokens to other experts than the exact path does */
    rs_cuda_matmul(c, dlogits, x, w->router, NULL, rows, RS_NUMERICS_EXACT);
    const size_t n_sel = (size_t)rows * (size_t)k;
    float *logits = (float *)rs_xmalloc((size_t)rows * (size_t)n_exp * sizeof(float)); /* [rows][E] */
    int32_t *sel_e = (int32_t *)rs_xmalloc(n_sel * sizeof(int32_t));                   /* [rows][k] */
    float *sel_w = (float *)rs_xmalloc(n_sel * sizeof(float));                          /* [rows][k] */
    int32_t *offsets = (int32_t *)rs_xmalloc(((size_t)n_exp + 1) * sizeof(int32_t));
    int32_t *fill = (int32_t *)rs_xmalloc((size_t)n_exp * sizeof(int32_t));
    int32_t *lrows = (int32_t *)rs_xmalloc(n_sel * sizeof(int32_t));
    float *lwts = (float *)rs_xmalloc(n_sel * sizeof(float));
    CUDA_CHECK(cudaMemcpyAsync(logits, dlogits, (size_t)rows * (size_t)n_exp * sizeof(float), cudaMemcpyDeviceToHost,
                               c->stream));
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (int r = 0; r < rows; r++)
        rs_moe_route_row(logits + (size_t)r * (size_t)n_exp, n_exp, k, w->norm_topk_prob, sel_e + (size_t)r * k,
                         sel_w + (size_t)r * k);
    rs_moe_group(sel_e, sel_w, rows, k, n_exp, offsets, fill, lrows, lwts);
    const int32_t *drows = (const int32_t *)rs_cuda_mirror_of(c, RS_CUDA_M_MOE_ROWS, lrows, n_sel * sizeof(int32_t));
    const float *dwts = (const float *)rs_cuda_mirror_of(c, RS_CUDA_M_MOE_WEIGHTS, lwts, n_sel * sizeof(float));

    run_experts(b, c, out, x, rows, hidden, w, offsets, drows, dwts);
    free(logits);
    free(sel_e);
    free(sel_w);
    free(offsets);
    free(fill);
    free(lrows);
    free(lwts);
}
