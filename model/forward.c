/*
 * forward.c — the decoder-only transformer forward pass over one engine step, written once
 * against the backend op table (kernels/backend.h) for every supported architecture.
 *
 * A step is a flattened batch: each row is one token of some sequence at some position, so
 * prefill chunks and decode tokens of different sequences run through the same matmuls. All
 * activation buffers are allocated once in rs_forward_ctx_init for the largest step; rs_forward
 * itself allocates nothing.
 *
 * Per layer (HF Llama / Qwen2 / Qwen3 / Qwen3-MoE semantics):
 *   h = rmsnorm(x) ; q,k,v = h W^T (+b) ; [q,k per-head rmsnorm] ; rope(q,k) ; store k,v
 *   x += attention(q, cache) Wo^T
 *   h = rmsnorm(x) ; x += mlp(h)     (SwiGLU, or the sparse MoE block)
 * then the final norm and lm_head only on the rows whose logits the caller asked for. Each residual
 * add and the norm after it are one op (rs_op_add_rmsnorm), so a block ends by preparing the next
 * block's normed input, and the q/k norms and ropes are one op (rs_op_qk_norm_rope): one launch each
 * on a backend that fuses them, the same bits as the single ops.
 *
 * Step graphs (kernels/backend.h rs_backend_graph_begin). On a backend that records them, a decode
 * step (every sequence one row, every row's logits wanted) is padded to the next power of two rows
 * (1, 2, 4, ... up to the context's limits) and run as the recording of that size: one recording per
 * size, keyed by every pointer the ops touch (weights, KV pages, this context's buffers), the page
 * table width and the numerics, so a weight commit that moves tensors records anew. The padded
 * batch lives in this context's own arrays, at fixed addresses (the contract a replay relies on):
 * padding rows read position 0 of the first sequence's first page and store nothing (slot -1), and
 * their logits are computed but not downloaded. Exact numerics are batch-invariant, so padding
 * changes no bit of the real rows. A size the backend cannot record (e.g. MoE layers that route on
 * the host: exact numerics) runs op by op, unpadded.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

struct rs_forward_ctx {
    const rs_model *m;
    rs_backend *b;
    int max_tokens, max_logits;
    /* backend buffers, rows = max_tokens unless noted */
    float *x;       /* [rows][hidden] residual stream */
    float *h;       /* [rows][hidden] normed input / mlp output */
    float *q;       /* [rows][n_heads * head_dim] */
    float *k;       /* [rows][n_kv_heads * head_dim] */
    float *v;       /* [rows][n_kv_heads * head_dim] */
    float *attn;    /* [rows][max(n_heads * head_dim, hidden)]: attention out, then MoE out */
    float *gate;    /* [rows][intermediate] */
    float *up;      /* [rows][intermediate] */
    float *xl;      /* [max_logits][hidden] rows gathered for the lm_head */
    float *logits;  /* [max_logits][vocab] */
    /* step graphs: the padded decode batch (host), rows = graph_rows */
    bool graphs;
    int graph_rows;
    int32_t *g_tokens, *g_pos, *g_slot, *g_start /* [rows + 1] */, *g_ctx, *g_rows;
    int32_t *g_tables;  /* [rows][g_max_blocks] */
    int g_max_blocks;
};

static float *alloc_f32(rs_backend *b, size_t n) {
    float *p = rs_backend_alloc(b, n * sizeof(float));
    if (!p) RS_ERROR("forward: cannot allocate %zu floats on backend", n);
    return p;
}

