/*
 * test_update.c — weight slots by name (model/weight_store.h) and the update transaction
 * (sync/transaction.h), in process on the CPU backend.
 *
 * The references are independent of the code under test: the slot map is checked against the
 * tensors rs_testmodel_write puts in a checkpoint (every one must map, with its shape, to the very
 * rs_tensor the loader filled), and a full update from a second checkpoint is checked against a
 * fresh rs_model_load of that checkpoint: same bytes in every slot (E4M3 codes and block scales
 * included, so an FP8 slot fed BF16 is quantized exactly as at load) and bit-identical logits.
 * A failed update must leave logits, weights and the store's allocation count as they were.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/cpu/cpu_internal.h"
#include "../../kernels/fp8.h"
#include "../../kvcache/kvcache.h"
#include "../../model/model.h"
#include "../../model/quant.h"
#include "../../model/safetensors.h"
#include "../../model/weight_store.h"
#include "../../sync/transaction.h"
#include "test.h"
#include "test_util.h"

/* ---------------------------------------------------------------- helpers */

static rs_model_config cfg_for(rs_arch arch, bool tied) {
    /* hidden 160: two 128-blocks, the second ragged */
    return rs_test_config(arch, (rs_test_dims){.vocab = 200, .hidden = 160, .intermediate = 136, .n_layers = 2,
                                               .n_heads = 4, .n_kv_heads = 2, .head_dim = 32, .max_position = 256,
                                               .moe_intermediate = 72, .tied = tied});
}

static const char *model_dir(const char *name, const rs_model_config *c, uint64_t seed) {
    static char buf[8][512];
    static int k;
    char *d = buf[k++ % 8];
    snprintf(d, 512, "%s/%s", rs_test_tmpdir(), name);
    rs_error err = {0};
    if (rs_testmodel_write(d, c, seed, &err) != RS_OK) RS_TEST_FAIL("testmodel: %s", err.message);
    return d;
}

static rs_quant_policy policy(const char *mode) {
    rs_quant_policy p;
    rs_error err = {0};
    if (rs_quant_policy_init(&p, mode, "", 0, 0, &err) != RS_OK) RS_TEST_FAIL("policy: %s", err.message);
    return p;
}

static rs_model *load(const char *dir, rs_backend *b, const rs_quant_policy *qp) {
    rs_model *m = NULL;
    rs_error err = {0};
    if (rs_model_load(dir, b, qp, &m, &err) != RS_OK) RS_TEST_FAIL("load %s: %s", dir, err.message);
    return m;
}

/* Logits of every position of a fixed token sequence, [n][vocab] (malloc'd), through an F32 KV pool. */
enum { N_TOK = 12 };
static float *logits_of(rs_model *m) {
    int32_t tok[N_TOK];
    for (int i = 0; i < N_TOK; i++) tok[i] = (int32_t)((i * 37 + 5) % m->cfg.vocab_size);
    return rs_test_logits(m, tok, N_TOK);
}

static void expect_same_logits(rs_model *a, rs_model *b) {
    float *x = logits_of(a), *y = logits_of(b);
    size_t n = (size_t)N_TOK * (size_t)a->cfg.vocab_size;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&x[i], &y[i], sizeof(float)) != 0)
            RS_TEST_FAIL("logit %zu differs: %.9g vs %.9g", i, (double)x[i], (double)y[i]);
    free(x), free(y);
}

static size_t scale_bytes(const rs_tensor *t) {
    return (size_t)(rs_fp8_blocks(t->shape[0]) * rs_fp8_blocks(t->shape[1])) * sizeof(float);
}

/* Every parameter of a and b holds the same dtype and bytes (codes and scales for FP8). */
static void expect_same_weights(rs_model *a, rs_model *b) {
    ASSERT_EQ(rs_model_param_count(a), rs_model_param_count(b));
    for (int i = 0; i < rs_model_param_count(a); i++) {
        char name[300];
        rs_tensor *x = rs_model_param_at(a, i, name, sizeof name, NULL), *y = rs_model_param_at(b, i, name, sizeof name,
                                                                                             NULL);
        if (x->dtype != y->dtype) RS_TEST_FAIL("%s: dtype %s vs %s", name, rs_dtype_name(x->dtype), rs_dtype_name(y->dtype));
        if (x->layout != y->layout) RS_TEST_FAIL("%s: layout %d vs %d", name, (int)x->layout, (int)y->layout);
        if (memcmp(x->data, y->data, rs_tensor_nbytes(x)) != 0) RS_TEST_FAIL("%s: bytes differ", name);
        ASSERT_EQ(x->scale_inv == NULL, y->scale_inv == NULL);
        if (x->scale_inv && memcmp(x->scale_inv, y->scale_inv, scale_bytes(x)) != 0)
            RS_TEST_FAIL("%s: scales differ", name);
    }
    if (a->cfg.tie_embeddings) ASSERT_TRUE(a->lm_head.data == a->embed.data);
    ASSERT_EQ(a->weight_bytes, b->weight_bytes);
}

static rs_txn_tensor st_tensor(const rs_st_tensor *t) {
    return (rs_txn_tensor){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                              .data = t->data};
}

