/*
 * backend.h — the table of operations that model/ writes its forward pass against.
 *
 * In the spirit of ggml-backend: an opaque handle with a private table of function pointers
 * (backend_impl.h, seen only inside kernels/) and checked dispatch. The CPU backend (kernels/cpu/) is always built; it is the reference every other
 * backend is compared against, op by op, with the same inputs. The CUDA backend (kernels/cuda/,
 * `make CUDA=1`) implements the same table on device memory.
 *
 * Conventions for every op:
 *   - activations are fp32, row-major, one row per token of the step's flattened batch;
 *   - pointers named x/out/q/k/v/... live in the backend's memory (rs_backend_alloc);
 *   - per-step batch metadata (rs_batch) is host memory: a device backend uploads it itself;
 *     a negative slot stores nothing (the padding rows of a step graph; only backends with graph
 *     ops are handed one);
 *   - ops are asynchronous on a device backend; rs_backend_download synchronizes.
 */
#ifndef RS_BACKEND_H
#define RS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tensor.h"

#define RS_KV_BLOCK 16 /* tokens per KV page */

/* How E4M3 KV pages are scaled (a stored code c means c * scale). */
typedef enum rs_kv_scale_mode {
    RS_KV_SCALE_NONE = 0,   /* F32 / BF16 pages: no scales */
    RS_KV_SCALE_PER_HEAD,   /* one K and one V scale per layer and KV head: k_scale, v_scale */
    RS_KV_SCALE_PER_TOKEN,  /* one K and one V scale per token and KV head, beside the page: token_scales */
} rs_kv_scale_mode;

/* One layer's paged KV cache, as the attention ops see it. kvcache/ owns the memory.
 * pages: [n_blocks][2][RS_KV_BLOCK][n_kv_heads][head_dim] of `dtype` (index 0 = K, 1 = V).
 * A token's slot is block * RS_KV_BLOCK + offset. */
typedef struct rs_kv_layer {
    void *pages;
    rs_dtype dtype;         /* F32, BF16 or E4M3 */
    int n_blocks;
    int n_kv_heads;
    int head_dim;
    rs_kv_scale_mode scale_mode;    /* E4M3 only */
    float *k_scale, *v_scale;       /* PER_HEAD: [n_kv_heads] f32, backend memory */
    float *token_scales;            /* PER_TOKEN: [n_blocks][2][RS_KV_BLOCK][n_kv_heads] f32 */
} rs_kv_layer;

/* Asserts the layer's contract above (F32/BF16 pages carry no scales; E4M3 pages carry per-head or
 * per-token scales): a layer that breaks it is a bug in kvcache/ or the caller. Returns the size of
 * a page element. Every backend's kv_store and attention start with it. */
size_t rs_kv_layer_check(const rs_kv_layer *kv);

/* The flattened batch of one engine step: n_seq sequences, each contributing a contiguous run of
 * rows (a prefill chunk or one decode token). Host memory. */
typedef struct rs_batch {
    int n_tok;                      /* rows in this step */
    int n_seq;
    const int32_t *tokens;          /* [n_tok] token ids */
    const int32_t *pos;             /* [n_tok] absolute position of each row */
    const int32_t *slot;            /* [n_tok] KV slot each row's K/V is written to */
    const int32_t *seq_start;       /* [n_seq + 1] rows of seq s are [seq_start[s], seq_start[s+1]) */
    const int32_t *seq_ctx;         /* [n_seq] context length of seq s after this step (incl. new rows) */
    const int32_t *block_tables;    /* [n_seq][max_blocks] page ids of each sequence, in order */
    int max_blocks;
} rs_batch;

/* Mixture-of-experts weights of one layer (Qwen3-MoE). Experts are [n_experts] arrays. */
typedef struct rs_moe_weights {
    const rs_tensor *router;        /* [n_experts][hidden] */
    const rs_tensor *gate;          /* [n_experts] each [moe_inter][hidden] */
    const rs_tensor *up;            /* [n_experts] each [moe_inter][hidden] */
    const rs_tensor *down;          /* [n_experts] each [hidden][moe_inter] */
    int n_experts;
    int top_k;
    bool norm_topk_prob;
} rs_moe_weights;

/* How a backend does its arithmetic (--numerics).
 *   EXACT  the reference kernels: bit-identical to the CPU backend wherever the roundings allow
 *          (docs/design.md "Numerics"), every kernel batch-invariant. The CPU backend has only these.
 *   FAST   a device backend's tensor-core path: GEMMs through cuBLASLt (BF16 x BF16, block-scaled
 *          FP8) with fp32 accumulation in the library's order, BF16 activations into BF16 GEMMs,
 *          split-K attention. Compared with EXACT under per-op tolerances; not batch-invariant. */