rs_forward_ctx *rs_forward_ctx_init(const rs_model *m, int max_tokens, int max_logits) {
    const rs_model_config *c = &m->cfg;
    rs_forward_ctx *f = rs_xcalloc(1, sizeof *f);
    f->m = m;
    f->b = m->backend;
    f->max_tokens = max_tokens;
    f->max_logits = max_logits;
    size_t T = (size_t)max_tokens;
    size_t qdim = (size_t)c->n_heads * c->head_dim, kvdim = (size_t)c->n_kv_heads * c->head_dim;
    size_t inter = (size_t)c->intermediate;
    if (!(f->x = alloc_f32(f->b, T * c->hidden)) || !(f->h = alloc_f32(f->b, T * c->hidden)) ||
        !(f->q = alloc_f32(f->b, T * qdim)) || !(f->k = alloc_f32(f->b, T * kvdim)) ||
        !(f->v = alloc_f32(f->b, T * kvdim)) || !(f->attn = alloc_f32(f->b, T * RS_MAX(qdim, (size_t)c->hidden))) ||
        !(f->gate = alloc_f32(f->b, T * (inter ? inter : 1))) ||
        !(f->up = alloc_f32(f->b, T * (inter ? inter : 1))) ||
        !(f->xl = alloc_f32(f->b, (size_t)max_logits * c->hidden)) ||
        !(f->logits = alloc_f32(f->b, (size_t)max_logits * c->vocab_size))) {
        rs_forward_ctx_free(f);
        return NULL;
    }
    f->graphs = rs_backend_has_graphs(f->b);
    if (f->graphs) {
        const size_t rows = (size_t)RS_MIN(max_tokens, max_logits);
        f->graph_rows = (int)rows;
        f->g_tokens = rs_xmalloc(rows * sizeof(int32_t));
        f->g_pos = rs_xmalloc(rows * sizeof(int32_t));
        f->g_slot = rs_xmalloc(rows * sizeof(int32_t));
        f->g_start = rs_xmalloc((rows + 1) * sizeof(int32_t));
        f->g_ctx = rs_xmalloc(rows * sizeof(int32_t));
        f->g_rows = rs_xmalloc(rows * sizeof(int32_t));
    }
    return f;
}

void rs_forward_ctx_free(rs_forward_ctx *f) {
    if (!f) return;
    rs_backend_graph_forget(f->b, f);
    free(f->g_tokens), free(f->g_pos), free(f->g_slot), free(f->g_start), free(f->g_ctx), free(f->g_rows);
    free(f->g_tables);
    float *bufs[] = {f->x, f->h, f->q, f->k, f->v, f->attn, f->gate, f->up, f->xl, f->logits};
    for (size_t i = 0; i < RS_ARRAY_LEN(bufs); i++) rs_backend_free_mem(f->b, bufs[i]);
    free(f);
}

/* The residual add that ends a block, fused with the norm that starts the next one: x += y, then
 * h = rmsnorm(x) * next_norm. next_norm NULL (the last layer's end, whose norm is the final one and
 * runs after gather_rows): the add alone. */
static void residual_add(rs_forward_ctx *f, const float *y, const rs_tensor *next_norm, int n) {
    const rs_model_config *c = &f->m->cfg;
    if (next_norm) rs_op_add_rmsnorm(f->b, f->x, y, f->h, next_norm, n, c->hidden, c->rms_eps);
    else rs_op_add(f->b, f->x, y, (size_t)n * c->hidden);
}

/* h = attn_norm(x) on entry; x += attention, h = mlp_norm(x) on return. */
static void attention_block(rs_forward_ctx *f, const rs_layer_weights *L, rs_kv_layer *kv,
                            const rs_batch *batch) {
    const rs_model_config *c = &f->m->cfg;
    rs_backend *b = f->b;
    int n = batch->n_tok;

    float *const qkv_out[] = {f->q, f->k, f->v};
    const rs_tensor *const qkv_w[] = {&L->wq, &L->wk, &L->wv}, *const qkv_b[] = {&L->bq, &L->bk, &L->bv};
    rs_op_matmul_group(b, qkv_out, f->h, qkv_w, qkv_b, 3, n); /* one launch where the backend can */
    rs_op_qk_norm_rope(b, f->q, f->k, c->qk_norm ? &L->q_norm : NULL, c->qk_norm ? &L->k_norm : NULL, n, c->n_heads,
                       c->n_kv_heads, c->head_dim, c->rms_eps, batch->pos, f->m->rope_inv_freq);
    rs_op_kv_store(b, kv, f->k, f->v, batch);
    rs_op_attention(b, f->attn, f->q, kv, c->n_heads, 1.0f / sqrtf((float)c->head_dim), batch);
    rs_op_matmul(b, f->h, f->attn, &L->wo, NULL, n);
    residual_add(f, f->h, &L->mlp_norm, n);
}

/* h = mlp_norm(x) on entry; x += mlp(h), then h = next_norm(x) (the next layer's attention norm;
 * NULL after the last layer) on return. */