/* Stages every tensor of checkpoint `dir` except `skip` (may be NULL). */
static void stage_dir(rs_txn *u, const char *dir, const char *skip) {
    rs_st_dir *d = NULL;
    rs_error err = {0};
    if (rs_st_dir_open(&d, dir, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
    for (size_t i = 0; i < rs_st_dir_count(d); i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(d, i, NULL);
        if (skip && strcmp(t->name, skip) == 0) continue;
        rs_txn_tensor ut = st_tensor(t);
        if (rs_txn_add(u, &ut, &err) != RS_OK) RS_TEST_FAIL("add %s: %s", t->name, err.message);
    }
    rs_st_dir_close(d);
}

/* ---------------------------------------------------------------- slots */

/* Every tensor of each architecture's checkpoint maps to the slot the loader filled, with its
 * shape; the enumeration covers exactly the checkpoint's tensors, in model order. */
RS_TEST(update_slot_mapping_every_architecture) {
    static const struct { rs_arch arch; bool tied; } cases[] = {
        {RS_ARCH_QWEN3, true}, {RS_ARCH_QWEN2, false}, {RS_ARCH_LLAMA, false}, {RS_ARCH_QWEN3_MOE, false},
    };
    rs_backend *b = rs_backend_cpu_init(1);
    for (size_t k = 0; k < RS_ARRAY_LEN(cases); k++) {
        rs_model_config c = cfg_for(cases[k].arch, cases[k].tied);
        char name[32];
        snprintf(name, sizeof name, "arch%zu", k);
        const char *dir = model_dir(name, &c, 3);
        rs_model *m = load(dir, b, NULL);
        rs_st_dir *d = NULL;
        rs_error err = {0};
        ASSERT_EQ(rs_st_dir_open(&d, dir, &err), RS_OK);
        ASSERT_EQ((size_t)rs_model_param_count(m), rs_st_dir_count(d));
        bool *seen = calloc(rs_st_dir_count(d), 1);
        for (size_t i = 0; i < rs_st_dir_count(d); i++) {
            const rs_st_tensor *t = rs_st_dir_tensor_at(d, i, NULL);
            rs_slot_info info;
            rs_tensor *slot = rs_model_slot(m, t->name, &info);
            if (!slot) RS_TEST_FAIL("%s: no slot for %s", rs_arch_name(c.arch), t->name);
            ASSERT_EQ(info.ndim, t->ndim);
            ASSERT_EQ(info.shape[0], t->shape[0]);
            if (t->ndim == 2) ASSERT_EQ(info.shape[1], t->shape[1]);
            ASSERT_EQ(slot->shape[0], t->shape[0]);
            ASSERT_TRUE(info.index >= 0 && info.index < rs_model_param_count(m));
            ASSERT_TRUE(!seen[info.index]);
            seen[info.index] = true;
            ASSERT_EQ(info.fp8_eligible, rs_quant_eligible(t->name, NULL));
            ASSERT_EQ(info.kind, t->ndim == 2 ? RS_SLOT_MATRIX : RS_SLOT_VECTOR);
            char back[300];
            rs_slot_info info2;
            ASSERT_TRUE(rs_model_param_at(m, info.index, back, sizeof back, &info2) == slot);
            ASSERT_STREQ(back, t->name);
            /* the loader's bytes are in that slot (BF16 matrices as stored) */
            if (t->ndim == 2) ASSERT_EQ(memcmp(slot->data, t->data, t->nbytes), 0);
        }
        free(seen);
        rs_st_dir_close(d);

        /* the named fields */
        rs_slot_info info;
        ASSERT_TRUE(rs_model_slot(m, "model.embed_tokens.weight", &info) == &m->embed);
        ASSERT_EQ(info.index, 0);
        ASSERT_TRUE(rs_model_slot(m, "model.layers.1.self_attn.o_proj.weight", &info) == &m->layers[1].wo);
        ASSERT_EQ(info.layer, 1);
        ASSERT_TRUE(rs_model_slot(m, "model.norm.weight", &info) == &m->final_norm);
        if (c.tie_embeddings) {
            ASSERT_TRUE(rs_model_slot(m, "lm_head.weight", &info) == &m->lm_head);
            ASSERT_TRUE(info.tied);
            ASSERT_EQ(info.index, -1);
        } else {
            ASSERT_TRUE(rs_model_slot(m, "lm_head.weight", &info) == &m->lm_head);
            ASSERT_TRUE(!info.tied);
            ASSERT_EQ(info.index, rs_model_param_count(m) - 1);
        }
        if (c.qkv_bias) ASSERT_TRUE(rs_model_slot(m, "model.layers.0.self_attn.k_proj.bias", NULL) == &m->layers[0].bk);
        else ASSERT_TRUE(rs_model_slot(m, "model.layers.0.self_attn.k_proj.bias", NULL) == NULL);
        if (c.qk_norm) ASSERT_TRUE(rs_model_slot(m, "model.layers.1.self_attn.q_norm.weight", NULL) == &m->layers[1].q_norm);
        else ASSERT_TRUE(rs_model_slot(m, "model.layers.1.self_attn.q_norm.weight", NULL) == NULL);
        if (c.arch == RS_ARCH_QWEN3_MOE) {
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.gate.weight", &info) == &m->layers[1].router);
            ASSERT_TRUE(!info.fp8_eligible);
            ASSERT_EQ(info.shape[0], 4);
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.experts.3.down_proj.weight", &info) ==
                        &m->layers[1].e_down[3]);
            ASSERT_TRUE(info.fp8_eligible);
            ASSERT_EQ(info.shape[0], c.hidden);
            ASSERT_EQ(info.shape[1], c.moe_intermediate);
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.experts.0.gate_proj.weight", NULL) == &m->layers[1].e_gate[0]);
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.experts.2.up_proj.weight", NULL) == &m->layers[1].e_up[2]);
            /* layer 0 is dense: no router or experts; layer 1 is sparse: no dense MLP */
            ASSERT_TRUE(rs_model_slot(m, "model.layers.0.mlp.gate.weight", NULL) == NULL);
            ASSERT_TRUE(rs_model_slot(m, "model.layers.0.mlp.experts.0.up_proj.weight", NULL) == NULL);
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.gate_proj.weight", NULL) == NULL);
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.experts.4.up_proj.weight", NULL) == NULL);
            /* a fused-expert name without ".weight" is not silently some other tensor (verl #7443) */
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.experts.0.up_proj", NULL) == NULL);
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.experts.gate_up_proj", NULL) == NULL);
            ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.experts.01.up_proj.weight", NULL) == NULL);
        }
        /* scales map to their matrix with the block-grid shape; vectors have none */
        ASSERT_TRUE(rs_model_slot(m, "model.layers.0.self_attn.q_proj.weight_scale_inv", &info) == &m->layers[0].wq);
        ASSERT_TRUE(info.is_scale);
        ASSERT_EQ(info.shape[0], 1);
        ASSERT_EQ(info.shape[1], 2);
        ASSERT_TRUE(rs_model_slot(m, "model.norm.weight_scale_inv", NULL) == NULL);
        /* names that are not parameters */
        static const char *const unknown[] = {
            "model.layers.2.self_attn.q_proj.weight", "model.layers.00.self_attn.q_proj.weight",
            "model.layers.-1.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj", "model.layers.0",
            "model.layers.0.self_attn.q_proj.weight.x", "model.embed_tokens", "lm_head", "", "model.norm.bias",
            "model.layers.0.self_attn.qkv_proj.weight", "model.rotary_emb.inv_freq",
            "model.layers.99999999999999999999.self_attn.q_proj.weight", "_scale_inv",
        };
        for (size_t i = 0; i < RS_ARRAY_LEN(unknown); i++)
            if (rs_model_slot(m, unknown[i], NULL)) RS_TEST_FAIL("'%s' mapped to a slot", unknown[i]);
        rs_model_free(m);
    }
    rs_backend_free(b);
}

/* FP8 policy: the served formats the slots report. */
RS_TEST(update_slot_served_format) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_model_config c = cfg_for(RS_ARCH_QWEN3_MOE, true);
    rs_quant_policy fp8 = policy("fp8");
    rs_model *m = load(model_dir("m", &c, 4), b, &fp8);
    rs_slot_info info;
    ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.experts.1.gate_proj.weight", &info) != NULL);
    ASSERT_TRUE(info.served_fp8);
    ASSERT_TRUE(rs_model_slot(m, "model.layers.1.mlp.gate.weight", &info) != NULL);
    ASSERT_TRUE(!info.served_fp8); /* the router stays BF16 */
    ASSERT_TRUE(rs_model_slot(m, "model.embed_tokens.weight", &info) != NULL);
    ASSERT_TRUE(!info.served_fp8);
    ASSERT_TRUE(rs_model_slot(m, "model.layers.0.mlp.down_proj.weight", &info) != NULL);
    ASSERT_TRUE(info.served_fp8);
    rs_model_free(m);
    rs_backend_free(b);
}