typedef enum rs_numerics {
    RS_NUMERICS_EXACT = 0,
    RS_NUMERICS_FAST,
} rs_numerics;

const char *rs_numerics_name(rs_numerics n);                /* "exact" | "fast" */
int rs_numerics_parse(const char *s, rs_numerics *out);     /* RS_OK, or RS_EINVAL */

/* Step graphs (optional ops below): what rs_backend_graph_begin did. */
typedef enum rs_graph_state {
    RS_GRAPH_OFF = 0,       /* nothing: run the ops one by one (a first sighting of the key warms up) */
    RS_GRAPH_RECORDING,     /* run the ops, then rs_backend_graph_end: they are recorded, not run yet */
    RS_GRAPH_REPLAYED,      /* the recording of this key ran: skip the ops */
    RS_GRAPH_NEVER,         /* this key cannot be recorded (an earlier try was refused): run the
                             * ops as without step graphs */
} rs_graph_state;

/* Sampling on the device (optional op `sample`): one request per logits row to sample from, the
 * semantics of scheduler/sampler.c (sampler.h) bit for bit on the same logits: the distribution
 * relative to the largest logit (rs_expf((x - max) / T), the 16-lane double sum), the (seed,
 * sample index, position) RNG, top-k / top-p / min-p over the order (logit desc, id asc), greedy
 * for T <= 0, the logprob of the requested mode and the top logprobs. An invalid row (a NaN, a
 * +inf, no finite entry) comes back done with token -1, as rs_sample returns it. A backend may
 * leave a request undone (done false: e.g. a truncation that keeps more tokens than it sorts);
 * the caller samples that row on the host. That is bit for bit under exact numerics; under fast
 * numerics a backend may sum the distribution and the draw in another order (the CUDA backend's
 * parts): the same tokens but where u falls within rounding of a boundary, logprobs within a few
 * fp32 ulps. */
#define RS_SAMPLE_MAX_TOP 64
typedef enum rs_sample_lp_mode {
    RS_SAMPLE_LP_DEFAULT = 0,   /* log_softmax(logits / T) before truncation (T = 1 when greedy) */
    RS_SAMPLE_LP_RAW,           /* log_softmax(logits) */
    RS_SAMPLE_LP_PROCESSED,     /* of the distribution sampled from (T, truncation, renormalized) */
} rs_sample_lp_mode;

typedef struct rs_sample_req {
    int row;                    /* logits row */
    float temperature;          /* <= 0: greedy (the engine sends 0 where rs_sampling_greedy holds) */
    float top_p, min_p;
    int top_k;                  /* <= 0 or >= vocab: off */
    uint64_t seed, sample_index, position;
    rs_sample_lp_mode lp_mode;
    int n_top;                  /* top logprobs wanted, 0..RS_SAMPLE_MAX_TOP */
} rs_sample_req;

typedef struct rs_sample_res {
    bool done;                  /* false: not sampled here, sample the row on the host */
    int32_t token;
    float logprob;              /* in the request's mode */
    int n_top;                  /* top entries written (fewer than asked when truncation keeps fewer) */
    int32_t top_ids[RS_SAMPLE_MAX_TOP];
    float top_lps[RS_SAMPLE_MAX_TOP];
} rs_sample_res;

/* An opaque handle: the op table behind it is private to kernels/ (backend_impl.h). Callers use
 * the constructors and the checked dispatch below. */
typedef struct rs_backend rs_backend;
struct rs_error; /* core/rs.h */

/* Constructors. n_threads <= 0 picks the number of online CPUs. */
rs_backend *rs_backend_cpu_init(int n_threads);
/* The CPU backend with its kernel class chosen by `kernels` (the --cpu-kernels setting): "auto",
 * the best this CPU runs (the RS_CPU_SIMD environment variable may cap it), or "avx512", "avx2",
 * "scalar", forced (to test or benchmark a lower class on a bigger CPU). NULL with err set
 * (RS_EINVAL for another name, RS_EUNSUPPORTED when this CPU cannot run the class). Logs the
 * dispatch (rs_backend_cpu_describe) at info level. */
