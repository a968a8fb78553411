/*
 * backend.c — checked dispatch over a backend's op table (see backend.h).
 *
 * Every op is reached through these wrappers, which check the contract (shapes that must agree,
 * pointers that must be set) before calling into the backend, so a shape bug in model/ fails
 * loudly at the call site instead of reading out of bounds inside a kernel.
 */
#include "backend_impl.h"

#include "../core/rs.h"

const char *rs_backend_name(const rs_backend *b) { return b->ops->name; }
bool rs_backend_host_memory(const rs_backend *b) { return b->ops->host_memory; }

void rs_backend_free(rs_backend *b) {
    if (b) b->ops->destroy(b);
}

const char *rs_backend_missing_op(const rs_backend *b) {
    const rs_backend_ops *o = b->ops;
#define RS_CHECK_OP(f) if (!o->f) return #f
    RS_CHECK_OP(alloc); RS_CHECK_OP(free); RS_CHECK_OP(upload); RS_CHECK_OP(download);
    RS_CHECK_OP(copy);
    RS_CHECK_OP(embed); RS_CHECK_OP(rmsnorm); RS_CHECK_OP(matmul); RS_CHECK_OP(rope);
    RS_CHECK_OP(kv_store); RS_CHECK_OP(attention); RS_CHECK_OP(swiglu); RS_CHECK_OP(add);
    RS_CHECK_OP(gather_rows); RS_CHECK_OP(moe); RS_CHECK_OP(destroy);
#undef RS_CHECK_OP
    return NULL;
}

size_t rs_kv_layer_check(const rs_kv_layer *kv) {
    if (kv->dtype == RS_DTYPE_E4M3) {
        RS_ASSERT((kv->scale_mode == RS_KV_SCALE_PER_HEAD && kv->k_scale && kv->v_scale) ||
                  (kv->scale_mode == RS_KV_SCALE_PER_TOKEN && kv->token_scales));
    } else {
        RS_ASSERT(kv->dtype == RS_DTYPE_F32 || kv->dtype == RS_DTYPE_BF16);
        RS_ASSERT(kv->scale_mode == RS_KV_SCALE_NONE);
    }
    return rs_dtype_size(kv->dtype);
}

void *rs_backend_alloc(rs_backend *b, size_t bytes) { return b->ops->alloc(b, bytes); }

void rs_backend_free_mem(rs_backend *b, void *p) {
    if (p) b->ops->free(b, p);
}

void rs_backend_upload(rs_backend *b, void *dst, const void *src_host, size_t bytes) {
    RS_ASSERT(dst && (src_host || bytes == 0));
    b->ops->upload(b, dst, src_host, bytes);
}

void rs_backend_download(rs_backend *b, void *dst_host, const void *src, size_t bytes) {
    RS_ASSERT(dst_host && (src || bytes == 0));
    b->ops->download(b, dst_host, src, bytes);
}

void rs_backend_copy(rs_backend *b, void *dst, const void *src, size_t bytes) {
    RS_ASSERT(dst && (src || bytes == 0));
    b->ops->copy(b, dst, src, bytes);
}

rs_layout rs_backend_fp8_layout(rs_backend *b, int64_t n, int64_t k) {
    return b->ops->fp8_layout ? b->ops->fp8_layout(b, n, k) : RS_LAYOUT_ROWS;
}

void rs_backend_fp8_pack(rs_backend *b, rs_layout layout, void *dst, const uint8_t *src_host, int64_t n, int64_t k) {
    RS_ASSERT(dst && n >= 0 && k >= 0 && (src_host || n * k == 0));
    if (layout == RS_LAYOUT_ROWS) {
        b->ops->upload(b, dst, src_host, (size_t)(n * k));
        return;
    }
    RS_ASSERT(b->ops->fp8_pack && b->ops->host_memory); /* rows may be a band of a weight: any n */
    b->ops->fp8_pack(b, layout, dst, src_host, n, k);
}

void rs_op_embed(rs_backend *b, float *out, const rs_tensor *table, const int32_t *ids, int n) {
    RS_ASSERT(out && ids && table->ndim == 2 && n >= 0);
    b->ops->embed(b, out, table, ids, n);
}

void rs_op_rmsnorm(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim, float eps) {
    RS_ASSERT(out && x && w->ndim == 1 && w->shape[0] == dim && rows >= 0);
    b->ops->rmsnorm(b, out, x, w, rows, dim, eps);
}

void rs_op_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias, int rows) {
    RS_ASSERT(out && x && w->ndim == 2 && rows >= 0);
    RS_ASSERT(!bias || !rs_tensor_present(bias) || (bias->ndim == 1 && bias->shape[0] == w->shape[0]));
    b->ops->matmul(b, out, x, w, bias, rows);
}

void rs_op_rope(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                const float *inv_freq) {
    RS_ASSERT(x && pos && inv_freq && head_dim % 2 == 0);
    b->ops->rope(b, x, rows, n_heads, head_dim, pos, inv_freq);
}

static void check_batch(const rs_batch *batch) {
    RS_ASSERT(batch && batch->n_seq >= 0 && batch->seq_start[0] == 0 &&
              batch->seq_start[batch->n_seq] == batch->n_tok);
}

void rs_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v, const rs_batch *batch) {
    RS_ASSERT(kv && kv->pages && k && v);
    check_batch(batch);
    b->ops->kv_store(b, kv, k, v, batch);
}

void rs_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                     float scale, const rs_batch *batch) {
    RS_ASSERT(out && q && kv && n_heads % kv->n_kv_heads == 0);
    check_batch(batch);
    b->ops->attention(b, out, q, kv, n_heads, scale, batch);
}

void rs_op_swiglu(rs_backend *b, float *out, const float *gate, const float *up, size_t n) {
    RS_ASSERT(out && gate && up);
    b->ops->swiglu(b, out, gate, up, n);
}

void rs_op_add(rs_backend *b, float *x, const float *y, size_t n) {
    RS_ASSERT(x && y);
    b->ops->add(b, x, y, n);
}

void rs_op_gather_rows(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim) {
    RS_ASSERT(out && x && (idx || n == 0) && out != x);
    b->ops->gather_rows(b, out, x, idx, n, dim);
}

void rs_op_moe(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w) {
    RS_ASSERT(out && x && w && w->router && w->top_k > 0 && w->top_k <= w->n_experts);
    b->ops->moe(b, out, x, rows, hidden, w);
}
