/*
 * test_commit_refusal.c — a weight update whose FP8 KV scales cannot be settled is refused before
 * the swap: the old weights, scales and version stay in service, whether the scales are calibrated
 * on the sync service's own backend, by the engine before its swap (a service without one), or
 * handed in by the caller. And K/V that are finite but overflow when the calibration margin is
 * applied still get finite scales (they used to get infinite ones, which the engine refused only
 * after it had swapped the weights in).
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../model/presets.h"
#include "../../model/quant.h"
#include "../../model/safetensors.h"
#include "../../scheduler/engine.h"
#include "../../sync/transaction.h"
#include "test.h"

enum { NL = 2, NKV = 2, HD = 16, NSCORE = 39 };

static void tiny(rs_model_config *c) {
    ASSERT_EQ(rs_model_preset("default", c), RS_OK);
    c->vocab_size = 256;
    c->hidden = 64;
    c->intermediate = 128;
    c->n_layers = NL;
    c->n_heads = 4;
    c->n_kv_heads = NKV;
    c->head_dim = HD;
    c->max_position = 256;
}

static rs_engine *calibrating_engine(rs_model *m, float margin) {
    rs_engine_opts o = {.kv_cache_bytes = 1 << 20, .max_running = 4, .max_step_tokens = 256,
                        .kv_dtype = RS_DTYPE_E4M3, .kv_scales = RS_KV_SCALES_CALIBRATE,
                        .kv_calib_margin = margin, .kv_calib_percentile = 1.0f,
                        .limits = {.max_context = 256, .max_new_tokens = 16, .max_n = 1, .max_batch = 1}};
    rs_engine *e = NULL;
    rs_error err = {0};
    if (rs_engine_init(&e, m, &o, &err) != RS_OK) RS_TEST_FAIL("engine: %s", err.message);
    ASSERT_EQ(rs_engine_kv_scales(e), RS_KV_SCALES_CALIBRATE);
    return e;
}

/* Prompt logprobs of a fixed 40-token sequence: what the engine serves. */
static void score(rs_engine *e, float *out /* [NSCORE] */) {
    rs_gen_job *j = rs_gen_job_new();
    j->n_prompts = 1;
    j->prompts = calloc(1, sizeof(int32_t *));
    j->prompt_lens = calloc(1, sizeof(int));
    j->prompt_lens[0] = NSCORE + 1;
    j->prompts[0] = malloc((NSCORE + 1) * sizeof(int32_t));
    for (int i = 0; i <= NSCORE; i++) j->prompts[0][i] = (i * 37 + 11) % 256;
    j->sp.max_new_tokens = 0;
    j->logprob_start_len = 1;
    rs_error err = {0};
    ASSERT_EQ(rs_engine_submit(e, j, &err), RS_OK);
    rs_engine_run_until_idle(e);
    memcpy(out, j->outputs[0].input_logprobs, NSCORE * sizeof(float));
    rs_gen_job_free(j);
}

static bool same_bits(const float *a, const float *b, int n) { return memcmp(a, b, (size_t)n * sizeof *a) == 0; }

/* Stages every tensor of dir into u, with `name` (F32 [HD]) replaced by `data`. */
static void stage_with(rs_txn *u, const char *dir, const char *name, const float *data) {
    rs_st_dir *d = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_st_dir_open(&d, dir, &err), RS_OK);
    bool replaced = false;
    for (size_t i = 0; i < rs_st_dir_count(d); i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(d, i, NULL);
        rs_txn_tensor ut = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                               .data = t->data};
        if (!strcmp(t->name, name)) {
            ASSERT_EQ(t->ndim, 1);
            ASSERT_EQ(t->shape[0], HD);
            ut.dtype = RS_DTYPE_F32;
            ut.data = data;
            replaced = true;
        }
        if (rs_txn_add(u, &ut, &err) != RS_OK) RS_TEST_FAIL("add %s: %s", t->name, err.message);
    }
    rs_st_dir_close(d);
    ASSERT_TRUE(replaced);
}

/* The tiny checkpoint the tests start from, at <tmp>/ckpt. */
static void write_ckpt(char *dir, size_t cap) {
    snprintf(dir, cap, "%s/ckpt", rs_test_tmpdir());
    rs_model_config cfg;
    tiny(&cfg);
    rs_error err = {0};
    ASSERT_EQ(rs_testmodel_write(dir, &cfg, 7, &err), RS_OK);
}

static rs_model *load(const char *dir, rs_backend *b) {
    rs_error err = {0};
    rs_quant_policy qp;
    ASSERT_EQ(rs_quant_policy_init(&qp, "fp8", "", 0, 0, &err), RS_OK);
    rs_model *m = NULL;
    if (rs_model_load(dir, b, &qp, &m, &err) != RS_OK) RS_TEST_FAIL("load: %s", err.message);
    return m;
}

/* Layer 0's k_norm made FLT_MAX: K overflows, and so the calibration is not finite. Refused on the sync
 * service's backend and, without one, by the engine before its swap. */