/* ---------------------------------------------------------------- full updates */

/* A served model updated with every tensor of a second checkpoint (same config, other seed)
 * serves exactly what a fresh load of that checkpoint serves. */
static void full_update_policy(rs_arch arch, bool tied, const rs_quant_policy *policy_) {
    rs_backend *b = rs_backend_cpu_init(2);
    rs_model_config c = cfg_for(arch, tied);
    const rs_quant_policy qp = *policy_;
    const char *da = model_dir("a", &c, 11), *db = model_dir("b", &c, 12);
    rs_model *a = load(da, b, &qp), *fresh_b = load(db, b, &qp);
    const size_t allocs = rs_weight_store_count(a->store);
    rs_txn *u = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_txn_begin(&u, a, "v1", 0, &err), RS_OK);
    ASSERT_EQ(rs_txn_n_required(u), rs_model_param_count(a));
    stage_dir(u, db, NULL);
    ASSERT_TRUE(rs_txn_complete(u));
    ASSERT_EQ(rs_txn_staged_bytes(u), a->weight_bytes); /* staged = served size, never raw BF16 */
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_OK);
    ASSERT_EQ(rs_weight_store_count(a->store), allocs);
    expect_same_weights(a, fresh_b);
    expect_same_logits(a, fresh_b);
    rs_model_free(a);
    rs_model_free(fresh_b);
    rs_backend_free(b);
}

static void full_update(rs_arch arch, bool tied, const char *mode) {
    const rs_quant_policy qp = policy(mode);
    full_update_policy(arch, tied, &qp);
}

/* --quantize-lm-head: pushes land in the FP8 head too (tied: the FP8 table that serves both
 * ends), as a fresh load with the same policy has it. */
static void full_update_fp8_head(rs_arch arch, bool tied) {
    rs_quant_policy qp = policy("fp8");
    qp.quantize_lm_head = true;
    full_update_policy(arch, tied, &qp);
}

