/*
 * backend.c — checked dispatch over a backend's op table (see backend.h).
 *
 * Every op is reached through these wrappers, which check the contract (shapes that must agree,
 * pointers that must be set) before calling into the backend, so a shape bug in model/ fails
 * loudly at the call site instead of reading out of bounds inside a kernel.
 */
#include "backend_impl.h"

#include <stdlib.h>
#include <string.h>

#include "../core/rs.h"

/* ---- op profiling (backend.h rs_backend_profile) ---- */

/* A fused op that the backend runs as one counts under its own name; one that it runs as the
 * sequence of single ops counts under theirs. */
enum {
    PROF_EMBED, PROF_RMSNORM, PROF_MATMUL_BF16, PROF_MATMUL_E4M3, PROF_MATMUL_OTHER, PROF_ROPE, PROF_KV_STORE,
    PROF_ATTENTION, PROF_SWIGLU, PROF_ADD, PROF_ADD_RMSNORM, PROF_QK_NORM_ROPE, PROF_GATHER, PROF_MOE, PROF_SAMPLE,
    PROF_UPLOAD, PROF_DOWNLOAD, PROF_COPY, PROF_COUNT
};

static const char *const prof_names[PROF_COUNT] = {
    "embed", "rmsnorm", "matmul bf16", "matmul e4m3", "matmul other", "rope", "kv_store", "attention",
    "swiglu", "add", "add+rmsnorm", "qk_norm+rope", "gather_rows", "moe", "sample", "upload", "download", "copy"};

struct rs_op_profile {
    double secs[PROF_COUNT];
    unsigned long long calls[PROF_COUNT];
};

static double prof_begin(rs_backend *b) {
    if (b->ops->sync) b->ops->sync(b);
    return rs_now_s();
}

static void prof_end(rs_backend *b, int op, double t0) {
    if (b->ops->sync) b->ops->sync(b);
    b->prof->secs[op] += rs_now_s() - t0;
    b->prof->calls[op]++;
}

/* CALL, timed under op OP when b's profile is on */
#define PROFILED(b, op, call)                                                                                          \
    do {                                                                                                               \
        if ((b)->prof) {                                                                                               \
            const double t0_ = prof_begin(b);                                                                          \
            call;                                                                                                      \
            prof_end((b), (op), t0_);                                                                                  \
        } else {                                                                                                       \
            call;                                                                                                      \
        }                                                                                                              \
    } while (0)

void rs_backend_profile(rs_backend *b, bool on) {
    if (on && !b->prof) b->prof = rs_xmalloc(sizeof *b->prof);
    if (on) memset(b->prof, 0, sizeof *b->prof);
    if (!on) {
        free(b->prof);
        b->prof = NULL;
    }
}

void rs_backend_profile_print(const rs_backend *b, FILE *f, int steps) {
    if (!b->prof) return;
    double total = 0;
    for (int i = 0; i < PROF_COUNT; i++) total += b->prof->secs[i];
    if (steps < 1) steps = 1;
    fprintf(f, "    %-14s %10s %12s %12s %7s\n", "op", "calls", "ms", "ms/step", "share");
    for (int i = 0; i < PROF_COUNT; i++) {
        if (!b->prof->calls[i]) continue;
        fprintf(f, "    %-14s %10llu %12.2f %12.3f %6.1f%%\n", prof_names[i], b->prof->calls[i], 1e3 * b->prof->secs[i],
                1e3 * b->prof->secs[i] / steps, total > 0 ? 100.0 * b->prof->secs[i] / total : 0.0);
    }
    fprintf(f, "    %-14s %10s %12.2f %12.3f\n", "all ops", "", 1e3 * total, 1e3 * total / steps);
}

const char *rs_backend_name(const rs_backend *b) { return b->ops->name; }
bool rs_backend_host_memory(const rs_backend *b) { return b->ops->host_memory; }

const char *rs_numerics_name(rs_numerics n) { return n == RS_NUMERICS_FAST ? "fast" : "exact"; }

int rs_numerics_parse(const char *s, rs_numerics *out) {
    if (s && strcmp(s, "exact") == 0) *out = RS_NUMERICS_EXACT;
    else if (s && strcmp(s, "fast") == 0) *out = RS_NUMERICS_FAST;
    else return RS_EINVAL;
    return RS_OK;
}

rs_numerics rs_backend_numerics(const rs_backend *b) {
    return b->ops->numerics ? b->ops->numerics(b) : RS_NUMERICS_EXACT;
}