RS_TEST(commit_refused_when_calibration_fails_either_way) {
    char dir[512];
    write_ckpt(dir, sizeof dir);
    rs_error err = {0};
    rs_backend *b = rs_backend_cpu_init(1), *calib = rs_backend_cpu_init(2);
    rs_model *m = load(dir, b);
    rs_engine *e = calibrating_engine(m, 1.2f);
    float before[NSCORE], after[NSCORE], inf[HD];
    for (int i = 0; i < HD; i++) inf[i] = FLT_MAX; /* finite, so staged (a non-finite weight is refused there) */
    score(e, before);
    char version[64];
    snprintf(version, sizeof version, "%s", rs_engine_weight_version(e));
    for (int pass = 0; pass < 2; pass++) {
        rs_txn *u = NULL;
        ASSERT_EQ(rs_txn_begin(&u, m, "bad", 0, &err), RS_OK);
        if (pass == 0) rs_txn_set_calib_backend(u, calib);
        stage_with(u, dir, "model.layers.0.self_attn.k_norm.weight", inf);
        err = (rs_error){0};
        ASSERT_EQ(rs_txn_commit(u, e, false, NULL, &err), RS_EINVAL);
        ASSERT_STREQ(err.param, "kv-cache-dtype");
        if (!strstr(err.message, "weights in service are unchanged")) RS_TEST_FAIL("pass %d: %s", pass, err.message);
        ASSERT_STREQ(rs_engine_weight_version(e), version);
        score(e, after);
        if (!same_bits(before, after, NSCORE)) RS_TEST_FAIL("pass %d: the refused weights are in service", pass);
    }
    rs_engine_free(e);
    rs_model_free(m);
    rs_backend_free(calib);
    rs_backend_free(b);
}

/* The last layer's k_norm at 1e37: its K are finite (|K| <= sqrt(head_dim) 1e37), but times the
 * margin 100 they overflow. The scales stay finite and the update commits, on either calibrator;
 * the engine serves exactly what an engine started on those weights serves. */
RS_TEST(commit_calibrates_finite_scales_for_huge_kv) {
    char dir[512];
    write_ckpt(dir, sizeof dir);
    rs_error err = {0};
    rs_backend *b = rs_backend_cpu_init(1), *calib = rs_backend_cpu_init(2);
    float big[HD];
    for (int i = 0; i < HD; i++) big[i] = 1e37f;
    char last_knorm[96];
    snprintf(last_knorm, sizeof last_knorm, "model.layers.%d.self_attn.k_norm.weight", NL - 1);

    for (int pass = 0; pass < 2; pass++) {
        rs_model *m = load(dir, b);
        rs_engine *e = calibrating_engine(m, 100.0f);
        rs_txn *u = NULL;
        ASSERT_EQ(rs_txn_begin(&u, m, "big", 0, &err), RS_OK);
        if (pass == 0) rs_txn_set_calib_backend(u, calib);
        stage_with(u, dir, last_knorm, big);
        if (rs_txn_commit(u, e, false, NULL, &err) != RS_OK) RS_TEST_FAIL("pass %d: %s", pass, err.message);
        ASSERT_STREQ(rs_engine_weight_version(e), "big");
        /* the scales the engine installed are what it computes for the weights it now serves */
        float k[NL * NKV], v[NL * NKV];
        ASSERT_EQ(rs_engine_calibrate_kv_on(e, m, k, v, &err), RS_OK);
        for (int i = 0; i < NL * NKV; i++)
            if (!(isfinite(k[i]) && k[i] > 0 && isfinite(v[i]) && v[i] > 0))
                RS_TEST_FAIL("pass %d: scale %d is k %g v %g", pass, i, (double)k[i], (double)v[i]);
        ASSERT_TRUE(k[(NL - 1) * NKV] > 7e35f); /* the overflowed layer: FLT_MAX / 448 */
        rs_engine_free(e);
        rs_model_free(m);
    }
    rs_backend_free(calib);
    rs_backend_free(b);
}

static int applied;
static void count_apply(rs_model *m, void *ctx) {
    (void)m, (void)ctx;
    applied++;
}

/* A calibration the engine runs before the swap that yields a zero scale. */
static int calibrate_zero(void *ctx, const rs_engine *e, float *k, float *v, rs_error *err) {
    (void)ctx, (void)e, (void)err;
    for (int i = 0; i < NL * NKV; i++) k[i] = v[i] = 0.01f;
    v[NL * NKV - 1] = 0.0f;
    return RS_OK;
}

/* Scales handed to the engine's swap, or computed by the calibration it runs, are checked before
 * the swap: unusable ones refuse the update with nothing applied. */
RS_TEST(commit_refuses_unusable_caller_scales) {
    char dir[512];
    write_ckpt(dir, sizeof dir);
    rs_error err = {0};
    rs_backend *b = rs_backend_cpu_init(1);
    rs_model *m = load(dir, b);
    rs_engine *e = calibrating_engine(m, 1.2f);
    float k[NL * NKV], v[NL * NKV];
    for (int i = 0; i < NL * NKV; i++) k[i] = v[i] = 0.01f;
    k[3] = INFINITY;
    applied = 0;
    rs_weight_swap w = {.apply = count_apply, .k_scales = k, .v_scales = v, .version = "x"};
    ASSERT_EQ(rs_engine_swap_weights(e, &w, NULL, &err), RS_EINVAL);
    ASSERT_EQ(applied, 0);
    ASSERT_STREQ(rs_engine_weight_version(e), "0");
    rs_weight_swap wc = {.apply = count_apply, .calibrate = calibrate_zero, .version = "x"};
    ASSERT_EQ(rs_engine_swap_weights(e, &wc, NULL, &err), RS_EINVAL);
    ASSERT_EQ(applied, 0);
    ASSERT_STREQ(rs_engine_weight_version(e), "0");
    k[3] = 0.01f;
    w.version = "y";
    ASSERT_EQ(rs_engine_swap_weights(e, &w, NULL, &err), RS_OK);
    ASSERT_EQ(applied, 1);
    ASSERT_STREQ(rs_engine_weight_version(e), "y");
    rs_engine_free(e);
    rs_model_free(m);
    rs_backend_free(b);
}