RS_TEST(update_full_fp8_head_qwen3_tied) { full_update_fp8_head(RS_ARCH_QWEN3, true); }
RS_TEST(update_full_fp8_head_llama_untied) { full_update_fp8_head(RS_ARCH_LLAMA, false); }
RS_TEST(update_full_bf16_qwen3) { full_update(RS_ARCH_QWEN3, true, "bf16"); }
RS_TEST(update_full_fp8_qwen3) { full_update(RS_ARCH_QWEN3, true, "fp8"); }
RS_TEST(update_full_fp8_qwen3_moe) { full_update(RS_ARCH_QWEN3_MOE, false, "fp8"); }
RS_TEST(update_full_bf16_qwen2) { full_update(RS_ARCH_QWEN2, false, "bf16"); }
RS_TEST(update_full_fp8_llama) { full_update(RS_ARCH_LLAMA, false, "fp8"); }

/* rs_model_view (what the sync service calibrates KV scales on before a commit): a view of A with
 * every parameter repointed, through rs_model_param_at, to B's tensors computes B's logits bit for
 * bit (so every slot, MoE experts included, belongs to the view), and A is untouched. */
static void view_of(rs_arch arch, bool tied) {
    rs_backend *b = rs_backend_cpu_init(2), *other = rs_backend_cpu_init(1);
    rs_model_config c = cfg_for(arch, tied);
    rs_quant_policy qp = policy("fp8");
    const char *da = model_dir("va", &c, 21), *db = model_dir("vb", &c, 22);
    rs_model *a = load(da, b, &qp), *mb = load(db, b, &qp), *fresh_a = load(da, b, &qp);
    rs_model *v = rs_model_view(a, other);
    ASSERT_TRUE(v->backend == other && v->layers != a->layers);
    char name[300];
    for (int i = 0; i < rs_model_param_count(a); i++) {
        rs_tensor *t = rs_model_param_at(v, i, name, sizeof name, NULL);
        const rs_tensor *src = rs_model_param_at(mb, i, name, sizeof name, NULL);
        t->data = src->data;
        t->scale_inv = src->scale_inv;
    }
    if (tied) v->lm_head = v->embed;
    expect_same_logits(v, mb);
    expect_same_logits(a, fresh_a);
    rs_model_view_free(v);
    rs_model_free(a);
    rs_model_free(mb);
    rs_model_free(fresh_a);
    rs_backend_free(other);
    rs_backend_free(b);
}

RS_TEST(update_model_view_qwen3_tied) { view_of(RS_ARCH_QWEN3, true); }
RS_TEST(update_model_view_qwen3_moe) { view_of(RS_ARCH_QWEN3_MOE, false); }
RS_TEST(update_model_view_llama) { view_of(RS_ARCH_LLAMA, false); }

/* An FP8 update (codes + `_scale_inv`, the trainer-side quantization of slime / SGLang): the pair
 * may come in either order, in separate adds or together; the result equals quantizing on arrival. */
RS_TEST(update_fp8_pairs_equal_quantize_on_arrival) {
    rs_backend *b = rs_backend_cpu_init(2);
    rs_model_config c = cfg_for(RS_ARCH_QWEN3, true);
    rs_quant_policy fp8 = policy("fp8");
    const char *da = model_dir("a", &c, 21), *db = model_dir("b", &c, 22);
    rs_model *a = load(da, b, &fp8), *fresh_b = load(db, b, &fp8);
    rs_txn *u = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_txn_begin(&u, a, "fp8", 0, &err), RS_OK);
    rs_st_dir *d = NULL;
    ASSERT_EQ(rs_st_dir_open(&d, db, &err), RS_OK);
    int k = 0;
    for (size_t i = 0; i < rs_st_dir_count(d); i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(d, i, NULL);
        rs_txn_tensor ut = st_tensor(t);
        if (!rs_quant_eligible(t->name, NULL)) {
            ASSERT_EQ(rs_txn_add(u, &ut, &err), RS_OK);
            continue;
        }
        rs_tensor host = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {t->shape[0], t->shape[1]}};
        host.data = malloc(t->nbytes);
        memcpy(host.data, t->data, t->nbytes);
        uint8_t *q = malloc((size_t)(t->shape[0] * t->shape[1]));
        size_t ns = (size_t)(rs_fp8_blocks(t->shape[0]) * rs_fp8_blocks(t->shape[1]));
        float *s = malloc(ns * sizeof(float));
        ASSERT_EQ(rs_fp8_quantize_weight(&host, q, s), RS_OK);
        char sname[300];
        snprintf(sname, sizeof sname, "%s_scale_inv", t->name);
        int64_t sshape[2] = {rs_fp8_blocks(t->shape[0]), rs_fp8_blocks(t->shape[1])};
        rs_txn_tensor codes = {.name = t->name, .dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = t->shape, .data = q};
        rs_txn_tensor scale = {.name = sname, .dtype = RS_DTYPE_F32, .ndim = 2, .shape = sshape, .data = s};
        switch (k++ % 3) {
        case 0: /* codes, then scale */
            ASSERT_EQ(rs_txn_add(u, &codes, &err), RS_OK);
            ASSERT_TRUE(!rs_txn_complete(u));
            ASSERT_EQ(rs_txn_add(u, &scale, &err), RS_OK);
            break;
        case 1: /* scale first */
            ASSERT_EQ(rs_txn_add(u, &scale, &err), RS_OK);
            ASSERT_EQ(rs_txn_add(u, &codes, &err), RS_OK);
            break;
        default: /* together */
            codes.scale_inv = s;
            codes.scale_dtype = RS_DTYPE_F32;
            ASSERT_EQ(rs_txn_add(u, &codes, &err), RS_OK);
            break;
        }
        free(host.data), free(q), free(s);
    }
    rs_st_dir_close(d);
    ASSERT_TRUE(rs_txn_complete(u));
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_OK);
    expect_same_weights(a, fresh_b);
    expect_same_logits(a, fresh_b);
    rs_model_free(a);
    rs_model_free(fresh_b);
    rs_backend_free(b);
}