rs_numerics rs_backend_set_numerics(rs_backend *b, rs_numerics want) {
    RS_ASSERT(want == RS_NUMERICS_EXACT || want == RS_NUMERICS_FAST);
    return b->ops->set_numerics ? b->ops->set_numerics(b, want) : RS_NUMERICS_EXACT;
}

void rs_backend_free(rs_backend *b) {
    if (!b) return;
    free(b->prof);
    b->ops->destroy(b);
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

rs_graph_state rs_backend_graph_begin(rs_backend *b, const void *owner, int slot, uint64_t key) {
    RS_ASSERT(owner && slot >= 0);
    return b->ops->graph_begin ? b->ops->graph_begin(b, owner, slot, key) : RS_GRAPH_OFF;
}

bool rs_backend_graph_end(rs_backend *b) {
    RS_ASSERT(b->ops->graph_end);
    return b->ops->graph_end(b);
}

void rs_backend_graph_forget(rs_backend *b, const void *owner) {
    if (b->ops->graph_forget) b->ops->graph_forget(b, owner);
}

bool rs_backend_has_graphs(const rs_backend *b) { return b->ops->graph_begin != NULL; }

bool rs_backend_has_sample(const rs_backend *b) { return b->ops->sample != NULL; }

void rs_backend_sample(rs_backend *b, const float *logits, int vocab, const rs_sample_req *req, int n,
                       rs_sample_res *res) {
    RS_ASSERT(b->ops->sample && logits && vocab > 0 && n >= 0 && (n == 0 || (req && res)));
    for (int i = 0; i < n; i++) RS_ASSERT(req[i].row >= 0 && req[i].n_top >= 0 && req[i].n_top <= RS_SAMPLE_MAX_TOP);
    PROFILED(b, PROF_SAMPLE, b->ops->sample(b, logits, vocab, req, n, res));
}

void *rs_backend_alloc(rs_backend *b, size_t bytes) { return b->ops->alloc(b, bytes); }

void rs_backend_free_mem(rs_backend *b, void *p) {
    if (p) b->ops->free(b, p);
}

void rs_backend_upload(rs_backend *b, void *dst, const void *src_host, size_t bytes) {
    RS_ASSERT(dst && (src_host || bytes == 0));
    PROFILED(b, PROF_UPLOAD, b->ops->upload(b, dst, src_host, bytes));
}

void rs_backend_download(rs_backend *b, void *dst_host, const void *src, size_t bytes) {
    RS_ASSERT(dst_host && (src || bytes == 0));
    PROFILED(b, PROF_DOWNLOAD, b->ops->download(b, dst_host, src, bytes));
}

void rs_backend_copy(rs_backend *b, void *dst, const void *src, size_t bytes) {
    RS_ASSERT(dst && (src || bytes == 0));
    PROFILED(b, PROF_COPY, b->ops->copy(b, dst, src, bytes));
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
    PROFILED(b, PROF_EMBED, b->ops->embed(b, out, table, ids, n));
}

void rs_op_rmsnorm(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim, float eps) {
    RS_ASSERT(out && x && w->ndim == 1 && w->shape[0] == dim && rows >= 0);
    PROFILED(b, PROF_RMSNORM, b->ops->rmsnorm(b, out, x, w, rows, dim, eps));
}

static int prof_matmul(const rs_tensor *w) {
    return w->dtype == RS_DTYPE_BF16 ? PROF_MATMUL_BF16 : w->dtype == RS_DTYPE_E4M3 ? PROF_MATMUL_E4M3 : PROF_MATMUL_OTHER;
}

static void check_matmul(const float *out, const float *x, const rs_tensor *w, const rs_tensor *bias, int rows) {
    RS_ASSERT(out && x && w->ndim == 2 && rows >= 0);
    RS_ASSERT(!bias || !rs_tensor_present(bias) || (bias->ndim == 1 && bias->shape[0] == w->shape[0]));
}

void rs_op_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias, int rows) {
    check_matmul(out, x, w, bias, rows);
    PROFILED(b, prof_matmul(w), b->ops->matmul(b, out, x, w, bias, rows));
}

void rs_op_matmul_group(rs_backend *b, float *const *outs, const float *x, const rs_tensor *const *ws,
                        const rs_tensor *const *biases, int count, int rows) {
    RS_ASSERT(count >= 1 && count <= RS_MATMUL_GROUP);
    bool alike = true; /* one kernel for all: the same dtype and layout */
    for (int i = 0; i < count; i++) {
        check_matmul(outs[i], x, ws[i], biases ? biases[i] : NULL, rows);
        RS_ASSERT(ws[i]->shape[1] == ws[0]->shape[1]);
        alike &= ws[i]->dtype == ws[0]->dtype && ws[i]->layout == ws[0]->layout;
    }
    /* weights of different dtypes (q_proj kept BF16 by --quant-ignore while k/v are FP8, an F16
     * q_proj in a BF16 checkpoint) take one matmul each */
    if (!b->ops->matmul_group || !alike) {
        for (int i = 0; i < count; i++) rs_op_matmul(b, outs[i], x, ws[i], biases ? biases[i] : NULL, rows);
        return;
    }
    PROFILED(b, prof_matmul(ws[0]), b->ops->matmul_group(b, outs, x, ws, biases, count, rows));
}