static void mlp_block(rs_forward_ctx *f, const rs_layer_weights *L, int layer, int n, const rs_tensor *next_norm) {
    const rs_model_config *c = &f->m->cfg;
    rs_backend *b = f->b;

    if (c->n_experts > 0 && c->layer_is_moe[layer]) {
        rs_moe_weights mw = {.router = &L->router, .gate = L->e_gate, .up = L->e_up, .down = L->e_down,
                             .n_experts = c->n_experts, .top_k = c->n_experts_per_tok,
                             .norm_topk_prob = c->norm_topk_prob};
        rs_op_moe(b, f->attn /* free after attention */, f->h, n, c->hidden, &mw);
        residual_add(f, f->attn, next_norm, n);
        return;
    }
    float *const gate_up_out[] = {f->gate, f->up};
    const rs_tensor *const gate_up_w[] = {&L->w_gate, &L->w_up};
    rs_op_matmul_group(b, gate_up_out, f->h, gate_up_w, NULL, 2, n);
    rs_op_swiglu(b, f->gate, f->gate, f->up, (size_t)n * c->intermediate);
    rs_op_matmul(b, f->h, f->gate, &L->w_down, NULL, n);
    residual_add(f, f->h, next_norm, n);
}

/* The step's ops, up to the logits on the backend. */
static void run_ops(rs_forward_ctx *f, const rs_batch *batch, rs_kv_layer *kv, const int32_t *logit_rows, int n_logits) {
    const rs_model *m = f->m;
    const rs_model_config *c = &m->cfg;
    rs_backend *b = f->b;
    int n = batch->n_tok;
    rs_op_embed(b, f->x, &m->embed, batch->tokens, n);
    /* layer 0's attention norm; every later norm runs fused with the residual add before it */
    rs_op_rmsnorm(b, f->h, f->x, &m->layers[0].attn_norm, n, c->hidden, c->rms_eps);
    for (int l = 0; l < c->n_layers; l++) {
        const rs_tensor *next_norm = l + 1 < c->n_layers ? &m->layers[l + 1].attn_norm : NULL;
        attention_block(f, &m->layers[l], &kv[l], batch);
        mlp_block(f, &m->layers[l], l, n, next_norm);
    }
    if (n_logits == 0) return;
    rs_op_gather_rows(b, f->xl, f->x, logit_rows, n_logits, c->hidden);
    rs_op_rmsnorm(b, f->xl, f->xl, &m->final_norm, n_logits, c->hidden, c->rms_eps);
    rs_op_matmul(b, f->logits, f->xl, &m->lm_head, NULL, n_logits);
}

/* ---- step graphs ---- */

/* A decode step: every sequence one row, and every row's logits, in row order. */
static bool decode_only(const rs_batch *batch, const int32_t *logit_rows, int n_logits) {
    if (batch->n_seq != batch->n_tok || n_logits != batch->n_tok) return false;
    for (int i = 0; i < batch->n_tok; i++)
        if (batch->seq_start[i] != i || logit_rows[i] != i) return false;
    return true;
}

static uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ull; }

static uint64_t mix_tensor(uint64_t h, const rs_tensor *t) {
    h = mix(h, (uint64_t)(uintptr_t)t->data);
    h = mix(h, (uint64_t)(uintptr_t)t->scale_inv);
    h = mix(h, (uint64_t)t->dtype);
    return mix(h, (uint64_t)t->shape[0] * 1000003u + (uint64_t)t->shape[1]);
}

/* Everything a recorded step depends on besides memory contents (backend.h): rows, page-table width,
 * numerics, and every weight, KV and activation pointer the ops use. */
static uint64_t step_key(const rs_forward_ctx *f, int rows, int max_blocks, const rs_kv_layer *kv) {
    const rs_model *m = f->m;
    uint64_t h = 1469598103934665603ull;
    h = mix(h, (uint64_t)rows), h = mix(h, (uint64_t)max_blocks), h = mix(h, (uint64_t)rs_backend_numerics(f->b));
    h = mix_tensor(h, &m->embed), h = mix_tensor(h, &m->final_norm), h = mix_tensor(h, &m->lm_head);
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const rs_layer_weights *L = &m->layers[l];
        const rs_tensor *ts[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq, &L->bk, &L->bv,
                                 &L->q_norm, &L->k_norm, &L->mlp_norm, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < RS_ARRAY_LEN(ts); i++) h = mix_tensor(h, ts[i]);
        if (m->cfg.n_experts > 0 && m->cfg.layer_is_moe[l]) {
            h = mix_tensor(h, &L->router);
            for (int e = 0; e < m->cfg.n_experts; e++)
                h = mix_tensor(mix_tensor(mix_tensor(h, &L->e_gate[e]), &L->e_up[e]), &L->e_down[e]);
        }
        h = mix(h, (uint64_t)(uintptr_t)kv[l].pages), h = mix(h, (uint64_t)(uintptr_t)kv[l].k_scale);
        h = mix(h, (uint64_t)(uintptr_t)kv[l].v_scale), h = mix(h, (uint64_t)(uintptr_t)kv[l].token_scales);
        h = mix(h, (uint64_t)kv[l].dtype * 31u + (uint64_t)kv[l].scale_mode), h = mix(h, (uint64_t)kv[l].n_blocks);
    }
    return h;
}

