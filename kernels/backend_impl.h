/*
 * backend_impl.h — the op table behind rs_backend (backend.h). Private to kernels/: the CPU and
 * CUDA backends fill it in, backend.c dispatches through it, and nothing outside kernels/ includes
 * this header (scripts/check_layers.sh refuses it), so the rest of the daemon sees only the
 * opaque handle and its checked calls.
 */
#ifndef RS_BACKEND_IMPL_H
#define RS_BACKEND_IMPL_H

#include "backend.h"

typedef struct rs_backend_ops {
    const char *name;
    bool host_memory;  /* alloc returns host memory that host code may read and write directly */

    /* memory */
    void *(*alloc)(rs_backend *b, size_t bytes);             /* zeroed; NULL on failure */
    void (*free)(rs_backend *b, void *p);
    void (*upload)(rs_backend *b, void *dst, const void *src_host, size_t bytes);
    void (*download)(rs_backend *b, void *dst_host, const void *src, size_t bytes); /* synchronizes */
    void (*copy)(rs_backend *b, void *dst, const void *src, size_t bytes);   /* within the backend */

    /* Optional, host-memory backends only (NULL: FP8 weights are read row-major, as stored).
     * fp8_layout: the layout (rs_tensor.layout) the backend serves an E4M3 weight [n][k] in;
     * fp8_pack: row-major codes src [n][k] (host) -> dst (backend memory) in that layout; n may
     * also be a 128-row band of the weight (bands of any layout are whole groups). */
    rs_layout (*fp8_layout)(rs_backend *b, int64_t n, int64_t k);
    void (*fp8_pack)(rs_backend *b, rs_layout layout, uint8_t *dst, const uint8_t *src, int64_t n, int64_t k);

    /* out[i][:] = table[ids[i]][:]  (table [vocab][dim] bf16/f16/f32; the CPU backend also takes
     * E4M3 with scale_inv, dequantized: a tied table under --quantize-lm-head) */
    void (*embed)(rs_backend *b, float *out, const rs_tensor *table, const int32_t *ids, int n);

    /* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, over `rows` rows of `dim`; out may alias x.
     * Per-head q/k norm is the same op with rows = n_tok * n_heads and dim = head_dim. */
    void (*rmsnorm)(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim,
                    float eps);

    /* out[rows][N] = x[rows][K] @ w^T (+ bias), w [N][K] in bf16/f16/f32, or E4M3 with scale_inv
     * (W8A8: x is quantized per token in 1x128 groups, docs/design.md "Numerics"). out must not alias x. */
    void (*matmul)(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias,
                   int rows);

    /* Optional (NULL: one matmul each): outs[i] = x @ ws[i]^T (+ biases[i]) for i < count
     * (<= RS_MATMUL_GROUP), weights of one dtype and K that multiply the same rows (a layer's q, k
     * and v; gate and up). Each out is what the matmul op computes, bit for bit; the backend may run
     * them in one launch. */
    void (*matmul_group)(rs_backend *b, float *const *outs, const float *x, const rs_tensor *const *ws,
                         const rs_tensor *const *biases, int count, int rows);

    /* Rotary embedding, rotate-half (NeoX/HF) convention, in place on x [rows][n_heads][head_dim]:
     * row r uses position pos[r] and inv_freq [head_dim/2]. */
    void (*rope)(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                 const float *inv_freq);

    /* Optional (NULL: add, then rmsnorm): x += y, then out = rmsnorm(x) * w over `rows` rows of
     * `dim`, bit for bit the two ops (backend.h rs_op_add_rmsnorm); out may be y or x. A producer of
     * activation forms (the CUDA backend's fast numerics) writes out's forms as rmsnorm does. */
    void (*add_rmsnorm)(rs_backend *b, float *x, const float *y, float *out, const rs_tensor *w, int rows, int dim,
                        float eps);

    /* Optional (NULL: the per-head rmsnorms, then the two ropes): q [rows][n_heads][head_dim] and
     * k [rows][n_kv_heads][head_dim] in place, each head normed by q_norm / k_norm (NULL: not
     * normed), then rotated as rope does; bit for bit those ops (backend.h rs_op_qk_norm_rope). */
    void (*qk_norm_rope)(rs_backend *b, float *q, float *k, const rs_tensor *q_norm, const rs_tensor *k_norm, int rows,
                         int n_heads, int n_kv_heads, int head_dim, float eps, const int32_t *pos,
                         const float *inv_freq);

    /* Write each row's k, v [n_tok][n_kv_heads][head_dim] into its slot of the layer's pages. */
    void (*kv_store)(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v, const rs_batch *batch);

    /* Causal attention over the paged cache (after kv_store): for row r of sequence s at position
     * p, out[r] = softmax(q[r] . K[0..p] * scale) V[0..p], grouped-query (n_heads / n_kv_heads
     * query heads share a KV head). q, out: [n_tok][n_heads][head_dim]. */
    void (*attention)(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                      float scale, const rs_batch *batch);

    /* out[r][i] = silu(gate[r][i]) * up[r][i] over rows x n; out may alias gate. */
    void (*swiglu)(rs_backend *b, float *out, const float *gate, const float *up, size_t n);

    /* x[i] += y[i] */
    void (*add)(rs_backend *b, float *x, const float *y, size_t n);

    /* Gather rows: out[i] = x[idx[i]] for i < n, rows of `dim` (idx is host memory). */
    void (*gather_rows)(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim);

    /* Qwen3-MoE sparse MLP: out[rows][hidden] = sum over top-k experts of
     * w_e * down_e(silu(gate_e x) * up_e x), router softmax in fp32, weights renormalized over the
     * top k when norm_topk_prob. */
    void (*moe)(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w);

    /* Optional (NULL: the backend has only exact kernels). Switches the arithmetic of every later op
     * and returns the mode now in effect; numerics reports it. */
    rs_numerics (*set_numerics)(rs_backend *b, rs_numerics want);
    rs_numerics (*numerics)(const rs_backend *b);

    /* Optional (NULL: sampling on the host): requests [n] over logits [rows][vocab] in backend
     * memory; synchronizes (results are host memory). */
    void (*sample)(rs_backend *b, const float *logits, int vocab, const rs_sample_req *req, int n, rs_sample_res *res);

    /* Optional (NULL: no step graphs): rs_backend_graph_begin and friends below. */
    rs_graph_state (*graph_begin)(rs_backend *b, const void *owner, int slot, uint64_t key);
    bool (*graph_end)(rs_backend *b);
    void (*graph_forget)(rs_backend *b, const void *owner);

    /* Optional (NULL: every op has finished when it returns): waits for the work queued so far. */
    void (*sync)(rs_backend *b);

    void (*destroy)(rs_backend *b);
} rs_backend_ops;

typedef struct rs_op_profile rs_op_profile; /* backend.c */

struct rs_backend {
    const rs_backend_ops *ops;
    void *ctx;           /* the backend's private state */
    rs_op_profile *prof; /* rs_backend_profile's counts; NULL when off */
};

#endif /* RS_BACKEND_IMPL_H */
