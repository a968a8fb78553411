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
 * the others (sums in another order, expf, attention) are compared with a tolerance. That is the
 * exact numerics (RS_NUMERICS_EXACT). The fast numerics (the daemon's default on a GPU) route the
 * same ops to tensor cores and fp32 accumulation in other orders: cuBLASLt GEMMs (cuda_blas.cu, the
 * only file that calls cuBLASLt) on BF16 or FP8 activation forms fused into the producing kernel
 * (cuda_act.cu), the decode GEMV (cuda_matmul_fast.cu), split-context decode and tensor-core
 * prefill attention (cuda_attention.cu, cuda_attention_tc.cu), routing and grouped experts on the
 * device (cuda_moe_fast.cu); the tests bound them against the exact kernels. Step graphs
 * (cuda_graph.cu) and device sampling (cuda_sample.cu) serve both numerics.
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

/* A device copy of a host array, re-sent only when the bytes change. While a step graph records
 * (cuda_graph.cu), the copy is recorded from the mirror's pinned staging buffer instead (a recorded
 * copy cannot read pageable memory), and the graph refreshes that buffer from the caller's array
 * before each replay. */
struct rs_cuda_mirror {
    rs_cuda_buf dev;
    void *host;      /* the bytes last sent (bytes 0: unknown, e.g. after a replay wrote dev) */
    size_t bytes;    /* their length */
    size_t host_cap;
    void *pinned;    /* page-locked staging of the recorded copies, pinned_cap bytes */
    size_t pinned_cap;
    const void *rec_src; /* recording: the host array this mirror copies in the current graph */
    size_t rec_bytes;
};

/* Mirror slots. Each op uses its own, so two arrays of one op never evict each other. */
enum {
    RS_CUDA_M_EMBED_IDS = 0,
    RS_CUDA_M_ROPE_POS,
    RS_CUDA_M_ROPE_FREQ,
    RS_CUDA_M_GATHER_IDX,
    RS_CUDA_M_KV_SLOT,
    RS_CUDA_M_ATTN_POS,
    RS_CUDA_M_ATTN_SEQ_START,
    RS_CUDA_M_ATTN_ROWS,     /* fast attention: the decode rows of a mixed step */
    RS_CUDA_M_ATTN_TILES,    /* fast attention: the prefill tiles of a step */
    RS_CUDA_M_ATTN_TABLES,
    RS_CUDA_M_MOE_ROWS,
    RS_CUDA_M_MOE_WEIGHTS,
    RS_CUDA_M_COUNT
};

/* Scratch slots. */
enum {
    RS_CUDA_S_ACT_CODES = 0, /* FP8 matmul: activation codes [rows][k] */
    RS_CUDA_S_ACT_SCALES,    /* FP8 matmul: activation scales [rows][ceil(k/128)] */
    RS_CUDA_S_FORM_BF16,     /* fast numerics: the cached activation's BF16 form [n] */
    RS_CUDA_S_FORM_Q8,       /* fast numerics: its E4M3 codes [n] */
    RS_CUDA_S_FORM_Q8S,      /* fast numerics: their 1x128 scales [rows][ceil(k/128)] */
    RS_CUDA_S_GEMM_CODES,    /* fast FP8 GEMM: codes padded to t_pad rows [t_pad][k] */
    RS_CUDA_S_GEMM_XSCALES,  /* fast FP8 GEMM: activation scales in cuBLASLt's layout [ceil(k/128)][t_pad] */
    RS_CUDA_S_GEMM_WSCALES,  /* fast FP8 GEMM: weight scales with rows padded to L4 [ceil(n/128)][L4] */
    RS_CUDA_S_GEMM_OUT,      /* fast GEMMs: output of t_pad rows [t_pad][n] */
    RS_CUDA_S_ATT_PART_O,    /* split attention: partial outputs [rows][n_heads][splits][hd] */
    RS_CUDA_S_ATT_PART_LSE,  /* split attention: their log-sum-exp [rows][n_heads][splits] */
    RS_CUDA_S_ATT_SH_O,      /* shared-page attention: partial outputs [rows][n_heads][splits][hd] */
    RS_CUDA_S_ATT_SH_LSE,    /* shared-page attention: their log-sum-exp [rows][n_heads][splits] */
    RS_CUDA_S_ATT_UNITS,     /* shared-page attention: units [rows][SH_UNIT], then row starts [rows] (int32) */
    RS_CUDA_S_SAMPLE_REQ,    /* sampling: the requests [n] */
    RS_CUDA_S_SAMPLE_RES,    /* sampling: the results [n] */
    RS_CUDA_S_SAMPLE_W,      /* sampling: a [vocab] fp32 row per block */
    RS_CUDA_S_MOE_LOGITS,    /* MoE: router logits [rows][n_experts] */
    RS_CUDA_S_MOE_X,         /* MoE: the rows routed to one expert [n][hidden] */
    RS_CUDA_S_MOE_GATE,      /* MoE: [n][moe_inter] */
    RS_CUDA_S_MOE_UP,        /* MoE: [n][moe_inter] */
    RS_CUDA_S_MOE_Y,         /* MoE: one expert's down output [n][hidden] */
    RS_CUDA_S_MOE_XCOPY,     /* MoE: x [rows][hidden], when out aliases it */
    RS_CUDA_S_MOE_SEL,       /* fast MoE: the selections [rows][k] experts, then [rows][k] weights */
    RS_CUDA_S_MOE_LISTS,     /* fast MoE: offsets [E + 1], rows [rows k], weights [rows k] */
    RS_CUDA_S_COUNT
};

/* The low-precision forms of one fp32 activation that fast-numerics GEMMs read (cuda_act.cu): its
 * BF16 values, and its E4M3 codes with their 1x128 scales [rows][ceil(k/128)] (rs_fp8_quantize_act's
 * bits). The op that produces an activation writes them in the same kernel (rmsnorm, swiglu), or the
 * first matmul that needs them computes them; later matmuls of the same x reuse them (q, k and v
 * share the normed input, gate and up theirs). Valid from the op that wrote them until the next
 * backend entry that is not a matmul of that x: every other entry point (rs_cuda_ctx_of) drops them,
 * so an upload, a copy or any kernel that could rewrite x invalidates first. */
struct rs_cuda_act {
    const void *x;      /* the activation; NULL: nothing cached */
    size_t n;           /* its elements */
    int group_len;      /* the groups run along rows of this length; 0: groups of 128 consecutive
                         * elements (the forms of any row length that is a multiple of 128) */
    bool bf16, fp8;     /* which forms are present */
};

struct rs_cuda_blas;   /* cuda_blas.cu */
struct rs_cuda_moe_table; /* cuda_moe_fast.cu */
struct rs_cuda_graphs; /* cuda_graph.cu */

struct rs_cuda_ctx {
    int device;
    int sm_count;
    rs_numerics numerics;   /* kernels/backend.h: EXACT (the constructor's) or FAST */
    int gemv_rows_fp8;      /* fast numerics: matmuls of up to this many rows take the GEMV kernels, */
    int gemv_rows_bf16;     /* per weight dtype (RS_CUDA_GEMV_ROWS_*) */
    int att_splits;         /* fast numerics: context splits of decode attention (0: by size; tests set it) */
    rs_cuda_attention_kernel att_kernel; /* backend.h; RS_CUDA_ATTENTION, default RS_CUDA_ATTENTION_PIPELINED */
    bool att_shared;        /* fast numerics: decode steps read pages that rows share once per unit
                             * (cuda_attention.cu; RS_CUDA_ATTENTION_SHARED=1, backend.h) */
    bool no_device_sampling; /* rs_backend_cuda_set_device_sampling(false): every request left undone */
    uint64_t sampled;       /* requests the device has sampled */
    uint64_t gemv_tc_runs;  /* tensor-core GEMVs launched (cuda_matmul_fast.cu; tests: which kernel ran) */
    uint64_t att_shared_runs; /* attention calls that launched attention_shared_kernel (tests: it ran) */
    bool pdl;               /* tensor-core GEMVs launch as programmatic dependents (backend.h rs_backend_cuda_set_pdl) */
    cudaStream_t stream;
    rs_cuda_blas *blas;     /* cuBLASLt handle, workspace and descriptor cache */
    rs_cuda_act act;
    rs_cuda_buf scratch[RS_CUDA_S_COUNT];
    rs_cuda_mirror mirror[RS_CUDA_M_COUNT];
    uint64_t mem_gen;       /* bumped whenever a scratch or mirror buffer moves: recorded graphs
                             * point at the old ones and are dropped */
    bool recording;         /* a step graph is being recorded on the stream */
    const char *rec_broken; /* why the recording cannot be used (NULL: fine so far) */
    rs_cuda_graphs *graphs;
    rs_cuda_moe_table *moe_tables; /* per MoE layer: its experts' pointers on the device */
    int n_moe_tables;
};

/* While recording: the recording is unusable (graph_end refuses it, and the step reruns op by op).
 * Ops call it instead of what a capture forbids (synchronizing, allocating). */
void rs_cuda_recording_broken(rs_cuda_ctx *c, const char *why);

/* The fast-numerics GEMV/GEMM crossover per weight dtype: up to this many rows, the tensor-core GEMVs
 * of cuda_matmul_fast.cu, which serve up to 8 rows (one mma n-tile); above, cuBLASLt. Measured on an
 * H200 (`build-cuda/bench-gpu gemv`, 6144 x 4096 and 4096 x 12288, docs/benchmarks.md): at 1-8 rows
 * the GEMVs took 13.3-22.9 us (FP8) and 20.0-38.2 us (BF16) where cuBLASLt took 19.7-37.4 and
 * 20.4-40.1; from 12 rows cuBLASLt won. */
#define RS_CUDA_GEMV_ROWS_FP8 8
#define RS_CUDA_GEMV_ROWS_BF16 8

/* The backend's context with its device current on the calling thread, for a matmul: it keeps the
 * cached activation forms (a matmul of their x reads them). The CUDA runtime's current device is per
 * thread, and the backend is called from threads other than the one that created it (the engine,
 * the weight-sync service): without this, --cuda-device 1 would launch the engine's kernels on
 * device 0 with device 1's stream. */
static inline rs_cuda_ctx *rs_cuda_ctx_keep(rs_backend *b) {
    rs_cuda_ctx *c = (rs_cuda_ctx *)b->ctx;
    int current = -1; /* asked each time: the NCCL transport may set another device on this thread */
    CUDA_CHECK(cudaGetDevice(&current));
    if (current != c->device) CUDA_CHECK(cudaSetDevice(c->device));
    return c;
}

/* The same for every other entry point: drops the cached activation forms first (rs_cuda_act). */
static inline rs_cuda_ctx *rs_cuda_ctx_of(rs_backend *b) {
    rs_cuda_ctx *c = rs_cuda_ctx_keep(b);
    c->act.x = NULL;
    return c;
}

/* A scratch slot with room for `bytes` (contents undefined). Never NULL: out of memory aborts. */
void *rs_cuda_scratch(rs_cuda_ctx *c, int slot, size_t bytes);

/* The device copy of host[0..bytes) in mirror `slot`, valid for ops queued after this call. */
const void *rs_cuda_mirror_of(rs_cuda_ctx *c, int slot, const void *host, size_t bytes);

/* Programmatic dependent launch (sm_90; nothing elsewhere and under the emulation, which runs launches
 * one after another). A kernel launched with the programmatic-serialization attribute (the
 * tensor-core GEMVs when c->pdl) may start while the kernel before it still runs, once every block
 * of that one has called rs_cuda_pdl_trigger (or exited): it may read what the step does not write
 * (weights) before rs_cuda_pdl_wait, which returns when the kernel before it has completed and its
 * writes are visible, and must read or write nothing else before. The kernels that feed a GEMV's
 * activation trigger at their start, which lets the GEMV's blocks load weights beside them. */
__device__ __forceinline__ void rs_cuda_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void rs_cuda_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Blocks of `threads` covering n items. */
static inline unsigned rs_cuda_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b ? b : 1);
}