rs_backend *rs_backend_cpu_init_kernels(int n_threads, const char *kernels, struct rs_error *err);
/* A CPU backend that computes as the CPU backend `like` does (its kernel class, forced or capped,
 * and its AMX choice; numerics are set apart, rs_backend_set_numerics), on a pool of its own: a
 * second backend whose results must match the first's bit for bit (the KV-scale calibration of
 * weight updates). Quiet: it logs nothing. */
rs_backend *rs_backend_cpu_init_like(const rs_backend *like, int n_threads);
/* One line naming what a CPU backend dispatches to, e.g. "cpu: avx2 fma f16c; fp8 kernel
 * avx2-exact; bf16 tile 4x3". Returns buf. */
const char *rs_backend_cpu_describe(rs_backend *b, char *buf, size_t n);
/* ---- the CUDA backend (kernels/cuda): defined in a CUDA=1 build only. Declared in every build: a
 * header reads the same whatever CUDA= says (the Makefile relies on it), and only .c files test
 * RS_CUDA. ---- */
/* A CUDA backend on `device`, in RS_NUMERICS_EXACT until rs_backend_set_numerics says otherwise
 * (the daemon and the benchmarks switch it to their --numerics, fast by default). */
rs_backend *rs_backend_cuda_init(int device);
/* The CUDA device ordinal of a CUDA backend, -1 for any other backend. */
int rs_backend_cuda_device(const rs_backend *b);
/* Fast numerics: matmuls with weights of weight_dtype (E4M3 or BF16) and up to `rows` rows take the
 * GEMV kernels, more take cuBLASLt (defaults: kernels/cuda/cuda_internal.h RS_CUDA_GEMV_ROWS_*;
 * benchmarks and tests move it). Returns the previous value. */
int rs_backend_cuda_set_gemv_rows(rs_backend *b, rs_dtype weight_dtype, int rows);
/* Step graphs are recorded with global-mode stream capture: while one thread records, no thread of
 * the process may allocate or free device or pinned memory, synchronize, or put work on the recorded
 * stream (CUDA refuses the call, or records it into the graph). The backend holds this lock while it
 * records and around its own allocations, frees and transfers (rs_backend_upload from the weight
 * staging thread, for one); CUDA code outside the backend that allocates (NCCL staging) holds it
 * around those calls. Recursive. */
void rs_backend_cuda_capture_lock(void);
void rs_backend_cuda_capture_unlock(void);
/* The attention kernel (kernels/cuda/cuda_attention.cu):
 *   TILES   a block walks its positions by tiles of 64, reading each K and V row as it uses it;
 *   STAGED  the same, each tile's K and V rows first staged in shared memory with one burst of
 *           16-byte loads: the same arithmetic in the same order, so the same bits as TILES;
 *   WARPS   fast numerics' decode rows take a kernel whose warps stream their own runs of
 *           positions, many K/V loads in flight, with no barrier per tile; another fp32 order (the
 *           tests bound it). Exact numerics and head sizes it does not take run TILES.
 *   PIPELINED  (the default) WARPS with runs of half the length, each warp's next run of loads issued
 *           before the current run's arithmetic (another fp32 order; the tests bound it the same
 *           way). Measured on an H200: 3-6% faster than WARPS on every decode shape of
 *           `bench-gpu attention`, 5.8-7.6x faster than TILES at 32 and 256 rows (docs/benchmarks.md).
 *   MMA     WARPS' contract with the products on tensor cores (Q and P rounded to BF16 or F16, as the
 *           prefill kernel does); head sizes 32, 64 and 128, others run PIPELINED. Not measured on a
 *           GPU yet, so not the default.
 * The environment variable RS_CUDA_ATTENTION=tiles|staged|warps|pipelined|mma sets it for a process
 * (benchmarks compare them). */
typedef enum {
    RS_CUDA_ATTENTION_TILES = 0,
    RS_CUDA_ATTENTION_STAGED,
    RS_CUDA_ATTENTION_WARPS,
    RS_CUDA_ATTENTION_PIPELINED,
    RS_CUDA_ATTENTION_MMA
} rs_cuda_attention_kernel;
void rs_backend_cuda_set_attention_kernel(rs_backend *b, rs_cuda_attention_kernel k);
/* Decode steps of fast numerics (every sequence one row) with the option on read the KV pages that
 * rows share (the n samples of a prompt, prompts with the same cached prefix) once per unit of up to
 * 16 / group rows, on tensor cores, instead of once per row; each row's own pages then go through the
 * kernel above, and a combine pass merges both (kernels/cuda/cuda_attention.cu,
 * attention_shared_kernel). Head sizes 32, 64 and 128, groups of up to 8 query heads. Off by
 * default until measured on a GPU; the environment variable RS_CUDA_ATTENTION_SHARED=1 turns it on for
 * a process. */