/* The FP8 slot fed BF16 is quantized, never left BF16, and bit-identical to quantizing at load;
 * F32 input is quantized from the same values. */
RS_TEST(update_fp8_slot_quantizes_bf16_bit_identically) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_model_config c = cfg_for(RS_ARCH_QWEN3, true);
    rs_quant_policy fp8 = policy("fp8");
    const char *da = model_dir("a", &c, 31), *db = model_dir("b", &c, 32);
    rs_model *a = load(da, b, &fp8), *fresh_b = load(db, b, &fp8);
    rs_st_dir *d = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_st_dir_open(&d, db, &err), RS_OK);
    const char *w = "model.layers.1.mlp.down_proj.weight";
    const rs_st_tensor *t = rs_st_dir_find(d, w, NULL, NULL);
    ASSERT_TRUE(t != NULL);
    rs_txn *u = NULL;
    ASSERT_EQ(rs_txn_begin(&u, a, NULL, 0, &err), RS_OK);
    /* F32 copy of the BF16 values: quantizes to the same codes */
    size_t n = (size_t)(t->shape[0] * t->shape[1]);
    float *f = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)t->data + 2 * i, 2);
        f[i] = rs_bf16_to_f32(h);
    }
    rs_txn_tensor ut = {.name = w, .dtype = RS_DTYPE_F32, .ndim = 2, .shape = t->shape, .data = f};
    ASSERT_EQ(rs_txn_add(u, &ut, &err), RS_OK);
    free(f);
    stage_dir(u, db, w);
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_OK);
    rs_tensor *slot = &a->layers[1].w_down;
    ASSERT_EQ(slot->dtype, RS_DTYPE_E4M3);
    ASSERT_TRUE(slot->scale_inv != NULL);
    ASSERT_EQ(memcmp(slot->data, fresh_b->layers[1].w_down.data, n), 0);
    ASSERT_EQ(memcmp(slot->scale_inv, fresh_b->layers[1].w_down.scale_inv, scale_bytes(slot)), 0);
    expect_same_weights(a, fresh_b);
    rs_st_dir_close(d);
    rs_model_free(a);
    rs_model_free(fresh_b);
    rs_backend_free(b);
}

/* A weight takes the layout its backend chooses when it is staged, not the one its slot had: with
 * the CPU backend's SIMD level lowered below AVX-512 VNNI after loading (where the FP8 weights were
 * packed), an update commits row-major weights and the slots say so. */
RS_TEST(update_fp8_layout_is_the_staged_weights) {
    rs_backend *b = rs_backend_cpu_init(1), *rows = rs_backend_cpu_init(1);
    rs_cpu_set_simd(rows, RS_CPU_SIMD_AVX2);
    rs_model_config c = cfg_for(RS_ARCH_QWEN3, true);
    rs_quant_policy fp8 = policy("fp8");
    const char *da = model_dir("a", &c, 33), *db = model_dir("b", &c, 34);
    rs_model *a = load(da, b, &fp8), *fresh_b = load(db, rows, &fp8);
    rs_cpu_set_simd(b, RS_CPU_SIMD_AVX2);
    rs_txn *u = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_txn_begin(&u, a, NULL, 0, &err), RS_OK);
    stage_dir(u, db, NULL);
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_OK);
    expect_same_weights(a, fresh_b); /* codes, scales and layouts */
    ASSERT_EQ(a->layers[1].w_down.layout, RS_LAYOUT_ROWS);
    rs_model_free(a);
    rs_model_free(fresh_b);
    rs_backend_free(b);
    rs_backend_free(rows);
}

/* Tied lm_head may be sent (validated, ignored) and follows embed_tokens. */
RS_TEST(update_tied_lm_head_follows_embed) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_model_config c = cfg_for(RS_ARCH_QWEN3, true);
    const char *da = model_dir("a", &c, 41), *db = model_dir("b", &c, 42);
    rs_model *a = load(da, b, NULL), *fresh_b = load(db, b, NULL);
    rs_txn *u = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_txn_begin(&u, a, "t", 0, &err), RS_OK);
    stage_dir(u, db, NULL);
    rs_slot_info info;
    rs_tensor *emb = rs_model_slot(fresh_b, "model.embed_tokens.weight", &info);
    rs_txn_tensor lm = {.name = "lm_head.weight", .dtype = RS_DTYPE_BF16, .ndim = 2, .shape = emb->shape,
                           .data = emb->data};
    ASSERT_EQ(rs_txn_add(u, &lm, &err), RS_OK);
    ASSERT_EQ(rs_txn_add(u, &lm, &err), RS_EINVAL); /* twice is a duplicate */
    ASSERT_STREQ(err.param, "lm_head.weight");
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_OK);
    ASSERT_TRUE(a->lm_head.data == a->embed.data);
    expect_same_logits(a, fresh_b);
    rs_model_free(a);
    rs_model_free(fresh_b);
    rs_backend_free(b);
}

