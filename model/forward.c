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
 * then the final norm and lm_head only on the rows whose logits the caller asked for.
 */
#include <math.h>
#include <stdlib.h>

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
    return f;
}

void rs_forward_ctx_free(rs_forward_ctx *f) {
    if (!f) return;
    float *bufs[] = {f->x, f->h, f->q, f->k, f->v, f->attn, f->gate, f->up, f->xl, f->logits};
    for (size_t i = 0; i < RS_ARRAY_LEN(bufs); i++) rs_backend_free_mem(f->b, bufs[i]);
    free(f);
}

static void attention_block(rs_forward_ctx *f, const rs_layer_weights *L, rs_kv_layer *kv,
                            const rs_batch *batch) {
    const rs_model_config *c = &f->m->cfg;
    rs_backend *b = f->b;
    int n = batch->n_tok;

    rs_op_rmsnorm(b, f->h, f->x, &L->attn_norm, n, c->hidden, c->rms_eps);
    rs_op_matmul(b, f->q, f->h, &L->wq, &L->bq, n);
    rs_op_matmul(b, f->k, f->h, &L->wk, &L->bk, n);
    rs_op_matmul(b, f->v, f->h, &L->wv, &L->bv, n);
    if (c->qk_norm) {
        rs_op_rmsnorm(b, f->q, f->q, &L->q_norm, n * c->n_heads, c->head_dim, c->rms_eps);
        rs_op_rmsnorm(b, f->k, f->k, &L->k_norm, n * c->n_kv_heads, c->head_dim, c->rms_eps);
    }
    rs_op_rope(b, f->q, n, c->n_heads, c->head_dim, batch->pos, f->m->rope_inv_freq);
    rs_op_rope(b, f->k, n, c->n_kv_heads, c->head_dim, batch->pos, f->m->rope_inv_freq);
    rs_op_kv_store(b, kv, f->k, f->v, batch);
    rs_op_attention(b, f->attn, f->q, kv, c->n_heads, 1.0f / sqrtf((float)c->head_dim), batch);
    rs_op_matmul(b, f->h, f->attn, &L->wo, NULL, n);
    rs_op_add(b, f->x, f->h, (size_t)n * c->hidden);
}

static void mlp_block(rs_forward_ctx *f, const rs_layer_weights *L, int layer, int n) {
    const rs_model_config *c = &f->m->cfg;
    rs_backend *b = f->b;

    rs_op_rmsnorm(b, f->h, f->x, &L->mlp_norm, n, c->hidden, c->rms_eps);
    if (c->n_experts > 0 && c->layer_is_moe[layer]) {
        rs_moe_weights mw = {.router = &L->router, .gate = L->e_gate, .up = L->e_up, .down = L->e_down,
                             .n_experts = c->n_experts, .top_k = c->n_experts_per_tok,
                             .norm_topk_prob = c->norm_topk_prob};
        rs_op_moe(b, f->attn /* free after attention */, f->h, n, c->hidden, &mw);
        rs_op_add(b, f->x, f->attn, (size_t)n * c->hidden);
        return;
    }
    rs_op_matmul(b, f->gate, f->h, &L->w_gate, NULL, n);
    rs_op_matmul(b, f->up, f->h, &L->w_up, NULL, n);
    rs_op_swiglu(b, f->gate, f->gate, f->up, (size_t)n * c->intermediate);
    rs_op_matmul(b, f->h, f->gate, &L->w_down, NULL, n);
    rs_op_add(b, f->x, f->h, (size_t)n * c->hidden);
}

void rs_forward(rs_forward_ctx *f, const rs_batch *batch, rs_kv_layer *kv, const int32_t *logit_rows,
                int n_logits, float *logits_host) {
    const rs_model *m = f->m;
    const rs_model_config *c = &m->cfg;
    rs_backend *b = f->b;
    int n = batch->n_tok;
    RS_ASSERT(n > 0 && n <= f->max_tokens && n_logits >= 0 && n_logits <= f->max_logits);

    rs_op_embed(b, f->x, &m->embed, batch->tokens, n);
    for (int l = 0; l < c->n_layers; l++) {
        attention_block(f, &m->layers[l], &kv[l], batch);
        mlp_block(f, &m->layers[l], l, n);
    }
    if (n_logits == 0) return;
    rs_op_gather_rows(b, f->xl, f->x, logit_rows, n_logits, c->hidden);
    rs_op_rmsnorm(b, f->xl, f->xl, &m->final_norm, n_logits, c->hidden, c->rms_eps);
    rs_op_matmul(b, f->logits, f->xl, &m->lm_head, NULL, n_logits);
    rs_backend_download(b, logits_host, f->logits, (size_t)n_logits * c->vocab_size * sizeof(float));
}
