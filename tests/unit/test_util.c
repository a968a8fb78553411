/*
 * test_util.c — helpers shared by the unit tests (see test_util.h).
 */
#include "test_util.h"

#include "../../kernels/backend_impl.h" /* a host-memory backend of the test's own */
#include "../../kvcache/kvcache.h"
#include "../../model/quant.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int rs_test_live_allocs;

static void *hb_alloc(rs_backend *b, size_t n) {
    (void)b;
    rs_test_live_allocs++;
    return calloc(1, n ? n : 1);
}

static void hb_free(rs_backend *b, void *p) {
    (void)b;
    rs_test_live_allocs--;
    free(p);
}

static void hb_copy(rs_backend *b, void *dst, const void *src, size_t n) {
    (void)b;
    memcpy(dst, src, n);
}

static void hb_destroy(rs_backend *b) { free(b); }

static const rs_backend_ops hb_ops = {
    .name = "host-test", .alloc = hb_alloc, .free = hb_free, .upload = hb_copy, .download = hb_copy,
    .copy = hb_copy, .destroy = hb_destroy,
};

rs_backend *rs_test_host_backend(void) {
    rs_backend *b = calloc(1, sizeof *b);
    b->ops = &hb_ops;
    return b;
}

float *rs_test_logits(rs_model *m, const int32_t *tokens, int n) {
    const rs_model_config *c = &m->cfg;
    rs_kv_pool p;
    ASSERT_EQ(rs_kv_pool_init(&p, m->backend, c->n_layers, c->n_kv_heads, c->head_dim, RS_DTYPE_F32, 1 << 20), RS_OK);
    rs_kv_seq s = {0};
    ASSERT_EQ(rs_kv_seq_reserve(&p, &s, n), RS_OK);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n), *slot = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) {
        pos[i] = i;
        slot[i] = rs_kv_slot(&s, i);
    }
    int32_t start[2] = {0, n}, ctx[1] = {n};
    rs_batch bt = {.n_tok = n, .n_seq = 1, .tokens = tokens, .pos = pos, .slot = slot, .seq_start = start,
                   .seq_ctx = ctx, .block_tables = s.blocks, .max_blocks = s.n_blocks};
    float *out = malloc(sizeof(float) * (size_t)n * (size_t)c->vocab_size);
    rs_forward_ctx *f = rs_forward_ctx_init(m, n, n);
    rs_forward(f, &bt, p.layers, pos /* every row: 0..n-1 */, n, out);
    rs_forward_ctx_free(f);
    rs_kv_seq_release(&p, &s);
    rs_kv_pool_free(&p);
    free(pos);
    free(slot);
    return out;
}

float *rs_test_probe_logits(rs_model *m) {
    int32_t tok[RS_TEST_PROBE_TOKENS];
    for (int i = 0; i < RS_TEST_PROBE_TOKENS; i++) tok[i] = (int32_t)((i * 53 + 3) % m->cfg.vocab_size);
    return rs_test_logits(m, tok, RS_TEST_PROBE_TOKENS);
}

int rs_test_same_probe(const float *x, const float *y, int vocab) {
    return memcmp(x, y, sizeof(float) * RS_TEST_PROBE_TOKENS * (size_t)vocab) == 0;
}

rs_model_config rs_test_tiny_qwen3(void) {
    rs_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = RS_ARCH_QWEN3;
    c.vocab_size = 256;
    c.hidden = 160;
    c.intermediate = 200;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 32;
    c.max_position = 512;
    c.rms_eps = 1e-6f;
    c.rope_theta = 10000.0;
    c.rope_factor = c.rope_low_freq_factor = c.rope_high_freq_factor = 1.0;
    c.rope_original_max_position = 512;
    c.tie_embeddings = true;
    c.qk_norm = true;
    c.decoder_sparse_step = 1;
    c.bos_token_id = 1;
    c.eos_token_ids[0] = 2;
    c.n_eos = 1;
    return c;
}

rs_model_config rs_test_config(rs_arch arch, rs_test_dims d) {
    rs_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = arch;
    c.vocab_size = d.vocab;
    c.hidden = d.hidden;
    c.intermediate = d.intermediate;
    c.n_layers = d.n_layers;
    c.n_heads = d.n_heads;
    c.n_kv_heads = d.n_kv_heads;
    c.head_dim = d.head_dim;
    c.max_position = d.max_position;
    c.rms_eps = d.rms_eps > 0 ? d.rms_eps : 1e-6f;
    c.rope_theta = 10000.0;
    c.rope_factor = c.rope_low_freq_factor = c.rope_high_freq_factor = 1.0;
    c.rope_original_max_position = d.max_position;
    c.tie_embeddings = d.tied;
    c.qk_norm = arch == RS_ARCH_QWEN3 || arch == RS_ARCH_QWEN3_MOE;
    c.qkv_bias = arch == RS_ARCH_QWEN2;
    c.decoder_sparse_step = 1;
    c.bos_token_id = 1;
    c.eos_token_ids[0] = 2;
    c.n_eos = 1;
    if (arch == RS_ARCH_QWEN3_MOE) {
        c.n_experts = 4;
        c.n_experts_per_tok = 2;
        c.moe_intermediate = d.moe_intermediate;
        c.norm_topk_prob = true;
        for (int l = 1; l < d.n_layers; l++) c.layer_is_moe[l] = true;
    }
    return c;
}