void rs_op_rope(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                const float *inv_freq) {
    RS_ASSERT(x && pos && inv_freq && head_dim % 2 == 0);
    PROFILED(b, PROF_ROPE, b->ops->rope(b, x, rows, n_heads, head_dim, pos, inv_freq));
}

void rs_op_add_rmsnorm(rs_backend *b, float *x, const float *y, float *out, const rs_tensor *w, int rows, int dim,
                       float eps) {
    RS_ASSERT(x && y && out && w->ndim == 1 && w->shape[0] == dim && rows >= 0);
    if (!b->ops->add_rmsnorm) {
        rs_op_add(b, x, y, (size_t)rows * (size_t)dim);
        rs_op_rmsnorm(b, out, x, w, rows, dim, eps);
        return;
    }
    PROFILED(b, PROF_ADD_RMSNORM, b->ops->add_rmsnorm(b, x, y, out, w, rows, dim, eps));
}

void rs_op_qk_norm_rope(rs_backend *b, float *q, float *k, const rs_tensor *q_norm, const rs_tensor *k_norm, int rows,
                        int n_heads, int n_kv_heads, int head_dim, float eps, const int32_t *pos, const float *inv_freq) {
    RS_ASSERT(q && k && pos && inv_freq && rows >= 0 && n_heads > 0 && n_kv_heads > 0 && head_dim % 2 == 0);
    RS_ASSERT(!q_norm || (q_norm->ndim == 1 && q_norm->shape[0] == head_dim));
    RS_ASSERT(!k_norm || (k_norm->ndim == 1 && k_norm->shape[0] == head_dim));
    if (!b->ops->qk_norm_rope) {
        if (q_norm) rs_op_rmsnorm(b, q, q, q_norm, rows * n_heads, head_dim, eps);
        if (k_norm) rs_op_rmsnorm(b, k, k, k_norm, rows * n_kv_heads, head_dim, eps);
        rs_op_rope(b, q, rows, n_heads, head_dim, pos, inv_freq);
        rs_op_rope(b, k, rows, n_kv_heads, head_dim, pos, inv_freq);
        return;
    }
    PROFILED(b, PROF_QK_NORM_ROPE,
             b->ops->qk_norm_rope(b, q, k, q_norm, k_norm, rows, n_heads, n_kv_heads, head_dim, eps, pos, inv_freq));
}

static void check_batch(const rs_batch *batch) {
    RS_ASSERT(batch && batch->n_seq >= 0 && batch->seq_start[0] == 0 &&
              batch->seq_start[batch->n_seq] == batch->n_tok);
}

void rs_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v, const rs_batch *batch) {
    RS_ASSERT(kv && kv->pages && k && v);
    check_batch(batch);
    PROFILED(b, PROF_KV_STORE, b->ops->kv_store(b, kv, k, v, batch));
}

void rs_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                     float scale, const rs_batch *batch) {
    RS_ASSERT(out && q && kv && n_heads % kv->n_kv_heads == 0);
    check_batch(batch);
    PROFILED(b, PROF_ATTENTION, b->ops->attention(b, out, q, kv, n_heads, scale, batch));
}

void rs_op_swiglu(rs_backend *b, float *out, const float *gate, const float *up, size_t n) {
    RS_ASSERT(out && gate && up);
    PROFILED(b, PROF_SWIGLU, b->ops->swiglu(b, out, gate, up, n));
}

void rs_op_add(rs_backend *b, float *x, const float *y, size_t n) {
    RS_ASSERT(x && y);
    PROFILED(b, PROF_ADD, b->ops->add(b, x, y, n));
}

void rs_op_gather_rows(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim) {
    RS_ASSERT(out && x && (idx || n == 0) && out != x);
    PROFILED(b, PROF_GATHER, b->ops->gather_rows(b, out, x, idx, n, dim));
}

void rs_op_moe(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w) {
    RS_ASSERT(out && x && w && w->router && w->top_k > 0 && w->top_k <= w->n_experts);
    PROFILED(b, PROF_MOE, b->ops->moe(b, out, x, rows, hidden, w));
}