/* The decode step padded to the next power of two rows, as a step graph (or as it is, when the
 * backend cannot record this size). */
static void run_graphed(rs_forward_ctx *f, const rs_batch *batch, rs_kv_layer *kv, const int32_t *logit_rows) {
    const int n = batch->n_tok, mb = batch->max_blocks;
    int rows = 1;
    while (rows < n) rows *= 2;
    if (rows > f->graph_rows) rows = n;
    if (mb > f->g_max_blocks) { /* the arrays move: the recordings that read them go */
        rs_backend_graph_forget(f->b, f);
        free(f->g_tables);
        f->g_tables = rs_xmalloc((size_t)f->graph_rows * (size_t)mb * sizeof(int32_t));
        f->g_max_blocks = mb;
    }
    memcpy(f->g_tokens, batch->tokens, (size_t)n * sizeof(int32_t));
    memcpy(f->g_pos, batch->pos, (size_t)n * sizeof(int32_t));
    memcpy(f->g_slot, batch->slot, (size_t)n * sizeof(int32_t));
    memcpy(f->g_ctx, batch->seq_ctx, (size_t)n * sizeof(int32_t));
    memcpy(f->g_tables, batch->block_tables, (size_t)n * (size_t)mb * sizeof(int32_t));
    for (int i = n; i < rows; i++) { /* padding: position 0 of row 0's first page, read only */
        f->g_tokens[i] = 0, f->g_pos[i] = 0, f->g_slot[i] = -1, f->g_ctx[i] = 1;
        memcpy(f->g_tables + (size_t)i * mb, batch->block_tables, (size_t)mb * sizeof(int32_t));
    }
    for (int i = 0; i <= rows; i++) f->g_start[i] = i;
    for (int i = 0; i < rows; i++) f->g_rows[i] = i;
    const rs_batch padded = {.n_tok = rows, .n_seq = rows, .tokens = f->g_tokens, .pos = f->g_pos, .slot = f->g_slot,
                             .seq_start = f->g_start, .seq_ctx = f->g_ctx, .block_tables = f->g_tables, .max_blocks = mb};
    const rs_graph_state st = rs_backend_graph_begin(f->b, f, rows, step_key(f, rows, mb, kv));
    if (st == RS_GRAPH_REPLAYED) return;
    if (st == RS_GRAPH_NEVER) {
        run_ops(f, batch, kv, logit_rows, n);
        return;
    }
    run_ops(f, &padded, kv, f->g_rows, rows);
    if (st == RS_GRAPH_RECORDING && !rs_backend_graph_end(f->b)) run_ops(f, &padded, kv, f->g_rows, rows);
}

void rs_forward(rs_forward_ctx *f, const rs_batch *batch, rs_kv_layer *kv, const int32_t *logit_rows,
                int n_logits, float *logits_host) {
    const rs_model_config *c = &f->m->cfg;
    int n = batch->n_tok;
    RS_ASSERT(n > 0 && n <= f->max_tokens && n_logits >= 0 && n_logits <= f->max_logits);
    if (f->graphs && decode_only(batch, logit_rows, n_logits)) run_graphed(f, batch, kv, logit_rows);
    else run_ops(f, batch, kv, logit_rows, n_logits);
    if (n_logits == 0 || !logits_host) return;
    rs_backend_download(f->b, logits_host, f->logits, (size_t)n_logits * c->vocab_size * sizeof(float));
}

bool rs_forward_samples(const rs_forward_ctx *f) { return rs_backend_has_sample(f->b); }

void rs_forward_sample(rs_forward_ctx *f, const rs_sample_req *req, int n, rs_sample_res *res) {
    for (int i = 0; i < n; i++) RS_ASSERT(req[i].row < f->max_logits);
    rs_backend_sample(f->b, f->logits, f->m->cfg.vocab_size, req, n, res);
}

void rs_forward_logits_row(rs_forward_ctx *f, int i, float *dst) {
    const size_t V = (size_t)f->m->cfg.vocab_size;
    RS_ASSERT(i >= 0 && i < f->max_logits);
    rs_backend_download(f->b, dst, f->logits + (size_t)i * V, V * sizeof(float));
}
