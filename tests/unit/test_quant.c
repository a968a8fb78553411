/*
 * test_quant.c — the quantization policy (model/quant.c) and FP8 weights at load (model/loader.c):
 * which tensors become E4M3, what lands in the weight store, and FP8 checkpoints.
 *
 * References. The policy tests spell out, name by name, the recipe of docs/design.md "Numerics" and
 * the FP8-RL recipe (arXiv 2601.18150) (quantize attention q/k/v/o, MLP gate/up/down and MoE experts; keep
 * embeddings, lm_head, norms, biases and the router). Codes and scales of a loaded model are
 * compared with rs_fp8_quantize_weight applied here to the BF16 bytes read back from the file, so
 * the loader's plumbing (which tensor, which bytes, which layout, nothing left in BF16) is what is
 * tested; the quantizer's own numerics are checked against ml_dtypes fixtures in test_fp8.c. FP8
 * checkpoints are written here in the DeepSeek-V3 / Qwen3-FP8 layout (F8_E4M3 weight +
 * `<name>_scale_inv`, config.json quantization_config) from a BF16 model, and must load to the very
 * bytes the BF16 model gives when quantized at load.
 *
 * The backend is host memory that counts live allocations, as in test_model_load.c, so every load
 * and every failure path is also checked to give back all memory.
 */
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../../kernels/fp8.h"
#include "../../model/model.h"
#include "../../model/quant.h"
#include "../../model/safetensors.h"
#include "test.h"
#include "test_util.h"

/* ---- configs, policies, loading ---- */

static char *subdir(const char *name) {
    static char buf[4][512];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", rs_test_tmpdir(), name);
    return p;
}

/* A small model of `arch`. hidden 256, 4 heads of 64, 2 KV heads, intermediate 384: every dense
 * matrix is a whole number of 128x128 blocks. The MoE variant has layer 0 dense and layer 1 sparse
 * with 4 experts of width 24 (ragged blocks: [24][256] and [256][24]). */
static rs_model_config make_cfg(rs_arch arch, int n_layers) {
    return rs_test_config(arch, (rs_test_dims){.vocab = 128, .hidden = 256, .intermediate = 384,
                                               .n_layers = n_layers, .n_heads = 4, .n_kv_heads = 2, .head_dim = 64,
                                               .max_position = 256, .moe_intermediate = 24});
}

static void write_model(const char *dir, const rs_model_config *c, uint64_t seed) { rs_test_write_model(dir, c, seed); }

static rs_quant_policy policy(const char *mode, const char *ignore, int first, int last) {
    rs_quant_policy p;
    rs_error err = {0};
    if (rs_quant_policy_init(&p, mode, ignore, first, last, &err) != RS_OK) RS_TEST_FAIL("policy: %s", err.message);
    return p;
}

static rs_model *load_ok(const char *dir, rs_backend *b, const rs_quant_policy *qp) {
    rs_model *m = NULL;
    rs_error err = {0};
    if (rs_model_load(dir, b, qp, &m, &err) != RS_OK) RS_TEST_FAIL("load %s: %s", dir, err.message);
    return m;
}

/* Loads dir and expects failure with code, err.param == param and needles in the message. */
static void expect_load_error(const char *dir, const rs_quant_policy *qp, int code, const char *param,
                              const char *n1, const char *n2) {
    rs_backend *b = rs_test_host_backend();
    rs_model *m = (rs_model *)&rs_test_live_allocs; /* sentinel: must stay untouched */
    rs_error err = {0};
    int rc = rs_model_load(dir, b, qp, &m, &err);
    if (rc != code || strcmp(err.param, param) != 0 || !strstr(err.message, n1) || (n2 && !strstr(err.message, n2)))
        RS_TEST_FAIL("rc %d (want %d), param \"%s\" (want \"%s\"), message \"%s\"", rc, code, err.param, param,
                     err.message);
    ASSERT_TRUE(m == (rs_model *)&rs_test_live_allocs);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}

/* ---- every tensor of a loaded model, with its HF name ---- */

typedef struct named_tensor {
    char name[128];
    int layer;              /* -1 outside the decoder layers */
    const rs_tensor *t;
} named_tensor;

typedef struct tensor_list {
    named_tensor v[512];
    int n;
} tensor_list;