/* A launch's error, checked right after it is queued. */
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

/* The sequence of row r: the last s with seq_start[s] <= r (seq_start ascending, [n_seq + 1]). */
__device__ __forceinline__ int rs_cuda_row_seq(const int32_t *seq_start, int n_seq, int r) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (seq_start[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

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
void rs_cuda_op_add_rmsnorm(rs_backend *b, float *x, const float *y, float *out, const rs_tensor *w, int rows, int dim,
                            float eps);
void rs_cuda_op_qk_norm_rope(rs_backend *b, float *q, float *k, const rs_tensor *q_norm, const rs_tensor *k_norm,
                             int rows, int n_heads, int n_kv_heads, int head_dim, float eps, const int32_t *pos,
                             const float *inv_freq);
void rs_cuda_op_swiglu(rs_backend *b, float *out, const float *gate, const float *up, size_t n);
void rs_cuda_op_add(rs_backend *b, float *x, const float *y, size_t n);
void rs_cuda_op_gather_rows(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim);

/* cuda_matmul.cu */
void rs_cuda_op_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias,
                       int rows);
/* The op in the given numerics (the MoE router always takes the exact kernels). */
void rs_cuda_matmul(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias, int rows,
                    rs_numerics numerics);
/* cuda_matmul_fast.cu: the fast numerics' matmul without bias; false when it does not take this
 * problem (few rows, a weight dtype without a fast path, or cuBLASLt refused it). */
bool rs_cuda_matmul_fast(rs_cuda_ctx *c, float *out, const float *x, const rs_tensor *w, int rows);
/* The tensor-core GEMVs of ws[0 .. count) (one dtype and K) over the same rows in one launch, no
 * bias, or false (nothing ran) where the single matmuls would not all take them. */
bool rs_cuda_matmul_group_fast(rs_cuda_ctx *c, float *const *outs, const float *x, const rs_tensor *const *ws, int count,
                               int rows);
void rs_cuda_op_matmul_group(rs_backend *b, float *const *outs, const float *x, const rs_tensor *const *ws,
                             const rs_tensor *const *biases, int count, int rows);
/* The W8A8 pieces, for the tests: activation quantization (rs_fp8_quantize_act's bits) and the
 * exact-block GEMM (rs_fp8_gemm_ref's bits). All pointers are device memory. */
void rs_cuda_fp8_quantize_act(rs_cuda_ctx *c, const float *x, int rows, int k, uint8_t *q, float *scale);
void rs_cuda_fp8_gemm(rs_cuda_ctx *c, float *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                      const float *ws, int rows, int n, int k);

/* cuda_blas.cu: every cuBLASLt call */
enum { RS_CUDA_GEMM_BF16 = 0, RS_CUDA_GEMM_FP8 };
/* out[t][n] = x[t][k] @ w[n][k]^T, row-major; cuda_blas.cu has the layouts and rules. */
struct rs_cuda_gemm {
    int kind;                 /* RS_CUDA_GEMM_BF16 | RS_CUDA_GEMM_FP8 */
    void *out;                /* [t][n] out_dt */
    rs_dtype out_dt;          /* F32 | BF16 */
    const void *x;            /* [t][k] bf16 / e4m3 */
    const float *xs;          /* FP8: [ceil(k/128)][t] f32 */
    const void *w;            /* [n][k] bf16 / e4m3 */
    const float *ws;          /* FP8: [ceil(n/128)][roundup(ceil(k/128), 4)] f32 */
    int t, n, k;              /* FP8: t and n multiples of 4, k of 16 */
};
void rs_cuda_blas_init(rs_cuda_ctx *c);
void rs_cuda_blas_free(rs_cuda_ctx *c);
size_t rs_cuda_blas_version(const rs_cuda_ctx *c);
/* RS_OK, or RS_EUNSUPPORTED when cuBLASLt does not run this problem (logged once per problem kind):
 * the caller runs its own kernels then. */
int rs_cuda_blas_gemm(rs_cuda_ctx *c, const rs_cuda_gemm *g);

/* cuda_act.cu: the cached activation forms (rs_cuda_act) */
/* Buffers for a producer that writes the forms of x [n] (group_len as in rs_cuda_act) in its own
 * kernel, and marks them cached: bf16 [n], q [n], s [groups] (groups = rows * ceil(group_len/128),
 * or n / 128 when group_len is 0). */
void rs_cuda_act_produce(rs_cuda_ctx *c, const float *x, size_t n, int group_len, uint16_t **bf16, uint8_t **q,
                         float **s);
/* The BF16 form of x [rows][k], computed unless cached. */
const uint16_t *rs_cuda_act_bf16(rs_cuda_ctx *c, const float *x, int rows, int k);
/* The E4M3 codes [rows][k] of x and (*scales) their scales [rows][ceil(k/128)], computed unless cached. */
const uint8_t *rs_cuda_act_fp8(rs_cuda_ctx *c, const float *x, int rows, int k, const float **scales);

/* cuda_sample.cu: sampling on the device (backend.h rs_sample_req) */
void rs_cuda_op_sample(rs_backend *b, const float *logits, int vocab, const rs_sample_req *req, int n, rs_sample_res *res);

/* cuda_graph.cu: step graphs (kernels/backend.h rs_backend_graph_begin) */
rs_graph_state rs_cuda_graph_begin(rs_backend *b, const void *owner, int slot, uint64_t key);
bool rs_cuda_graph_end(rs_backend *b);
void rs_cuda_graph_forget(rs_backend *b, const void *owner);
void rs_cuda_graphs_free(rs_cuda_ctx *c);
/* A mirror's recorded copy: slot's device buffer is filled from `host` before each replay. */
void rs_cuda_graph_note_copy(rs_cuda_ctx *c, int slot, const void *host, size_t bytes);

/* cuda_attention_tc.cu: tensor-core prefill attention over the paged cache (fast numerics) */
#define RS_CUDA_ATT_TC_ROWS 64 /* query rows per tile */
bool rs_cuda_attention_tc_takes(int head_dim);
/* tiles: device [n_tiles][4] {sequence, first row, rows (<= RS_CUDA_ATT_TC_ROWS), 0}: rows of one
 * sequence, consecutive in the batch; pos and tables as the exact kernel reads them. */
void rs_cuda_attention_tc(rs_cuda_ctx *c, float *out, const float *q, const rs_kv_layer *kv, int n_heads, float scale,
                          const int32_t *pos, const int32_t *tiles, int n_tiles, const int32_t *tables, int max_blocks);

/* cuda_attention.cu */
void rs_cuda_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v, const rs_batch *batch);
void rs_cuda_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                          float scale, const rs_batch *batch);

/* cuda_moe_fast.cu: fast numerics' MoE pieces */
#define RS_CUDA_MOE_FUSED_ROWS 16 /* up to this many rows: the fused device path */
/* The whole block on the device (no host round trip); false when the experts are not all E4M3 or
 * all BF16 of one shape, or there are too many rows. */
bool rs_cuda_moe_fused(rs_cuda_ctx *c, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w);
/* Routing and grouping on the device: offsets_host [E + 1] (synchronizes), the rows and weights of
 * every expert's selections (device, in row order) at *rows_dev / *wts_dev. */
int rs_cuda_moe_route_groups(rs_cuda_ctx *c, const float *x, int rows, int hidden, const rs_moe_weights *w,
                             int32_t *offsets_host, const int32_t **rows_dev, const float **wts_dev);
void rs_cuda_moe_tables_free(rs_cuda_ctx *c);

/* cuda_moe.cu */
void rs_cuda_op_moe(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w);

#endif /* RS_CUDA_INTERNAL_H */
