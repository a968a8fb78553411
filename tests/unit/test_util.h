/*
 * test_util.h — helpers shared by the unit tests.
 *
 * rs_test_host_backend: a host-memory backend that counts live allocations, so a test can check
 * that a failed load or update freed everything it had uploaded. It implements only the memory
 * ops (alloc, free, upload, download, copy): enough for loading and weight updates, not for
 * running a model.
 *
 * rs_test_logits: the logits of every position of one token sequence, computed in a single
 * prefill through a private F32 KV pool: the reference "what does this model say" for tests that
 * compare two ways of arriving at the same weights. rs_test_probe_logits runs a fixed 10-token
 * probe through it, and rs_test_same_probe compares two such results bit for bit.
 *
 * rs_test_sync_open: two tiny checkpoints, the engine serving one and the weight-sync service,
 * for the tests that push the other through a transport (test_sync.c, test_shm_guard.c).
 *
 * rs_test_tiny_qwen3: a two-layer Qwen3 config (hidden 160, vocab 256; tied embeddings, q/k
 * norms) small enough for a test to load, update and score many times.
 */
#ifndef RS_TEST_UTIL_H
#define RS_TEST_UTIL_H

#include "../../kernels/backend.h"
#include "../../model/model.h"
#include "../../model/safetensors.h"
#include "../../scheduler/engine.h"
#include "../../sync/sync.h"

extern int rs_test_live_allocs; /* allocations not yet freed, in this test process */

rs_backend *rs_test_host_backend(void);

/* Returns malloc'd logits [n][vocab] of tokens[0..n) run through m (on a backend that computes). */
float *rs_test_logits(rs_model *m, const int32_t *tokens, int n);

#define RS_TEST_PROBE_TOKENS 10
/* malloc'd logits [RS_TEST_PROBE_TOKENS][vocab] of the fixed probe sequence. */
float *rs_test_probe_logits(rs_model *m);
/* Bit-identical probe logits of two models with `vocab` tokens. */
int rs_test_same_probe(const float *x, const float *y, int vocab);

rs_model_config rs_test_tiny_qwen3(void);

/* A synthetic config of `arch` with these dimensions; the rest is what every test model shares:
 * rope theta 1e4 without scaling, bos 1, eos 2, q/k norms for Qwen3 and Qwen3-MoE, q/k/v biases
 * for Qwen2, and for Qwen3-MoE 4 experts (top 2, renormalized) of width moe_intermediate in every
 * layer but layer 0 (in mlp_only_layers). rms_eps 0 means 1e-6. */
typedef struct rs_test_dims {
    int vocab, hidden, intermediate, n_layers, n_heads, n_kv_heads, head_dim, max_position;
    int moe_intermediate;
    bool tied;
    float rms_eps;
} rs_test_dims;
rs_model_config rs_test_config(rs_arch arch, rs_test_dims d);

/* rs_testmodel_write (model/testmodel.h) that fails the test on error. */
void rs_test_write_model(const char *dir, const rs_model_config *c, uint64_t seed);

/* splitmix64: the next pseudo-random word of the stream *s. */
uint64_t rs_test_rng(uint64_t *s);
/* Uniform in [-1, 1), from rs_test_rng. */
float rs_test_uniform(uint64_t *s);

/* A float's bits, and the float of some bits. */
uint32_t rs_test_f32_bits(float f);
float rs_test_f32_from_bits(uint32_t u);

/* A copy of host[0..bytes) in a new allocation of b (at least one byte). */
void *rs_test_to_backend(rs_backend *b, const void *host, size_t bytes);
/* A malloc'd host copy of b's src[0..bytes). */
void *rs_test_to_host(rs_backend *b, const void *src, size_t bytes);
/* Frees a test KV layer's backend allocations: pages and whichever scales it has. */
void rs_test_kv_layer_free(rs_backend *b, rs_kv_layer *kv);

/* The CUDA backend on device 0, or the test ends as skipped when this machine has no GPU (defined
 * in a CUDA=1 build only). */
rs_backend *rs_test_cuda_or_skip(void);

/* The weight-sync service in process: the served tiny Qwen3 A (seed 1, quantization `mode`) with
 * a running engine thread and the sync service (opts so, NULL = defaults); checkpoint B (seed 2)
 * on the trainer side, open as bt; and the probe logits of a fresh load of each (the references).
 * The checkpoints live in rs_test_tmpdir()/a and /b. */
typedef struct rs_test_sync_env {
    rs_backend *b;
    rs_model *m;
    rs_engine *e;
    rs_sync *s;
    char dir_a[512], dir_b[512];
    rs_st_dir *bt;                      /* B's tensors */
    float *logits_a, *logits_b;
} rs_test_sync_env;
rs_test_sync_env rs_test_sync_open(const char *mode, const rs_sync_opts *so);
void rs_test_sync_close(rs_test_sync_env *v);
/* Whether the engine now serves exactly `want` (probe logits, bit for bit). */
int rs_test_sync_serves(rs_test_sync_env *v, const float *want);

#endif /* RS_TEST_UTIL_H */