void rs_test_write_model(const char *dir, const rs_model_config *c, uint64_t seed) {
    rs_error err = {0};
    if (rs_testmodel_write(dir, c, seed, &err) != RS_OK) RS_TEST_FAIL("testmodel %s: %s", dir, err.message);
}

uint64_t rs_test_rng(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float rs_test_uniform(uint64_t *s) {
    return (float)((double)(rs_test_rng(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

uint32_t rs_test_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

float rs_test_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

void *rs_test_to_backend(rs_backend *b, const void *host, size_t bytes) {
    void *p = rs_backend_alloc(b, bytes ? bytes : 1);
    ASSERT_TRUE(p != NULL);
    if (bytes) rs_backend_upload(b, p, host, bytes);
    return p;
}

void rs_test_kv_layer_free(rs_backend *b, rs_kv_layer *kv) {
    rs_backend_free_mem(b, kv->pages);
    if (kv->k_scale) rs_backend_free_mem(b, kv->k_scale);
    if (kv->v_scale) rs_backend_free_mem(b, kv->v_scale);
    if (kv->token_scales) rs_backend_free_mem(b, kv->token_scales);
}

void *rs_test_to_host(rs_backend *b, const void *src, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (bytes) rs_backend_download(b, p, src, bytes);
    return p;
}

/* ---------------------------------------------------------------- the sync service in process */

rs_test_sync_env rs_test_sync_open(const char *mode, const rs_sync_opts *so) {
    rs_test_sync_env v;
    memset(&v, 0, sizeof v);
    snprintf(v.dir_a, sizeof v.dir_a, "%s/a", rs_test_tmpdir());
    snprintf(v.dir_b, sizeof v.dir_b, "%s/b", rs_test_tmpdir());
    rs_model_config c = rs_test_tiny_qwen3();
    rs_error err = {0};
    if (rs_testmodel_write(v.dir_a, &c, 1, &err) != RS_OK || rs_testmodel_write(v.dir_b, &c, 2, &err) != RS_OK)
        RS_TEST_FAIL("testmodel: %s", err.message);
    v.b = rs_backend_cpu_init(2);
    rs_quant_policy qp;
    ASSERT_EQ(rs_quant_policy_init(&qp, mode, "", 0, 0, &err), RS_OK);
    rs_model *ref_b = NULL;
    ASSERT_EQ(rs_model_load(v.dir_b, v.b, &qp, &ref_b, &err), RS_OK);
    v.logits_b = rs_test_probe_logits(ref_b);
    rs_model_free(ref_b);
    ASSERT_EQ(rs_model_load(v.dir_a, v.b, &qp, &v.m, &err), RS_OK);
    v.logits_a = rs_test_probe_logits(v.m);
    ASSERT_TRUE(!rs_test_same_probe(v.logits_a, v.logits_b, c.vocab_size));
    rs_engine_opts eo = {.kv_cache_bytes = 2 << 20, .max_running = 4, .max_step_tokens = 256,
                         .limits = {.max_context = 256, .max_new_tokens = 128, .max_n = 2, .max_batch = 4}};
    ASSERT_EQ(rs_engine_init(&v.e, v.m, &eo, &err), RS_OK);
    ASSERT_EQ(rs_engine_start(v.e), RS_OK);
    rs_sync_opts def = {0};
    if (rs_sync_start(&v.s, v.e, v.m, so ? so : &def, &err) != RS_OK) RS_TEST_FAIL("sync: %s", err.message);
    ASSERT_EQ(rs_st_dir_open(&v.bt, v.dir_b, &err), RS_OK);
    return v;
}

void rs_test_sync_close(rs_test_sync_env *v) {
    rs_sync_stop(v->s);
    rs_engine_stop(v->e);
    rs_engine_free(v->e);
    rs_model_free(v->m);
    rs_st_dir_close(v->bt);
    rs_backend_free(v->b);
    free(v->logits_a), free(v->logits_b);
}

int rs_test_sync_serves(rs_test_sync_env *v, const float *want) {
    float *got = rs_test_probe_logits(v->m);
    const int same = rs_test_same_probe(got, want, rs_test_tiny_qwen3().vocab_size);
    free(got);
    return same;
}

#ifdef RS_CUDA
#include <cuda_runtime.h>

rs_backend *rs_test_cuda_or_skip(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) RS_TEST_SKIP("no CUDA device");
    rs_backend *b = rs_backend_cuda_init(0);
    ASSERT_TRUE(b != NULL);
    return b;
}
#endif