/* ---------------------------------------------------------------- failures */

typedef struct bad_case {
    const char *what;
    const char *name;                   /* tensor to send */
    rs_dtype dtype;
    int ndim;
    int64_t shape[2];
    int code;
    const char *param, *needle;
} bad_case;

/* Each bad tensor is refused with a message naming it; the transaction, aborted, leaves the
 * served model exactly as it was (logits, bytes, allocations). */
RS_TEST(update_rejects_bad_tensors_and_leaves_weights) {
    rs_backend *b = rs_backend_cpu_init(2);
    rs_model_config c = cfg_for(RS_ARCH_QWEN3, true);
    rs_quant_policy fp8 = policy("fp8");
    const char *da = model_dir("a", &c, 51), *db = model_dir("b", &c, 52);
    rs_model *a = load(da, b, &fp8), *ref = load(da, b, &fp8);
    const size_t allocs = rs_weight_store_count(a->store), bytes = a->weight_bytes;
    const int64_t h = c.hidden, q = (int64_t)c.n_heads * c.head_dim;
    const bad_case cases[] = {
        {"unknown name", "model.layers.0.self_attn.qkv_proj.weight", RS_DTYPE_BF16, 2, {q, h}, RS_EINVAL,
         "model.layers.0.self_attn.qkv_proj.weight", "unknown tensor"},
        {"layer out of range", "model.layers.7.self_attn.q_proj.weight", RS_DTYPE_BF16, 2, {q, h}, RS_EINVAL,
         "model.layers.7.self_attn.q_proj.weight", "unknown tensor"},
        {"wrong shape (transposed)", "model.layers.0.self_attn.o_proj.weight", RS_DTYPE_BF16, 2, {q, h}, RS_EINVAL,
         "model.layers.0.self_attn.o_proj.weight", "expected [160, 128]"},
        {"wrong rank", "model.norm.weight", RS_DTYPE_BF16, 2, {1, h}, RS_EINVAL, "model.norm.weight", "shape"},
        {"FP8 into a BF16 slot", "model.embed_tokens.weight", RS_DTYPE_E4M3, 2, {c.vocab_size, h}, RS_EUNSUPPORTED,
         "model.embed_tokens.weight", "cannot take FP8"},
        {"FP8 norm", "model.layers.0.input_layernorm.weight", RS_DTYPE_E4M3, 1, {h, 0}, RS_EUNSUPPORTED,
         "model.layers.0.input_layernorm.weight", "cannot take FP8"},
        {"integer weights", "model.layers.0.self_attn.q_proj.weight", RS_DTYPE_I32, 2, {q, h}, RS_EUNSUPPORTED,
         "model.layers.0.self_attn.q_proj.weight", "int32"},
        {"scale for a BF16 slot", "lm_head.weight_scale_inv", RS_DTYPE_F32, 2, {2, 2}, RS_EINVAL,
         "lm_head.weight_scale_inv", "no scale_inv"},
        {"scale of the wrong grid", "model.layers.0.self_attn.q_proj.weight_scale_inv", RS_DTYPE_F32, 2, {2, 2},
         RS_EINVAL, "model.layers.0.self_attn.q_proj.weight_scale_inv", "expected [1, 2]"},
        {"integer scale", "model.layers.0.self_attn.q_proj.weight_scale_inv", RS_DTYPE_I32, 2, {1, 2},
         RS_EUNSUPPORTED, "model.layers.0.self_attn.q_proj.weight_scale_inv", "expected float32 or bfloat16"},
    };
    float *before = logits_of(a);
    static float zeros[1 << 16];
    for (size_t k = 0; k < RS_ARRAY_LEN(cases); k++) {
        const bad_case *bc = &cases[k];
        rs_txn *u = NULL;
        rs_error err = {0};
        ASSERT_EQ(rs_txn_begin(&u, a, "bad", 0, &err), RS_OK);
        stage_dir(u, db, bc->name); /* the rest of a valid update ... */
        rs_txn_tensor t = {.name = bc->name, .dtype = bc->dtype, .ndim = bc->ndim, .shape = bc->shape,
                              .data = zeros};
        int rc = rs_txn_add(u, &t, &err); /* ... spoiled by one bad tensor */
        if (rc != bc->code || strcmp(err.param, bc->param) != 0 || !strstr(err.message, bc->needle))
            RS_TEST_FAIL("%s: rc %d (want %d), param '%s', message '%s'", bc->what, rc, bc->code, err.param,
                         err.message);
        rs_txn_abort(u);
        ASSERT_EQ(rs_weight_store_count(a->store), allocs);
        ASSERT_EQ(a->weight_bytes, bytes);
    }
    expect_same_weights(a, ref);
    float *after = logits_of(a);
    ASSERT_EQ(memcmp(before, after, sizeof(float) * N_TOK * (size_t)c.vocab_size), 0);
    free(before), free(after);
    rs_model_free(a);
    rs_model_free(ref);
    rs_backend_free(b);
}