static void tl_add(tensor_list *L, int layer, const rs_tensor *t, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void tl_add(tensor_list *L, int layer, const rs_tensor *t, const char *fmt, ...) {
    if (!rs_tensor_present(t)) return;
    if (L->n == (int)RS_ARRAY_LEN(L->v)) RS_TEST_FAIL("tensor list full");
    named_tensor *e = &L->v[L->n++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->name, sizeof e->name, fmt, ap);
    va_end(ap);
    e->layer = layer;
    e->t = t;
}

static void model_tensors(const rs_model *m, tensor_list *L) {
    const rs_model_config *c = &m->cfg;
    L->n = 0;
    tl_add(L, -1, &m->embed, "model.embed_tokens.weight");
    tl_add(L, -1, &m->final_norm, "model.norm.weight");
    if (!c->tie_embeddings) tl_add(L, -1, &m->lm_head, "lm_head.weight");
    for (int l = 0; l < c->n_layers; l++) {
        const rs_layer_weights *w = &m->layers[l];
        const char *p = "model.layers";
        tl_add(L, l, &w->attn_norm, "%s.%d.input_layernorm.weight", p, l);
        tl_add(L, l, &w->mlp_norm, "%s.%d.post_attention_layernorm.weight", p, l);
        tl_add(L, l, &w->wq, "%s.%d.self_attn.q_proj.weight", p, l);
        tl_add(L, l, &w->wk, "%s.%d.self_attn.k_proj.weight", p, l);
        tl_add(L, l, &w->wv, "%s.%d.self_attn.v_proj.weight", p, l);
        tl_add(L, l, &w->wo, "%s.%d.self_attn.o_proj.weight", p, l);
        tl_add(L, l, &w->bq, "%s.%d.self_attn.q_proj.bias", p, l);
        tl_add(L, l, &w->bk, "%s.%d.self_attn.k_proj.bias", p, l);
        tl_add(L, l, &w->bv, "%s.%d.self_attn.v_proj.bias", p, l);
        tl_add(L, l, &w->q_norm, "%s.%d.self_attn.q_norm.weight", p, l);
        tl_add(L, l, &w->k_norm, "%s.%d.self_attn.k_norm.weight", p, l);
        tl_add(L, l, &w->w_gate, "%s.%d.mlp.gate_proj.weight", p, l);
        tl_add(L, l, &w->w_up, "%s.%d.mlp.up_proj.weight", p, l);
        tl_add(L, l, &w->w_down, "%s.%d.mlp.down_proj.weight", p, l);
        tl_add(L, l, &w->router, "%s.%d.mlp.gate.weight", p, l);
        for (int e = 0; c->layer_is_moe[l] && e < c->n_experts; e++) {
            tl_add(L, l, &w->e_gate[e], "%s.%d.mlp.experts.%d.gate_proj.weight", p, l, e);
            tl_add(L, l, &w->e_up[e], "%s.%d.mlp.experts.%d.up_proj.weight", p, l, e);
            tl_add(L, l, &w->e_down[e], "%s.%d.mlp.experts.%d.down_proj.weight", p, l, e);
        }
    }
}

static size_t scale_bytes(const rs_tensor *t) {
    return (size_t)(rs_fp8_blocks(t->shape[0]) * rs_fp8_blocks(t->shape[1])) * sizeof(float);
}

/* Resident bytes as the tensors describe them: data plus FP8 scales, a tied lm_head counted once. */
static size_t resident_bytes(const tensor_list *L) {
    size_t n = 0;
    for (int i = 0; i < L->n; i++)
        n += rs_tensor_nbytes(L->v[i].t) + (L->v[i].t->dtype == RS_DTYPE_E4M3 ? scale_bytes(L->v[i].t) : 0);
    return n;
}

/* The loaded model against the BF16 file in dir: tensors the policy quantizes are E4M3 with the
 * codes and scales rs_fp8_quantize_weight gives for the file's bytes; the others are as stored
 * (matrices) or F32 (vectors) with no scales. Checks the model's byte accounting too. */
static void check_against_file(const char *dir, const rs_model *m, const rs_quant_policy *qp) {
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    rs_st_file *f = NULL;
    rs_error err = {0};
    if (rs_st_open(&f, path, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
    tensor_list *L = calloc(1, sizeof *L);
    model_tensors(m, L);
    int n_fp8 = 0;
    size_t q_bytes = 0, q_bf16 = 0;
    for (int i = 0; i < L->n; i++) {
        const named_tensor *e = &L->v[i];
        const rs_st_tensor *s = rs_st_find(f, e->name);
        if (!s) RS_TEST_FAIL("no tensor %s in the file", e->name);
        ASSERT_EQ(s->dtype, RS_DTYPE_BF16);
        if (!rs_quant_should_quantize(qp, &m->cfg, e->name, e->layer)) {
            if (e->t->dtype != (e->t->ndim == 2 ? RS_DTYPE_BF16 : RS_DTYPE_F32) || e->t->scale_inv)
                RS_TEST_FAIL("%s: dtype %s, expected it unquantized", e->name, rs_dtype_name(e->t->dtype));
            continue;
        }
        if (e->t->dtype != RS_DTYPE_E4M3 || !e->t->scale_inv)
            RS_TEST_FAIL("%s: dtype %s, expected E4M3 with scales", e->name, rs_dtype_name(e->t->dtype));
        const int64_t out = s->shape[0], in = s->shape[1];
        ASSERT_EQ(e->t->shape[0], out);
        ASSERT_EQ(e->t->shape[1], in);
        rs_tensor w = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {out, in}};
        w.data = malloc(s->nbytes);
        memcpy(w.data, s->data, s->nbytes);
        uint8_t *q = malloc((size_t)(out * in));
        float *sc = malloc(scale_bytes(e->t));
        ASSERT_EQ(rs_fp8_quantize_weight(&w, q, sc), RS_OK);
        if (memcmp(q, e->t->data, (size_t)(out * in)) != 0) RS_TEST_FAIL("%s: codes differ", e->name);
        if (memcmp(sc, e->t->scale_inv, scale_bytes(e->t)) != 0) RS_TEST_FAIL("%s: scales differ", e->name);
        free(w.data);
        free(q);
        free(sc);
        n_fp8++;
        q_bytes += (size_t)(out * in) + scale_bytes(e->t);
        q_bf16 += (size_t)(out * in) * 2;
    }
    ASSERT_EQ(m->n_quantized, n_fp8);
    ASSERT_EQ(m->quantized_bytes, q_bytes);
    ASSERT_EQ(m->quantized_bf16_bytes, q_bf16);
    ASSERT_EQ(m->weight_bytes, resident_bytes(L));
    free(L);
    rs_st_close(f);
}

/* ---- the policy, name by name ---- */

RS_TEST(quant_policy_tensor_kinds) {
    rs_model_config c = make_cfg(RS_ARCH_QWEN3_MOE, 4);
    rs_quant_policy fp8 = policy("fp8", "", 0, 0), bf16 = policy("bf16", "", 0, 0);
    static const struct {
        const char *name;
        int layer;
        bool quantized;
    } cases[] = {
        {"model.layers.2.self_attn.q_proj.weight", 2, true},
        {"model.layers.2.self_attn.k_proj.weight", 2, true},
        {"model.layers.2.self_attn.v_proj.weight", 2, true},
        {"model.layers.2.self_attn.o_proj.weight", 2, true},
        {"model.layers.0.mlp.gate_proj.weight", 0, true},
        {"model.layers.0.mlp.up_proj.weight", 0, true},
        {"model.layers.0.mlp.down_proj.weight", 0, true},
        {"model.layers.1.mlp.experts.0.gate_proj.weight", 1, true},
        {"model.layers.1.mlp.experts.3.up_proj.weight", 1, true},
        {"model.layers.3.mlp.experts.127.down_proj.weight", 3, true},
        /* kept */
        {"model.embed_tokens.weight", -1, false},
        {"lm_head.weight", -1, false},
        {"model.norm.weight", -1, false},
        {"model.layers.2.input_layernorm.weight", 2, false},
        {"model.layers.2.post_attention_layernorm.weight", 2, false},
        {"model.layers.2.self_attn.q_norm.weight", 2, false},
        {"model.layers.2.self_attn.k_norm.weight", 2, false},
        {"model.layers.2.self_attn.q_proj.bias", 2, false},
        {"model.layers.2.self_attn.v_proj.bias", 2, false},
        {"model.layers.1.mlp.gate.weight", 1, false},             /* the MoE router */
        /* near misses: never by substring */
        {"model.layers.1.mlp.experts.0.gate_proj", 1, false},     /* no ".weight" (verl #7443) */
        {"model.layers.1.mlp.experts.gate_up_proj", 1, false},    /* fused experts: not our layout */
        {"model.layers.1.mlp.experts.x.up_proj.weight", 1, false},
        {"model.layers.2.self_attn.q_proj.weight_scale_inv", 2, false},
        {"model.layers.02.self_attn.q_proj.weight", 2, false},
        {"model.layers.2.self_attn.qkv_proj.weight", 2, false},
        {"layers.2.self_attn.q_proj.weight", 2, false},
        {"model.layers.2.self_attn.q_proj.weight.x", 2, false},
        {"model.layers.2.mlp.shared_expert.gate_proj.weight", 2, false},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(cases); i++) {
        int layer = -7;
        bool elig = rs_quant_eligible(cases[i].name, &layer);
        if (elig != cases[i].quantized) RS_TEST_FAIL("%s: eligible %d", cases[i].name, elig);
        if (elig) ASSERT_EQ(layer, cases[i].layer);
        if (rs_quant_should_quantize(&fp8, &c, cases[i].name, cases[i].layer) != cases[i].quantized)
            RS_TEST_FAIL("%s: fp8 policy says %d", cases[i].name, !cases[i].quantized);
        if (rs_quant_should_quantize(&bf16, &c, cases[i].name, cases[i].layer))
            RS_TEST_FAIL("%s: bf16 policy quantizes", cases[i].name);
        if (rs_quant_should_quantize(NULL, &c, cases[i].name, cases[i].layer))
            RS_TEST_FAIL("%s: no policy quantizes", cases[i].name);
    }
    /* outside the decoder layers nothing is quantized, whatever the name */
    ASSERT_TRUE(!rs_quant_should_quantize(&fp8, &c, "model.layers.2.self_attn.q_proj.weight", -1));
}

RS_TEST(quant_policy_ignore_globs) {
    rs_model_config c = make_cfg(RS_ARCH_QWEN3_MOE, 4);
    /* blanks around commas, empty entries, a glob on the module name and one on the full name */
    rs_quant_policy p = policy("fp8", " *.mlp.down_proj ,, model.layers.2.self_attn.*,*.experts.3.*.weight", 0, 0);
    ASSERT_TRUE(!rs_quant_should_quantize(&p, &c, "model.layers.0.mlp.down_proj.weight", 0));
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.0.mlp.up_proj.weight", 0));
    ASSERT_TRUE(!rs_quant_should_quantize(&p, &c, "model.layers.2.self_attn.o_proj.weight", 2));
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.3.self_attn.o_proj.weight", 3));
    ASSERT_TRUE(!rs_quant_should_quantize(&p, &c, "model.layers.1.mlp.experts.3.gate_proj.weight", 1));
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.1.mlp.experts.2.gate_proj.weight", 1));
    /* experts' down_proj: "*.mlp.down_proj" does not reach them ('.' is a plain character) */
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.1.mlp.experts.2.down_proj.weight", 1));
    /* a glob must match the whole name: "down_proj" alone matches nothing */
    p = policy("fp8", "down_proj", 0, 0);
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.0.mlp.down_proj.weight", 0));
    p = policy("fp8", "*down_proj*", 0, 0);
    ASSERT_TRUE(!rs_quant_should_quantize(&p, &c, "model.layers.1.mlp.experts.2.down_proj.weight", 1));
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.1.mlp.experts.2.up_proj.weight", 1));
    /* character classes */
    p = policy("fp8", "model.layers.[01].*", 0, 0);
    ASSERT_TRUE(!rs_quant_should_quantize(&p, &c, "model.layers.1.self_attn.q_proj.weight", 1));
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.2.self_attn.q_proj.weight", 2));
}

RS_TEST(quant_policy_first_last_layers) {
    rs_model_config c = make_cfg(RS_ARCH_QWEN3, 6);
    rs_quant_policy p = policy("fp8", "", 2, 1);
    for (int l = 0; l < 6; l++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.mlp.down_proj.weight", l);
        ASSERT_EQ(rs_quant_should_quantize(&p, &c, name, l), l >= 2 && l < 5);
    }
    p = policy("fp8", "", 3, 3); /* every layer kept */
    for (int l = 0; l < 6; l++) ASSERT_TRUE(!rs_quant_should_quantize(&p, &c, "model.layers.0.mlp.up_proj.weight", l));
    p = policy("fp8", "", 0, 10); /* more than there are */
    ASSERT_TRUE(!rs_quant_should_quantize(&p, &c, "model.layers.0.mlp.up_proj.weight", 0));

    rs_quant_policy q;
    rs_error err = {0};
    ASSERT_EQ(rs_quant_policy_init(&q, "int8", "", 0, 0, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "quantization");
    ASSERT_TRUE(strstr(err.message, "int8") != NULL);
    ASSERT_EQ(rs_quant_policy_init(&q, "fp8", "", -1, 0, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "bf16-first-layers");
    ASSERT_EQ(rs_quant_policy_init(&q, "fp8", "", 0, -2, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "bf16-last-layers");
    char *longlist = malloc(RS_QUANT_IGNORE_MAX + 1);
    memset(longlist, '*', RS_QUANT_IGNORE_MAX);
    longlist[RS_QUANT_IGNORE_MAX] = 0;
    ASSERT_EQ(rs_quant_policy_init(&q, "fp8", longlist, 0, 0, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "quant-ignore");
    free(longlist);
    ASSERT_STREQ(rs_quant_mode_name(RS_QUANT_FP8), "fp8");
    ASSERT_STREQ(rs_quant_mode_name(RS_QUANT_BF16), "bf16");
}

/* A checkpoint's modules_to_not_convert / ignored_layers entries. */
RS_TEST(quant_policy_checkpoint_lists) {
    const char *list = "lm_head\nmlp.gate\nmodel.layers.3\nre:model\\.layers\\.[0-9]+\\.mlp\\.experts\\.1\\.\n"
                       "model.layers.5.self_attn.v_proj.weight";
    ASSERT_TRUE(rs_quant_listed(list, "lm_head.weight"));
    ASSERT_TRUE(rs_quant_listed(list, "model.layers.7.mlp.gate.weight"));
    ASSERT_TRUE(!rs_quant_listed(list, "model.layers.7.mlp.gate_proj.weight")); /* transformers' substring would */
    ASSERT_TRUE(rs_quant_listed(list, "model.layers.3.self_attn.q_proj.weight"));
    ASSERT_TRUE(!rs_quant_listed(list, "model.layers.30.self_attn.q_proj.weight"));
    ASSERT_TRUE(rs_quant_listed(list, "model.layers.12.mlp.experts.1.up_proj.weight"));
    ASSERT_TRUE(!rs_quant_listed(list, "model.layers.12.mlp.experts.10.up_proj.weight"));
    ASSERT_TRUE(rs_quant_listed(list, "model.layers.5.self_attn.v_proj.weight")); /* a full tensor name */
    ASSERT_TRUE(!rs_quant_listed(list, "model.layers.5.self_attn.k_proj.weight"));
    ASSERT_TRUE(!rs_quant_listed("", "lm_head.weight"));
    ASSERT_EQ(rs_quant_check_list_entry("re:model.layers.(1"), RS_EFORMAT);
    ASSERT_EQ(rs_quant_check_list_entry(""), RS_EFORMAT);
    ASSERT_EQ(rs_quant_check_list_entry("re:.*experts.*"), RS_OK);

    /* the policy honours the list only for FP8 checkpoints */
    rs_model_config c = make_cfg(RS_ARCH_QWEN3, 6);
    rs_quant_policy p = policy("fp8", "", 0, 0);
    snprintf(c.fp8_not_converted, sizeof c.fp8_not_converted, "%s", list);
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.3.self_attn.q_proj.weight", 3));
    c.fp8_checkpoint = true;
    ASSERT_TRUE(!rs_quant_should_quantize(&p, &c, "model.layers.3.self_attn.q_proj.weight", 3));
    ASSERT_TRUE(rs_quant_should_quantize(&p, &c, "model.layers.4.self_attn.q_proj.weight", 4));
}

/* ---- loading a BF16 checkpoint with the FP8 policy ---- */

RS_TEST(quant_load_dense_fp8) {
    const char *d = subdir("dense");
    rs_model_config c = make_cfg(RS_ARCH_QWEN3, 3);
    write_model(d, &c, 21);
    rs_backend *b = rs_test_host_backend();
    rs_quant_policy fp8 = policy("fp8", "", 0, 0), bf16 = policy("bf16", "", 0, 0);
    rs_model *mb = load_ok(d, b, &bf16);
    rs_model *mq = load_ok(d, b, &fp8);
    check_against_file(d, mb, &bf16);
    check_against_file(d, mq, &fp8);
    ASSERT_EQ(mb->n_quantized, 0);
    ASSERT_EQ(mq->n_quantized, 3 * 7);
    ASSERT_EQ(mq->layers[1].wq.dtype, RS_DTYPE_E4M3);
    ASSERT_EQ(mq->layers[2].w_down.dtype, RS_DTYPE_E4M3);
    ASSERT_EQ(mq->layers[2].q_norm.dtype, RS_DTYPE_F32);
    ASSERT_EQ(mq->embed.dtype, RS_DTYPE_BF16);
    ASSERT_EQ(mq->lm_head.dtype, RS_DTYPE_BF16);
    ASSERT_EQ(mq->final_norm.dtype, RS_DTYPE_F32);
    /* every dense dim is a multiple of 128: codes are half the BF16 bytes, and each 128x128 block
     * adds a 4-byte scale, 1/8192 of its BF16 bytes */
    ASSERT_TRUE((double)mq->quantized_bytes <= 0.55 * (double)mq->quantized_bf16_bytes);
    ASSERT_EQ(mq->quantized_bytes * 8192, mq->quantized_bf16_bytes * (4096 + 1));
    ASSERT_EQ(mb->weight_bytes - mq->weight_bytes, mq->quantized_bf16_bytes - mq->quantized_bytes);
    /* a block's largest magnitude encodes to +-448 (0x7E / 0xFE) */
    const rs_tensor *wo = &mq->layers[0].wo;
    uint8_t top = 0;
    for (int i = 0; i < 128; i++)
        for (int j = 0; j < 128; j++) top = RS_MAX(top, ((const uint8_t *)wo->data)[i * 256 + j] & 0x7F);
    ASSERT_EQ(top, 0x7E);
    rs_model_free(mq);
    rs_model_free(mb);

    /* first/last layers and ignore globs at load */
    rs_quant_policy p = policy("fp8", "*.self_attn.k_proj", 1, 1);
    rs_model *m = load_ok(d, b, &p);
    check_against_file(d, m, &p);
    ASSERT_EQ(m->n_quantized, 6); /* layer 1 only, without k_proj */
    ASSERT_EQ(m->layers[0].wq.dtype, RS_DTYPE_BF16);
    ASSERT_EQ(m->layers[1].wq.dtype, RS_DTYPE_E4M3);
    ASSERT_EQ(m->layers[1].wk.dtype, RS_DTYPE_BF16);
    ASSERT_EQ(m->layers[2].wq.dtype, RS_DTYPE_BF16);
    rs_model_free(m);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}

/* --quantize-lm-head: the output projection joins the FP8 matrices, nothing else changes. For a
 * tied model that projection is the embedding table (one tensor serves both ends), for an untied
 * one lm_head alone; the codes are rs_fp8_quantize_weight's of the file's BF16 values (checked by
 * check_against_file through the policy), and a CPU forward pass reads them. */
RS_TEST(quant_policy_lm_head_opt_in) {
    rs_model_config tied = make_cfg(RS_ARCH_QWEN3, 2), untied = tied;
    tied.tie_embeddings = true;
    untied.tie_embeddings = false;
    rs_quant_policy fp8 = policy("fp8", "", 0, 0), head = fp8, bf16_head = policy("bf16", "", 0, 0);
    ASSERT_TRUE(!fp8.quantize_lm_head); /* off unless asked for */
    head.quantize_lm_head = bf16_head.quantize_lm_head = true;
    ASSERT_TRUE(rs_quant_should_quantize(&head, &tied, "model.embed_tokens.weight", -1));
    ASSERT_TRUE(!rs_quant_should_quantize(&head, &tied, "lm_head.weight", -1));
    ASSERT_TRUE(rs_quant_should_quantize(&head, &untied, "lm_head.weight", -1));
    ASSERT_TRUE(!rs_quant_should_quantize(&head, &untied, "model.embed_tokens.weight", -1));
    ASSERT_TRUE(!rs_quant_should_quantize(&fp8, &untied, "lm_head.weight", -1));
    ASSERT_TRUE(!rs_quant_should_quantize(&bf16_head, &untied, "lm_head.weight", -1));
    ASSERT_TRUE(!rs_quant_should_quantize(&head, &untied, "model.norm.weight", -1));
    ASSERT_TRUE(rs_quant_should_quantize(&head, &untied, "model.layers.1.mlp.up_proj.weight", 1));
}

RS_TEST(quant_load_lm_head_opt_in) {
    for (int t = 0; t < 2; t++) {
        const char *d = subdir(t ? "head-tied" : "head-untied");
        rs_model_config c = make_cfg(RS_ARCH_QWEN3, 2);
        c.vocab_size = 300; /* ragged: 3 blocks of rows, the last partial */
        c.tie_embeddings = t == 1;
        write_model(d, &c, 31);
        rs_quant_policy qp = policy("fp8", "", 0, 0);
        qp.quantize_lm_head = true;
        rs_backend *hb = rs_test_host_backend();
        rs_model *m = load_ok(d, hb, &qp);
        check_against_file(d, m, &qp);
        ASSERT_EQ(m->n_quantized, 2 * 7 + 1);
        ASSERT_EQ(m->lm_head.dtype, RS_DTYPE_E4M3);
        ASSERT_EQ(m->embed.dtype, t ? RS_DTYPE_E4M3 : RS_DTYPE_BF16);
        if (t) ASSERT_TRUE(m->lm_head.data == m->embed.data);
        rs_model_free(m);
        rs_backend_free(hb);
        ASSERT_EQ(rs_test_live_allocs, 0);

        /* the CPU backend runs it (its own layout; the embedding rows dequantized) and its logits are
         * close to the recipe's, which keeps the head in BF16 */
        rs_backend *b = rs_backend_cpu_init(2);
        rs_quant_policy recipe = policy("fp8", "", 0, 0);
        rs_model *mh = load_ok(d, b, &qp), *mr = load_ok(d, b, &recipe);
        float *lh = rs_test_probe_logits(mh), *lr = rs_test_probe_logits(mr);
        double err = 0, norm = 0;
        for (int i = 0; i < RS_TEST_PROBE_TOKENS * c.vocab_size; i++) {
            err += ((double)lh[i] - lr[i]) * ((double)lh[i] - lr[i]);
            norm += (double)lr[i] * lr[i];
        }
        ASSERT_TRUE(norm > 0 && err > 0);    /* the head really is FP8 */
        ASSERT_TRUE(sqrt(err / norm) < 0.2); /* ... and still the same model */
        free(lh), free(lr);
        rs_model_free(mh), rs_model_free(mr);
        rs_backend_free(b);
    }
}

RS_TEST(quant_load_biases_and_ragged_blocks) {
    /* Qwen2: q/k/v biases stay F32 next to FP8 weights. hidden 200 and intermediate 300 leave
     * ragged 72- and 44-wide edge blocks. */
    const char *d = subdir("qwen2");
    rs_model_config c = make_cfg(RS_ARCH_QWEN2, 2);
    c.hidden = 200;
    c.intermediate = 300;
    c.n_heads = 5;
    c.n_kv_heads = 1;
    c.head_dim = 40;
    write_model(d, &c, 5);
    rs_backend *b = rs_test_host_backend();
    rs_quant_policy fp8 = policy("fp8", "", 0, 0);
    rs_model *m = load_ok(d, b, &fp8);
    check_against_file(d, m, &fp8);
    ASSERT_EQ(m->layers[0].wq.dtype, RS_DTYPE_E4M3);
    ASSERT_EQ(m->layers[0].bq.dtype, RS_DTYPE_F32);
    ASSERT_TRUE(m->layers[0].bq.scale_inv == NULL);
    ASSERT_EQ(m->layers[1].w_gate.shape[0], 300);
    ASSERT_EQ(m->n_quantized, 2 * 7);
    rs_model_free(m);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}

RS_TEST(quant_load_moe_experts_not_router) {
    const char *d = subdir("moe");
    rs_model_config c = make_cfg(RS_ARCH_QWEN3_MOE, 3);
    write_model(d, &c, 33);
    rs_backend *b = rs_test_host_backend();
    rs_quant_policy fp8 = policy("fp8", "", 0, 0);
    rs_model *m = load_ok(d, b, &fp8);
    check_against_file(d, m, &fp8);
    for (int l = 1; l < 3; l++) {
        const rs_layer_weights *w = &m->layers[l];
        ASSERT_EQ(w->router.dtype, RS_DTYPE_BF16);
        ASSERT_TRUE(w->router.scale_inv == NULL);
        for (int e = 0; e < c.n_experts; e++) {
            ASSERT_EQ(w->e_gate[e].dtype, RS_DTYPE_E4M3);
            ASSERT_EQ(w->e_up[e].dtype, RS_DTYPE_E4M3);
            ASSERT_EQ(w->e_down[e].dtype, RS_DTYPE_E4M3);
            ASSERT_TRUE(w->e_down[e].scale_inv != NULL);
        }
    }
    ASSERT_EQ(m->layers[0].w_up.dtype, RS_DTYPE_E4M3); /* the dense layer */
    ASSERT_EQ(m->n_quantized, 3 * 4 + 3 + 2 * 4 * 3); /* attention, layer 0's MLP, 4 experts x 3 in layers 1-2 */
    rs_model_free(m);

    /* the last layer in BF16: its experts too */
    rs_quant_policy p = policy("fp8", "", 0, 1);
    m = load_ok(d, b, &p);
    check_against_file(d, m, &p);
    ASSERT_EQ(m->layers[2].e_up[3].dtype, RS_DTYPE_BF16);
    ASSERT_EQ(m->layers[1].e_up[3].dtype, RS_DTYPE_E4M3);
    rs_model_free(m);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}

/* ---- FP8 checkpoints ---- */

static const char *FP8_QC =
    "{\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", \"quant_method\": \"fp8\","
    " \"weight_block_size\": [128, 128], \"modules_to_not_convert\": [\"lm_head\"]}";

typedef struct fp8_opts {
    const char *qc;             /* quantization_config JSON, or NULL for none */
    rs_dtype scale_dtype;       /* F32 or BF16 */
    const char *keep;           /* an eligible tensor left in BF16, or NULL */
    const char *drop_scale;     /* the weight whose _scale_inv is left out, or NULL */
    const char *bad_scale;      /* the weight whose _scale_inv gets one block row too many, or NULL */
    const char *nan_scale;      /* the weight whose first scale becomes NaN, or NULL */
    const char *fp8_router;     /* a router also stored F8_E4M3 (with a scale), or NULL */
} fp8_opts;

/* Writes an FP8 checkpoint of the BF16 model in src into dst (the DeepSeek-V3 / Qwen3-FP8 layout):
 * every FP8-eligible matrix as F8_E4M3 + `<name>_scale_inv`, the rest copied. */
static void write_fp8_checkpoint(const char *src, const char *dst, const fp8_opts *o) {
    char path[600];
    mkdir(dst, 0700);
    snprintf(path, sizeof path, "%s/model.safetensors", src);
    rs_st_file *f = NULL;
    rs_error err = {0};
    if (rs_st_open(&f, path, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
    size_t n = rs_st_count(f), k = 0, n_owned = 0;
    rs_st_wtensor *wt = calloc(2 * n, sizeof *wt);
    void **owned = calloc(3 * n, sizeof *owned); /* codes, scales and scale names, freed after writing */
    for (size_t i = 0; i < n; i++) {
        const rs_st_tensor *s = rs_st_tensor_at(f, i);
        rs_st_wtensor *w = &wt[k++];
        *w = (rs_st_wtensor){.name = s->name, .dtype = s->dtype, .ndim = s->ndim, .data = s->data};
        memcpy(w->shape, s->shape, sizeof w->shape);
        bool router = o->fp8_router && strcmp(s->name, o->fp8_router) == 0;
        if (!(rs_quant_eligible(s->name, NULL) || router) || (o->keep && strcmp(s->name, o->keep) == 0)) continue;

        const int64_t out = s->shape[0], in = s->shape[1], nbo = rs_fp8_blocks(out), nbi = rs_fp8_blocks(in);
        rs_tensor bf = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {out, in}};
        bf.data = malloc(s->nbytes);
        memcpy(bf.data, s->data, s->nbytes);
        uint8_t *q = owned[n_owned++] = malloc((size_t)(out * in));
        float *sc = owned[n_owned++] = calloc((size_t)((nbo + 1) * nbi), sizeof *sc); /* room for bad_scale */
        ASSERT_EQ(rs_fp8_quantize_weight(&bf, q, sc), RS_OK);
        free(bf.data);
        w->dtype = RS_DTYPE_E4M3;
        w->data = q;
        if (o->drop_scale && strcmp(s->name, o->drop_scale) == 0) continue;

        char *sname = owned[n_owned++] = malloc(strlen(s->name) + sizeof "_scale_inv");
        sprintf(sname, "%s_scale_inv", s->name);
        rs_st_wtensor *ws = &wt[k++];
        *ws = (rs_st_wtensor){.name = sname, .dtype = o->scale_dtype, .ndim = 2, .shape = {nbo, nbi}, .data = sc};
        if (o->bad_scale && strcmp(s->name, o->bad_scale) == 0) {
            sc[nbo * nbi] = 1.0f;
            ws->shape[0] = nbo + 1;
        }
        if (o->nan_scale && strcmp(s->name, o->nan_scale) == 0) sc[0] = NAN;
        if (o->scale_dtype == RS_DTYPE_BF16) { /* in place: the front of sc becomes bf16 */
            uint16_t *h = (uint16_t *)sc;
            for (int64_t j = 0; j < ws->shape[0] * nbi; j++) h[j] = rs_f32_to_bf16(sc[j]);
        }
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dst);
    if (rs_st_write(path, wt, k, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
    for (size_t i = 0; i < n_owned; i++) free(owned[i]);
    free(owned);
    free(wt);
    rs_st_close(f);

    snprintf(path, sizeof path, "%s/config.json", src);
    json_error_t je;
    json_t *cfg = json_load_file(path, 0, &je);
    if (!cfg) RS_TEST_FAIL("%s: %s", path, je.text);
    if (o->qc) {
        json_t *qc = json_loads(o->qc, 0, &je);
        if (!qc) RS_TEST_FAIL("quantization_config: %s", je.text);
        json_object_set_new(cfg, "quantization_config", qc);
    }
    snprintf(path, sizeof path, "%s/config.json", dst);
    if (json_dump_file(cfg, path, JSON_INDENT(2)) != 0) RS_TEST_FAIL("cannot write %s", path);
    json_decref(cfg);
}

/* Two loaded models hold the same bytes in every tensor, scales included. */
static void expect_identical(const rs_model *a, const rs_model *b) {
    tensor_list *la = calloc(1, sizeof *la), *lb = calloc(1, sizeof *lb);
    model_tensors(a, la);
    model_tensors(b, lb);
    ASSERT_EQ(la->n, lb->n);
    for (int i = 0; i < la->n; i++) {
        const rs_tensor *x = la->v[i].t, *y = lb->v[i].t;
        ASSERT_STREQ(la->v[i].name, lb->v[i].name);
        if (x->dtype != y->dtype) RS_TEST_FAIL("%s: %s vs %s", la->v[i].name, rs_dtype_name(x->dtype),
                                               rs_dtype_name(y->dtype));
        ASSERT_EQ(x->shape[0], y->shape[0]);
        ASSERT_EQ(x->shape[1], y->shape[1]);
        if (memcmp(x->data, y->data, rs_tensor_nbytes(x)) != 0) RS_TEST_FAIL("%s: data differ", la->v[i].name);
        ASSERT_EQ(x->scale_inv == NULL, y->scale_inv == NULL);
        if (x->scale_inv && memcmp(x->scale_inv, y->scale_inv, scale_bytes(x)) != 0)
            RS_TEST_FAIL("%s: scales differ", la->v[i].name);
    }
    ASSERT_EQ(a->weight_bytes, b->weight_bytes);
    ASSERT_EQ(a->n_quantized, b->n_quantized);
    ASSERT_EQ(a->quantized_bytes, b->quantized_bytes);
    ASSERT_EQ(a->quantized_bf16_bytes, b->quantized_bf16_bytes);
    free(la);
    free(lb);
}

RS_TEST(quant_fp8_checkpoint_roundtrip) {
    const char *src = subdir("bf16"), *dst = subdir("fp8");
    rs_model_config c = make_cfg(RS_ARCH_QWEN3_MOE, 3);
    write_model(src, &c, 44);
    fp8_opts o = {.qc = FP8_QC, .scale_dtype = RS_DTYPE_F32};
    write_fp8_checkpoint(src, dst, &o);

    rs_model_config back;
    rs_error err = {0};
    ASSERT_EQ(rs_model_config_load(dst, &back, &err), RS_OK);
    ASSERT_TRUE(back.fp8_checkpoint);
    ASSERT_STREQ(back.fp8_not_converted, "lm_head");

    rs_backend *b = rs_test_host_backend();
    rs_quant_policy fp8 = policy("fp8", "", 0, 0), bf16 = policy("bf16", "", 0, 0);
    rs_model *at_load = load_ok(src, b, &fp8);
    rs_model *stored = load_ok(dst, b, &fp8);
    expect_identical(at_load, stored);
    rs_model_free(stored);
    /* FP8 in the checkpoint is served FP8 whatever the policy (a warning is logged) */
    stored = load_ok(dst, b, &bf16);
    expect_identical(at_load, stored);
    rs_model_free(stored);
    stored = load_ok(dst, b, NULL);
    expect_identical(at_load, stored);
    rs_model_free(stored);
    rs_model_free(at_load);

    /* BF16 scales (what some writers emit) are widened to f32 exactly */
    o.scale_dtype = RS_DTYPE_BF16;
    write_fp8_checkpoint(src, dst, &o);
    stored = load_ok(dst, b, &fp8);
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dst);
    rs_st_file *f = NULL;
    ASSERT_EQ(rs_st_open(&f, path, &err), RS_OK);
    const rs_st_tensor *s = rs_st_find(f, "model.layers.0.mlp.down_proj.weight_scale_inv");
    ASSERT_TRUE(s != NULL && s->dtype == RS_DTYPE_BF16 && s->shape[0] == 2 && s->shape[1] == 3);
    const rs_tensor *down = &stored->layers[0].w_down;
    ASSERT_EQ(down->dtype, RS_DTYPE_E4M3);
    for (int i = 0; i < 6; i++) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)s->data + 2 * i, 2);
        ASSERT_TRUE(down->scale_inv[i] == rs_bf16_to_f32(h));
    }
    rs_st_close(f);
    rs_model_free(stored);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}

RS_TEST(quant_fp8_checkpoint_unconverted_modules) {
    const char *src = subdir("bf16"), *dst = subdir("fp8");
    rs_model_config c = make_cfg(RS_ARCH_QWEN3_MOE, 3);
    write_model(src, &c, 45);
    rs_backend *b = rs_test_host_backend();
    rs_quant_policy fp8 = policy("fp8", "", 0, 0);

    /* a matrix the checkpoint lists as not converted stays BF16 under the FP8 policy */
    const char *keep = "model.layers.2.self_attn.o_proj.weight";
    fp8_opts o = {.qc = "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
                        " \"ignored_layers\": [\"model.layers.2.self_attn.o_proj\"]}",
                  .scale_dtype = RS_DTYPE_F32, .keep = keep};
    write_fp8_checkpoint(src, dst, &o);
    rs_model *m = load_ok(dst, b, &fp8);
    ASSERT_EQ(m->layers[2].wo.dtype, RS_DTYPE_BF16);
    ASSERT_EQ(m->layers[1].wo.dtype, RS_DTYPE_E4M3);
    rs_model *ref = load_ok(src, b, &fp8);
    ASSERT_EQ(m->n_quantized, ref->n_quantized - 1);
    rs_model_free(m);

    /* an expert the writer left in BF16 without listing it (verl #7443) is not served BF16
     * silently: under the FP8 policy it is quantized at load, to the same bytes */
    o = (fp8_opts){.qc = FP8_QC, .scale_dtype = RS_DTYPE_F32, .keep = "model.layers.1.mlp.experts.2.up_proj.weight"};
    write_fp8_checkpoint(src, dst, &o);
    m = load_ok(dst, b, &fp8);
    expect_identical(ref, m);
    rs_model_free(m);
    rs_model_free(ref);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}

RS_TEST(quant_fp8_checkpoint_errors) {
    const char *src = subdir("bf16"), *dst = subdir("fp8");
    rs_model_config c = make_cfg(RS_ARCH_QWEN3_MOE, 2);
    write_model(src, &c, 46);
    rs_quant_policy fp8 = policy("fp8", "", 0, 0);

    /* an E4M3 weight without its scale */
    const char *w = "model.layers.1.mlp.experts.3.down_proj.weight";
    write_fp8_checkpoint(src, dst, &(fp8_opts){.qc = FP8_QC, .scale_dtype = RS_DTYPE_F32, .drop_scale = w});
    expect_load_error(dst, &fp8, RS_EFORMAT, "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv", w,
                      "[2, 1]");
    /* a scale of the wrong shape */
    w = "model.layers.0.self_attn.q_proj.weight";
    write_fp8_checkpoint(src, dst, &(fp8_opts){.qc = FP8_QC, .scale_dtype = RS_DTYPE_F32, .bad_scale = w});
    expect_load_error(dst, &fp8, RS_EFORMAT, "model.layers.0.self_attn.q_proj.weight_scale_inv", "shape [3, 2]",
                      "expected [2, 2]");
    /* a NaN scale */
    write_fp8_checkpoint(src, dst, &(fp8_opts){.qc = FP8_QC, .scale_dtype = RS_DTYPE_F32, .nan_scale = w});
    expect_load_error(dst, &fp8, RS_EFORMAT, "model.layers.0.self_attn.q_proj.weight_scale_inv", "nan", "[0][0]");
    /* an FP8 router */
    write_fp8_checkpoint(src, dst,
                         &(fp8_opts){.qc = FP8_QC, .scale_dtype = RS_DTYPE_F32,
                                     .fp8_router = "model.layers.1.mlp.gate.weight"});
    expect_load_error(dst, &fp8, RS_EUNSUPPORTED, "model.layers.1.mlp.gate.weight", "F8_E4M3", "router");
    /* E4M3 tensors without a quantization_config */
    write_fp8_checkpoint(src, dst, &(fp8_opts){.qc = NULL, .scale_dtype = RS_DTYPE_F32});
    expect_load_error(dst, &fp8, RS_EUNSUPPORTED, "model.layers.0.self_attn.q_proj.weight", "F8_E4M3",
                      "quantization_config");
    /* quantization methods and block sizes we do not serve */
    write_fp8_checkpoint(src, dst,
                         &(fp8_opts){.qc = "{\"quant_method\": \"compressed-tensors\"}", .scale_dtype = RS_DTYPE_F32});
    expect_load_error(dst, &fp8, RS_EUNSUPPORTED, "quant_method", "compressed-tensors", "config.json");
    write_fp8_checkpoint(src, dst,
                         &(fp8_opts){.qc = "{\"quant_method\": \"fp8\", \"weight_block_size\": [64, 64]}",
                                     .scale_dtype = RS_DTYPE_F32});
    expect_load_error(dst, &fp8, RS_EUNSUPPORTED, "weight_block_size", "[64, 64]", "[128, 128]");
    write_fp8_checkpoint(src, dst, &(fp8_opts){.qc = "{\"quant_method\": \"fp8\", \"activation_scheme\": \"dynamic\"}",
                                               .scale_dtype = RS_DTYPE_F32});
    expect_load_error(dst, &fp8, RS_EUNSUPPORTED, "weight_block_size", "per-tensor", NULL);
}

/* tests/fixtures/models/qwen3_fp8 is the qwen3 fixture as an FP8 checkpoint written by PyTorch
 * (scripts/make_fixtures.py: torch's float8_e4m3fn cast, safetensors' writer): an independent
 * quantizer and writer. Loading it must give the bytes rolloutd's own quantization at load gives
 * for the BF16 fixture. */
RS_TEST(quant_fp8_checkpoint_matches_torch_fixture) {
    char bf16_dir[600], fp8_dir[600];
    snprintf(bf16_dir, sizeof bf16_dir, "%s/models/qwen3", rs_test_fixtures_dir());
    snprintf(fp8_dir, sizeof fp8_dir, "%s/models/qwen3_fp8", rs_test_fixtures_dir());
    struct stat st;
    if (stat(fp8_dir, &st) != 0) RS_TEST_SKIP("no %s (scripts/make_fixtures.py)", fp8_dir);
    rs_backend *b = rs_test_host_backend();
    rs_quant_policy fp8 = policy("fp8", "", 0, 0);
    rs_model *at_load = load_ok(bf16_dir, b, &fp8);
    rs_model *stored = load_ok(fp8_dir, b, &fp8);
    ASSERT_TRUE(stored->cfg.fp8_checkpoint);
    ASSERT_EQ(stored->n_quantized, 3 * 7);
    expect_identical(at_load, stored);
    rs_model_free(stored);
    rs_model_free(at_load);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}
