/*
 * cuda_internal.h — what the CUDA backend's .cu files share: the context, scratch and host-array
 * mirrors, launch helpers, and the op entry points that backend_cuda.cu puts in the table.
 *
 * Every op runs asynchronously on the context's one stream, in call order, so a buffer is free to
 * reuse as soon as the next op is queued; rs_backend_download synchronizes. Host arrays that an op
 * receives (token ids, positions, slots, block tables: kernels/backend.h says which) are copied to
 * the device through a mirror, which skips the copy when the bytes equal the last ones it sent:
 * the forward pass hands the same batch to every layer, so a step uploads its metadata once.
 *
 * Numerics follow docs/design.md "Numerics" and the CPU backend, which is the reference: kernels that
 * the tests check bit for bit (FP8 activation quantization, the exact-block FP8 GEMM, E4M3 KV
 * stores, embed, add, gather) use the same sequence of correctly rounded operations as the CPU
 * (`__fdiv_rn`, `__fmul_rn`, `__fmaf_rn`; the build passes --fmad=false so nothing is contracted);
 * the others (sums in another order, expf, attention) are compared with a tolerance.
 */
#ifndef RS_CUDA_INTERNAL_H
#define RS_CUDA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "../backend_impl.h"
}
#include <cuda_fp16.h>

#include "cuda_check.h"

/* A device buffer that grows on demand (stream-ordered: cudaMallocAsync / cudaFreeAsync). */
struct rs_cuda_buf {
    void *p;
    size_t cap;
};

/* A device copy of a host array, re-sent only when the bytes change. */
struct rs_cuda_mirror {
    rs_cuda_buf dev;
    void *host;      /* the bytes last sent */
    size_t bytes;    /* their length */
    size_t host_cap;
};

/* Mirror slots. Each op uses its own, so two arrays of one op never evict each other. */
enum {
    RS_CUDA_M_EMBED_IDS = 0,
    RS_CUDA_M_ROPE_POS,
    RS_CUDA_M_ROPE_FREQ,
    RS_CUDA_M_GATHER_IDX,
    RS_CUDA_M_KV_SLOT,
    RS_CUDA_M_ATTN_POS,
    RS_CUDA_M_ATTN_ROW_SEQ,
    RS_CUDA_M_ATTN_TABLES,
    RS_CUDA_M_MOE_ROWS,
    RS_CUDA_M_MOE_WEIGHTS,
    RS_CUDA_M_COUNT
};

/* Scratch slots. */
enum {
    RS_CUDA_S_ACT_CODES = 0, /* FP8 matmul: activation codes [rows][k] */
    RS_CUDA_S_ACT_SCALES,    /* FP8 matmul: activation scales [rows][ceil(k/128)] */
    RS_CUDA_S_MOE_LOGITS,    /* MoE: router logits [rows][n_experts] */
    RS_CUDA_S_MOE_X,         /* MoE: the rows routed to one expert [n][hidden] */
    RS_CUDA_S_MOE_GATE,      /* MoE: [n][moe_inter] */
    RS_CUDA_S_MOE_UP,        /* MoE: [n][moe_inter] */
    RS_CUDA_S_MOE_Y,         /* MoE: one expert's down output [n][hidden] */
    RS_CUDA_S_MOE_XCOPY,     /* MoE: x [rows][hidden], when out aliases it */
    RS_CUDA_S_COUNT
};

struct rs_cuda_ctx {
    int device;
    int sm_count;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_workspace; /* cuBLASLt workspace, 32 MiB (Hopper recommendation) */
    size_t lt_workspace_bytes;
    rs_cuda_buf scratch[RS_CUDA_S_COUNT];
    rs_cuda_mirror mirror[RS_CUDA_M_COUNT];
};

/* The backend's context, with its device made current on the calling thread. The CUDA runtime's
 * current device is per thread, and the backend is called from threads other than the one that
 * created it (the engine, the weight-sync service): without this, --cuda-device 1 would launch the
 * engine's kernels on device 0 with device 1's stream. Every entry point goes through here. */
static inline rs_cuda_ctx *rs_cuda_ctx_of(rs_backend *b) {
    rs_cuda_ctx *c = (rs_cuda_ctx *)b->ctx;
    int current = -1; /* asked each time: the NCCL transport may set another device on this thread */
    CUDA_CHECK(cudaGetDevice(&current));
    if (current != c->device) CUDA_CHECK(cudaSetDevice(c->device));
    return c;
}

/* A scratch slot with room for `bytes` (contents undefined). Never NULL: out of memory aborts. */
void *rs_cuda_scratch(rs_cuda_ctx *c, int slot, size_t bytes);

/* The device copy of host[0..bytes) in mirror `slot`, valid for ops queued after this call. */
const void *rs_cuda_mirror_of(rs_cuda_ctx *c, int slot, const void *host, size_t bytes);

/* Blocks of `threads` covering n items. */
static inline unsigned rs_cuda_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b ? b : 1);
}

/* A launch's error, checked right after it is queued. */
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

/* Element i of a BF16 / F16 / F32 array (norm weights, biases, embeddings), as fp32 (exact). */
__device__ __forceinline__ float rs_cuda_elem(const void *p, rs_dtype dt, size_t i) {
    if (dt == RS_DTYPE_F32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    if (dt == RS_DTYPE_BF16) return __uint_as_float((uint32_t)h << 16);
    return __half2float(__ushort_as_half(h));
}

/* ---- ops (kernels/backend.h has the contracts) ---- */

/* cuda_ops.cu */
void rs_cuda_op_embed(rs_backend *b, float *out, const rs_tensor *table, const int32_t *ids, int n);
void rs_cuda_op_rmsnorm(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim, float eps);
void rs_cuda_op_rope(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                     const float *inv_freq);
void rs_cuda_op_swiglu(rs_backend *b, float *out, const float *gate, const float *up, size_t n);
void rs_cuda_op_add(rs_backend *b, float *x, const float *y, size_t n);
void rs_cuda_op_gather_rows(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim);

/* cuda_matmul.cu */
void rs_cuda_op_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias,
                       int rows);
/* The W8A8 pieces, for the tests: activation quantization (rs_fp8_quantize_act's bits) and the
 * exact-block GEMM (rs_fp8_gemm_ref's bits). All pointers are device memory. */
void rs_cuda_fp8_quantize_act(rs_cuda_ctx *c, const float *x, int rows, int k, uint8_t *q, float *scale);
void rs_cuda_fp8_gemm(rs_cuda_ctx *c, float *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                      const float *ws, int rows, int n, int k);

/* cuda_attention.cu */
void rs_cuda_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v, const rs_batch *batch);
void rs_cuda_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                          float scale, const rs_batch *batch);

/* cuda_moe.cu */
void rs_cuda_op_moe(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w);

#endif /* RS_CUDA_INTERNAL_H */