/* Duplicates, a missing tensor at commit (named: the first in model order), FP8 half-pairs, a
 * float weight after its scale, and the staging limit: each fails, and the model is untouched. */
RS_TEST(update_incomplete_duplicate_and_limit) {
    rs_backend *b = rs_backend_cpu_init(2);
    rs_model_config c = cfg_for(RS_ARCH_QWEN3, true);
    rs_quant_policy fp8 = policy("fp8");
    const char *da = model_dir("a", &c, 61), *db = model_dir("b", &c, 62);
    rs_model *a = load(da, b, &fp8), *ref = load(da, b, &fp8);
    const size_t allocs = rs_weight_store_count(a->store);
    rs_error err = {0};
    rs_txn *u = NULL;
    rs_st_dir *d = NULL;
    ASSERT_EQ(rs_st_dir_open(&d, db, &err), RS_OK);
    const rs_st_tensor *qw = rs_st_dir_find(d, "model.layers.0.self_attn.q_proj.weight", NULL, NULL);
    rs_txn_tensor q = st_tensor(qw);

    /* duplicate */
    ASSERT_EQ(rs_txn_begin(&u, a, "d", 0, &err), RS_OK);
    ASSERT_EQ(rs_txn_add(u, &q, &err), RS_OK);
    ASSERT_EQ(rs_txn_add(u, &q, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "model.layers.0.self_attn.q_proj.weight");
    ASSERT_TRUE(strstr(err.message, "duplicate"));
    rs_txn_abort(u);

    /* missing at commit: the first missing parameter in model order is named */
    ASSERT_EQ(rs_txn_begin(&u, a, "m", 0, &err), RS_OK);
    stage_dir(u, db, "model.layers.1.self_attn.k_norm.weight");
    ASSERT_TRUE(!rs_txn_complete(u));
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "model.layers.1.self_attn.k_norm.weight");
    ASSERT_TRUE(strstr(err.message, "missing tensor"));
    ASSERT_EQ(rs_weight_store_count(a->store), allocs);

    /* an empty commit names the embedding */
    ASSERT_EQ(rs_txn_begin(&u, a, "e", 0, &err), RS_OK);
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "model.embed_tokens.weight");

    /* FP8 codes without their scale */
    ASSERT_EQ(rs_txn_begin(&u, a, "h", 0, &err), RS_OK);
    stage_dir(u, db, "model.layers.0.self_attn.q_proj.weight");
    uint8_t *codes = calloc((size_t)(qw->shape[0] * qw->shape[1]), 1);
    rs_txn_tensor qc = {.name = q.name, .dtype = RS_DTYPE_E4M3, .ndim = 2, .shape = qw->shape, .data = codes};
    ASSERT_EQ(rs_txn_add(u, &qc, &err), RS_OK);
    ASSERT_TRUE(!rs_txn_complete(u));
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "model.layers.0.self_attn.q_proj.weight");
    ASSERT_TRUE(strstr(err.message, "without"));

    /* a scale, then the float weight: refused (which scales would it be?) */
    ASSERT_EQ(rs_txn_begin(&u, a, "s", 0, &err), RS_OK);
    float sc[2] = {1.0f, 1.0f};
    int64_t sshape[2] = {1, 2};
    rs_txn_tensor st = {.name = "model.layers.0.self_attn.q_proj.weight_scale_inv", .dtype = RS_DTYPE_F32,
                           .ndim = 2, .shape = sshape, .data = sc};
    ASSERT_EQ(rs_txn_add(u, &st, &err), RS_OK);
    ASSERT_EQ(rs_txn_add(u, &q, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "model.layers.0.self_attn.q_proj.weight");
    rs_txn_abort(u);
    /* and a float weight, then a scale */
    ASSERT_EQ(rs_txn_begin(&u, a, "s2", 0, &err), RS_OK);
    ASSERT_EQ(rs_txn_add(u, &q, &err), RS_OK);
    ASSERT_EQ(rs_txn_add(u, &st, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "model.layers.0.self_attn.q_proj.weight_scale_inv");
    rs_txn_abort(u);
    /* a NaN scale */
    ASSERT_EQ(rs_txn_begin(&u, a, "n", 0, &err), RS_OK);
    sc[1] = NAN;
    ASSERT_EQ(rs_txn_add(u, &st, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "nan"));
    rs_txn_abort(u);

    /* the staging limit: 64 KiB is refused with 400 before the backend is asked */
    ASSERT_EQ(rs_txn_begin(&u, a, "l", 64 << 10, &err), RS_OK);
    rs_txn_tensor emb = st_tensor(rs_st_dir_find(d, "model.embed_tokens.weight", NULL, NULL));
    ASSERT_EQ(rs_txn_add(u, &emb, &err), RS_OK); /* 200 x 160 BF16 = 62.5 KiB */
    ASSERT_EQ(rs_txn_add(u, &q, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "model.layers.0.self_attn.q_proj.weight");
    ASSERT_TRUE(strstr(err.message, "staging limit"));
    ASSERT_TRUE(rs_txn_staged_bytes(u) <= (64 << 10));
    rs_txn_abort(u);

    free(codes);
    rs_st_dir_close(d);
    ASSERT_EQ(rs_weight_store_count(a->store), allocs);
    expect_same_weights(a, ref);
    expect_same_logits(a, ref);
    rs_model_free(a);
    rs_model_free(ref);
    rs_backend_free(b);
}

/* The weight store: release and adopt by address, with many allocations (MoE-sized counts). */
RS_TEST(update_weight_store_release_adopt) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_weight_store *x = rs_weight_store_new(b), *y = rs_weight_store_new(b);
    enum { N = 5000 };
    void **p = malloc(N * sizeof *p);
    for (int i = 0; i < N; i++) p[i] = rs_weight_store_alloc(x, (size_t)(i % 7 + 1));
    ASSERT_EQ(rs_weight_store_count(x), N);
    size_t bytes = rs_weight_store_bytes(x);
    for (int i = 0; i < N; i += 2) rs_weight_store_adopt(y, x, p[i]);
    for (int i = 1; i < N; i += 4) rs_weight_store_release(x, p[i]);
    ASSERT_EQ(rs_weight_store_count(y), N / 2);
    ASSERT_EQ(rs_weight_store_count(x), N / 2 - N / 4);
    size_t moved = 0, freed = 0;
    for (int i = 0; i < N; i += 2) moved += (size_t)(i % 7 + 1);
    for (int i = 1; i < N; i += 4) freed += (size_t)(i % 7 + 1);
    ASSERT_EQ(rs_weight_store_bytes(y), moved);
    ASSERT_EQ(rs_weight_store_bytes(x), bytes - moved - freed);
    for (int i = 3; i < N; i += 4) rs_weight_store_release(x, p[i]);
    ASSERT_EQ(rs_weight_store_count(x), 0);
    ASSERT_EQ(rs_weight_store_bytes(x), 0);
    rs_weight_store_free(x);
    rs_weight_store_free(y);
    free(p);
    rs_backend_free(b);
}

/* The served pointers of every parameter (data, then scale_inv or NULL), in model order. */
static void **slot_ptrs(rs_model *m) {
    const int n = rs_model_param_count(m);
    void **p = calloc(2 * (size_t)n, sizeof *p);
    char name[300];
    for (int i = 0; i < n; i++) {
        rs_tensor *t = rs_model_param_at(m, i, name, sizeof name, NULL);
        p[2 * i] = t->data;
        p[2 * i + 1] = t->scale_inv;
    }
    return p;
}

static bool ptr_in(void *x, void **set, int n) {
    for (int i = 0; i < n; i++)
        if (set[i] == x) return true;
    return false;
}

/* Recycling: with keep_released, a commit parks the replaced tensors' memory and the next update
 * stages into exactly that memory (no new allocation), an aborted update hands its staging back,
 * and the served weights are still exactly a fresh load's. */
RS_TEST(update_staging_recycles_replaced_weights) {
    rs_backend *b = rs_backend_cpu_init(2);
    rs_model_config c = cfg_for(RS_ARCH_QWEN3, true);
    rs_quant_policy qp = policy("fp8");
    const char *da = model_dir("a", &c, 11), *db = model_dir("b", &c, 12);
    rs_model *m = load(da, b, &qp), *fresh_a = load(da, b, &qp), *fresh_b = load(db, b, &qp);
    rs_weight_store_keep_released(m->store, true);
    const int n = 2 * rs_model_param_count(m);
    const size_t served = m->weight_bytes;
    void **p0 = slot_ptrs(m);
    rs_txn *u = NULL;
    rs_error err = {0};

    ASSERT_EQ(rs_txn_begin(&u, m, "v1", 0, &err), RS_OK); /* nothing parked yet: new memory */
    stage_dir(u, db, NULL);
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_OK);
    ASSERT_EQ(rs_weight_store_spare_bytes(m->store), served);
    ASSERT_EQ(m->weight_bytes, served);
    void **p1 = slot_ptrs(m);
    for (int i = 0; i < n; i++) ASSERT_TRUE(!p1[i] || !ptr_in(p1[i], p0, n));
    expect_same_logits(m, fresh_b);

    ASSERT_EQ(rs_txn_begin(&u, m, "v2", 0, &err), RS_OK); /* stages into v0's memory */
    stage_dir(u, da, NULL);
    ASSERT_EQ(rs_weight_store_spare_bytes(m->store), 0);
    ASSERT_EQ(rs_txn_commit(u, NULL, false, NULL, &err), RS_OK);
    void **p2 = slot_ptrs(m);
    for (int i = 0; i < n; i++) ASSERT_TRUE(!p2[i] || ptr_in(p2[i], p0, n));
    ASSERT_EQ(rs_weight_store_spare_bytes(m->store), served);
    expect_same_weights(m, fresh_a);
    expect_same_logits(m, fresh_a);

    ASSERT_EQ(rs_txn_begin(&u, m, "v3", 0, &err), RS_OK); /* aborted: its staging goes back */
    stage_dir(u, db, "model.norm.weight");
    ASSERT_TRUE(rs_weight_store_spare_bytes(m->store) < served);
    rs_txn_abort(u);
    ASSERT_EQ(rs_weight_store_spare_bytes(m->store), served);
    expect_same_logits(m, fresh_a);

    rs_weight_store_keep_released(m->store, false);
    ASSERT_EQ(rs_weight_store_spare_bytes(m->store), 0);
    free(p0);
    free(p1);
    free(p2);
    rs_model_free(m);
    rs_model_free(fresh_a);
    rs_model_free(fresh_b);
    rs_backend_free(b);
}