void rs_backend_cuda_set_attention_shared(rs_backend *b, bool on);
/* Tensor-core GEMVs (fast numerics, up to RS_CUDA_GEMV_ROWS_* rows) launched as programmatic dependents
 * of the kernel before them (sm_90 PDL): their blocks start while that kernel runs and load their
 * first weights before waiting for it, which hides part of each launch and of the first memory
 * latency. Off by default until measured; the environment variable RS_CUDA_PDL=1 turns it on for a
 * process (scripts/gpu-check.sh's pdl step compares). */
void rs_backend_cuda_set_pdl(rs_backend *b, bool on);
/* Sampling on the device on (the default) or off: off, every request comes back undone and the
 * caller samples on the host (the engine does, row by row). */
void rs_backend_cuda_set_device_sampling(rs_backend *b, bool on);
/* Step graphs on (the default) or off (every step op by op), e.g. --cuda-graphs false. */
void rs_backend_cuda_set_graphs(rs_backend *b, bool on);
/* Recordings made, replays run and recordings refused so far. */
void rs_backend_cuda_graph_stats(const rs_backend *b, uint64_t *recorded, uint64_t *replayed, uint64_t *refused);
void rs_backend_free(rs_backend *b);

/* The name of the first op in the table that this backend does not provide, or NULL when it
 * provides them all. A model is only ever run on a complete backend. */
const char *rs_backend_missing_op(const rs_backend *b);

/* The backend's name ("cpu", "cuda"), for logs and /get_server_info. */
const char *rs_backend_name(const rs_backend *b);
/* Whether rs_backend_alloc returns host memory that host code may read and write directly (the
 * CPU backend): a weight update then writes in place instead of uploading. */
bool rs_backend_host_memory(const rs_backend *b);

/* The arithmetic b runs in, and the switch: returns the mode in effect after the call (EXACT on a
 * backend without fast kernels, whatever was asked). */
rs_numerics rs_backend_numerics(const rs_backend *b);
rs_numerics rs_backend_set_numerics(rs_backend *b, rs_numerics want);

/* Whether b samples on the device, and the call (see rs_sample_req). */
bool rs_backend_has_sample(const rs_backend *b);
void rs_backend_sample(rs_backend *b, const float *logits, int vocab, const rs_sample_req *req, int n,
                       rs_sample_res *res);

/* Step graphs: a sequence of ops that runs again and again with the same shapes and pointers (a
 * decode step of one batch size) is recorded once and replayed (CUDA graphs). Protocol:
 *   st = rs_backend_graph_begin(b, owner, slot, key);
 *   if (st != RS_GRAPH_REPLAYED) {
 *       ...the ops...
 *       if (st == RS_GRAPH_RECORDING && !rs_backend_graph_end(b)) ...the ops again (the recording
 *                                                       failed: they have not run; nothing did)
 *   }
 * owner (the caller's identity) and slot (e.g. the padded batch size) name one recording; key is
 * everything the recorded ops depend on besides the contents of memory: shapes, every device
 * pointer they read or write (weights, KV pages, activations), the numerics. A key seen for the first
 * time runs op by op (OFF: warm-up, so buffers reach their sizes), the second time it is recorded,
 * then replayed; a new key for the same (owner, slot) replaces the recording. Contract while
 * recording: every host array an op reads (token ids, positions, slots, block tables: rs_batch)
 * must live at an address whose contents the caller updates in place before each later begin —
 * a replay re-reads those addresses; the ops must not synchronize (no download). An op the
 * backend cannot record (e.g. one that reads device results on the host) makes graph_end return
 * false, and that key answers RS_GRAPH_NEVER from then on. Backends without graphs always answer
 * OFF. */
rs_graph_state rs_backend_graph_begin(rs_backend *b, const void *owner, int slot, uint64_t key);
bool rs_backend_graph_end(rs_backend *b);
/* Drops owner's recordings (before freeing what they point to). */
void rs_backend_graph_forget(rs_backend *b, const void *owner);
/* Whether b records step graphs at all. */
bool rs_backend_has_graphs(const rs_backend *b);

