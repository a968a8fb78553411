/*
 * cpu_moe.c — the Qwen3-MoE sparse MLP, as transformers' Qwen3MoeSparseMoeBlock computes it.
 *
 *   router_logits = x @ router^T                       fp32
 *   probs         = softmax(router_logits)             fp32, max-subtracted, e / sum
 *   top-k         largest probs, ties to the lower expert index (what torch.topk does in practice)
 *   weights       /= their sum when norm_topk_prob
 *   out[r]        = 0, then for each selected expert e in ascending index order:
 *                   out[r] += (down_e(silu(gate_e x[r]) * up_e x[r])) * w[r][e]
 *
 * The accumulation order is torch's: Qwen3MoeExperts loops over the hit experts in ascending
 * index and index_add_s each one's weighted output into a zeroed buffer; the product is rounded
 * before the add. Here too, and since only the matmuls are threaded (over their output rows), the
 * result does not depend on the thread count.
 *
 * Rows are grouped per expert (a counting sort in row order), gathered into a contiguous block
 * and pushed through the shared matmul core, so an expert's weights are streamed once per step
 * however many rows picked it. E4M3 experts take the core's W8A8 path (each gathered row
 * quantized per token, the same bits as quantizing it alone), while the router stays BF16/F32.
 * Scratch lives in the context and only grows.
 */
#include <math.h>
#include <string.h>

#include "../../core/rs.h"
#include "../moe_route.h"
#include "cpu_internal.h"

/* The context's MoE scratch buffers. */
enum moe_buf {
    BUF_LOGITS,   /* [rows][n_experts] router logits, then probabilities */
    BUF_SELECTED, /* [rows][top_k] expert ids, then [rows][top_k] weights */
    BUF_LISTS,    /* expert_lists */
    BUF_FILL,     /* [n_experts] fill cursors of the counting sort */
    BUF_GATHERED, /* [n][hidden] one expert's input rows */
    BUF_ACT,      /* [n][inter] gate, [n][inter] up, [n][hidden] down output */
    BUF_X_COPY,   /* [rows][hidden] x, when out aliases it */
    BUF_COUNT
};
_Static_assert(BUF_COUNT <= RS_ARRAY_LEN(((rs_cpu_ctx *)0)->moe), "rs_cpu_ctx.moe too small");

/* Per-expert lists of (row, weight) in row order. offsets [n_experts + 1]; rows, wts [n_rows * k]. */
typedef struct expert_lists {
    int32_t *offsets;
    int32_t *rows;
    float *wts;
} expert_lists;

static expert_lists group_by_expert(rs_cpu_ctx *c, const int32_t *sel_e, const float *sel_w, int n_rows,
                                    int k, int n_experts) {
    size_t n_sel = (size_t)n_rows * (size_t)k;
    char *mem = rs_cpu_scratch(&c->moe[BUF_LISTS], ((size_t)n_experts + 1 + 2 * n_sel) * 4 + 64);
    expert_lists l = {.offsets = (int32_t *)mem};
    l.rows = l.offsets + n_experts + 1;
    l.wts = (float *)(l.rows + n_sel);
    int32_t *fill = rs_cpu_scratch(&c->moe[BUF_FILL], (size_t)n_experts * sizeof(int32_t));
    rs_moe_group(sel_e, sel_w, n_rows, k, n_experts, l.offsets, fill, l.rows, l.wts);
    return l;
}

static void check_expert(const rs_moe_weights *w, int e, int hidden, int64_t inter) {
    RS_ASSERT(w->gate[e].ndim == 2 && w->gate[e].shape[0] == inter && w->gate[e].shape[1] == hidden);
    RS_ASSERT(w->up[e].ndim == 2 && w->up[e].shape[0] == inter && w->up[e].shape[1] == hidden);
    RS_ASSERT(w->down[e].ndim == 2 && w->down[e].shape[0] == hidden && w->down[e].shape[1] == inter);
}

/* Expert e over its rows: out[row] += w * down(silu(gate x) * up x). */
static void run_expert(rs_cpu_ctx *c, float *out, const float *x, int hidden, const rs_moe_weights *w, int e,
                       const int32_t *rows, const float *wts, int n) {
    int64_t inter = w->gate[e].shape[0];
    check_expert(w, e, hidden, inter);
    float *xg =
        rs_cpu_scratch(&c->moe[BUF_GATHERED], (size_t)n * (size_t)hidden * sizeof(float)); /* [n][hidden] */
    size_t act = (size_t)n * (size_t)inter;
    float *g = rs_cpu_scratch(&c->moe[BUF_ACT], (2 * act + (size_t)n * (size_t)hidden) * sizeof(float));
    float *u = g + act; /* [n][inter] */
    float *y = u + act; /* [n][hidden] */
    for (int i = 0; i < n; i++)
        memcpy(xg + (size_t)i * (size_t)hidden, x + (size_t)rows[i] * (size_t)hidden,
               (size_t)hidden * sizeof(float));
    rs_cpu_matmul(c, g, xg, &w->gate[e], NULL, n);
    rs_cpu_matmul(c, u, xg, &w->up[e], NULL, n);
    rs_cpu_swiglu_span(g, g, u, act);
    rs_cpu_matmul(c, y, g, &w->down[e], NULL, n);
    for (int i = 0; i < n; i++) {
        float *o = out + (size_t)rows[i] * (size_t)hidden;
        const float *yi = y + (size_t)i * (size_t)hidden;
        for (int d = 0; d < hidden; d++) o[d] += yi[d] * wts[i];
    }
}

void rs_cpu_op_moe(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w) {
    rs_cpu_ctx *c = rs_cpu_ctx_of(b);
    int n_exp = w->n_experts, k = w->top_k;
    RS_ASSERT(w->router->ndim == 2 && w->router->shape[0] == n_exp && w->router->shape[1] == hidden);
    if (rows <= 0) return;
    size_t xbytes = (size_t)rows * (size_t)hidden * sizeof(float);
    if (out == x) x = memcpy(rs_cpu_scratch(&c->moe[BUF_X_COPY], xbytes), x, xbytes);

    float *logits =
        rs_cpu_scratch(&c->moe[BUF_LOGITS], (size_t)rows * (size_t)n_exp * sizeof(float)); /* [rows][E] */
    rs_cpu_matmul(c, logits, x, w->router, NULL, rows);
    size_t n_sel = (size_t)rows * (size_t)k;
    int32_t *sel_e =
        rs_cpu_scratch(&c->moe[BUF_SELECTED], n_sel * (sizeof(int32_t) + sizeof(float))); /* [rows][k] */
    float *sel_w = (float *)(sel_e + n_sel);                                              /* [rows][k] */
    for (int r = 0; r < rows; r++)
        rs_moe_route_row(logits + (size_t)r * (size_t)n_exp, n_exp, k, w->norm_topk_prob, sel_e + (size_t)r * k,
                         sel_w + (size_t)r * k);

    expert_lists l = group_by_expert(c, sel_e, sel_w, rows, k, n_exp);
    memset(out, 0, xbytes);
    for (int e = 0; e < n_exp; e++) {
        int n = l.offsets[e + 1] - l.offsets[e];
        if (n > 0) run_expert(c, out, x, hidden, w, e, l.rows + l.offsets[e], l.wts + l.offsets[e], n);
    }
}