/* Op profiling (rollout-bench --profile-ops): while on, every op, sample, upload, download and
 * copy through the wrappers here is timed from the end of the work queued before it to the end of
 * its own. An asynchronous backend is synchronized around each one, so it loses its overlap; step
 * graphs must be off (a replay calls no ops, and a recording may not synchronize). The profile says
 * where a step's time goes, not how fast the step runs unprofiled. For one calling thread at a time
 * (the counts are not atomic). rs_backend_profile(b, true) also clears the counts. */
void rs_backend_profile(rs_backend *b, bool on);
/* Prints the counts: per op, calls, milliseconds in all and per step (of `steps`), share. */
void rs_backend_profile_print(const rs_backend *b, FILE *f, int steps);

/* Checked dispatch: every caller goes through these. */
void *rs_backend_alloc(rs_backend *b, size_t bytes);
void rs_backend_free_mem(rs_backend *b, void *p);
void rs_backend_upload(rs_backend *b, void *dst, const void *src_host, size_t bytes);
void rs_backend_download(rs_backend *b, void *dst_host, const void *src, size_t bytes);
void rs_backend_copy(rs_backend *b, void *dst, const void *src, size_t bytes);
/* The layout in which b serves an E4M3 weight [n][k] (RS_LAYOUT_ROWS without fp8_layout), and the
 * packing of row-major host codes into b's memory in it (a plain upload for RS_LAYOUT_ROWS). */
rs_layout rs_backend_fp8_layout(rs_backend *b, int64_t n, int64_t k);
void rs_backend_fp8_pack(rs_backend *b, rs_layout layout, void *dst, const uint8_t *src_host, int64_t n, int64_t k);
void rs_op_embed(rs_backend *b, float *out, const rs_tensor *table, const int32_t *ids, int n);
void rs_op_rmsnorm(rs_backend *b, float *out, const float *x, const rs_tensor *w, int rows, int dim, float eps);
void rs_op_matmul(rs_backend *b, float *out, const float *x, const rs_tensor *w, const rs_tensor *bias, int rows);
/* outs[i] = rs_op_matmul(x, ws[i], biases[i]) for i < count: weights of the same K over the same
 * rows (q, k, v; gate, up), in one launch where the backend can (backend_impl.h matmul_group) and the
 * weights share a dtype and layout, else one matmul each. biases may be NULL (none), or hold NULL or
 * absent tensors. */
#define RS_MATMUL_GROUP 3
void rs_op_matmul_group(rs_backend *b, float *const *outs, const float *x, const rs_tensor *const *ws,
                        const rs_tensor *const *biases, int count, int rows);
void rs_op_rope(rs_backend *b, float *x, int rows, int n_heads, int head_dim, const int32_t *pos,
                const float *inv_freq);
/* Fused ops: the bits of the op sequence each one names, in one launch where the backend can
 * (backend_impl.h), the sequence of single ops elsewhere.
 * rs_op_add_rmsnorm: x += y (the residual stream), then out = rmsnorm(x) * w over rows of dim:
 *   rs_op_add then rs_op_rmsnorm. out may be y or x.
 * rs_op_qk_norm_rope: attention's q [rows][n_heads][head_dim] and k [rows][n_kv_heads][head_dim] in
 *   place: each head normed by q_norm / k_norm [head_dim] (NULL: that tensor is not normed), then
 *   rotated at pos [rows] with inv_freq [head_dim / 2]: rs_op_rmsnorm of q's heads and of k's heads,
 *   then rs_op_rope of q and of k. */
void rs_op_add_rmsnorm(rs_backend *b, float *x, const float *y, float *out, const rs_tensor *w, int rows, int dim,
                       float eps);
void rs_op_qk_norm_rope(rs_backend *b, float *q, float *k, const rs_tensor *q_norm, const rs_tensor *k_norm, int rows,
                        int n_heads, int n_kv_heads, int head_dim, float eps, const int32_t *pos, const float *inv_freq);
void rs_op_kv_store(rs_backend *b, rs_kv_layer *kv, const float *k, const float *v, const rs_batch *batch);
void rs_op_attention(rs_backend *b, float *out, const float *q, const rs_kv_layer *kv, int n_heads,
                     float scale, const rs_batch *batch);
void rs_op_swiglu(rs_backend *b, float *out, const float *gate, const float *up, size_t n);
void rs_op_add(rs_backend *b, float *x, const float *y, size_t n);
void rs_op_gather_rows(rs_backend *b, float *out, const float *x, const int32_t *idx, int n, int dim);
void rs_op_moe(rs_backend *b, float *out, const float *x, int rows, int hidden, const rs_moe_weights *w);

#endif /* RS_BACKEND_H */
